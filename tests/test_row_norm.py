"""Training BatchNorm on channels-last maps as rows (``vitlab.ops.row_norm``) against ``nn.BatchNorm2d`` and the
paper's equations (the refiner's training step with it: tests/test_mixnorm.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from vitlab import ops
from vitlab.ops.row_norm import batch_norm_rows, can_normalise_rows, column_sums, gradient_sums, normalise_rows


@pytest.fixture(autouse=True)
def fast_paths_on():
    """The switch on, whatever VITLAB_FAST_PATHS says: these tests compare the fast path with the plain one."""
    with ops.fast_paths(True):
        yield


def channels_last(*shape: int, scale: float = 2.0, shift: float = 3.0) -> torch.Tensor:
    x = torch.randn(*shape, dtype=torch.float64) * scale + shift
    return x.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("rows", [1, 7, 64, 1001])
@pytest.mark.parametrize("channels", [1, 3, 16, 18, 36])
def test_column_sums_are_the_sums_over_rows(rows, channels):
    x = torch.randn(rows, channels, dtype=torch.float64)
    torch.testing.assert_close(column_sums(x), x.sum(0), rtol=1e-12, atol=1e-12)
    batched = torch.randn(2, rows, channels, dtype=torch.float64)
    torch.testing.assert_close(column_sums(batched), batched.sum((0, 1)), rtol=1e-12, atol=1e-12)
    strided = batched.transpose(0, 1)  # not contiguous: the plain sum
    torch.testing.assert_close(column_sums(strided), batched.sum((0, 1)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows", [5, 64, 128, 1000, 1001])  # the wide view: absent (< 2 of its rows), exact, a rest
@pytest.mark.parametrize("channels", [3, 18, 36])
@pytest.mark.parametrize("affine", [True, False])
def test_normalise_rows_and_gradient_sums_against_the_definition(rows, channels, affine):
    """Both against Ioffe & Szegedy's formulas computed directly on the (M, C) rows, in float64."""
    torch.manual_seed(rows + channels)
    x = torch.randn(rows, channels, dtype=torch.float64) * torch.rand(channels, dtype=torch.float64) * 3 + 2
    gamma = torch.rand(channels, dtype=torch.float64) + 0.5 if affine else None
    beta = torch.randn(channels, dtype=torch.float64) if affine else None
    eps = 1e-5
    mean, var = x.mean(0), x.var(0, correction=0)
    xhat = (x - mean) / torch.sqrt(var + eps)
    expected = xhat * gamma + beta if affine else xhat
    out = torch.empty_like(x)
    got_mean, got_var, got_rstd = normalise_rows(x, out, gamma, beta, eps)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_var, var, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_rstd, 1 / torch.sqrt(var + eps), rtol=1e-10, atol=0)
    g = torch.randn_like(x)
    sum_g, sum_g_xhat = gradient_sums(x, g, mean, 1 / torch.sqrt(var + eps))
    torch.testing.assert_close(sum_g, g.sum(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sum_g_xhat, (g * xhat).sum(0), rtol=1e-12, atol=1e-12)


def test_normalise_rows_keeps_constant_columns_finite_with_zero_eps():
    """Every 2nd row of channel 0 constant: a column of the wide view has no spread; with ε = 0 the channel's result
    is still the definition's (the kernel's per-column step runs with a tiny ε)."""
    x = torch.randn(256, 3, dtype=torch.float64)
    x[::2, 0] = 1.5
    out = torch.empty_like(x)
    normalise_rows(x, out, None, None, 0.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, (x - x.mean(0)) / x.std(0, correction=0), rtol=1e-12, atol=1e-12)


def naive_batch_norm(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float) -> torch.Tensor:
    """Ioffe & Szegedy Alg. 1 per channel, from the definition: mean and biased variance over (B, H, W)."""
    mean = x.mean((0, 2, 3), keepdim=True)
    var = ((x - mean) ** 2).mean((0, 2, 3), keepdim=True)
    return gamma.view(1, -1, 1, 1) * (x - mean) / torch.sqrt(var + eps) + beta.view(1, -1, 1, 1)


@pytest.mark.parametrize("channels", [3, 12, 18, 36])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_rows_give_the_module_values_gradients_and_running_statistics(channels, momentum):
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(channels, momentum=momentum).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 2.0)
        ref.bias.uniform_(-1.0, 1.0)
    fast = copy.deepcopy(ref)
    for step in range(3):  # the running statistics and the batch count over several calls
        x = channels_last(4, channels, 9, 11)
        g = torch.randn_like(x)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        assert can_normalise_rows(xa, fast)
        ya, yb = batch_norm_rows(xa, fast), ref(xb)
        assert ya.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ya, naive_batch_norm(x, ref.weight, ref.bias, ref.eps), rtol=1e-12, atol=1e-12)
        ya.backward(g)
        yb.backward(g)
        torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-12)
        for name in ("weight", "bias"):
            torch.testing.assert_close(getattr(fast, name).grad, getattr(ref, name).grad, rtol=1e-10, atol=1e-10)
        for name, buf in ref.named_buffers():
            torch.testing.assert_close(getattr(fast, name), buf, rtol=1e-12, atol=1e-14, msg=f"{name} at {step}")


@pytest.mark.parametrize("track", [True, False])
def test_without_affine_or_running_statistics(track):
    ref = nn.BatchNorm2d(5, affine=False, track_running_stats=track).double()
    fast = copy.deepcopy(ref)
    x = channels_last(3, 5, 7, 7)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = batch_norm_rows(xa, fast), ref(xb)
    torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-12)
    ya.square().sum().backward()
    yb.square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-12)
    for a, b in zip(fast.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b)


def test_one_value_per_channel_is_the_modules_error():
    x = torch.randn(1, 18, 1, 1).contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="more than 1 value per channel") as ours:
        batch_norm_rows(x, nn.BatchNorm2d(18))
    with pytest.raises(ValueError) as module:
        nn.BatchNorm2d(18)(x)
    assert str(ours.value) == str(module.value)


def test_the_result_may_be_modified_in_place():
    """A ReLU6(inplace=True) follows it in the refiner: the result is a tensor of its own, not a view."""
    x = channels_last(2, 18, 5, 5).requires_grad_()
    y = nn.functional.relu6(batch_norm_rows(x, nn.BatchNorm2d(18).double()), inplace=True)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_it_applies_to_channels_last_training_maps_only():
    bn = nn.BatchNorm2d(18)
    x = torch.randn(2, 18, 5, 5)
    assert not can_normalise_rows(x, bn)  # the standard layout: PyTorch's kernel is fast there
    cl = x.contiguous(memory_format=torch.channels_last)
    assert can_normalise_rows(cl, bn)
    assert not can_normalise_rows(cl, bn.eval())  # running statistics: folded or the module
    assert not can_normalise_rows(cl.half(), bn.train())
    for channels in (16, 48):  # multiples of 16: PyTorch's channels-last kernel is vectorised and faster
        wide = torch.randn(2, channels, 5, 5).contiguous(memory_format=torch.channels_last)
        assert not can_normalise_rows(wide, nn.BatchNorm2d(channels))
    with ops.fast_paths(False):
        assert not can_normalise_rows(cl, bn)
