"""vitlab.analysis: metrics against naive paper formulas and constructed cases with known answers,
the analyses on tiny models with constructed weights, and the `vitlab analyze` command."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import safetensors.torch
import torch

import vitlab
from vitlab import cli as vitlab_cli
from vitlab.analysis import analyze, parse_what
from vitlab.measure import maps as metrics

# ------------------------------------------------------------------------------ naive references


def naive_cross_layer(maps: list[torch.Tensor]) -> torch.Tensor:
    """DeepViT: M^{p,q}_{h,t} = cos(A^p[h, :, t], A^q[h, :, t]), averaged over h, t and images."""
    L = len(maps)
    b, h, _, n = maps[0].shape
    out = torch.zeros(L, L, dtype=torch.float64)
    for p in range(L):
        for q in range(L):
            vals = [
                torch.dot(maps[p][i, k, :, t], maps[q][i, k, :, t])
                / (maps[p][i, k, :, t].norm() * maps[q][i, k, :, t].norm())
                for i in range(b)
                for k in range(h)
                for t in range(n)
            ]
            out[p, q] = torch.stack(vals).mean()
    return out


def naive_heads(a: torch.Tensor) -> torch.Tensor:
    b, h, _, c = a.shape
    out = torch.zeros(h, h, dtype=torch.float64)
    for g in range(h):
        for k in range(h):
            vals = [torch.cosine_similarity(a[i, g, :, t], a[i, k, :, t], dim=0) for i in range(b) for t in range(c)]
            out[g, k] = torch.stack(vals).mean()
    return out


def softmax_maps(*shape: int, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(*shape, dtype=torch.float64) * scale).softmax(-1)


# --------------------------------------------------------------------------------------- metrics


def test_cross_layer_similarity_matches_paper_formula():
    torch.manual_seed(0)
    maps = [softmax_maps(2, 2, 4, 4) for _ in range(2)]
    maps.append(torch.randn(2, 2, 4, 4, dtype=torch.float64))  # re-attention maps may be signed
    got = metrics.cross_layer_similarity(maps)
    torch.testing.assert_close(got, naive_cross_layer(maps), rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(metrics.cross_layer_similarity(torch.stack(maps)), got)
    assert torch.allclose(got, got.T) and torch.allclose(got.diagonal(), torch.ones(3, dtype=torch.float64))


def test_identical_and_uniform_layers_have_similarity_one():
    torch.manual_seed(1)
    a = softmax_maps(2, 4, 6, 6)
    torch.testing.assert_close(metrics.cross_layer_similarity([a, a.clone(), a.clone()]), torch.ones(3, 3).double())
    n = 7
    uniform = torch.full((1, 2, n, n), 1 / n, dtype=torch.float64)
    torch.testing.assert_close(metrics.cross_layer_similarity([uniform, uniform]), torch.ones(2, 2).double())
    torch.testing.assert_close(metrics.head_similarity(uniform), torch.ones(2, 2).double())


def test_uniform_against_one_hot_columns_is_one_over_sqrt_n():
    # column t of the identity map is e_t, of the uniform map (1/N)·1: cosine (1/N) / (1 · 1/√N) = 1/√N
    n = 9
    uniform = torch.full((1, 1, n, n), 1 / n, dtype=torch.float64)
    identity = torch.eye(n, dtype=torch.float64)[None, None]
    sim = metrics.cross_layer_similarity([uniform, identity])
    torch.testing.assert_close(sim[0, 1], torch.tensor(1 / math.sqrt(n), dtype=torch.float64))
    heads = metrics.head_similarity(torch.cat([uniform, identity], 1))
    torch.testing.assert_close(heads[0, 1], torch.tensor(1 / math.sqrt(n), dtype=torch.float64))


def test_similar_blocks_counts_adjacent_similarity_above_threshold():
    adj = [0.95, 0.5, 0.91, 0.9, 0.99]
    sim = torch.eye(6, dtype=torch.float64)
    for k, s in enumerate(adj, 1):
        sim[k - 1, k] = sim[k, k - 1] = s
    sim[0, 5] = sim[5, 0] = 0.99  # far pairs do not count
    assert metrics.adjacent_similarity(sim).tolist() == adj
    assert metrics.similar_blocks(sim, 0.9) == [1, 3, 5]  # strictly above: 0.9 itself is not
    assert metrics.similar_block_count(sim, 0.9) == 3
    assert metrics.similar_block_count(sim, 0.4) == 5 and metrics.similar_block_count(sim, 1.0) == 0
    with pytest.raises(ValueError, match="threshold"):
        metrics.similar_blocks(sim, 90)


def test_head_similarity_matches_naive_and_handles_external_maps():
    torch.manual_seed(2)
    a = softmax_maps(2, 3, 6, 6)
    torch.testing.assert_close(metrics.head_similarity(a), naive_heads(a), rtol=1e-5, atol=1e-12)
    ea = softmax_maps(2, 4, 10, 3)  # (B, heads, N, S): columns are the slots' attention over tokens
    torch.testing.assert_close(metrics.head_similarity(ea), naive_heads(ea), rtol=1e-5, atol=1e-12)


def test_feature_evolution_known_values():
    torch.manual_seed(3)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(metrics.feature_evolution([x, x.clone(), x.clone()]), torch.ones(2).double())
    ortho = torch.zeros(1, 3, 4, dtype=torch.float64)
    ortho[..., 0] = 1
    other = torch.zeros_like(ortho)
    other[..., 1] = 2
    got = metrics.feature_evolution([ortho, other, -other])
    torch.testing.assert_close(got, torch.tensor([0.0, -1.0], dtype=torch.float64))
    # naive: per token cosine, mean over tokens and images
    y = torch.randn(2, 5, 8, dtype=torch.float64)
    want = torch.stack([torch.cosine_similarity(x[i, n], y[i, n], dim=0) for i in range(2) for n in range(5)]).mean()
    torch.testing.assert_close(metrics.feature_evolution([x, y])[0], want, rtol=1e-5, atol=0)
    # prefix tokens are left out when asked
    z = x.clone()
    z[:, 0] = -x[:, 0]
    torch.testing.assert_close(metrics.feature_evolution([x, z], num_prefix=1), torch.ones(1).double())


def test_query_attention_puts_a_one_hot_row_at_the_right_pixel():
    gh, gw, p = 3, 4, 1
    n = p + gh * gw
    a = torch.zeros(2, 2, n, n)
    a[:, 0, 0, p + 1 * gw + 2] = 1.0  # head 0: the class token looks at patch (1, 2)
    a[:, 1, 0, p + 2 * gw + 0] = 1.0  # head 1: at patch (2, 0)
    a[:, :, 5, 0] = 1.0  # patch token 4 looks at the class token only: nothing on the image
    m = metrics.query_attention(a, 0, (gh, gw), p)
    assert m.shape == (2, 2, gh, gw)
    assert m[:, 0, 1, 2].eq(1).all() and m[:, 0].sum() == 2
    assert m[:, 1, 2, 0].eq(1).all() and m[:, 1].sum() == 2
    assert metrics.query_attention(a, 5, (gh, gw), p).abs().sum() == 0
    with pytest.raises(ValueError, match="query"):
        metrics.query_attention(a, n, (gh, gw), p)
    with pytest.raises(ValueError, match="grid"):
        metrics.query_attention(a, 0, (4, 4), p)


def test_slot_and_token_maps_place_values_on_the_grid():
    x = torch.arange(2 * 7 * 3, dtype=torch.float32).view(2, 7, 3)  # 1 prefix + 2x3 grid, 3 channels
    m = metrics.token_maps(x, (2, 3), 1)
    assert m.shape == (2, 3, 2, 3)
    assert m[1, 2, 1, 0] == x[1, 1 + 3, 2]
    ea = torch.rand(2, 4, 7, 5)
    s = metrics.slot_maps(ea, [3, 1], (2, 3), 1)
    assert s.shape == (2, 2, 4, 2, 3)
    assert s[1, 0, 2, 0, 1] == ea[1, 2, 1 + 1, 3] and s[0, 1, 3, 1, 2] == ea[0, 3, 1 + 5, 1]
    with pytest.raises(ValueError, match="slots"):
        metrics.slot_maps(ea, [5], (2, 3), 1)


def test_metrics_reject_bad_input():
    a = torch.rand(1, 2, 4, 4)
    with pytest.raises(ValueError, match="same shape"):
        metrics.cross_layer_similarity([a, torch.rand(1, 3, 4, 4)])
    with pytest.raises(ValueError, match=r"\(B, H, N, N\)"):
        metrics.cross_layer_similarity([torch.rand(2, 4, 4)])
    with pytest.raises(ValueError, match="square"):
        metrics.cross_layer_similarity([torch.rand(1, 2, 4, 3)])
    with pytest.raises(ValueError, match="at least 2"):
        metrics.feature_evolution([torch.rand(1, 4, 3)])
    with pytest.raises(ValueError, match="one shape"):
        metrics.feature_evolution([torch.rand(1, 4, 3), torch.rand(1, 5, 3)])


# ------------------------------------------------------------------- analyses on constructed models


def images_and_input(n: int = 2, size: int = 32, chans: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(n, chans, size, size, generator=g)
    return images, (images - 0.5) / 0.5


def sum_rtol(terms: int) -> float:
    """Worst-case relative rounding of a float32 mean of ``terms`` products (each summand rounds once, in
    whatever order the BLAS of this machine and thread count reduces them)."""
    return terms * torch.finfo(torch.float32).eps


def run(model, what, tmp_path, **kw) -> dict:
    images, x = images_and_input()
    report = analyze(model.eval(), images, x, what, tmp_path, log=lambda s: None, **kw)
    for name in what:
        if "skipped" not in report["analyses"][name]:
            assert (tmp_path / f"{name}.png").stat().st_size > 0
    return {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in what if (tmp_path / f"{n}.json").exists()}


@torch.no_grad()
def test_uniform_attention_model(tmp_path):
    # q = k = 0 in every block: softmax of zeros is 1/N for every pair
    model = vitlab.create_model("deit_mini", depth=3, num_classes=10)
    dim = model.embed_dim
    for blk in model.blocks:
        blk.mixer.qkv.weight[: 2 * dim] = 0
        blk.mixer.qkv.bias[: 2 * dim] = 0
    res = run(model, ["attention", "collapse", "heads"], tmp_path)
    n = 1 + 8 * 8
    maps = np.array(res["attention"]["maps"])  # (images, blocks, heads, 8, 8)
    assert maps.shape == (2, 3, 2, 8, 8)
    np.testing.assert_allclose(maps, 1 / n, rtol=1e-5)
    np.testing.assert_allclose(res["collapse"]["similarity"], np.ones((3, 3)), rtol=sum_rtol(2 * 2 * n * n))
    assert res["collapse"]["similar_blocks"] == 2 and res["collapse"]["similar_block_indices"] == [1, 2]
    np.testing.assert_allclose(res["heads"]["similarity"], np.ones((3, 2, 2)), rtol=sum_rtol(2 * n * n))


@torch.no_grad()
def test_identical_blocks_give_similarity_one(tmp_path):
    # every block is the identity (zero output projections) and shares block 0's qkv: every block sees the
    # same tokens and computes the same, non-uniform maps
    torch.manual_seed(0)
    model = vitlab.create_model("deit_mini", depth=4, num_classes=10)
    qkv = model.blocks[0].mixer.qkv
    qkv.weight.normal_(0, 0.5)
    for blk in model.blocks:
        blk.mixer.qkv.load_state_dict(qkv.state_dict())
        for lin in (blk.mixer.proj, blk.mlp.fc2):
            lin.weight.zero_()
            lin.bias.zero_()
    res = run(model, ["collapse", "evolution", "heads"], tmp_path, threshold=0.99)
    n = 1 + 8 * 8
    np.testing.assert_allclose(res["collapse"]["similarity"], np.ones((4, 4)), rtol=sum_rtol(2 * 2 * n * n))
    assert res["collapse"]["similar_blocks"] == 3
    np.testing.assert_allclose(res["evolution"]["similarity"], np.ones(3), rtol=sum_rtol(2 * (n - 1) * 64))
    assert res["evolution"]["blocks"] == [1, 2, 3]
    # the maps are far from uniform: the two heads differ
    assert max(res["heads"]["mean_between_heads"]) < 0.95
    # and a model with its own random blocks is not collapsed
    for blk in model.blocks[1:]:
        blk.mixer.qkv.weight.normal_(0, 0.5)
    out = model.forward_trace(images_and_input()[1])
    assert metrics.cross_layer_similarity([a["attn"] for a in out["aux"]])[0, 3] < 0.9


@torch.no_grad()
def test_aft_conv_bias_json_is_exp_w_minus_one(tmp_path):
    torch.manual_seed(0)
    model = vitlab.create_model("aft_conv_mini", depth=2, num_classes=10)  # 16 heads, kernel 5
    s, h = 5, 16
    hot = [(i % s, (3 * i) % s) for i in range(h)]
    for layer, blk in enumerate(model.blocks):
        m = blk.mixer
        m.w.zero_()
        for i, (r, c) in enumerate(hot):
            m.w[i, r, c] = 1.0
        m.gamma.copy_(torch.linspace(0.5, 2.0, h) * (layer + 1))
        m.beta.copy_(torch.linspace(-1.0, 1.0, h))
    res = run(model, ["aft_bias", "aft_keys"], tmp_path, max_heads=4)["aft_bias"]
    assert res["layers"] == ["blocks.0.mixer", "blocks.1.mixer"] and res["blocks"] == [0, 1]
    for layer, blk in enumerate(model.blocks):
        got = torch.tensor(res["kernels"][layer], dtype=torch.float32)
        assert torch.equal(got, blk.mixer.effective_kernel())  # exactly the module's float32 values
        # paper Eq. 8 in float64: w' = gamma (w - mean) / std + beta, plotted as exp(w') - 1
        w = blk.mixer.w.double()
        std = w.var((1, 2), unbiased=False, keepdim=True).add(1e-8).sqrt()
        want = torch.expm1(
            blk.mixer.gamma.double()[:, None, None] * (w - w.mean((1, 2), keepdim=True)) / std
            + blk.mixer.beta.double()[:, None, None]
        )
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        for i, (r, c) in enumerate(hot):  # the constructed spike is where the plot puts it
            assert divmod(int(got[i].argmax()), s) == (r, c)
    keys = json.loads((tmp_path / "aft_keys.json").read_text())
    assert np.array(keys["maps"]).shape == (2, 2, 4, 8, 8) and keys["num_channels"] == [16, 16]


@torch.no_grad()
def test_aft_bias_is_zero_at_init_and_skipped_without_aft(tmp_path):
    res = run(vitlab.create_model("aft_conv_mini", depth=1), ["aft_bias"], tmp_path)
    assert np.array(res["aft_bias"]["kernels"]).shape == (1, 16, 5, 5)
    assert not np.array(res["aft_bias"]["kernels"]).any()  # gamma = beta = 0: AFT-conv starts as AFT-simple
    report = analyze(
        vitlab.create_model("deit_mini", depth=1).eval(),
        *images_and_input(),
        ["aft_bias", "external"],
        tmp_path / "deit",
        log=lambda s: None,
    )
    assert "AFT-conv" in report["analyses"]["aft_bias"]["skipped"]
    assert "external" in report["analyses"]["external"]["skipped"]
    assert not (tmp_path / "deit" / "aft_bias.json").exists()


@torch.no_grad()
def test_external_maps_are_double_normalised(tmp_path):
    model = vitlab.create_model("eamlp_mini", depth=2, num_classes=10)
    slots = list(range(model.blocks[0].mixer.memory_size))
    res = run(model, ["external", "attention"], tmp_path, slots=slots, max_heads=3)
    maps = np.array(res["external"]["maps"])  # (images, blocks, slots, heads, 8, 8)
    assert maps.shape == (2, 2, len(slots), 3, 8, 8)
    # l1 over the memory slots: every patch's attention sums to 1 over all slots (eps 1e-9)
    np.testing.assert_allclose(maps.sum(2), 1.0, rtol=1e-5)
    assert not (tmp_path / "attention.json").exists()  # no self-attention in EAMLP's blocks


MODELS = ["deit_mini", "deepvit_mini", "refiner_vit_mini", "cpvt_mini", "tnt_mini", "eamlp_mini", "aft_conv_mini"]


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_explicit_path_gives_the_same_logits(name):
    torch.manual_seed(0)
    model = vitlab.create_model(name, num_classes=10).eval()
    for p in model.parameters():  # non-trivial maps: larger weights than the init's
        p.add_(torch.randn_like(p) * 0.05)
    _, x = images_and_input(3)
    out = model.forward_trace(x, return_aux=True)
    torch.testing.assert_close(model.forward_head(out["features"]), model(x), rtol=1e-5, atol=1e-5)
    assert len(out["tokens"]) == len(out["aux"]) == len(model.blocks)


# -------------------------------------------------------------------------------------- the command


def main(argv: list[str]) -> int:
    """`vitlab ARGS` with only `analyze` registered, so that a colleague's unfinished subcommand cannot break it."""
    assert "analyze" in vitlab_cli.COMMANDS
    saved = dict(vitlab_cli.COMMANDS)
    vitlab_cli.COMMANDS.clear()
    vitlab_cli.COMMANDS["analyze"] = saved["analyze"]
    try:
        return vitlab_cli.main(argv)
    finally:
        vitlab_cli.COMMANDS.update(saved)


