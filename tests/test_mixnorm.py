"""The fused head mix + training BatchNorm (``vitlab.ops.head_mix_norm``) against the plain modules.

The fused function computes ``c · BN(W A + b)`` with the batch's statistics and a closed-form backward pass; it
must give the modules' output, running statistics and gradients (every input, weight, bias, BN affine), in float64
to rounding and in float32 to the rounding of its reductions over the B·N·N map elements.
"""

from __future__ import annotations

import copy

import pytest
import torch

from vitlab import ops
from vitlab.mixers import ReAttention, RefinerAttention
from vitlab.mixers import reattention as reattention_module
from vitlab.mixers import refiner as refiner_module
from vitlab.mixers.attention import HeadMix
from vitlab.ops.head_mix_norm import as_maps, can_fuse, head_mix_batchnorm, mix_heads, token_rows


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()


def make_pair(heads_in, heads_out, bias, affine, track, momentum, dtype):
    torch.manual_seed(0)
    mix = HeadMix(heads_in, heads_out, bias=bias).to(dtype)
    bn = torch.nn.BatchNorm2d(heads_out, affine=affine, track_running_stats=track, momentum=momentum).to(dtype)
    with torch.no_grad():
        if affine:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_()
        if bias:
            mix.bias.normal_()
    return (mix, bn), copy.deepcopy((mix, bn))


def maps(b, h, n, dtype):
    return torch.randn(b, h, n, n, dtype=dtype).mul(3).softmax(-1)


def run(mix, bn, a, grad, scale, fused, steps=2):
    a = a.clone().requires_grad_()
    for _ in range(steps):  # the running statistics move twice
        out = head_mix_batchnorm(a, mix, bn, scale) if fused else bn(mix(a)) * scale
    out.backward(grad)
    params = {f"mix.{k}": p.grad for k, p in mix.named_parameters()}
    params.update({f"bn.{k}": p.grad for k, p in bn.named_parameters()})
    return out, a.grad, params


CASES = [  # heads in, heads out, mix bias, BN affine, running stats, momentum, scale
    (4, 4, True, True, True, 0.1, 1.0),
    (3, 7, True, True, True, None, 0.3),  # expansion; cumulative running average
    (6, 2, False, True, True, 0.1, 2.0),  # reduction without bias
    (4, 5, True, False, True, 0.1, 0.5),  # no BN affine
    (4, 4, True, True, False, 0.1, 1.0),  # no running statistics
]


@pytest.mark.parametrize("case", CASES)
def test_float64_equals_the_modules(case):
    *spec, scale = case
    (mix, bn), (mix2, bn2) = make_pair(*spec, torch.float64)
    a, grad = maps(3, spec[0], 7, torch.float64), torch.randn(3, spec[1], 7, 7, dtype=torch.float64)
    out, ga, gp = run(mix, bn, a, grad, scale, fused=True)
    ref, ga_ref, gp_ref = run(mix2, bn2, a, grad, scale, fused=False)
    assert rel_err(out, ref) < 1e-12
    assert rel_err(ga, ga_ref) < 1e-12
    for name, g in gp_ref.items():
        if name == "mix.bias":  # the batch mean cancels the bias: its gradient is 0 (autograd's is rounding)
            assert (
                torch.equal(gp[name], torch.zeros_like(g)) and g.abs().max() < 1e-10 * gp_ref["mix.weight"].abs().max()
            )
        else:
            assert rel_err(gp[name], g) < 1e-12, name
    for buf in ("running_mean", "running_var", "num_batches_tracked"):
        expected = getattr(bn2, buf)
        assert (getattr(bn, buf) is None) == (expected is None)
        if expected is not None:
            assert rel_err(getattr(bn, buf), expected) < 1e-12, buf


