"""T2T-ViT / EAMLP: the token-layer golden (EANet), the T2T module and the whole model against a naive
float64 re-implementation, the sinusoid table, parameter counts, training and input-size behaviour."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import vitlab
from conftest import assert_close_to_golden, load_golden
from vitlab.layers import sinusoid_1d
from vitlab.models.t2t import T2TViT, TokenExternalAttention, TokenSelfAttention, TokensToToken

MINI_SPLIT = ((3, 1, 1), (3, 2, 1), (3, 2, 1))


def tiny(**kw) -> T2TViT:
    cfg = dict(
        img_size=16,
        embed_dim=32,
        depth=2,
        num_heads=2,
        mlp_ratio=2.0,
        token_dim=8,
        soft_split=MINI_SPLIT,
        num_classes=5,
    )
    return T2TViT(**{**cfg, **kw})


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Draw every tensor at O(1) so that a wrong axis or missing term shows (the init is near-degenerate)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 1.0 / math.sqrt(p.shape[-1]) if p.dim() > 1 else 0.3
            p.copy_(
                torch.randn(p.shape, generator=g, dtype=p.dtype) * std + (1.0 if name.endswith("norm1.weight") else 0)
            )
    return model


# ------------------------------------------------------------------------ naive reference (float64, loops)
def naive_soft_split(img: torch.Tensor, k: int, s: int, p: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """One token per k x k window (zero padding p, stride s), features channel-major (c, ki, kj)."""
    b, c, h, w = img.shape
    padded = torch.zeros(b, c, h + 2 * p, w + 2 * p, dtype=img.dtype)
    padded[:, :, p : p + h, p : p + w] = img
    gh, gw = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    windows = [padded[:, :, i * s : i * s + k, j * s : j * s + k].reshape(b, -1) for i in range(gh) for j in range(gw)]
    return torch.stack(windows, dim=1), (gh, gw)


def layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def mlp(x, p, prefix):
    h = x @ p[prefix + "fc1.weight"].T + p[prefix + "fc1.bias"]
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    return h @ p[prefix + "fc2.weight"].T + p[prefix + "fc2.bias"]


def double_norm(logits):
    """Paper: α̂_ij = exp(α̃_ij) / Σ_k exp(α̃_kj) over tokens i; α_ij = α̂_ij / (1e-9 + Σ_k α̂_ik) over slots j."""
    e = torch.exp(logits - logits.amax(dim=-2, keepdim=True))
    a = e / e.sum(dim=-2, keepdim=True)
    return a / (1e-9 + a.sum(dim=-1, keepdim=True))


def naive_token_ea(x, p, prefix):
    t = x @ p[prefix + "q_linear.weight"].T + p[prefix + "q_linear.bias"]
    a = double_norm(t @ p[prefix + "mk.weight"].T)
    y = a @ p[prefix + "mv.weight"].T + p[prefix + "mv.bias"]
    return t + y @ p[prefix + "proj.weight"].T + p[prefix + "proj.bias"]


def naive_multihead_ea(x, p, prefix, num_heads, coef=4):
    t = x @ p[prefix + "query.weight"].T + p[prefix + "query.bias"]
    d = t.shape[-1] // (num_heads * coef)
    heads = []
    for h in range(num_heads * coef):
        th = t[..., h * d : (h + 1) * d]
        a = double_norm(th @ p[prefix + "mk.weight"].T + p[prefix + "mk.bias"])
        heads.append(a @ p[prefix + "mv.weight"].T + p[prefix + "mv.bias"])
    return torch.cat(heads, -1) @ p[prefix + "proj.weight"].T + p[prefix + "proj.bias"]


def naive_sinusoid(n: int, d: int) -> torch.Tensor:
    """T2T-ViT get_sinusoid_encoding: angle = pos / 10000^(2 (j // 2) / d); sin on even j, cos on odd j."""
    rows = []
    for pos in range(n):
        angles = [pos / 10000 ** (2 * (j // 2) / d) for j in range(d)]
        rows.append([math.sin(a) if j % 2 == 0 else math.cos(a) for j, a in enumerate(angles)])
    return torch.tensor(rows, dtype=torch.float64)


def naive_t2t_vit(model: T2TViT, img: torch.Tensor, num_heads: int) -> torch.Tensor:
    p = {k: v.double() for k, v in model.state_dict().items()}
    x = img.double()
    splits = model.tokens_to_token.soft_split
    x, grid = naive_soft_split(x, *splits[0])
    for i, split in enumerate(splits[1:]):
        pre = f"tokens_to_token.layers.{i}."
        x = naive_token_ea(layer_norm(x, p[pre + "norm1.weight"], p[pre + "norm1.bias"]), p, pre + "attn.")
        x = x + mlp(layer_norm(x, p[pre + "norm2.weight"], p[pre + "norm2.bias"]), p, pre + "mlp.")
        b, _, c = x.shape
        image = x.transpose(1, 2).reshape(b, c, *grid)  # tokens are the grid in row-major order
        x, grid = naive_soft_split(image, *split)
    x = x @ p["tokens_to_token.project.weight"].T + p["tokens_to_token.project.bias"]
    x = torch.cat([p["cls_token"].expand(x.shape[0], -1, -1), x], dim=1)
    x = x + naive_sinusoid(x.shape[1], x.shape[2])
    for i in range(len(model.blocks)):
        pre = f"blocks.{i}."
        x = x + naive_multihead_ea(
            layer_norm(x, p[pre + "norm1.weight"], p[pre + "norm1.bias"]), p, pre + "mixer.", num_heads
        )
        x = x + mlp(layer_norm(x, p[pre + "norm2.weight"], p[pre + "norm2.bias"]), p, pre + "mlp.")
    x = layer_norm(x, p["norm.weight"], p["norm.bias"])
    return x[:, 0] @ p["head.weight"].T + p["head.bias"]


# ------------------------------------------------------------------------------------------ golden
def test_golden_eamlp_token_attention():
    g = load_golden("ea_token_eamlp.npz")
    m = TokenExternalAttention(32, 16).eval()
    keys = {
        "q_linear.weight": "q_linear.weight",
        "q_linear.bias": "q_linear.bias",
        "linear_1.weight": "mk.weight",
        "linear_2.weight": "mv.weight",
        "linear_2.bias": "mv.bias",
        "proj.weight": "proj.weight",
        "proj.bias": "proj.bias",
    }
    m.load_state_dict({keys[k]: v for k, v in g.state().items()})
    out, aux = m(g.input("x"), return_aux=True)
    assert_close_to_golden(out, g.output("x"))
    assert aux["memory_attn"].shape == (2, 17, 128)
    torch.testing.assert_close(aux["memory_attn"].sum(-1), torch.ones(2, 17), rtol=0, atol=1e-5)  # ℓ1 over slots


# ------------------------------------------------------------------------------- naive equations
def test_model_matches_naive_float64():
    """The whole EAMLP (soft splits, EA token layers, sinusoid, multi-head EA blocks, class-token head)."""
    model = randomize(tiny()).double().eval()
    img = torch.randn(2, 3, 16, 12, dtype=torch.float64)  # not square: the grid is tracked per axis
    torch.testing.assert_close(model(img), naive_t2t_vit(model, img, num_heads=2), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("split", [((7, 4, 2), (3, 2, 1), (3, 2, 1)), ((4, 4, 0), (2, 2, 0))])
def test_soft_split_order(split):
    """nn.Unfold's windows and feature order equal the explicit window extraction (official and other splits)."""
    t2t = TokensToToken(in_chans=2, embed_dim=6, token_dim=4, soft_split=split).double()
    img = torch.randn(1, 2, 32, 24, dtype=torch.float64)
    tokens, grid = naive_soft_split(img, *split[0])
    torch.testing.assert_close(t2t.splits[0](img).transpose(1, 2), tokens)
    assert t2t.grids((32, 24))[0] == grid
    assert t2t(img)[0].shape == (1, t2t.grid_size((32, 24))[0] * t2t.grid_size((32, 24))[1], 6)


def test_token_self_attention_naive():
    """T2T-ViT-t token layer attention: v + proj(softmax(q kᵀ / sqrt(in_dim)) v), SDPA and explicit paths."""
    m = randomize(TokenSelfAttention(27, 8)).double().eval()
    x = torch.randn(2, 10, 27, dtype=torch.float64)
    q, k, v = (x @ m.qkv.weight.T).split(8, dim=-1)
    e = torch.exp(q @ k.transpose(1, 2) / math.sqrt(27))
    ref = v + (e / e.sum(-1, keepdim=True)) @ v @ m.proj.weight.T + m.proj.bias
    out, aux = m(x, return_aux=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(m(x), ref)
    assert aux["attn"].shape == (2, 10, 10)


def test_sinusoid_table():
    torch.testing.assert_close(sinusoid_1d(50, 24).double(), naive_sinusoid(50, 24), rtol=0, atol=1e-6)
    model = tiny()
    assert "pos_embed" not in dict(model.named_parameters()) and "pos_embed" not in model.state_dict()
    torch.testing.assert_close(model.pos_embed[0].double(), naive_sinusoid(1 + 4 * 4, 32), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        model.position_table(1 + 12 * 10)[0].double(), naive_sinusoid(121, 32), rtol=0, atol=1e-6
    )


# ------------------------------------------------------------------------------------ registry rows
@pytest.mark.parametrize("name, target", [("eamlp_7", 6.10), ("eamlp_14", 29.80), ("eamlp_19", 54.47)])
def test_param_counts(name, target):
    with torch.device("meta"):
        model = vitlab.create_model(name)
    n = sum(p.numel() for p in model.parameters()) / 1e6
    assert abs(n - target) <= 0.01 * target, (name, n, target)
    assert n == pytest.approx(vitlab.models.get_config(name).params_m, rel=0.01)


def test_eamlp_structure_and_init():
    model = tiny(depth=1)
    layer = model.tokens_to_token.layers[0]
    assert layer.attn.mk.bias is None and layer.attn.mk.out_features == 128
    torch.testing.assert_close(layer.attn.mv.weight, layer.attn.mk.weight.t())  # official aliasing at init
    assert layer.attn.mv.weight.data_ptr() != layer.attn.mk.weight.data_ptr()  # a copy: trained independently
    assert (layer.attn.mv.bias == 0).all() and layer.mlp.fc1.out_features == 8  # token MLP ratio 1
    assert layer.attn.attn_drop.p == 0.1 and layer.attn.proj_drop.p == 0.1  # token_performer.py dp1 = dp2 = 0.1
    mixer = model.blocks[0].mixer
    assert type(mixer).__name__ == "MultiHeadExternalAttention" and mixer.num_heads == 8
    assert mixer.query.bias is not None  # the official query Linear has a bias whatever qkv_bias says
    assert mixer.mk.weight.std() < 0.03 and mixer.mv.weight.std() < 0.03  # trunc-normal 0.02, not tied
    assert model.norm.eps == 1e-5 and model.blocks[0].norm1.eps == 1e-5 and layer.norm1.eps == 1e-5
    assert model.no_weight_decay() == {"cls_token"}


# ---------------------------------------------------------------------------------- train / sizes
@pytest.mark.parametrize("size, chans", [(32, 3), (28, 1)])
def test_mini_trains(size, chans):
    torch.manual_seed(0)
    model = vitlab.create_model("eamlp_mini", img_size=size, in_chans=chans, num_classes=10, drop_path_rate=0.1)
    grid = (size // 4, size // 4)
    assert model.grid == grid
    x, y = torch.randn(4, chans, size, size), torch.randint(0, 10, (4,))
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.isfinite().all() and p.grad.abs().sum() > 0, name
    model.eval()
    out = model.forward_trace(x, return_aux=True)
    assert len(out["tokens"]) == 4 and out["layout"].grid == grid and out["layout"].num_prefix == 1
    assert out["aux"][0]["memory_attn"].shape == (4, 8, 1 + grid[0] * grid[1], 64)
    torch.testing.assert_close(out["features"], model.forward_features(x))
    assert model.forward_head(out["features"], pre_logits=True).shape == (4, 64)


def test_other_input_sizes():
    model = tiny().eval()
    x = torch.randn(2, 3, 24, 20)
    out = model.forward_trace(x, return_aux=False)
    assert out["layout"].grid == (6, 5) and out["features"].shape == (2, 31, 32)
    assert model(x).shape == (2, 5)
    # the official split also runs at sizes off its 16 px stride (a 13x13 grid at 200 px)
    official = T2TViT(img_size=64, embed_dim=32, depth=1, num_heads=2, token_dim=8, num_classes=3).eval()
    assert official.grid == (4, 4) and official.tokens_to_token.grid_size(200) == (13, 13)
    assert official(torch.randn(1, 3, 50, 40)).shape == (1, 3)


def test_other_mixers_and_options():
    model = tiny(token_mixer="attention", mixer=["attention", ("aft_conv", dict(num_heads=4))], global_pool="avg")
    assert model.tokens_to_token.layers[0].attn.attn_drop.p == 0.0
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 5)
    model.reset_classifier(0)
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 32)


def test_bad_input():
    model = tiny()
    with pytest.raises(ValueError, match=r"expected images of shape \(B, 3, H, W\)"):
        model(torch.randn(2, 1, 16, 16))
    with pytest.raises(ValueError, match="expected images"):
        model(torch.randn(3, 16, 16))
    with pytest.raises(ValueError, match="too small for the T2T soft splits"):
        T2TViT(img_size=2, embed_dim=32, depth=1, num_heads=2)
    official = T2TViT(img_size=32, embed_dim=32, depth=1, num_heads=2, token_dim=8)
    with pytest.raises(ValueError, match="needs at least 3"):
        official(torch.randn(1, 3, 2, 32))
    with pytest.raises(ValueError, match="soft_split"):
        tiny(soft_split=((3, 0, 1),))
    with pytest.raises(ValueError, match="token_mixer"):
        tiny(token_mixer="linformer")  # (the Performer is T2T-ViT's own, supported)
    with pytest.raises(ValueError, match="global_pool"):
        tiny(global_pool="mean")
    with pytest.raises(ValueError, match="divisible"):
        tiny(num_heads=3)
    with pytest.raises(ValueError, match="unknown option"):
        vitlab.create_model("eamlp_mini", patch_size=4)
