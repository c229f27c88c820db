"""Fixed-pattern sparse softmax attention computed block by block: O(N·S) time and memory, not O(N²).

Each query ``i`` attends to a fixed key set ``S_i`` (Child et al. 2019, Eq. 2)::

    a(x_i, S_i) = softmax(q_i K_{S_i}ᵀ · s) V_{S_i}

A pattern is cut into :class:`Blocks`: the queries are split into blocks, and each block gathers the keys its
queries may need (``s`` of them: the window around the block), with a mask saying which of them each query sees.
The scores are a (B, H, blocks, b, s) tensor, so time and memory grow with ``N·s``:

* :func:`local_blocks` -- ``|i - j| < w`` (causal: ``0 <= i - j < w``): blocks of ``b`` queries meet their own
  block and the ``ceil((w-1)/b)`` blocks before (and, not causal, after) it;
* :func:`strided_blocks` -- the Sparse Transformer's strided pattern in its merged-head form, ``|i - j| < l`` or
  ``(i - j) mod l = 0``: its local part as above plus, with the sequence folded into (N/l, l), attention along the
  strided axis (each query meets the N/l keys of its column): O(N·(l + N/l)), one softmax over both parts;
* :func:`local2d_blocks` -- the Image Transformer's 2-D local attention (Parmar et al. 2018): query blocks of
  ``(h_q, w_q)`` of a row-major image ``row_len`` wide, each with the memory block around it (``h_f`` rows above,
  ``w_f`` columns either side; below too when not causal), causal in raster order.

The masks are the patterns themselves evaluated on the gathered positions (the same predicates as the dense
masks of :mod:`vitlab.mixers.sparse_attention`), so the blocked function is the masked dense one; the tests
hold them equal. Positions outside ``[0, n)`` (padding of the last block, keys before the first) are a zero
slot that no real query sees. ``num_global`` leading tokens (a class token) see, and are seen by, every token.
Autograd differentiates the plain operations (index_select, matmul, softmax).

FlexAttention (``torch.nn.attention.flex_attention``) would take block masks, but in torch 2.13 it has no
backward pass on the CPU, eager or compiled, so the training benchmark cannot use it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

MIN_BLOCK = 64  # smaller query blocks only add per-block overhead (and a window of 1 would be one per query)

Predicate = Callable[[Tensor, Tensor], Tensor]
T = TypeVar("T")


@dataclass(frozen=True)
class Blocks:
    """One cut of the ``n`` queries into ``nb`` blocks of ``b``, each meeting ``s`` keys: ``queries`` (nb, b) and
    ``keys`` (nb, s) positions (``n`` = the zero padding slot), ``allowed`` (nb, b, s) which key each query sees,
    ``rows`` (n + 1,) the flat row (block·b + slot) of each position (the padding slot's: 0)."""

    queries: Tensor
    keys: Tensor
    allowed: Tensor
    rows: Tensor

    @property
    def pairs(self) -> int:
        """Query-key pairs scored (the size of one head's score tensor)."""
        return self.allowed.numel()


def cut(q_pos: Tensor, q_real: Tensor, k_pos: Tensor, k_real: Tensor, allows: Predicate, n: int) -> Blocks:
    """:class:`Blocks` of query positions (nb, b) and key positions (nb, s), ``*_real`` False on padding, with
    ``allowed = allows(i, j)`` on real pairs."""
    allowed = allows(q_pos[..., None], k_pos[:, None]) & q_real[..., None] & k_real[:, None]
    # a padded query row sees one (zero) key: its softmax stays finite, so its zero gradient stays zero
    allowed[..., 0] |= ~q_real
    rows = torch.zeros(n + 1, dtype=torch.long, device=q_pos.device)
    rows[q_pos[q_real]] = torch.arange(q_pos.numel(), device=q_pos.device).view(q_pos.shape)[q_real]
    return Blocks(q_pos.where(q_real, n), k_pos.where(k_real, n), allowed, rows)


def local_allows(window: int, causal: bool) -> Predicate:
    """``|i - j| < window``, and ``j <= i`` if causal."""

    def allows(i: Tensor, j: Tensor) -> Tensor:
        near = (i - j).abs() < window
        # Python branches, not `& (j <= i | not causal)`: a TorchScript trace cannot run a tensor-bool `or`
        return near & (j <= i) if causal else near

    return allows


def strided_allows(stride: int, causal: bool) -> Predicate:
    """The strided component alone: ``(i - j) mod stride = 0`` and ``i != j`` (``j < i`` if causal)."""

    def allows(i: Tensor, j: Tensor) -> Tensor:
        return ((i - j) % stride == 0) & ((j < i) if causal else (j != i))

    return allows


def local2d_allows(row_len: int, query_shape: tuple[int, int], flange: tuple[int, int], causal: bool) -> Predicate:
    """Key ``j`` lies in the memory block of query ``i``'s query block (raster positions of an image ``row_len``
    wide): rows ``[r0 - h_f, r0 + h_q)`` (``+ h_f`` if not causal), columns ``[c0 - w_f, c0 + w_q + w_f)`` for the
    block at ``(r0, c0)``; and ``j <= i`` if causal."""
    (hq, wq), (hf, wf) = query_shape, flange

    def allows(i: Tensor, j: Tensor) -> Tensor:
        r0, c0 = i.div(row_len, rounding_mode="floor") // hq * hq, i % row_len // wq * wq
        rj, cj = j.div(row_len, rounding_mode="floor"), j % row_len
        inside = (rj >= r0 - hf) & (rj < r0 + hq + (0 if causal else hf)) & (cj >= c0 - wf) & (cj < c0 + wq + wf)
        return inside & (j <= i) if causal else inside

    return allows


def cached(build: Callable[..., T]) -> Callable[..., T]:
    """``build`` memoised per argument tuple, its tensors made as ordinary tensors even when first asked for under
    ``torch.inference_mode()`` (the cache outlives it, and autograd refuses to save inference tensors)."""

    @functools.lru_cache(maxsize=32)
    @functools.wraps(build)
    def built(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad():
            return build(*args, **kwargs)

    return built


@cached
def local_blocks(n: int, window: int, causal: bool, block: int = 0, device: torch.device | None = None) -> Blocks:
    """Blocks of ``b`` queries meeting their own block and the ``p = ceil((w - 1)/b)`` before it (and after it, not
    causal): ``s = (p + 1)·b`` (or ``(2p + 1)·b``) keys. ``block`` b defaults to ``max(ceil(w/2), MIN_BLOCK)``:
    ``s = 1.5 w`` (causal) where ``b = w`` would score ``2 w`` keys a query."""
    window = min(window, n)  # offsets >= n never occur
    b = min(block or max(-(-window // 2), MIN_BLOCK), n)
    p, nb = -(-(window - 1) // b), -(-n // b)
    start = torch.arange(nb, device=device)[:, None] * b
    q_pos = start + torch.arange(b, device=device)
    k_pos = start + torch.arange(-p * b, b + (0 if causal else p * b), device=device)
    return cut(q_pos, q_pos < n, k_pos, (k_pos >= 0) & (k_pos < n), local_allows(window, causal), n)


@cached
def strided_blocks(n: int, stride: int, causal: bool, device: torch.device | None = None) -> tuple[Blocks, Blocks]:
    """The strided pattern's two parts: the local ``|i - j| < stride`` and, with positions folded into rows of
    ``stride``, each column's ``ceil(n / stride)`` queries against the same column's keys."""
    local = local_blocks(n, stride, causal, 0, device)
    rows = -(-n // stride)
    pos = torch.arange(stride, device=device)[:, None] + torch.arange(rows, device=device) * stride  # (l, N/l)
    return local, cut(pos, pos < n, pos, pos < n, strided_allows(stride, causal), n)


@cached
def local2d_blocks(
    n: int,
    row_len: int,
    query_shape: tuple[int, int],
    flange: tuple[int, int],
    causal: bool,
    device: torch.device | None = None,
) -> Blocks:
    """Query blocks ``(h_q, w_q)`` of the ``ceil(n / row_len) x row_len`` raster (the last row may be partial),
    each meeting its memory block of ``(h_q + h_f (+ h_f)) x (w_q + 2 w_f)`` positions."""
    (hq, wq), (hf, wf) = query_shape, flange
    rows = -(-n // row_len)
    ar = functools.partial(torch.arange, device=device)
    r0 = (ar(-(-rows // hq)) * hq)[:, None, None, None]  # (block rows, block cols, rows in block, cols)
    c0 = (ar(-(-row_len // wq)) * wq)[None, :, None, None]
    qr, qc = r0 + ar(hq)[:, None], c0 + ar(wq)
    kr, kc = r0 + ar(-hf, hq + (0 if causal else hf))[:, None], c0 + ar(-wf, wq + wf)

    def raster(r: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        r, c = torch.broadcast_tensors(r, c)
        pos = (r * row_len + c).flatten(0, 1).flatten(1)
        return pos, ((r >= 0) & (c >= 0) & (c < row_len)).flatten(0, 1).flatten(1) & (pos < n)

    (q_pos, q_real), (k_pos, k_real) = raster(qr, qc), raster(kr, kc)
    return cut(q_pos, q_real, k_pos, k_real, local2d_allows(row_len, query_shape, flange, causal), n)


def pays_off(parts: Blocks | tuple[Blocks, ...], n: int) -> bool:
    """Whether the blocks score fewer than half the ``n x n`` pairs of the dense masked product."""
    parts = parts if isinstance(parts, tuple) else (parts,)
    return 2 * sum(p.pairs for p in parts) < n * n


def blocked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    parts: Blocks | tuple[Blocks, ...],
    scale: float,
    dropout_p: float = 0.0,
    num_global: int = 0,
    causal: bool = False,
) -> Tensor:
    """``softmax(q_i K_{S_i}ᵀ · scale) V_{S_i}`` for q, k, v (B, H, N, d), ``S_i`` the union of ``parts``' allowed
    keys of query i (one softmax over all parts) among the ``N - num_global`` tokens after the ``num_global``
    global ones, which every query sees; a global query sees every key (``j <= i`` if ``causal``)."""
    parts = parts if isinstance(parts, tuple) else (parts,)
    g, n = num_global, q.shape[2] - num_global
    # the body's tokens and, at position n, the zero slot padding points to
    qb, kb, vb = (F.pad(t[:, :, g:], (0, 0, 0, 1)) for t in (q, k, v))
    queries, logits, values = [], [], []
    for p in parts:
        qp = (qb.index_select(2, p.queries.flatten()) * scale).unflatten(2, p.queries.shape)
        kp = kb.index_select(2, p.keys.flatten()).unflatten(2, p.keys.shape)
        queries.append(qp)
        logits.append((qp @ kp.transpose(-2, -1)).masked_fill(~p.allowed, float("-inf")))
        values.append(vb.index_select(2, p.keys.flatten()).unflatten(2, p.keys.shape))
    # one softmax over all parts, in the first part's layout: the other parts' score rows are moved there (and
    # their probabilities back), row by row
    first = parts[0].queries
    there = [p.rows.index_select(0, first.flatten()) for p in parts[1:]]  # each part's row of each first-layout row
    back = [parts[0].rows.index_select(0, p.queries.flatten()) for p in parts[1:]]  # and the reverse
    scores = [logits[0], *(moved(x, t, first.shape) for x, t in zip(logits[1:], there, strict=True))]
    if g:  # the global keys, seen by every query
        scores.append(queries[0] @ k[:, :, None, :g].transpose(-2, -1))
    attn = joint_softmax(torch.cat(scores, -1), dropout_p).split([x.shape[-1] for x in scores], -1)
    out = attn[0] @ values[0]
    for i, p in enumerate(parts[1:]):
        mine = moved(attn[i + 1], back[i], p.queries.shape) @ values[i + 1]
        out = out + moved(mine, there[i], first.shape)
    if g:
        out = out + attn[-1] @ v[:, :, None, :g]
    body = out.flatten(2, 3).index_select(2, parts[0].rows[:n])
    if not g:
        return body
    mask = torch.ones(g, g + n, dtype=torch.bool, device=q.device).tril() if causal else None
    head = F.scaled_dot_product_attention(q[:, :, :g], k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    return torch.cat([head, body], 2)


def moved(x: Tensor, rows: Tensor, blocks: torch.Size) -> Tensor:
    """Rows of ``x`` (B, H, nb, b, ·) picked by flat row index ``rows``, laid out as ``blocks`` (nb', b')."""
    return x.flatten(2, 3).index_select(2, rows).unflatten(2, tuple(blocks))


def joint_softmax(logits: Tensor, dropout_p: float) -> Tensor:
    """Softmax over the last axis (in fp32 for half-precision logits, as the dense path), then dropout."""
    low = logits.dtype in (torch.float16, torch.bfloat16)
    attn = logits.softmax(-1, dtype=torch.float32 if low else None).to(logits.dtype)
    return F.dropout(attn, dropout_p) if dropout_p else attn


__all__ = [
    "Blocks",
    "blocked_attention",
    "local2d_allows",
    "local2d_blocks",
    "local_allows",
    "local_blocks",
    "pays_off",
    "strided_allows",
    "strided_blocks",
]
