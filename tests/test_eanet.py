"""EANet in vitlab (:mod:`vitlab.tasks.segmentation`): the self-attention heads against direct loops over the
positions, EANet's decoder on a backbone's last stage (widths, auxiliary head and loss), the Cityscapes reader
(label ids to train ids, hostile folders answered in one line without blocking), multi-scale + flip inference
against its definition, and ``vitlab seg train | eval`` on a generated Cityscapes folder."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hangs import unblocked
from vitlab.cli import main
from vitlab.data.safe_files import DataFileError
from vitlab.tasks.segmentation import build_segmenter, open_masks, predict
from vitlab.tasks.segmentation.cityscapes import CLASSES, LABELS, TRAIN_IDS, to_train_ids
from vitlab.tasks.segmentation.heads import Head, SelfAttentionConv
from vitlab.tasks.segmentation.infer import window_starts
from vitlab.tasks.segmentation.synth import make_mask_folder
from vitlab.tasks.segmentation.task import SegLoss

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")


def one_line(excinfo, *parts: str) -> str:
    text = str(excinfo.value)
    assert "\n" not in text, text
    for p in parts:
        assert p in text, (p, text)
    return text


@pytest.fixture(scope="module")
def city(tmp_path_factory):
    return make_mask_folder(tmp_path_factory.mktemp("cs"), "cityscapes", train=8, val=2, size=(32, 48), classes=5)


# --------------------------------------------------------------------------- the attention blocks, by hand


def naive_block(block: SelfAttentionConv, x: torch.Tensor, double: bool) -> torch.Tensor:
    """The block's output with the attention computed one query position at a time (float64 loops)."""
    b, c, h, w = x.shape
    y = block.conv1(x).flatten(2).transpose(1, 2)  # (B, N, C)
    wq, wk, wv = block.attn.qkv.weight.chunk(3, 0)
    out = torch.zeros_like(y)
    for n in range(b):
        q, k, v = y[n] @ wq.T, y[n] @ wk.T, y[n] @ wv.T
        logits = (q @ k.T) / math.sqrt(c)  # (queries, keys)
        if double:  # softmax over the queries i for each key j, then L1 over the keys j for each query i
            e = (logits - logits.max(0, keepdim=True).values).exp()
            soft = e / e.sum(0, keepdim=True)
            attn = torch.stack([soft[i] / (1e-9 + soft[i].sum()) for i in range(len(q))])
        else:
            attn = torch.stack([torch.exp(row - row.max()) / torch.exp(row - row.max()).sum() for row in logits])
        for i in range(len(q)):
            out[n, i] = sum(attn[i, j] * v[j] for j in range(len(k)))
    out = block.attn.proj(out).transpose(1, 2).reshape(b, c, h, w)
    return torch.relu(x + block.conv2(out))


