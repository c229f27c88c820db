"""Block-sparse attention (vitlab.ops.block_sparse): the blocked local, strided and 2-D local patterns equal the
dense masked product (forward and gradients), the mixers take the blocked path only with the switch on, and the
blocked path's tensors are O(N·s), not O(N²)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from vitlab.mixers import TokenLayout, build
from vitlab.mixers.sparse_attention import sparse_pattern
from vitlab.ops import block_sparse as bs
from vitlab.ops import fast_paths

B, H, D = 2, 2, 8


def qkv(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g).requires_grad_() for _ in range(3)]


def assert_same_function(blocked, dense, inputs) -> None:
    """Equal outputs and equal gradients of q, k, v (fp32)."""
    out, ref = blocked(*inputs), dense(*inputs)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    cot = torch.randn_like(ref)
    grads = torch.autograd.grad(out, inputs, cot)
    ref_grads = torch.autograd.grad(ref, inputs, cot)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def masked(allowed: torch.Tensor, scale: float = D**-0.5):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)


SIZES = [(1, 1), (5, 1), (37, 1), (100, 7), (130, 64), (129, 64), (50, 80), (40, 40)]  # (T, window); >= T too


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("n", "window"), SIZES)
@pytest.mark.parametrize("block", [0, 16])
def test_blocked_local_equals_the_dense_masked_local(n, window, causal, block):
    """Blocks of the default size (>= window/2) or of 16 (several blocks back), T not a multiple of either."""
    parts = bs.local_blocks(n, window, causal, block)
    assert_same_function(
        lambda q, k, v: bs.blocked_attention(q, k, v, parts, D**-0.5),
        masked(sparse_pattern(n, "local", window, causal)),
        qkv(n),
    )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("n", "stride"), [(1, 1), (7, 1), (64, 8), (100, 7), (97, 96), (30, 50)])
@pytest.mark.parametrize("prefix", [0, 1, 3])
def test_blocked_strided_equals_the_dense_masked_strided(n, stride, causal, prefix):
    """Merged heads: ``|i - j| < l`` or ``(i - j) mod l = 0`` in one softmax; prefix tokens see and are seen by
    all (causal: keys j <= i)."""
    parts = bs.strided_blocks(n, stride, causal)
    assert_same_function(
        lambda q, k, v: bs.blocked_attention(q, k, v, parts, D**-0.5, 0.0, prefix, causal),
        masked(sparse_pattern(n + prefix, "strided", stride, causal, prefix)),
        qkv(n + prefix),
    )


def local2d_reference(n, row_len, query_shape, flange, causal, prefix=0) -> torch.Tensor:
    """Parmar et al.'s local 2-D key sets by loops over image coordinates: query (r, c) sees the memory block of
    its query block, rows [r0 - h_f, r0 + h_q (+ h_f)), columns [c0 - w_f, c0 + w_q + w_f); raster-causal."""
    (hq, wq), (hf, wf) = query_shape, flange
    allowed = torch.ones(n + prefix, n + prefix, dtype=torch.bool)
    for i in range(n):
        r, c = divmod(i, row_len)
        r0, c0 = r // hq * hq, c // wq * wq
        for j in range(n):
            rj, cj = divmod(j, row_len)
            rows = r0 - hf <= rj < r0 + hq + (0 if causal else hf)
            allowed[prefix + i, prefix + j] = rows and c0 - wf <= cj < c0 + wq + wf
    return allowed.tril() if causal else allowed


CASES_2D = [(70, 10, (2, 3), (1, 2)), (96, 12, (4, 4), (2, 4)), (45, 9, (3, 9), (0, 0)), (33, 33, (1, 8), (0, 5))]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("n", "row_len", "query_shape", "flange"), CASES_2D)
def test_blocked_local2d_equals_the_dense_masked_reference(n, row_len, query_shape, flange, causal):
    """Partial last rows and column blocks, flanges of 0, a single row."""
    parts = bs.local2d_blocks(n, row_len, query_shape, flange, causal)
    reference = local2d_reference(n, row_len, query_shape, flange, causal)
    assert_same_function(lambda q, k, v: bs.blocked_attention(q, k, v, parts, D**-0.5), masked(reference), qkv(n))


def spy(monkeypatch) -> list[int]:
    """Count the calls of the blocked kernel."""
    calls, kernel = [], bs.blocked_attention
    monkeypatch.setattr(bs, "blocked_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    return calls


MIXERS = [
    ("local_attention", {"window": 9}, 500, None),
    ("strided_attention", {"stride": 16}, 500, None),
    ("local2d_attention", {"row_len": 24, "query_shape": (4, 8), "memory_flange": (2, 4)}, 576, None),
    ("local2d_attention", {"query_shape": (2, 4), "memory_flange": (1, 2)}, 1 + 12 * 16, (12, 16)),
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("kind", "opts", "n", "grid"), MIXERS)
def test_the_mixers_blocked_path_equals_the_switched_off_dense_path(monkeypatch, kind, opts, n, grid, causal):
    """The mixers take the blocked kernel with the fast paths on, the dense mask with them off (and for the map):
    the same outputs and gradients. The 2-D mixer on a patch grid with a class token, and on rows of a 1-D
    sequence."""
    torch.manual_seed(0)
    m = build(kind, 16, num_heads=2, causal=causal, **opts)
    layout = TokenLayout(grid, 1) if grid else TokenLayout.sequence()
    x = torch.randn(2, n, 16, requires_grad=True)
    calls = spy(monkeypatch)
    out = m(x, layout)
    assert calls, "the blocked kernel did not run"
    with fast_paths(False):
        ref = m(x, layout)
    ref_map = m(x, layout, return_aux=True)[0]
    assert len(calls) == 1, "the switch (or the map) did not turn the blocked kernel off"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ref_map, ref, atol=1e-5, rtol=1e-4)
    (g,) = torch.autograd.grad(out.square().sum(), x)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-4)


def test_short_sequences_keep_the_dense_product(monkeypatch):
    """Where the blocks would score half the N x N pairs or more, the dense masked product runs."""
    calls = spy(monkeypatch)
    build("local_attention", 16, num_heads=2, causal=True, window=8)(torch.randn(1, 40, 16))
    assert not calls


@pytest.mark.parametrize(("kind", "opts"), [MIXERS[0][:2], MIXERS[1][:2], MIXERS[2][:2]])
def test_decoding_equals_the_blocked_forward(kind, opts):
    torch.manual_seed(0)
    m = build(kind, 16, num_heads=2, causal=True, **opts).eval()
    x = torch.randn(2, 150, 16)
    with torch.no_grad():
        full = m(x)
        state = m.init_state(2, 150, x)
        steps = torch.stack([m.step(x[:, t], t, state) for t in range(150)], 1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-4)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


# the keys a query meets: local window 64 in blocks of 64: its own and the previous block; strided 32: that
# local part (blocks of 64 again) and the T/l = 64 keys of its column
@pytest.mark.parametrize(
    ("kind", "opts", "keys"), [("local_attention", {"window": 64}, 128), ("strided_attention", {"stride": 32}, 192)]
)
def test_the_blocked_paths_tensors_grow_with_n_times_the_block(kind, opts, keys):
    """A training step's forward and backward at T = 2048 with attention dropout (the LM benchmark's setting): no
    tensor beyond B·H·T·s elements; with the switch off the dense path makes (B, H, T, T) maps."""
    n = 2048
    m = build(kind, 16, num_heads=2, causal=True, attn_drop=0.1, **opts).train()
    x = torch.randn(1, n, 16, requires_grad=True)
    sizes = []
    for on in (True, False):
        with fast_paths(on), LargestTensor() as largest:
            m(x).sum().backward()
        sizes.append(largest.numel)
    blocked, dense = sizes
    assert dense >= 2 * n * n
    assert blocked <= 2 * n * keys < dense / 10


def test_low_precision_stays_close_to_fp32():
    """Under bf16 autocast the joint softmax runs in fp32 (as the dense path's): close to the fp32 result."""
    torch.manual_seed(0)
    m = build("strided_attention", 16, num_heads=2, causal=True, stride=16)
    x = torch.randn(2, 300, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = m(x)
    assert low.dtype == torch.bfloat16 and (low.float() - m(x)).abs().max() < 0.05


def test_bad_2d_options():
    with pytest.raises(ValueError, match="query_shape"):
        build("local2d_attention", 16, query_shape=(0, 4))
    with pytest.raises(ValueError, match="memory_flange"):
        build("local2d_attention", 16, memory_flange=(-1, 4))
