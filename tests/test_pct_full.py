"""The full PCT (neighbour embedding; :class:`vitlab.tasks.points.models.PCT`): farthest-point sampling, k-NN and
the SG layer against naive loops, PCT's attention against the reference's equations in its (B, C, N) layout, the
parameter count against the paper's 2.88M, shapes, gradients, what a permutation of the points changes, and one
epoch of ``vitlab points train`` on a generated ModelNet40-layout file."""

from __future__ import annotations

import json
import math

import pytest
import torch

from vitlab.cli import main
from vitlab.tasks.points import PCT, build_point_model
from vitlab.tasks.points.models import LBR, OffsetAttention, SampleGroup
from vitlab.tasks.points.neighbours import farthest_point_sample, gather_points, group, knn, sample_and_group


def naive_fps(pts: list[list[float]], m: int) -> list[int]:
    """Farthest-point sampling as a loop over python floats: start at point 0, strict '>' keeps the first maximum."""
    chosen, dist = [0], [math.inf] * len(pts)
    for _ in range(m - 1):
        c = pts[chosen[-1]]
        for j, p in enumerate(pts):
            dist[j] = min(dist[j], (p[0] - c[0]) ** 2 + (p[1] - c[1]) ** 2 + (p[2] - c[2]) ** 2)
        best = 0
        for j in range(len(pts)):
            if dist[j] > dist[best]:
                best = j
        chosen.append(best)
    return chosen


def naive_knn(query: list[float], pts: list[list[float]], k: int) -> list[int]:
    return sorted(range(len(pts)), key=lambda j: sum((a - b) ** 2 for a, b in zip(query, pts[j])))[:k]


