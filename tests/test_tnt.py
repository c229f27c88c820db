"""TNT: golden vectors (Huawei official + timm), the paper's equations written out, complexity formulas,
parameter/MAC targets, partial TNT, SE, training, other input sizes and bad input."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import vitlab
from conftest import assert_close_to_golden, load_golden
from vitlab.interop import rename_keys
from vitlab.models.registry import get_config
from vitlab.models.tnt import TNT, TNTBlock


def convert_reference_state_dict(state, source="huawei"):
    """The official (Huawei) or timm TNT names -> ours, through the library's checkpoint key maps."""
    return rename_keys(state, f"tnt_{source}")


# the golden references' small configuration: d=32, c=8, 4/2 heads, 32 px, patch 8, stride 4 -> m=4 words
SMALL = dict(
    img_size=32, patch_size=8, num_classes=10, outer_dim=32, inner_dim=8, depth=2, outer_heads=4, inner_heads=2
)
TINY = dict(
    img_size=16,
    patch_size=4,
    num_classes=5,
    outer_dim=16,
    inner_dim=4,
    depth=3,
    outer_heads=2,
    inner_heads=2,
    inner_stride=2,
)


# ------------------------------------------------------------------------------------------ naive reference
def naive_msa(x, p, prefix, heads):
    """Paper MSA written head by head: softmax(Q_h K_hᵀ / sqrt(d_h)) V_h, concat, output projection."""
    c = x.shape[-1]
    hd = c // heads
    q, k, v = (x @ p[prefix + "qkv.weight"].T).split(c, dim=-1)
    outs = []
    for h in range(heads):
        sl = slice(h * hd, (h + 1) * hd)
        e = torch.exp(q[..., sl] @ k[..., sl].transpose(-1, -2) / math.sqrt(hd))
        outs.append((e / e.sum(-1, keepdim=True)) @ v[..., sl])
    return torch.cat(outs, -1) @ p[prefix + "proj.weight"].T + p[prefix + "proj.bias"]


