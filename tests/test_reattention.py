"""DeepViT re-attention: golden vectors (dvit_repo), the paper's equation written out, BN, dtypes."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_close_to_golden, load_golden
from vitlab.mixers import ReAttention, build


def naive_reattention(x, p, num_heads, transform_scale, bn_eps=1e-5):
    """Paper form ``Norm(Θᵀ softmax(Q_h K_hᵀ / sqrt(d_h))) V`` head by head, float64, BN in eval.

    ``Θ[h, g] = reatten_matrix.weight[g, h]``: the official 1x1 conv stores Θᵀ.
    """
    x = x.double()
    p = {k: v.double() for k, v in p.items()}
    c = x.shape[-1]
    hd = c // num_heads
    s = hd**-0.5
    q, k, v = (x @ p["qkv.weight"].T + p["qkv.bias"]).split(c, dim=-1)
    maps, values = [], []
    for h in range(num_heads):
        sl = slice(h * hd, (h + 1) * hd)
        e = torch.exp(q[..., sl] @ k[..., sl].transpose(1, 2) * s)
        maps.append(e / e.sum(-1, keepdim=True))
        values.append(v[..., sl])
    theta = p["reatten_matrix.weight"][:, :, 0, 0].T
    heads = []
    for g in range(num_heads):
        mixed = sum(theta[h, g] * maps[h] for h in range(num_heads)) + p["reatten_matrix.bias"][g]
        normed = (mixed - p["var_norm.running_mean"][g]) / torch.sqrt(p["var_norm.running_var"][g] + bn_eps)
        a = (normed * p["var_norm.weight"][g] + p["var_norm.bias"][g]) * (s if transform_scale else 1.0)
        heads.append(a @ values[g])
    return torch.cat(heads, dim=-1) @ p["proj.weight"].T + p["proj.bias"]


def random_bn_stats(m: ReAttention) -> None:
    with torch.no_grad():
        m.var_norm.running_mean.normal_(0, 0.1)
        m.var_norm.running_var.uniform_(0.5, 2.0)
        m.var_norm.weight.uniform_(0.5, 1.5)
        m.var_norm.bias.normal_(0, 0.2)


@pytest.mark.parametrize("transform_scale", [False, True])
def test_golden_dvit(transform_scale):
    g = load_golden("deepvit_reattention.npz")
    m = ReAttention(32, num_heads=4, transform_scale=transform_scale).eval()
    m.load_state_dict(g.state())  # official key names: qkv, reatten_matrix, var_norm, proj
    suffix = "_tscale" if transform_scale else ""
    out, aux = m(g.input("x"), return_aux=True)
    assert_close_to_golden(out, g.output("x" + suffix))
    assert_close_to_golden(aux["attn"], g.output("attn" + suffix))
    # the re-mixed map is not renormalised: its rows do not sum to 1
    assert not torch.allclose(aux["attn"].sum(-1), torch.ones(()), atol=1e-3)


@pytest.mark.parametrize("transform_scale", [False, True])
def test_matches_naive_paper_equation(transform_scale):
    torch.manual_seed(0)
    m = ReAttention(24, num_heads=3, transform_scale=transform_scale).double().eval()
    random_bn_stats(m)
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    state = {**dict(m.named_parameters()), **dict(m.named_buffers())}
    ref = naive_reattention(x, state, 3, transform_scale)
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-10)


def test_training_mode_batchnorm_normalises_each_head_over_batch_and_plane():
    torch.manual_seed(1)
    m = ReAttention(16, num_heads=4).train()
    m.var_norm.eps = 1e-12  # the maps' variance is ~1e-3, comparable to the default eps
    _, aux = m(torch.randn(3, 9, 16), return_aux=True)
    a = aux["attn"].double()  # BN weight 1, bias 0 at init
    zeros, ones = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    torch.testing.assert_close(a.mean(dim=(0, 2, 3)), zeros, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.var(dim=(0, 2, 3), unbiased=False), ones, rtol=1e-4, atol=0)


def test_shapes_aux_and_prev_map_ignored():
    torch.manual_seed(2)
    m = ReAttention(32, num_heads=4).eval()
    x = torch.randn(2, 10, 32)
    out, aux = m(x, return_aux=True)
    assert out.shape == x.shape and aux["attn"].shape == (2, 4, 10, 10)
    torch.testing.assert_close(m(x), out)  # asking for aux changes nothing
    torch.testing.assert_close(m(x, attn_prev=torch.rand(2, 4, 10, 10)), out)


@pytest.mark.usefixtures("fast_path")
def test_gradients_reach_every_parameter():
    torch.manual_seed(3)
    m = ReAttention(16, num_heads=2, attn_drop=0.1, proj_drop=0.1).train()
    m(torch.randn(2, 5, 16)).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None, name
        # a training BatchNorm subtracts the batch mean, which cancels the head mix's bias: its gradient is 0
        assert (p.grad.abs().sum() == 0) if name == "reatten_matrix.bias" else (p.grad.abs().sum() > 0), name


def test_bad_input_raises():
    m = ReAttention(16, num_heads=4)
    with pytest.raises(ValueError, match="expected tokens of shape"):
        m(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="expected tokens of shape"):
        m(torch.randn(5, 16))
    with pytest.raises(ValueError, match="divisible"):
        ReAttention(18, num_heads=4)


def test_build_by_name():
    m = build("reattention", 32, num_heads=4, transform_scale=True)
    assert isinstance(m, ReAttention) and m.reatten_scale == pytest.approx(8**-0.5)
    assert build("reattention", 32, num_heads=4).reatten_scale == 1.0


@pytest.mark.parametrize("train", [False, True])
def test_bf16_autocast_keeps_map_in_input_dtype(train):
    torch.manual_seed(4)
    m = ReAttention(32, num_heads=4).train(train)
    x = torch.randn(2, 9, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, aux = m(x, return_aux=True)
    assert aux["attn"].dtype == torch.bfloat16 and torch.isfinite(out).all()
    m.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = m(x).float()
    ref = m(x)
    assert (low - ref).abs().max() <= 0.05 * ref.abs().max()
