"""T2T's soft split as one gather (``vitlab.ops.soft_split``) against ``nn.Unfold`` and the definition of a window.

The T2T model with it: tests/test_t2t.py (against a naive soft split) and the model-level fast-path-off runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vitlab import ops
from vitlab.models.t2t import T2TViT
from vitlab.ops import soft_split as soft_split_module
from vitlab.ops.soft_split import gathers_windows, soft_split


@pytest.fixture(autouse=True)
def fast_paths_on():
    """The switch on, whatever VITLAB_FAST_PATHS says: these tests compare the fast path with the plain one."""
    with ops.fast_paths(True):
        yield


def naive_windows(x: torch.Tensor, k: tuple[int, int], s: tuple[int, int], p: tuple[int, int]) -> torch.Tensor:
    """Each window from the definition: token (i, j) holds x_pad[c, s·i + u, s·j + v] in the order (c, u, v)."""
    b, c, h, w = x.shape
    xp = torch.zeros(b, c, h + 2 * p[0], w + 2 * p[1], dtype=x.dtype)
    xp[:, :, p[0] : p[0] + h, p[1] : p[1] + w] = x
    ho, wo = (h + 2 * p[0] - k[0]) // s[0] + 1, (w + 2 * p[1] - k[1]) // s[1] + 1
    rows = [
        xp[:, :, s[0] * i : s[0] * i + k[0], s[1] * j : s[1] * j + k[1]].reshape(b, -1)
        for i in range(ho)
        for j in range(wo)
    ]
    return torch.stack(rows, 1)


def as_layout(base: torch.Tensor, layout: str) -> torch.Tensor:
    """``base`` (B, C, H, W) as an image in NCHW memory, channels-last memory, or a token grid's permuted view."""
    if layout == "nchw":
        return base.clone()
    if layout == "channels_last":
        return base.contiguous(memory_format=torch.channels_last)
    b, c, h, w = base.shape
    tokens = base.permute(0, 2, 3, 1).reshape(b, h * w, c).clone()  # (B, H·W, C), as a token layer leaves them
    return tokens.view(b, h, w, c).permute(0, 3, 1, 2)


GEOMETRIES = [  # (B, C, H, W, kernel, stride, padding)
    (2, 3, 17, 19, 7, 4, 2),  # T2T's first split, odd sides: the last rows and columns in no window
    (2, 5, 9, 8, 3, 2, 1),  # its later splits
    (1, 4, 6, 6, 3, 1, 1),  # stride 1 (T2T's small variants)
    (2, 3, 8, 8, 4, 4, 0),  # non-overlapping, no padding
    (2, 2, 7, 9, (3, 2), (2, 1), (1, 0)),  # rectangular kernel, stride and padding
    (1, 1, 5, 5, 3, 2, 1),  # one channel
    (2, 3, 5, 5, 5, 3, 3),  # windows of padding alone at the corners
    (2, 2, 9, 9, 2, 3, 0),  # stride > kernel: pixels between windows (zero gradient)
]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "token_grid"])
def test_gather_gives_the_unfold_tokens_and_their_gradient(geometry, layout):
    b, c, h, w, k, s, p = geometry
    pair = nn.modules.utils._pair
    split = nn.Unfold(k, padding=p, stride=s)
    torch.manual_seed(0)
    base = torch.randn(b, c, h, w, dtype=torch.float64)
    x = as_layout(base, layout).requires_grad_()
    assert gathers_windows(split, x)
    y = soft_split(split, x)
    assert type(y.grad_fn).__name__ == "_SoftSplitBackward"
    assert y.is_contiguous()
    assert torch.equal(y, naive_windows(base, pair(k), pair(s), pair(p)))
    assert torch.equal(y, split(base).transpose(1, 2))
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    xr = base.clone().requires_grad_()
    (dref,) = torch.autograd.grad(split(xr).transpose(1, 2), xr, g)  # fold, the adjoint PyTorch computes
    torch.testing.assert_close(dx, dref, rtol=1e-14, atol=1e-14)


def test_gradient_is_the_adjoint_by_gradcheck():
    split = nn.Unfold(3, padding=1, stride=2)
    x = as_layout(torch.randn(1, 2, 5, 6, dtype=torch.float64), "token_grid").requires_grad_()
    assert torch.autograd.gradcheck(lambda t: soft_split(split, t), (x,))


def test_a_strided_output_gradient():
    """The gradient arriving as a transposed view (a later operation's backward may give one)."""
    split = nn.Unfold(3, padding=1, stride=2)
    x = torch.randn(1, 2, 6, 6, dtype=torch.float64, requires_grad=True)
    y = soft_split(split, x)
    g = torch.randn(y.shape[0], y.shape[2], y.shape[1], dtype=torch.float64).transpose(1, 2)
    (dx,) = torch.autograd.grad(y, x, g)
    (dref,) = torch.autograd.grad(split(x).transpose(1, 2), x, g)
    torch.testing.assert_close(dx, dref, rtol=1e-14, atol=1e-14)


def test_output_is_fresh_memory_even_when_a_view_would_do():
    split = nn.Unfold(1)  # kernel 1, stride 1: the tokens are the pixels
    x = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    before = x.clone()
    y = soft_split(split, x)
    assert torch.equal(y, split(x).transpose(1, 2))
    y.add_(1.0)  # writing the tokens does not write the image
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_windows_are_copied_exactly(dtype):
    split = nn.Unfold(3, padding=1, stride=2)
    x = torch.randn(2, 4, 8, 8).to(dtype)
    assert torch.equal(soft_split(split, x), split(x).transpose(1, 2))


def test_plain_form_where_the_gather_does_not_apply():
    split = nn.Unfold(3, padding=1, stride=2)
    x = torch.randn(1, 2, 6, 6, requires_grad=True)
    with ops.fast_paths(False):
        assert not gathers_windows(split, x)
        assert type(soft_split(split, x).grad_fn).__name__ == "TransposeBackward0"
    assert not gathers_windows(nn.Unfold(3, dilation=2), x)
    traced = torch.jit.trace(lambda t: soft_split(split, t), (x.detach(),))  # a trace records the plain form
    assert "im2col" in str(traced.graph) and torch.equal(traced(x.detach()), split(x.detach()).transpose(1, 2))


def test_t2t_training_step_equals_the_plain_soft_split(monkeypatch):
    """An EAMLP-style model (external-attention token layers, two splits between them) trained one step with the
    gather and with nn.Unfold: the same loss, parameter gradients and input gradient."""
    torch.manual_seed(0)
    model = T2TViT(
        img_size=32, embed_dim=32, depth=1, num_heads=2, token_dim=8, soft_split=((7, 4, 2), (3, 2, 1), (3, 1, 1))
    )
    model = model.double().train()
    model.tokens_to_token.layers.apply(lambda m: setattr(m, "p", 0.0) if isinstance(m, nn.Dropout) else None)
    img = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    calls = []
    gather = soft_split_module._SoftSplit.apply
    monkeypatch.setattr(soft_split_module._SoftSplit, "apply", lambda *a: calls.append(1) or gather(*a))
    results = []
    for enabled in (True, False):
        model.zero_grad()
        x = img.clone().requires_grad_()
        with ops.fast_paths(enabled):
            loss = model(x).square().mean()
            loss.backward()
        results.append((loss.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert len(calls) == 3  # every split gathered in the first run, none in the second
    (la, xa, ga), (lb, xb, gb) = results
    torch.testing.assert_close(la, lb, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xa, xb, rtol=1e-10, atol=1e-12)
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-10, atol=1e-12, msg=name)