def naive_ln(x, p, prefix, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * p[prefix + "weight"] + p[prefix + "bias"]


def naive_mlp(x, p, prefix):
    h = x @ p[prefix + "fc1.weight"].T + p[prefix + "fc1.bias"]
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    return h @ p[prefix + "fc2.weight"].T + p[prefix + "fc2.bias"]


def naive_transformer(x, p, prefix, heads):
    """Eq. 9.1 / 9.2: X' = X + MSA(LN(X)); X = X' + MLP(LN(X'))."""
    x = x + naive_msa(naive_ln(x, p, prefix + "norm1."), p, prefix + "mixer.", heads)
    return x + naive_mlp(naive_ln(x, p, prefix + "norm2."), p, prefix + "mlp.")


def naive_words_to_sentence(y, p, prefix, batch):
    """LN(FC(LN(Vec(Y^i)))): Vec concatenates the m words of a patch, word-major."""
    n = y.shape[0] // batch
    vec = torch.stack(
        [torch.cat([y[b * n + i, j] for j in range(y.shape[1])]) for b in range(batch) for i in range(n)]
    ).view(batch, n, -1)
    z = naive_ln(vec, p, prefix + "norm1.") @ p[prefix + "fc.weight"].T
    if prefix + "fc.bias" in p:
        z = z + p[prefix + "fc.bias"]
    return naive_ln(z, p, prefix + "norm2.")


def naive_tnt_block(inner, outer, p, prefix, outer_heads, inner_heads, has_inner=True, se=False):
    """One TNT block: inner transformer per patch, fusion Z^i += FC(Vec(Y^i)) (no class token), outer block."""
    if has_inner:
        inner = naive_transformer(inner, p, prefix + "inner.", inner_heads)
        fused = naive_words_to_sentence(inner, p, prefix + "proj.", outer.shape[0])
        outer = torch.cat([outer[:, :1], outer[:, 1:] + fused], dim=1)
    if not se:
        return inner, naive_transformer(outer, p, prefix + "outer.", outer_heads)
    pre = prefix + "outer."
    outer = outer + naive_msa(naive_ln(outer, p, pre + "norm1."), p, pre + "mixer.", outer_heads)
    t = naive_mlp(naive_ln(outer, p, pre + "norm2."), p, pre + "mlp.")
    s = naive_ln(t.mean(1, keepdim=True), p, pre + "mlp.se.norm.")  # mean over ALL tokens (class included)
    g = torch.tanh(
        torch.relu(s @ p[pre + "mlp.se.fc1.weight"].T + p[pre + "mlp.se.fc1.bias"]) @ p[pre + "mlp.se.fc2.weight"].T
        + p[pre + "mlp.se.fc2.bias"]
    )
    return inner, outer + t + t * g


def naive_pixel_embed(x, p, patch, stride):
    """Visual words: each p x p patch convolved on its own (zero padding at its border), one patch at a time."""
    b, _, h, w = x.shape
    rows = []
    for bi in range(b):
        for i in range(h // patch):
            for j in range(w // patch):
                piece = x[bi : bi + 1, :, i * patch : (i + 1) * patch, j * patch : (j + 1) * patch]
                y = F.conv2d(piece, p["pixel_embed.proj.weight"], p["pixel_embed.proj.bias"], stride=stride, padding=3)
                rows.append(y[0].flatten(1).T)  # (m, c), words row-major
    return torch.stack(rows)


def naive_tnt(model: TNT, x, patch, stride, outer_heads, inner_heads):
    p = {k: v.double() for k, v in model.state_dict().items()}
    x = x.double()
    b = x.shape[0]
    inner = naive_pixel_embed(x, p, patch, stride) + p["inner_pos"]
    outer = torch.cat([p["cls_token"].expand(b, -1, -1), naive_words_to_sentence(inner, p, "proj.", b)], 1)
    outer = outer + p["pos_embed"]
    for i, blk in enumerate(model.blocks):
        inner, outer = naive_tnt_block(
            inner, outer, p, f"blocks.{i}.", outer_heads, inner_heads, blk.has_inner, se=hasattr(blk.outer.mlp, "se")
        )
    feats = naive_ln(outer, p, "norm.")
    pooled = feats[:, 1:].mean(1) if model.global_pool == "avg" else feats[:, 0]
    return pooled @ p["head.weight"].T + p["head.bias"], feats


def randomise(module: torch.nn.Module, seed: int = 0) -> None:
    """O(1) values in every tensor (the default init leaves biases 0 and norms 1, which would hide mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.named_parameters():
            if name.endswith("weight") and t.dim() >= 2:
                t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t[0].numel()))
            elif "norm" in name and name.endswith("weight"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)


# ----------------------------------------------------------------------------------------------- goldens
@pytest.mark.parametrize(
    "file, source, se, names",
    [
        ("tnt_block_huawei.npz", "huawei", 0, ("inner_tokens", "outer_tokens")),
        ("tnt_block_se_huawei.npz", "huawei", 4, ("inner_tokens", "outer_tokens")),  # official se>0: hidden C/4
        ("tnt_block_timm.npz", "timm", 0, ("pixel_embed", "patch_embed")),
    ],
)
def test_golden_block(file, source, se, names):
    g = load_golden(file)
    blk = TNTBlock(32, 8, 4, 2, num_words=4, se=se).eval()
    blk.load_state_dict(convert_reference_state_dict(g.state(), source))
    inner, outer = (g.input(n) for n in names)
    outer_before = outer.clone()
    new_inner, new_outer = blk(inner, outer)
    assert_close_to_golden(new_inner, g.output(names[0]))
    assert_close_to_golden(new_outer, g.output(names[1]))
    assert torch.equal(outer, outer_before), "the official in-place update must not leak to the caller's tensor"


@pytest.mark.parametrize("source", ["huawei", "timm"])
def test_golden_model(source):
    g = load_golden(f"tnt_model_{source}.npz")
    state = g.state()
    model = TNT(**SMALL).eval()
    converted = convert_reference_state_dict(state, source)
    model.load_state_dict(converted)  # strict: every key maps, the unused outer_tokens is dropped
    x = g.input("image")
    feats = model.forward_features(x)
    assert_close_to_golden(model.forward_head(feats), g.output("logits"))
    assert_close_to_golden(model(x), g.output("logits"))
    expected = g.output("features")
    # Huawei's forward_features returns the normed class token, timm's all normed tokens
    assert_close_to_golden(feats[:, 0] if expected.dim() == 2 else feats, expected)
    if source == "timm":  # timm's (1, c, p', p') pixel_pos is our (1, m, c) word table, word = row * p' + col
        pix = state["pixel_pos"]
        assert torch.equal(model.inner_pos[0, 1 * 2 + 0], pix[0, :, 1, 0])


def test_converter_rejects_unknown_source_and_missing_value():
    with pytest.raises(ValueError, match="source"):
        convert_reference_state_dict({}, "legacy")
    with pytest.raises(ValueError, match="value projection"):
        convert_reference_state_dict({"blocks.0.inner_attn.qk.weight": torch.zeros(4, 2)}, "huawei")


# ------------------------------------------------------------------------------ naive equations (float64)
@pytest.mark.parametrize("se", [0, 4])
def test_block_matches_paper_equations(se):
    blk = TNTBlock(16, 4, 2, 2, num_words=4, se=se).double().eval()
    randomise(blk, seed=se)
    inner, outer = torch.randn(2 * 6, 4, 4, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    p = {k: v.double() for k, v in blk.state_dict().items()}
    ref_inner, ref_outer = naive_tnt_block(inner, outer, p, "", 2, 2, se=se > 0)
    got_inner, got_outer = blk(inner, outer)
    torch.testing.assert_close(got_inner, ref_inner, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(got_outer, ref_outer, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(tnt_blocks=(1,), global_pool="avg"),  # partial TNT: blocks 0 and 2 are plain outer blocks
        dict(se=2, inner_stride=3, img_size=(12, 8)),  # ceil(4/3)^2 = 4 words, a non-square image
    ],
)
def test_model_matches_paper_equations(kw):
    cfg = {**TINY, **kw}
    model = TNT(**cfg).double().eval()
    randomise(model, seed=1)
    h, w = (cfg["img_size"],) * 2 if isinstance(cfg["img_size"], int) else cfg["img_size"]
    x = torch.randn(2, 3, h, w, dtype=torch.float64)
    ref_logits, ref_feats = naive_tnt(model, x, cfg["patch_size"], cfg["inner_stride"], 2, 2)
    torch.testing.assert_close(model.forward_features(x), ref_feats, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(model(x), ref_logits, rtol=1e-5, atol=1e-8)


# -------------------------------------------------------------------------------- params / complexity
def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_macs(outer_dim, inner_dim, outer_heads, inner_heads, n, m, has_inner=True) -> int:
    """Matmul MACs of one block (B=1, n patches + class token), counted on the meta device."""
    with torch.device("meta"):
        blk = TNTBlock(outer_dim, inner_dim, outer_heads, inner_heads, num_words=m, has_inner=has_inner)
        inner, outer = torch.empty(n, m, inner_dim), torch.empty(1, n + 1, outer_dim)
        with FlopCounterMode(display=False) as fc:
            blk(inner, outer)
    return fc.get_total_flops() // 2


def flops_t(n, d):
    return 2 * n * d * (6 * d + n)


def flops_tnt(n, d, m, c):
    return 2 * n * m * c * (6 * c + m) + n * m * c * d + flops_t(n, d)


def test_paper_complexity_formulas_tnt_s():
    # paper Sec. 2.3 for TNT-S (d=384, n=196, c=24, m=16): 376M and 429M per block, ratio ~1.14
    n, d, m, c = 196, 384, 16, 24
    assert round(flops_t(n, d) / 1e6) == 376
    assert round(flops_tnt(n, d, m, c) / 1e6) == 429
    assert flops_tnt(n, d, m, c) / flops_t(n, d) == pytest.approx(1.14, abs=0.005)
    # our block's matmuls are exactly the formula, with n + 1 outer tokens (the class token) in the outer part
    got = block_macs(d, c, 6, 4, n, m)
    assert got == flops_tnt(n, d, m, c) - flops_t(n, d) + flops_t(n + 1, d)
    assert got / 1e6 == pytest.approx(429, rel=0.01)
    assert block_macs(d, c, 6, 4, n, m, has_inner=False) == flops_t(n + 1, d)


@pytest.mark.parametrize("d, c, m", [(384, 24, 16), (192, 12, 16), (640, 40, 16), (32, 8, 4)])
def test_block_params_formula(d, c, m):
    """Params_TNT = 12cc + mcd + 12dd: the weight matrices; biases and norms on top, counted term by term."""
    blk = TNTBlock(d, c, max(1, d // 64), 2, num_words=m)
    norms_biases = (
        2 * c
        + c
        + 2 * c
        + 4 * c
        + c  # inner: LN1, proj bias, LN2, fc1/fc2 biases
        + 2 * m * c
        + 2 * d  # fusion: LN(mc), LN(d); its Linear has no bias
        + 2 * d
        + d
        + 2 * d
        + 4 * d
        + d  # outer: same as inner
    )
    assert count(blk) == 12 * c * c + m * c * d + 12 * d * d + norms_biases
    plain = TNTBlock(d, c, max(1, d // 64), 2, num_words=m, has_inner=False)
    assert count(plain) == 12 * d * d + 10 * d
    if (d, c, m) == (384, 24, 16):  # paper: about 1.08x the parameters of a transformer block
        assert (12 * c * c + m * c * d + 12 * d * d) / (12 * d * d) == pytest.approx(1.08, abs=0.01)


def tnt_params(d, c, m, depth, tnt_blocks, se, p=16, in_chans=3, classes=1000, grid=14) -> int:
    """Whole-model count from the official layer list (no frozen outer_tokens)."""
    inner = 12 * c * c + 10 * c + m * c * d + 2 * m * c + 2 * d
    outer = 12 * d * d + 10 * d + (2 * d + d * (d // se) + d // se + d * (d // se) + d if se else 0)
    embed = in_chans * 49 * c + c + m * c + (2 * m * c + m * c * d + d + 2 * d) + d + (grid * grid + 1) * d
    return embed + depth * outer + len(tnt_blocks) * inner + 2 * d + d * classes + classes


@pytest.mark.parametrize(
    "name, d, c, blocks, se",
    [
        ("tnt_ti_patch16_224", 192, 12, range(12), 0),
        ("tnt_s_patch16_224", 384, 24, range(12), 0),
        ("tnt_b_patch16_224", 640, 40, range(12), 0),
        ("tnt_s_1", 384, 24, (0, 3, 7, 11), 0),
        ("tnt_s_2", 384, 24, (0, 5, 11), 0),
        ("tnt_s_3", 384, 24, (0, 5), 0),
        ("tnt_s_4", 384, 24, (0,), 0),
        ("tnt_s_se_patch16_224", 384, 24, range(12), 4),
    ],
)
def test_registered_params(name, d, c, blocks, se):
    with torch.device("meta"):
        model = vitlab.create_model(name)
    n = count(model)
    assert n == tnt_params(d, c, 16, 12, tuple(blocks), se)
    assert n / 1e6 == pytest.approx(get_config(name).params_m, rel=0.01)
    assert not any(k.endswith("outer_tokens") for k in model.state_dict())  # docs/semantics.md, Decision T2


@pytest.mark.parametrize(
    "name, spec",
    [
        ("tnt_ti_patch16_224", 6.08),
        ("tnt_s_patch16_224", 23.77),
        ("tnt_b_patch16_224", 65.43),
        ("tnt_s_se_patch16_224", 24.7),
    ],
)
def test_params_targets(name, spec):
    """Official-code counts (6.08 / 23.77 / 65.43M, docs/models.md) and paper Table 12 (TNT-S + SE 24.7M), within 1%."""
    with torch.device("meta"):
        assert count(vitlab.create_model(name)) / 1e6 == pytest.approx(spec, rel=0.01)


@pytest.mark.parametrize(
    "name, spec, tol",
    [
        ("tnt_ti_patch16_224", 1.40, 0.014),
        ("tnt_s_patch16_224", 5.22, 0.052),
        ("tnt_b_patch16_224", 14.05, 0.14),
        # Table 5 gives the partial models' FLOPs to 0.1G
        ("tnt_s_1", 4.8, 0.05),
        ("tnt_s_2", 4.7, 0.05),
        ("tnt_s_3", 4.7, 0.05),
        ("tnt_s_4", 4.6, 0.05),
    ],
)
def test_macs_targets(name, spec, tol):
    """Paper Table 1 MACs at 224 (within 1%) and Table 5's partial-TNT FLOPs."""
    with torch.device("meta"):
        model = vitlab.create_model(name)
        with FlopCounterMode(display=False) as fc:
            model(torch.empty(1, 3, 224, 224))
    assert fc.get_total_flops() / 2e9 == pytest.approx(spec, abs=tol)
    assert get_config(name).macs_g == spec


# --------------------------------------------------------------------------------- training, API, sizes
@pytest.mark.parametrize("kw", [dict(), dict(tnt_blocks=(0, 2), se=4, drop_path_rate=0.1, drop_rate=0.1)])
def test_mini_forward_backward_every_param_gets_grad(kw):
    torch.manual_seed(0)
    model = vitlab.create_model("tnt_mini", num_classes=10, **kw).train()
    x = torch.randn(4, 3, 32, 32)
    loss = F.cross_entropy(model(x), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing
    assert torch.isfinite(loss)


def test_mini_mnist_size_and_one_channel():
    model = vitlab.create_model("tnt_mini", img_size=28, in_chans=1, num_classes=10).eval()
    assert model.grid == (7, 7) and model.pixel_embed.num_words == 4
    out = model(torch.randn(3, 1, 28, 28))
    assert out.shape == (3, 10)
    assert model.meta["input_size"] == (1, 28, 28)


def test_partial_tnt_blocks():
    with torch.device("meta"):
        model = vitlab.create_model("tnt_s_2")
    assert [i for i, b in enumerate(model.blocks) if b.has_inner] == [0, 5, 11]
    assert not hasattr(model.blocks[1], "inner")


def test_forward_trace():
    model = TNT(**{**TINY, "tnt_blocks": (0, 1)}).eval()
    randomise(model)
    x = torch.randn(2, 3, 16, 16)
    out = model.forward_trace(x)
    assert set(out) >= {"tokens", "aux", "features", "layout"}
    assert len(out["tokens"]) == len(out["aux"]) == 3
    assert out["layout"].grid == (4, 4) and out["layout"].num_prefix == 1
    torch.testing.assert_close(out["features"], model.forward_features(x))  # explicit path == SDPA path
    torch.testing.assert_close(out["features"], model.norm(out["tokens"][-1]))
    aux0, aux2 = out["aux"][0], out["aux"][2]
    assert aux0["attn"].shape == (2, 2, 17, 17) and aux0["inner_attn"].shape == (2 * 16, 2, 4, 4)
    assert "inner_attn" not in aux2 and aux2["attn"].shape == (2, 2, 17, 17)
    torch.testing.assert_close(aux0["attn"].sum(-1), torch.ones(2, 2, 17))
    plain = model.forward_trace(x, return_aux=False)
    assert all(a == {} for a in plain["aux"])
    torch.testing.assert_close(plain["tokens"][1], out["tokens"][1])


def test_head_api():
    model = TNT(**TINY).eval()
    x = torch.randn(2, 3, 16, 16)
    feats = model.forward_features(x)
    assert feats.shape == (2, 17, 16) and model.num_features == 16
    torch.testing.assert_close(model.forward_head(feats, pre_logits=True), feats[:, 0])
    model.reset_classifier(7, global_pool="avg")
    assert model(x).shape == (2, 7)
    torch.testing.assert_close(model.forward_head(feats, pre_logits=True), feats[:, 1:].mean(1))
    model.reset_classifier(0)
    assert model(x).shape == (2, 16)
    names = dict(model.named_parameters())
    assert model.no_weight_decay() <= set(names) and "inner_pos" in model.no_weight_decay()


def test_init_as_official():
    torch.manual_seed(0)
    model = TNT(**{**SMALL, "outer_dim": 64})
    for name, p in model.named_parameters():
        if name in ("cls_token", "pos_embed", "inner_pos") or (p.dim() == 2 and "weight" in name):
            assert abs(p.mean()) < 0.01 and 0.012 < p.std() < 0.028, name  # trunc_normal(std=0.02)
        elif "norm" in name:
            assert torch.all(p == (1.0 if name.endswith("weight") else 0.0)), name
        elif name.endswith("bias") and "pixel_embed" not in name:
            assert torch.all(p == 0), name
    # the word-embedding conv keeps PyTorch's default init (the official code does not re-initialise it)
    w = model.pixel_embed.proj.weight
    assert w.abs().max() <= 1 / math.sqrt(3 * 49) + 1e-6


def test_dynamic_img_size():
    torch.manual_seed(0)
    model = vitlab.create_model("tnt_mini", num_classes=10, dynamic_img_size=True).eval()
    x32, x48 = torch.randn(2, 3, 32, 32), torch.randn(2, 3, 48, 48)
    assert model(x48).shape == (2, 10)
    # same result as a 48 px model holding the bicubically resampled table
    big = vitlab.create_model("tnt_mini", num_classes=10, img_size=48).eval()
    state = model.state_dict()
    pos = state["pos_embed"]
    grid = pos[:, 1:].reshape(1, 8, 8, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=(12, 12), mode="bicubic", align_corners=False).permute(0, 2, 3, 1)
    state["pos_embed"] = torch.cat([pos[:, :1], grid.reshape(1, 144, -1)], 1)
    big.load_state_dict(state)
    torch.testing.assert_close(model(x48), big(x48))
    fixed = vitlab.create_model("tnt_mini", num_classes=10).eval()
    fixed.load_state_dict(model.state_dict())
    torch.testing.assert_close(fixed(x32), model(x32))
    with pytest.raises(ValueError, match=r"8x8 patch grid.*dynamic_img_size"):
        fixed(x48)


def test_bad_input():
    model = TNT(**TINY).eval()
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        model(torch.randn(2, 1, 16, 16))
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        model(torch.randn(3, 16, 16))
    with pytest.raises(ValueError, match="multiple of the patch size"):
        model(torch.randn(2, 3, 18, 16))
    with pytest.raises(ValueError, match="multiple of the patch size"):
        TNT(**{**TINY, "img_size": 30})
    with pytest.raises(ValueError, match="global_pool"):
        TNT(**{**TINY, "global_pool": "mean"})
    with pytest.raises(ValueError, match="tnt_blocks"):
        TNT(**{**TINY, "tnt_blocks": (3,)})
    with pytest.raises(ValueError, match="divisible by num_heads"):
        TNT(**{**TINY, "inner_heads": 3})
    with pytest.raises(ValueError, match="SE reduction"):
        TNT(**{**TINY, "se": -1})
    with pytest.raises(ValueError, match="inner_stride"):
        TNT(**{**TINY, "inner_stride": 0})
    blk = TNTBlock(16, 4, 2, 2, num_words=4)
    with pytest.raises(ValueError, match=r"B\*n=12"):
        blk(torch.randn(5, 4, 4), torch.randn(2, 7, 16))
    with pytest.raises(ValueError, match=r"m=4, c=4"):
        blk(torch.randn(12, 9, 4), torch.randn(2, 7, 16))
    with pytest.raises(ValueError, match="unknown option"):
        vitlab.create_model("tnt_mini", embed_dim=32)