@pytest.mark.parametrize("case", CASES[:3])
def test_float32_within_the_rounding_of_its_reductions(case):
    *spec, scale = case
    (mix, bn), _ = make_pair(*spec, torch.float32)
    ref_mix, ref_bn = copy.deepcopy(mix).double(), copy.deepcopy(bn).double()
    a, grad = maps(4, spec[0], 15, torch.float32), torch.randn(4, spec[1], 15, 15)
    out, ga, gp = run(mix, bn, a, grad, scale, fused=True)
    ref, ga_ref, gp_ref = run(ref_mix, ref_bn, a.double(), grad.double(), scale, fused=False)
    # products over H heads and sums over M = B·N·N elements: each term may add one float32 rounding
    terms = 4 * 15 * 15 + 8 * spec[0]
    tol = terms * torch.finfo(torch.float32).eps
    assert rel_err(out, ref) < 1e-5
    assert rel_err(ga, ga_ref) < tol
    for name, g in gp_ref.items():
        if name != "mix.bias":
            assert rel_err(gp[name], g) < tol, name


@pytest.mark.parametrize("heads_last", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_mix_heads_is_the_matrix_product(heads_last, channels_last):
    w, x = torch.randn(5, 3, dtype=torch.float64), torch.randn(2, 3, 4, 4, dtype=torch.float64)
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    out = as_maps(mix_heads(w, token_rows(x), heads_last), 4, heads_last)
    assert out.is_contiguous(memory_format=torch.channels_last if heads_last else torch.contiguous_format)
    torch.testing.assert_close(out, torch.einsum("gh,bhnm->bgnm", w, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("out_heads", [6, 16])
@pytest.mark.parametrize("heads_last", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_layouts_give_the_same_values_and_gradients(heads_last, channels_last, out_heads):
    """Input in the standard layout or channels-last, output in either: the modules' values, gradients and running
    statistics, and the input's gradient in the input's layout. (Channels-last output on the CPU: 6 maps are
    normalised as rows, 16 by PyTorch's kernel, :func:`vitlab.ops.row_norm.rows_pay`.)"""
    (mix, bn), (mix2, bn2) = make_pair(4, out_heads, True, True, True, 0.1, torch.float64)
    a, grad = maps(2, 4, 5, torch.float64), torch.randn(2, out_heads, 5, 5, dtype=torch.float64)
    a = a.contiguous(memory_format=torch.channels_last) if channels_last else a
    a1, a2 = a.detach().clone(memory_format=torch.preserve_format).requires_grad_(), a.detach().clone().requires_grad_()
    out = head_mix_batchnorm(a1, mix, bn, 0.5, heads_last=heads_last)
    ref = bn2(mix2(a2)) * 0.5
    assert rel_err(out, ref) < 1e-12
    out.backward(grad)
    ref.backward(grad)
    assert rel_err(a1.grad, a2.grad) < 1e-12 and rel_err(mix.weight.grad, mix2.weight.grad) < 1e-12
    assert a1.grad.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    for buf, ref_buf in zip(bn.buffers(), bn2.buffers()):
        torch.testing.assert_close(buf, ref_buf, rtol=1e-12, atol=1e-14)


@pytest.mark.usefixtures("fast_path")
def test_fused_only_while_training_with_batch_statistics():
    bn, a = torch.nn.BatchNorm2d(3), torch.randn(1, 3, 4, 4)
    assert can_fuse(a, bn)
    assert not can_fuse(a, bn.eval())
    assert not can_fuse(a.bfloat16(), bn.train())
    with torch.no_grad():
        assert not can_fuse(a, bn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not can_fuse(a, bn)
    assert not can_fuse(a.to("meta"), bn)  # FLOP counting on the meta device: the plain modules


@pytest.mark.usefixtures("fast_path")
@pytest.mark.parametrize("transform_scale", [False, True])
def test_reattention_training_step_equals_the_plain_modules(monkeypatch, transform_scale):
    torch.manual_seed(3)
    fused = ReAttention(24, num_heads=4, transform_scale=transform_scale).double().train()
    with torch.no_grad():
        fused.var_norm.weight.uniform_(0.5, 1.5)
        fused.var_norm.bias.normal_()
    plain = copy.deepcopy(fused)
    x = torch.randn(3, 10, 24, dtype=torch.float64)

    def step(m):
        out, aux = m(x, return_aux=True)
        out.square().sum().backward()
        return out, aux["attn"], {k: p.grad for k, p in m.named_parameters()}

    out, attn, grads = step(fused)
    monkeypatch.setattr(reattention_module, "can_fuse", lambda *args: False)
    out_ref, attn_ref, grads_ref = step(plain)
    assert rel_err(out, out_ref) < 1e-12 and rel_err(attn, attn_ref) < 1e-12
    for name, g in grads_ref.items():
        if name == "reatten_matrix.bias":
            scale = grads_ref["reatten_matrix.weight"].abs().max()
            assert grads[name].abs().max() == 0 and g.abs().max() < 1e-10 * scale
        else:
            assert rel_err(grads[name], g) < 1e-10, name
    torch.testing.assert_close(fused.var_norm.running_mean, plain.var_norm.running_mean, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(fused.var_norm.running_var, plain.var_norm.running_var, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("track", [False, True])
def test_gradcheck_float64(track):
    """Numerical gradients of every input: maps, mix weight and bias, BN affine (running stats move per call)."""
    (mix, bn), _ = make_pair(3, 4, True, True, track, 0.1, torch.float64)
    a = maps(2, 3, 4, torch.float64).requires_grad_()

    def fn(a, w, b, gamma, beta):
        mix.weight, mix.bias, bn.weight, bn.bias = w, b, gamma, beta
        return head_mix_batchnorm(a, mix, bn, 0.7)

    params = [mix.weight, mix.bias, bn.weight, bn.bias]
    inputs = (a, *[p.detach().clone().requires_grad_() for p in params])
    for m in (mix, bn):  # let the functional inputs stand in for the parameters
        for name in ("weight", "bias"):
            delattr(m, name)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_inference_mode_then_training_step():
    torch.manual_seed(5)
    m = ReAttention(16, num_heads=4, transform_scale=True).double()
    twin = copy.deepcopy(m)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    with torch.inference_mode():
        m.eval()(x)
        m.train()(x)  # batch statistics under inference mode: no autograd, the plain modules
    twin.train()(x)  # the same running-statistics update outside inference mode
    m(x).sum().backward()
    twin(x).sum().backward()
    for (name, p), q in zip(m.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)
    torch.testing.assert_close(m.var_norm.running_mean, twin.var_norm.running_mean, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("expansion", [1, 3])
@pytest.mark.parametrize("plain", ["unfused", "switch_off"])
def test_refiner_training_step_equals_the_plain_modules(monkeypatch, expansion, plain):
    """The official refiner (expansion + BN + ReLU6, depth-wise conv + BN + ReLU6, reduction + BN, shortcut,
    adapt_bn), 6 heads (18 expanded maps, which the rows' BatchNorm takes): with the fast paths on, the maps,
    gradients and running statistics of the modules with the head mixes unfused, and of every fast path off."""
    torch.manual_seed(4)
    fused = RefinerAttention(24, num_heads=6, share=True, official_extras=True, expansion=expansion).double().train()
    for bn in (m for m in fused.modules() if isinstance(m, torch.nn.BatchNorm2d)):
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_()
    plain_model = copy.deepcopy(fused)
    x = torch.randn(3, 9, 24, dtype=torch.float64)
    prev = torch.randn(3, 6, 9, 9, dtype=torch.float64).softmax(-1).requires_grad_()

    def step(m):
        prev.grad = None
        out = m(x, attn_prev=prev)
        out.square().sum().backward()
        return out, prev.grad, {k: p.grad for k, p in m.named_parameters()}

    calls = []
    rows_norm = refiner_module.batch_norm_rows
    monkeypatch.setattr(refiner_module, "batch_norm_rows", lambda t, bn: calls.append(1) or rows_norm(t, bn))
    with ops.fast_paths(True):
        out, gprev, grads = step(fused)
    assert len(calls) == (1 if expansion > 1 else 0)  # the conv's maps are channels-last after an expansion
    if plain == "unfused":
        monkeypatch.setattr(refiner_module, "can_fuse", lambda *args: False)
    with ops.fast_paths(plain == "unfused"):
        out_ref, gprev_ref, grads_ref = step(plain_model)
    assert rel_err(out, out_ref) < 1e-12 and rel_err(gprev, gprev_ref) < 1e-10
    scale = max(g.abs().max() for g in grads_ref.values())  # a BN before a training BN: its bias gets ~0
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-12 * scale, msg=name)
    for (name, buf), ref in zip(fused.named_buffers(), plain_model.buffers()):
        torch.testing.assert_close(buf, ref, rtol=1e-12, atol=1e-15, msg=name)