@pytest.mark.parametrize("norm", ["softmax", "double"])
def test_self_attention_block_equals_a_loop_over_positions(norm):
    torch.manual_seed(0)
    block = SelfAttentionConv(6, norm).double().eval()
    for p in block.parameters():  # away from the init's zeros, so every term counts
        nn.init.normal_(p, 0, 0.4)
    block.conv2[1].running_mean.normal_()
    block.conv2[1].running_var.uniform_(0.5, 2)
    x = torch.randn(2, 6, 3, 4, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(block(x), naive_block(block, x, norm == "double"))


def test_double_norm_is_softmax_over_queries_then_l1_over_keys():
    """The map of the sa_dn block: columns are softmax distributions over the queries before the L1 step, and
    each query's row sums to 1 after it."""
    block = SelfAttentionConv(4, "double").double().eval()
    x = torch.randn(1, 4, 2, 5, dtype=torch.float64)
    tokens = block.conv1(x).flatten(2).transpose(1, 2)
    _, aux = block.attn(tokens, return_aux=True)
    attn = aux["attn"][0, 0]
    q, k, _ = block.attn.qkv_heads(tokens)
    logits = (q[0, 0] @ k[0, 0].T) * block.attn.scale
    soft = torch.softmax(logits, dim=0)
    torch.testing.assert_close(attn, soft / (1e-9 + soft.sum(1, keepdim=True)))
    torch.testing.assert_close(attn.sum(1), torch.ones(10, dtype=torch.float64))


def test_the_heads_differ_only_by_their_block():
    def layers(kind: str, **widths) -> list[str]:
        return [type(m).__name__ for m in Head(8, 3, kind, memory_size=4, **widths).layers]

    cbr, tail = "Sequential", ["Dropout2d", "Conv2d"]
    assert layers("ea") == [cbr, "ExternalAttentionConv", cbr, *tail]
    assert layers("sa") == layers("sa_dn") == [cbr, "SelfAttentionConv", cbr, *tail]
    assert layers("plain") == [cbr, *tail]  # the pyramid decoder's plain head: the second conv goes too
    assert layers("plain", out_channels=4) == [cbr, cbr, *tail]  # ... unless it narrows the width (EANet's)
    sa, dn = Head(8, 3, "sa").state_dict(), Head(8, 3, "sa_dn").state_dict()
    assert {k: v.shape for k, v in sa.items()} == {k: v.shape for k, v in dn.items()}  # the norms share parameters
    # EANet's widths: C_in -> C -> C / 2 -> K
    for kind in ("ea", "sa", "plain"):
        head = Head(16, 5, kind, in_channels=32, out_channels=8)
        assert head(torch.randn(1, 32, 4, 4)).shape == (1, 5, 4, 4)
        convs = [m for m in head.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
        assert [(m.in_channels, m.out_channels) for m in convs] == [(32, 16), (16, 8)]


# --------------------------------------------------------------------------- EANet's decoder


def test_eanet_is_the_head_on_a_dilated_resnets_c5_at_the_papers_widths():
    with torch.device("meta"):  # no memory: the shapes only
        net = build_segmenter("resnet50", num_classes=21, img_size=513, decoder="eanet", aux_weight=0.4)
        logits, aux = net(torch.empty(2, 3, 65, 65))
    assert [(f["num_chs"], f["reduction"]) for f in net.backbone.feature_info] == [(1024, 8), (2048, 8)]
    convs = [m for m in net.head.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert [(m.in_channels, m.out_channels) for m in convs] == [(2048, 512), (512, 256)]
    ea = net.head.layers[1]
    assert type(ea).__name__ == "ExternalAttentionConv" and ea.ea.memory_size == 64 and ea.ea.memory_norm == "double"
    assert net.aux_head[0][0].in_channels == 1024 and net.aux_head[-1].in_channels == 256
    assert logits.shape == aux.shape == (2, 21, 65, 65) and net.neck is None
    with torch.device("meta"):  # told otherwise, the backbone keeps its output stride; 32: the plain classifier
        net16 = build_segmenter("resnet50", num_classes=21, img_size=513, decoder="eanet", output_stride=16)
        plain = build_segmenter("resnet50", num_classes=21, img_size=513)
    assert net16.backbone.feature_info[-1]["reduction"] == 16 and plain.backbone.feature_info[-1]["reduction"] == 32


def test_eanet_decoder_puts_the_head_on_the_last_stage_and_the_aux_head_on_the_one_before():
    torch.manual_seed(0)
    net = build_segmenter("resnet_mini", num_classes=4, img_size=32, decoder="eanet", head="sa_dn", channels=16,
                          aux_weight=0.4)  # fmt: skip
    assert net.neck is None and net.head.layers[0][0].in_channels == net.backbone.feature_info[-1]["num_chs"]
    assert net.aux_head[0][0].in_channels == net.backbone.feature_info[0]["num_chs"]
    assert net.backbone.feature_info[-1]["reduction"] == 8  # a 4 x 4 last map at 32 px
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 4, (2, 32, 32))
    logits, aux = net(x)
    assert logits.shape == aux.shape == (2, 4, 32, 32)
    loss = SegLoss(aux_weight=net.aux_weight)(x, (logits, aux), y)
    torch.testing.assert_close(loss, F.cross_entropy(logits, y) + 0.4 * F.cross_entropy(aux, y))
    loss.backward()
    assert net.aux_head[-1].weight.grad.abs().sum() > 0 and net.head.layers[1].attn.qkv.weight.grad.abs().sum() > 0
    assert net.eval()(x).shape == (2, 4, 32, 32)  # evaluation: the logits only
    with pytest.raises(ValueError, match="decoder=eanet"):
        build_segmenter("pcpvt_mini", num_classes=4, img_size=32, aux_weight=0.4)
    with pytest.raises(ValueError, match="decoder must be one of"):
        build_segmenter("pcpvt_mini", num_classes=4, img_size=32, decoder="fpn")


# --------------------------------------------------------------------------- Cityscapes


def test_cityscapes_label_ids_become_the_19_train_ids():
    # the benchmark's own table: the 19 scored label ids, in train-id order
    scored = dict(zip((7, 8, 11, 12, 13, 17, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 31, 32, 33), range(19)))
    assert len(LABELS) == 34 and {i: scored.get(i, 255) for i in range(34)} == TRAIN_IDS
    assert CLASSES[0] == "road" and CLASSES[10] == "sky" and CLASSES[-1] == "bicycle" and len(CLASSES) == 19
    ids = torch.arange(34).repeat(2, 1)
    ids[1, 0] = 255
    got = to_train_ids(ids, "m.png")
    assert got[0].tolist() == [scored.get(i, 255) for i in range(34)] and got[1, 0] == 255
    with pytest.raises(DataFileError) as e:
        to_train_ids(torch.tensor([[7, 34]]), "m.png")
    one_line(e, "m.png", "value 34", "label id")


def test_cityscapes_reader_reads_the_official_layout(city):
    from PIL import Image

    ds = open_masks(f"cityscapes:{city}", "train")
    assert (ds.layout, ds.num_classes, len(ds), ds.classes[:2]) == ("cityscapes", 19, 8, ["road", "sidewalk"])
    image_path, mask_path = ds.items[0]
    assert image_path.name.endswith("_leftImg8bit.png") and mask_path.name.endswith("_gtFine_labelIds.png")
    assert image_path.parent.name == mask_path.parent.name == "aachen"
    image, mask = ds.load(0)
    raw = torch.from_numpy(np.array(Image.open(mask_path))).long()
    assert image.shape == (3, 32, 48) and torch.equal(mask, to_train_ids(raw, mask_path))
    assert (mask[-4:] == 255).all() and set(mask.unique().tolist()) <= {0, 1, 2, 3, 4, 255}  # ego vehicle ignored
    assert open_masks(str(city), "val").layout == "cityscapes"  # a bare root, recognised by its folders


def test_cityscapes_refusals_are_one_line(city, tmp_path):
    with pytest.raises(ValueError) as e:
        open_masks(f"cityscapes:{tmp_path}", "train")
    one_line(e, "not in the cityscapes layout", "leftImg8bit/", "gtFine_trainvaltest.zip")
    root = make_mask_folder(tmp_path / "cs", "cityscapes", train=2, val=1, size=(8, 10), classes=3)
    outside = tmp_path / "outside"
    (outside / "gtFine").mkdir(parents=True)
    # a city folder that is a symlink out of the dataset: refused, not followed
    (root / "leftImg8bit" / "train" / "aachen").rename(outside / "aachen")
    (root / "leftImg8bit" / "train" / "aachen").symlink_to(outside / "aachen")
    with pytest.raises(DataFileError) as e:
        open_masks(str(root), "train")
    one_line(e, "outside the dataset folder")
    (root / "leftImg8bit" / "train" / "aachen").unlink()
    ds = open_masks(str(root), "train")  # bochum's frame is left
    mask = ds.items[0][1]
    from PIL import Image

    Image.fromarray(np.full((8, 10), 40, np.uint8)).save(mask)  # a grey image that holds no label ids
    with pytest.raises(DataFileError) as e:
        ds.load(0)
    one_line(e, str(mask), "not a Cityscapes label id")
    mask.unlink()
    with pytest.raises(FileNotFoundError) as e:
        ds.load(0)
    one_line(e, str(mask), "does not exist")


@needs_fifo
@pytest.mark.parametrize("which", [0, 1])
def test_cityscapes_named_pipe_is_refused_without_blocking(tmp_path, which):
    root = make_mask_folder(tmp_path / "cs", "cityscapes", train=2, val=1, size=(8, 10), classes=3)
    ds = open_masks(str(root), "train")
    path = ds.items[0][which]
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(DataFileError) as e:
        unblocked(lambda: ds.load(0), path)
    one_line(e, str(path), "named pipe")


def test_cityscapes_reader_answers_every_mutation_in_one_line(tmp_path):
    """The seeded mutations of the VOC / ADE20K fuzz test (truncations, random bytes, pipes, folders, symlinks
    out, PNG bombs, missing files) applied to a Cityscapes folder's files."""
    import random

    from test_dense_reader_fuzz import cases_for_files, check_masks, run_cases

    outside = tmp_path / "outside"
    outside.mkdir()
    base = make_mask_folder(tmp_path / "base", "cityscapes", train=2, val=1, size=(12, 14), classes=3, seed=1)
    files = [str(p.relative_to(base)) for pair in open_masks(str(base), "train").items for p in pair]
    files.append(str(open_masks(str(base), "val").items[0][1].relative_to(base)))
    cases = cases_for_files(random.Random("seg-cityscapes"), base, files, outside)
    cases.append(("newline-name", "leftImg8bit/train/aachen/a\nb_leftImg8bit.png", lambda p: p.write_bytes(b"x")))
    tally = run_cases(base, tmp_path, lambda p: f"cityscapes:{p}", check_masks, cases)
    assert tally["ok"] and sum(tally.values()) - tally["ok"] > len(cases) // 2, tally


# --------------------------------------------------------------------------- multi-scale + flip


class WindowMean(nn.Module):
    """Logits that depend on the whole window (each channel plus the window's mean): windows matter."""

    def forward(self, x):
        return torch.cat([x, x.mean((2, 3), keepdim=True).expand_as(x)], 1)


def test_msflip_with_one_scale_and_no_flip_is_slide():
    x = torch.randn(2, 3, 11, 14, dtype=torch.float64)
    slide = predict(WindowMean(), x, 6, "slide", 4)
    ms = predict(WindowMean(), x, 6, "msflip", 4, scales=(1.0,), flip=False)
    torch.testing.assert_close(ms, slide.log_softmax(1))
    assert torch.equal(ms.argmax(1), slide.argmax(1))


def test_msflip_averages_the_probabilities_of_every_scale_and_mirror():
    x = torch.randn(1, 3, 10, 13, dtype=torch.float64)
    model, crop, stride, scales = WindowMean(), 6, 4, (0.5, 1.0, 1.5)
    want = 0
    for s in scales:
        size = (round(10 * s), round(13 * s))
        xs = F.interpolate(x, size, mode="bilinear", align_corners=False) if s != 1 else x
        for mirror in (False, True):
            logits = predict(model, xs.flip(-1) if mirror else xs, crop, "slide", stride)
            logits = logits.flip(-1) if mirror else logits
            want = want + F.interpolate(logits, (10, 13), mode="bilinear", align_corners=False).softmax(1) / 6
    torch.testing.assert_close(predict(model, x, crop, "msflip", stride, scales=scales), want.log())


def test_msflip_is_flip_equivariant_and_a_symmetric_model_gains_nothing_from_flips():
    x = torch.randn(1, 3, 9, 15, dtype=torch.float64)
    assert window_starts(15, 6, 4) != [15 - 6 - s for s in reversed(window_starts(15, 6, 4))]  # windows asymmetric
    # any model: mirroring the image mirrors the prediction, since both views are averaged
    got = predict(WindowMean(), x.flip(-1), 6, "msflip", 4, scales=(0.75, 1.0))
    torch.testing.assert_close(got, predict(WindowMean(), x, 6, "msflip", 4, scales=(0.75, 1.0)).flip(-1))
    # a mirror-symmetric model (its kernels symmetric left-right): the mirrored view adds nothing
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    with torch.no_grad():
        conv.weight.copy_((conv.weight + conv.weight.flip(-1)) / 2)
    torch.testing.assert_close(predict(conv, x, 20, "msflip", scales=(1.0, 1.25), flip=True),
                               predict(conv, x, 20, "msflip", scales=(1.0, 1.25), flip=False))  # fmt: skip
    with pytest.raises(ValueError, match="positive factors"):
        predict(conv, x, 20, "msflip", scales=(1.0, 0.0))


# --------------------------------------------------------------------------- vitlab seg on a Cityscapes folder

EANET_MINI = ["--model", "resnet_mini", "--model-arg", "decoder=eanet", "--model-arg", "channels=16"]


def test_seg_train_eanet_on_a_generated_cityscapes_folder_and_eval_msflip(tmp_path, capsys):
    """`vitlab seg synth --layout cityscapes`, one epoch of EANet's decoder with the double-normalised
    self-attention head and the auxiliary loss through the engine, then `vitlab seg eval --mode msflip`."""
    root = tmp_path / "cs"
    assert main(["seg", "synth", str(root), "--layout", "cityscapes", "--train", "8", "--val", "2", "--height", "32",
                 "--width", "48", "--classes", "4"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["layout"] == "cityscapes"
    run = tmp_path / "run"
    args = ["seg", "train", "--data", f"cityscapes:{root}", *EANET_MINI, "--model-arg", "head=sa_dn", "--model-arg",
            "aux_weight=0.4", "--img-size", "32", "--batch-size", "4", "--epochs", "1", "--threads", "1",
            "--no-progress", "--device", "cpu", "--out", str(run)]  # fmt: skip
    assert main(args) == 0
    row = json.loads((run / "log.json").read_text())[0]
    assert row["step"] == 2 and 0 <= row["val_miou"] <= 100 and row["train_loss"] > 0
    capsys.readouterr()
    out_json = tmp_path / "ms.json"
    assert main(["seg", "eval", str(run / "last.pt"), "--data", str(root), "--mode", "msflip", "--scales", "0.75,1",
                 "--json", str(out_json)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "msflip x0.75,1.0" in printed and "road" in printed
    result = json.loads(out_json.read_text())
    assert result["scales"] == [0.75, 1.0] and result["flip"] is True and result["classes"][0] == "road"
    # the options of msflip alone, and factors that are not positive numbers: one line each
    assert main(["seg", "eval", str(run / "last.pt"), "--data", str(root), "--scales", "1"]) == 2
    assert "belong to --mode msflip" in capsys.readouterr().err
    assert main(["seg", "eval", str(run / "last.pt"), "--data", str(root), "--mode", "msflip", "--scales", "1,-2"]) == 2
    assert "positive factors" in capsys.readouterr().err