def eval_stats(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Eval mode with non-trivial running statistics, so a BatchNorm is a per-channel affine map to check."""
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm1d):
            m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.data.copy_(torch.rand(m.num_features, generator=g) - 0.5)
    return module.eval()


def test_farthest_point_sampling_equals_the_naive_loop():
    xyz = torch.randn(3, 200, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = farthest_point_sample(xyz, 40)
    assert got.shape == (3, 40) and got.dtype == torch.long
    for b in range(3):
        assert got[b].tolist() == naive_fps(xyz[b].tolist(), 40)
    assert torch.equal(farthest_point_sample(xyz.float(), 40), got)  # float32: the same choices here
    assert torch.equal(farthest_point_sample(xyz, 40), got)  # deterministic: the first point starts
    every = farthest_point_sample(xyz[:, :30], 30)
    assert all(sorted(r) == list(range(30)) for r in every.tolist())  # m = N: every point once
    with pytest.raises(ValueError, match="cannot take 201 of 200"):
        farthest_point_sample(xyz, 201)
    with pytest.raises(ValueError, match=r"expected coordinates \(B, N, 3\)"):
        farthest_point_sample(xyz[..., :2], 4)


def test_knn_equals_brute_force():
    g = torch.Generator().manual_seed(1)
    xyz, query = torch.randn(2, 90, 3, generator=g), torch.randn(2, 25, 3, generator=g)
    got = knn(query, xyz, 7)
    assert got.shape == (2, 25, 7)
    for b in range(2):
        for s in range(25):
            assert got[b, s].tolist() == naive_knn(query[b, s].tolist(), xyz[b].tolist(), 7)
    centres = farthest_point_sample(xyz, 10)
    assert torch.equal(knn(gather_points(xyz, centres), xyz, 1)[..., 0], centres)  # a centre finds itself first
    with pytest.raises(ValueError, match="cannot take 91 neighbours of 90"):
        knn(query, xyz, 91)


def test_grouping_is_neighbour_minus_centre_beside_centre():
    g = torch.Generator().manual_seed(2)
    xyz, feats = torch.randn(2, 50, 3, generator=g), torch.randn(2, 50, 5, generator=g)
    centres, grouped = sample_and_group(xyz, feats, 12, 4)
    assert centres.shape == (2, 12, 3) and grouped.shape == (2, 12, 4, 10)
    idx = farthest_point_sample(xyz, 12)
    torch.testing.assert_close(centres, gather_points(xyz, idx))
    nbr = knn(centres, xyz, 4)
    b, s, t = 1, 7, 2
    c, n = idx[b, s], nbr[b, s, t]
    torch.testing.assert_close(grouped[b, s, t], torch.cat([feats[b, n] - feats[b, c], feats[b, c]]))
    torch.testing.assert_close(group(feats, idx, nbr), grouped)


def lbr_by_hand(lbr: LBR, x: torch.Tensor) -> torch.Tensor:
    bn = lbr.bn
    z = x @ lbr.linear.weight.T + (0 if lbr.linear.bias is None else lbr.linear.bias)
    z = (z - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) * bn.weight + bn.bias
    return torch.relu(z) if lbr.slope == 0 else torch.nn.functional.leaky_relu(z, lbr.slope)


def test_sg_layer_equals_a_naive_loop_for_one_shape():
    torch.manual_seed(3)
    sg = eval_stats(SampleGroup(6, 8, samples=16, k=5)).double()
    g = torch.Generator().manual_seed(4)
    xyz, feats = (
        torch.randn(2, 40, 3, generator=g, dtype=torch.float64),
        torch.randn(2, 40, 6, generator=g, dtype=torch.float64),
    )
    centres, out = sg(xyz, feats)
    assert centres.shape == (2, 16, 3) and out.shape == (2, 16, 8)
    b = 1
    pts = xyz[b].tolist()
    for s, c in enumerate(naive_fps(pts, 16)):
        rows = [torch.cat([feats[b, n] - feats[b, c], feats[b, c]]) for n in naive_knn(pts[c], pts, 5)]
        h = torch.stack(rows)
        for lbr in sg.lbr:
            h = lbr_by_hand(lbr, h)
        torch.testing.assert_close(out[b, s], h.max(0).values)
        torch.testing.assert_close(centres[b, s], xyz[b, c])


def test_pct_attention_is_the_reference_sa_layer():
    """x + ReLU(BN(W_t (x - x_r) + b_t)), x_r = V A, A = softmax(Q^T K) over the last axis, then / its column sums,
    written in the reference's (B, C, N) layout with its bmm's (float64, eval mode)."""
    torch.manual_seed(5)
    layer = eval_stats(OffsetAttention(16, "pct", lbr_bias=True)).double()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    xc = x.transpose(1, 2)  # (B, C, N)
    w, wv, bv = layer.mixer.qk.weight, layer.mixer.v.weight, layer.mixer.v.bias
    x_q = (w @ xc).transpose(1, 2)  # b, n, c/4
    x_k = w @ xc  # b, c/4, n: the same weights
    x_v = wv @ xc + bv[:, None]
    attention = torch.softmax(torch.bmm(x_q, x_k), -1)
    attention = attention / (1e-9 + attention.sum(1, keepdim=True))
    x_r = torch.bmm(x_v, attention)  # b, c, n
    want = x + lbr_by_hand(layer.lbr, (xc - x_r).transpose(1, 2))
    torch.testing.assert_close(layer(x), want)
    with pytest.raises(ValueError, match="one head"):
        OffsetAttention(16, "pct", num_heads=2)


def reference_pct_parameters(classes: int = 40) -> int:
    """The reference code's layers (conv = 1x1 convolution; a BatchNorm has 2 C parameters; the SA layer's query
    and key convolutions share one weight)."""
    bn = lambda c: 2 * c  # noqa: E731
    embed = 3 * 64 + bn(64) + 64 * 64 + bn(64)
    local = 2 * (128 * 128 + bn(128)) + 2 * (256 * 256 + bn(256))  # gather_local_0, gather_local_1
    last = 2 * (256 * 256 + bn(256))  # Point_Transformer_Last's conv1, conv2
    sa = 256 * 64 + (256 * 256 + 256) + (256 * 256 + 256) + bn(256)  # q = k, v, trans_conv, after_norm
    fuse = 1280 * 1024 + bn(1024)
    head = 1024 * 512 + bn(512) + 512 * 256 + 256 + bn(256) + 256 * classes + classes
    return embed + local + last + 4 * sa + fuse + head


def test_full_pct_has_the_papers_parameter_count():
    model = build_point_model("pct", num_classes=40)
    count = sum(p.numel() for p in model.parameters())
    assert count == reference_pct_parameters(40) == 2_876_136
    assert round(count / 1e6, 2) == 2.88  # PCT paper, Table 1: 2.88M
    assert isinstance(model, PCT) and model.samples == (512, 256) and model.sg[0].k == 32
    ea = build_point_model("pct_full_ea", num_classes=40)  # EA in place of SA: 2 x 64 x 256 per layer
    sa_mixer, ea_mixer = 256 * 64 + 256 * 256 + 256, 2 * 64 * 256
    assert sum(p.numel() for p in ea.parameters()) == count - 4 * (sa_mixer - ea_mixer)


def test_full_pct_shapes_gradients_and_errors():
    torch.manual_seed(6)
    model = build_point_model("pct", num_classes=40)
    x = torch.randn(2, 512, 3)  # the fewest points the first SG layer's 512 centres allow
    feats = model.forward_features(x)
    assert feats.shape == (2, 256, 1024)
    logits = model.head(feats.amax(1))  # forward(x), without a second pass through the trunk
    assert logits.shape == (2, 40)
    logits.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    mini = build_point_model("pct_full_ea_mini", num_classes=4).eval()
    assert mini(torch.randn(3, 100, 3)).shape == (3, 4)
    with pytest.raises(ValueError, match="PCT samples 64 centres: give at least that many points, got 63"):
        mini(torch.randn(1, 63, 3))
    with pytest.raises(ValueError, match=r"expected points \(B, N, 3\)"):
        mini(torch.randn(2, 3, 100))
    with pytest.raises(ValueError, match="sample counts"):
        build_point_model("pct_mini", samples=(16, 32))


def test_full_pct_depends_on_the_points_not_their_order_once_the_start_is_fixed():
    """FPS starts at the first point; any reordering that keeps it picks the same centres (no ties in random
    data), the SG layers' max and the attention are order-free, so the eval-mode logits do not change. Moving
    another point first changes the start, and the sampled set."""
    torch.manual_seed(7)
    model = eval_stats(build_point_model("pct_mini", num_classes=5))
    x = torch.randn(2, 96, 3)
    perm = torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(95)])
    with torch.no_grad():
        torch.testing.assert_close(model(x[:, perm]), model(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x[1:]), model(x)[1:], rtol=1e-5, atol=1e-5)  # shapes are independent
    centres = gather_points(x, farthest_point_sample(x, 64))
    moved = torch.cat([x[:, 5:6], x[:, :5], x[:, 6:]], 1)  # point 5 first
    assert torch.equal(gather_points(moved, farthest_point_sample(moved, 1))[:, 0], x[:, 5])
    assert not torch.equal(gather_points(moved, farthest_point_sample(moved, 64)), centres)


@pytest.mark.parametrize("name, points", [("pct_mini", 128), pytest.param("pct", 512, marks=pytest.mark.slow)])
def test_points_train_runs_one_epoch_of_the_full_pct(name, points, tmp_path, capsys):
    pytest.importorskip("h5py")
    from vitlab.tasks.points.synth import make_modelnet40

    root = make_modelnet40(tmp_path / "mn", train=8, test=4, points=points, classes=4)
    out = tmp_path / "run"
    args = ["points", "train", "--data", f"modelnet40:{root}", "--model", name, "--epochs", "1", "--batch-size", "4",
            "--threads", "1", "--no-progress", "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    log = json.loads((out / "log.json").read_text())
    assert len(log) == 1 and math.isfinite(log[0]["train_loss"]) and 0 <= log[0]["val_oa"] <= 100
    capsys.readouterr()
    assert main(["points", "eval", str(out / "best.pt"), "--data", f"modelnet40:{root}"]) == 0
    assert "oa " in capsys.readouterr().out