def test_cli_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "an"
    rc = main(["analyze", "deit_mini", "--num-images", "2", "--what", "all", "--query", "10", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for name in ("attention", "collapse", "heads", "evolution"):
        assert (out / f"{name}.json").is_file() and (out / f"{name}.png").stat().st_size > 1000
        assert name in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["explicit_path_max_abs_logit_diff"] < 1e-5
    assert set(summary["analyses"]) == {
        "attention",
        "collapse",
        "heads",
        "evolution",
        "aft_bias",
        "aft_keys",
        "external",
        "relative_attention",
        "attention_matrix",
        "tnt_features",
        "tnt_tsne",
        "tnt_inner_attention",
    }
    assert "skipped" in summary["analyses"]["aft_keys"] and "skipped: " in text
    att = json.loads((out / "attention.json").read_text())
    assert att["query"] == "patch 10 (row 1, col 2)" and att["query_token"] == 11
    assert np.array(att["maps"]).shape == (2, 4, 2, 8, 8)


def test_cli_reads_image_files(tmp_path, capsys):
    from PIL import Image

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    Image.fromarray(rng.integers(0, 256, (30, 30), dtype=np.uint8)).save(tmp_path / "b.jpg")  # grey -> RGB
    out = tmp_path / "an"
    args = [
        "analyze",
        "cpvt_gap_mini",
        "--images",
        str(tmp_path / "a.png"),
        str(tmp_path / "b.jpg"),
        "--what",
        "evolution,attention",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    assert "2 image files" in capsys.readouterr().out
    att = json.loads((out / "attention.json").read_text())
    assert att["query"] == "patch 36 (row 4, col 4)"  # no class token: the centre patch by default
    assert np.array(att["maps"]).shape == (2, 4, 2, 8, 8)
    assert len(json.loads((out / "evolution.json").read_text())["similarity"]) == 3


def test_cli_checkpoint_round_trip(tmp_path, capsys):
    torch.manual_seed(0)
    model = vitlab.create_model("deepvit_mini", num_classes=7, in_chans=1, img_size=28)
    for p in model.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    safetensors.torch.save_file(sd, str(tmp_path / "w.safetensors"))
    torch.save({"model": sd, "epoch": 3}, tmp_path / "w.pt")
    sims = []
    for ckpt in ("w.safetensors", "w.pt"):
        out = tmp_path / ckpt.replace(".", "_")
        args = [
            "analyze",
            "deepvit_mini",
            "--checkpoint",
            str(tmp_path / ckpt),
            "--in-chans",
            "1",
            "--img-size",
            "28",
            "--data",
            "mnist",
            "--num-images",
            "3",
            "--what",
            "collapse",
            "--out",
            str(out),
        ]
        assert main(args) == 0, capsys.readouterr().err
        sims.append(json.loads((out / "collapse.json").read_text())["similarity"])
    assert sims[0] == sims[1]
    # the same numbers as the metric on the loaded model's maps (num_classes 7 was read from the head)
    from vitlab.data import load_dataset, make_transform

    ds = load_dataset("mnist", "test")
    x = make_transform(False, 28, ds.mean, ds.std)(ds.images[:3].float() / 255)
    with torch.no_grad():
        out = model.eval().forward_trace(x)
    want = metrics.cross_layer_similarity([a["attn"] for a in out["aux"]])
    np.testing.assert_allclose(sims[0], want.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["deit_mini", "--what", "attention,nope"], "unknown analysis 'nope'"),
        (["deit_mini", "--query", "64", "--what", "attention"], "index must be in [0, 64)"),
        (["cpvt_gap_mini", "--query", "cls", "--what", "attention"], "no class token"),
        (["deit_mini", "--checkpoint", "missing.safetensors"], "not found"),
        (["deit_mini", "--threshold", "1.5", "--what", "evolution"], "threshold"),
    ],
)
def test_cli_user_errors_are_one_line(args, message, tmp_path, capsys):
    assert main(["analyze", *args, "--num-images", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.strip().count("\n") == 0


def test_cli_bad_checkpoint_is_one_line(tmp_path, capsys):
    sd = vitlab.create_model("deit_mini", depth=2).state_dict()
    torch.save(sd, tmp_path / "two_blocks.pt")
    assert main(["analyze", "deit_mini", "--checkpoint", str(tmp_path / "two_blocks.pt"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "does not fit" in err and "missing" in err and err.strip().count("\n") == 0


def test_cli_training_checkpoint_rebuilds_its_model(tmp_path, capsys):
    ckpt_mod = pytest.importorskip("vitlab.checkpoint")
    torch.manual_seed(0)
    kwargs = dict(num_classes=10, in_chans=1, img_size=28)
    model = vitlab.create_model("aft_conv_mini", **kwargs)
    with torch.no_grad():
        model.blocks[0].mixer.beta.fill_(0.5)  # exp(0.5) - 1 everywhere in layer 0
    path = ckpt_mod.save_checkpoint(
        {"model_name": "aft_conv_mini", "model_kwargs": kwargs, "model": model.state_dict(), "epoch": 2},
        tmp_path / "last.pt",
    )
    out = tmp_path / "an"
    assert main(["analyze", "aft_conv_mini", "--checkpoint", str(path), "--what", "aft_bias", "--out", str(out)]) == 0
    assert "epoch 2" in capsys.readouterr().out  # no --in-chans / --img-size needed: the checkpoint knows
    kernels = np.array(json.loads((out / "aft_bias.json").read_text())["kernels"])
    np.testing.assert_allclose(kernels[0], math.expm1(0.5), rtol=1e-6)
    assert not kernels[1:].any()
    assert main(["analyze", "deit_mini", "--checkpoint", str(path), "--out", str(out)]) == 2
    assert "aft_conv_mini" in capsys.readouterr().err


def test_parse_what():
    assert parse_what("aft") == ["aft_bias", "aft_keys"]
    assert parse_what("collapse, heads,collapse") == ["collapse", "heads"]
    assert len(parse_what("all")) == 12


# ------------------------------------------------------------------------------ whole attention matrices


def naive_relative(attn: torch.Tensor, gh: int, gw: int, prefix: int) -> torch.Tensor:
    """For every offset (dy, dx): the mean over the query patches with a key patch at that offset."""
    b, h = attn.shape[:2]
    out = torch.zeros(b, h, 2 * gh - 1, 2 * gw - 1, dtype=torch.float64)
    for dy in range(-(gh - 1), gh):
        for dx in range(-(gw - 1), gw):
            vals = [
                attn[:, :, prefix + qy * gw + qx, prefix + (qy + dy) * gw + (qx + dx)].double()
                for qy in range(gh)
                for qx in range(gw)
                if 0 <= qy + dy < gh and 0 <= qx + dx < gw
            ]
            out[:, :, dy + gh - 1, dx + gw - 1] = torch.stack(vals).mean(0)
    return out


def test_relative_attention_matches_the_naive_mean_over_queries():
    from vitlab.analysis.matrices import relative_attention
    from vitlab.mixers.base import TokenLayout

    attn = torch.rand(2, 3, 1 + 3 * 4, 1 + 3 * 4).softmax(-1)
    got = relative_attention(attn, TokenLayout((3, 4), 1))
    torch.testing.assert_close(got, naive_relative(attn, 3, 4, 1), rtol=1e-12, atol=1e-12)
    eye = torch.eye(9).expand(1, 1, 9, 9)  # every patch attends to itself: all weight at offset (0, 0)
    rel = relative_attention(eye, TokenLayout((3, 3), 0))[0, 0]
    assert rel[2, 2] == 1 and rel.sum() == 1


@torch.no_grad()
def test_relative_attention_and_attention_matrix_on_a_model(tmp_path):
    torch.manual_seed(0)
    model = vitlab.create_model("deit_mini", depth=2, num_classes=10).eval()
    res = run(model, ["relative_attention", "attention_matrix"], tmp_path)
    out = model.forward_trace(images_and_input()[1], return_aux=True)
    maps = [aux["attn"] for aux in out["aux"]]
    rel = np.array(res["relative_attention"]["maps"])  # (blocks, heads, 15, 15) over the 8x8 grid
    assert rel.shape == (2, 2, 15, 15) and res["relative_attention"]["blocks"] == [0, 1]
    np.testing.assert_allclose(rel[1], naive_relative(maps[1], 8, 8, 1).mean(0).numpy(), rtol=1e-5, atol=1e-7)
    full = np.array(res["attention_matrix"]["maps"])  # (blocks, heads, 65, 65), mean over the images
    np.testing.assert_allclose(full[0], maps[0].double().mean(0).numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(full.sum(-1), 1.0, rtol=1e-5)
    assert (tmp_path / "relative_attention.png").read_bytes()[:4] == b"\x89PNG"
    cnn = vitlab.create_model("aft_conv_mini", num_classes=10)  # no self-attention maps: skipped with a reason
    summary = analyze(cnn, *images_and_input(), ["relative_attention"], tmp_path / "aft", log=lambda s: None)
    assert "skipped" in summary["analyses"]["relative_attention"]
