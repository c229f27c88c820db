"""The patch projection as one product (vitlab.ops.patchify): the convolution's function, values and gradients, in
both memory layouts, and the convolution wherever the product form does not apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vitlab.layers.patch_embed import PatchEmbed
from vitlab.ops import patchify
from vitlab.ops.switch import fast_paths


def naive_patch_tokens(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The equation of the module's docstring, a loop over the grid: y[n, o, i, j] = b[o] + Σ W[o] · patch(i, j)."""
    p, q = conv.stride
    rows = []
    for i in range(x.shape[-2] // p):
        for j in range(x.shape[-1] // q):
            patch = x[:, :, p * i : p * (i + 1), q * j : q * (j + 1)]  # (B, C, p, q)
            rows.append(torch.einsum("bcuv,ocuv->bo", patch, conv.weight) + conv.bias)
    return torch.stack(rows, 1)


@pytest.mark.usefixtures("fast_path")
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("patch", [(4, 4), (2, 3)])
def test_the_product_is_the_convolution_and_the_equation(channels_last, patch):
    torch.manual_seed(0)
    conv = nn.Conv2d(5, 7, patch, patch).double()
    x = torch.randn(2, 5, 4 * patch[0], 3 * patch[1], dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    assert patchify.projects_as_product(conv, x)
    x.requires_grad_()
    got = patchify.patch_tokens(conv, x)
    want = conv(x).flatten(2).transpose(1, 2)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, naive_patch_tokens(conv, x))
    g = torch.randn_like(want)
    grads = torch.autograd.grad(got, (x, conv.weight, conv.bias), g)
    for a, b in zip(grads, torch.autograd.grad(want, (x, conv.weight, conv.bias), g)):
        torch.testing.assert_close(a, b)


@pytest.mark.usefixtures("fast_path")
def test_the_convolution_runs_where_the_product_form_does_not_apply():
    """Padding, a stride other than the kernel, groups, sides that are no multiple of the patch, the switch off: the
    module itself (and its result)."""
    x = torch.randn(1, 4, 8, 8)
    for conv in (nn.Conv2d(4, 6, 2, 2, padding=1), nn.Conv2d(4, 6, 3, 2), nn.Conv2d(4, 6, 2, 2, groups=2)):
        assert not patchify.projects_as_product(conv, x)
        torch.testing.assert_close(patchify.patch_tokens(conv, x), conv(x).flatten(2).transpose(1, 2))
    conv = nn.Conv2d(4, 6, 3, 3)
    assert not patchify.projects_as_product(conv, x)  # 8 is no multiple of 3: the convolution drops the edge
    assert patchify.patch_tokens(conv, x).shape == (1, 4, 6)
    with fast_paths(False):
        assert not patchify.projects_as_product(nn.Conv2d(4, 6, 2, 2), x)


@pytest.mark.usefixtures("fast_path")
@pytest.mark.parametrize("stem", [(), (8, 16)], ids=["plain", "cnn_stem"])
def test_the_patch_embedding_is_the_same_with_the_fast_paths_off(stem):
    """The embedding (plain: the convolution; after a CNN stem in training mode: the product, which reads the stem's
    channels-last output) gives the same tokens and gradients as with the fast paths off."""
    torch.manual_seed(1)
    embed = PatchEmbed(16, 3, 32, stem)
    x = torch.randn(2, 3, 64, 64)
    calls = []
    embed.proj.register_forward_hook(lambda *a: calls.append(1))
    fast, grid = embed(x)
    assert len(calls) == (0 if stem else 1)  # after a stem the product, not the module
    fast_grads = torch.autograd.grad(fast.square().sum(), embed.proj.weight)
    with fast_paths(False):
        plain, plain_grid = embed(x)
        plain_grads = torch.autograd.grad(plain.square().sum(), embed.proj.weight)
    assert grid == plain_grid == (4, 4)
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_grads[0], plain_grads[0], rtol=1e-4, atol=1e-4)


def test_an_exported_graph_keeps_the_convolution(fast_path):
    """torch.export of an embedding with a CNN stem (where eager mode takes the product) records the module's
    convolution (runtimes fold and fuse it as they like)."""
    embed = PatchEmbed(8, 3, 16, (4,)).eval()
    program = torch.export.export(embed, (torch.randn(1, 3, 32, 32),))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert any("conv" in t for t in targets) and not any("linear" in t or "addmm" in t for t in targets), targets


@pytest.mark.usefixtures("fast_path")
def test_the_product_form_follows_autocast():
    """Under CPU autocast the product runs in bf16 as the convolution does."""
    conv, x = nn.Conv2d(3, 8, 4, 4), torch.randn(1, 3, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = patchify.patch_tokens(conv, x), conv(x).flatten(2).transpose(1, 2)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.usefixtures("fast_path")
@pytest.mark.parametrize("channels_last", [True, False], ids=["probe_keeps_channels_last", "probe_leaves_it"])
def test_a_stems_training_step_runs_in_the_layout_the_probe_chose(monkeypatch, channels_last):
    """In training the stem runs in channels-last where the probe keeps it and in NCHW where it does not
    (:func:`vitlab.ops.probe.stem_channels_last`), the same tokens and gradients either way; inference folds its
    BatchNorms in channels-last whatever the answer."""
    from dataclasses import replace

    from vitlab.ops import probe

    decision = replace(probe.stem_channels_last(), taken=channels_last)
    monkeypatch.setitem(probe._DECISIONS, probe._STEM, decision)
    torch.manual_seed(2)
    embed = PatchEmbed(16, 3, 24, (8, 16)).double()
    layouts = []
    embed.stem[3].register_forward_pre_hook(lambda m, a: layouts.append(a[0].is_contiguous()))
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    tokens, _ = embed(x)
    assert layouts == [not channels_last]  # NCHW is the contiguous layout (channels-last of 8 channels is not)
    params = list(embed.parameters())
    grads = torch.autograd.grad(tokens.square().sum(), params)
    with fast_paths(False):
        plain, _ = embed(x)
        plain_grads = torch.autograd.grad(plain.square().sum(), params)
    torch.testing.assert_close(tokens, plain)
    for got, want in zip(grads, plain_grads):
        torch.testing.assert_close(got, want)
    layouts.clear()
    with torch.inference_mode():
        embed.eval()(x)
    assert layouts == []  # the folded path calls no module of the stem
