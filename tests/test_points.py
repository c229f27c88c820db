"""Point clouds (:mod:`vitlab.tasks.points`, ``vitlab points``): offset attention with external attention against the
paper's equations, the metrics against direct counting, the ShapeNet-Part and ModelNet40 (HDF5) readers on
generated files in the real layouts, and a classifier trained through the engine on a ModelNet40-layout file."""

from __future__ import annotations

import sys

import pytest
import torch

from vitlab.cli import main
from vitlab.tasks.points import build_point_model, classification_accuracy, open_points, part_miou, part_predictions
from vitlab.tasks.points.data import part_ranges
from vitlab.tasks.points.models import OffsetAttention
from vitlab.tasks.points.synth import make_shapenet_part


def test_offset_attention_is_f_plus_lbr_of_f_minus_external_attention():
    """F + ReLU(BN(W (F - M_v(DN(M_k F))))), DN = softmax over the points then L1 over the S slots (float64)."""
    torch.manual_seed(0)
    layer = OffsetAttention(8, "external", memory_size=5).double().eval()
    layer.lbr.bn.running_mean.uniform_(-0.5, 0.5)
    layer.lbr.bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    logits = x @ layer.mixer.mk.weight.T  # (B, N, S)
    a = torch.exp(logits) / torch.exp(logits).sum(1, keepdim=True)  # softmax over the N points
    a = a / a.sum(2, keepdim=True)  # L1 over the S slots
    ea = a @ layer.mixer.mv.weight.T
    bn = layer.lbr.bn
    z = (x - ea) @ layer.lbr.linear.weight.T
    z = (z - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) * bn.weight + bn.bias
    torch.testing.assert_close(layer(x), x + torch.relu(z))


def test_models_give_class_and_part_logits():
    clf = build_point_model("pct_ea_mini", num_classes=40).eval()
    assert clf(torch.randn(3, 64, 3)).shape == (3, 40)
    seg = build_point_model("pct_partseg_ea_mini").eval()
    assert seg(torch.randn(2, 32, 3), torch.tensor([0, 5])).shape == (2, 32, 50)
    assert build_point_model("pct_sa_mini", num_classes=4)(torch.randn(2, 16, 3)).shape == (2, 4)
    pts, cat = torch.randn(2, 32, 3), torch.tensor([3, 15])
    batch = torch.cat([pts, cat.float()[:, None, None].expand(-1, 32, 1)], -1)  # as PointSet.get_batch gives it
    torch.testing.assert_close(seg(batch), seg(pts, cat))
    with pytest.raises(ValueError, match="unknown point model"):
        build_point_model("pct_nope")
    with pytest.raises(ValueError, match=r"expected points \(B, N, 3\)"):
        clf(torch.randn(2, 3, 64))


def test_accuracies_equal_direct_counts():
    pred, target = torch.tensor([0, 1, 1, 2, 2, 2, 0]), torch.tensor([0, 1, 2, 2, 2, 0, 0])
    got = classification_accuracy(pred, target, 40)
    assert got["oa"] == pytest.approx(100 * 5 / 7)
    assert got["macc"] == pytest.approx(100 * (2 / 3 + 1 / 1 + 2 / 3) / 3)  # classes 0, 1, 2 present


def test_part_miou_counts_only_the_shapes_own_parts():
    g = torch.Generator().manual_seed(0)
    category = torch.tensor([0, 0, 10, 15])
    parts = torch.stack([torch.tensor(list(part_ranges()[c]))[torch.randint(0, len(part_ranges()[c]), (30,), generator=g)]
                         for c in category.tolist()])  # fmt: skip
    logits = torch.randn(4, 30, 50, generator=g)
    pred = part_predictions(logits, category)
    for p, c in zip(pred, category.tolist()):
        assert set(p.tolist()) <= set(part_ranges()[c])  # never a part of another category
    want = []
    for p, t, c in zip(pred.tolist(), parts.tolist(), category.tolist()):
        ious = []
        for part in part_ranges()[c]:
            inter = sum(a == part and b == part for a, b in zip(p, t))
            union = sum(a == part or b == part for a, b in zip(p, t))
            ious.append(1.0 if union == 0 else inter / union)  # a part in neither counts as 1
        want.append(sum(ious) / len(ious))
    got = part_miou(pred, parts, category)
    assert got["instance_miou"] == pytest.approx(100 * sum(want) / 4)
    per_cat = [(want[0] + want[1]) / 2, want[2], want[3]]
    assert got["category_miou"] == pytest.approx(100 * sum(per_cat) / 3)


def test_shapenet_part_layout_reads_back(tmp_path):
    root = make_shapenet_part(tmp_path / "sp", per_split=4, points=40, categories=2)
    ds = open_points(f"shapenetpart:{root}", "val")
    assert ds.points.shape == (4, 2048, 3) and ds.labels.tolist() == [0, 1, 0, 1] and ds.num_classes == 16
    for parts, c in zip(ds.parts, ds.labels.tolist()):
        assert set(parts.tolist()) <= set(part_ranges()[c])
    with pytest.raises(ValueError, match="give modelnet40"):
        open_points(str(root), "train")


def test_modelnet40_without_h5py_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "h5py", None)  # as where h5py is not installed
    assert main(["points", "train", "--data", f"modelnet40:{tmp_path}", "--out", str(tmp_path / "r")]) == 2
    assert "needs h5py (not installed): pip install 'vitlab[points]'" in capsys.readouterr().err


def test_classifier_trains_on_a_modelnet40_hdf5_file(tmp_path, capsys):
    pytest.importorskip("h5py")
    from vitlab.tasks.points.synth import make_modelnet40

    root = make_modelnet40(tmp_path / "mn", train=64, test=32, points=128, classes=4)
    out = tmp_path / "run"
    args = ["points", "train", "--data", f"modelnet40:{root}", "--epochs", "8", "--lr", "3e-3", "--threads", "1",
            "--warmup-epochs", "0.25", "--no-progress", "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    import json

    log = json.loads((out / "log.json").read_text())
    assert log[-1]["train_loss"] < log[0]["train_loss"] and log[-1]["train_acc"] > 60
    assert max(r["val_oa"] for r in log) > 25 + 20  # 4 balanced classes: chance is 25 %
    capsys.readouterr()
    assert main(["points", "eval", str(out / "best.pt"), "--data", f"modelnet40:{root}"]) == 0
    assert "oa " in capsys.readouterr().out


def test_part_segmenter_trains_on_the_shapenet_part_layout(tmp_path, capsys):
    import json

    root = make_shapenet_part(tmp_path / "sp", per_split=4, points=32, categories=2)
    out = tmp_path / "run"
    args = ["points", "train", "--data", f"shapenetpart:{root}", "--model", "pct_partseg_ea_mini", "--epochs", "2",
            "--batch-size", "2", "--threads", "1", "--no-progress", "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    log = json.loads((out / "log.json").read_text())
    assert log[-1]["train_loss"] < log[0]["train_loss"] and 0 <= log[-1]["train_acc"] <= 100
    assert all(0 <= r["val_instance_miou"] <= 100 and 0 <= r["val_category_miou"] <= 100 for r in log)
    assert main([*args[:5], "pct_ea_mini", *args[6:-1], str(tmp_path / "other")]) == 2  # a classifier: one line
    assert "needs a pct_partseg_* model" in capsys.readouterr().err
