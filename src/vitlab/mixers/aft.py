"""AFT: An Attention Free Transformer (Zhai et al., arXiv 2105.14103 v1).

AFT replaces dot-product attention by a per-channel weighted average whose
weights combine the keys with learned pair-wise position biases (paper Eq. 2)::

    Y_t = sigmoid(Q_t) * sum_t' exp(K_t' + w[t, t']) V_t' / sum_t' exp(K_t' + w[t, t'])

(``w[t, t']``: t = output position). Variants (paper §3.2):

* :class:`AFTFull`   -- a learned ``T x T`` bias, factorised ``w = u vᵀ`` (Eq. 7);
* :class:`AFTLocal`  -- ``w`` kept for ``|t - t'| < s``, 0 outside (global connectivity kept); sequences
  longer than s take an O(T·s·d) banded path (:func:`aft_local_banded`, :mod:`.aft_banded`);
* :class:`AFTSimple` -- no bias: ``Y_t = sigmoid(Q_t) * sum_t' softmax_t'(K)_t' V_t'``;
* :class:`AFTConv`   -- heads with one key channel each and a shared ``k x k`` relative bias (Eq. 6).

Causal modules also decode one token at a time from a state of the prefix (``init_state`` / ``step``:
:class:`RunningSums`, :class:`PrefixCache`).

The core functions (:func:`aft_full`, :func:`aft_local_banded`, :func:`aft_simple`, :func:`aft_conv`)
take fp32 ``q, k, v`` and never form a ``(B, T, T, d)`` tensor: AFT-full/local
are two matrix products with ``exp(w)``, AFT-simple is O(T·d), AFT-conv is a
depth-wise convolution plus sums outside the window (no cancellation, unlike the
literal ``e^w - 1`` form). They subtract maxima before every exponential; an
entry whose shifted denominator still underflows (possible when the maxima of K
and of w sit at different t', or with causal cumulative sums) is recomputed
exactly by a per-entry log-sum-exp in float64 (:func:`_exact_entries`). In
normal use no entry takes that path. Under ``torch.compile`` the check and the
repair are branch-free (:func:`_repair_compiled`), so a compiled block stays one
graph. Modules run these cores in fp32 with autocast off; their projections
follow autocast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .aft_banded import band_block, banded_flops, banded_sums, local_bias_band
from .aft_conv_sums import AFTConvCore, conv_core, kernel_and_scale, qkv_width, split_qkv, window_band
from .aft_simple_fused import aft_simple_qkv
from .aft_simple_fused import context as _simple_context
from .base import (
    TokenLayout,
    TokenMixer,
    capturing_graph,
    check_divisible,
    fused_linear,
    linear_rows,
    traced_or_exported,
)

# Every max-shifted weight is <= 1. A shifted denominator >= 1e-20 is a sum whose contributing terms are products
# of normal fp32 factors (accurate); below it the leading terms may have underflowed: the entry is recomputed.
_UNDERFLOW = 1e-20
# bound on the elements of one fallback chunk (float64 logits and values), to cap its memory
_FALLBACK_ELEMS = 1 << 22
# a compiled model repairs a fixed number of entries in every call (:func:`_repair_compiled`): about this many
# float64 elements of logits and values (a small fraction of a block's work), and at least this many entries
_COMPILED_REPAIR_ELEMS, _COMPILED_MIN_SLOTS = 1 << 16, 16

BiasRows = Callable[[Tensor, Tensor], Tensor]


def _exact_entries(k: Tensor, v: Tensor, bias_rows: BiasRows, b: Tensor, t: Tensor, g: Tensor) -> Tensor:
    """Weighted averages of the listed ``(b, t, g)`` entries by a log-sum-exp over t', in float64.

    ``k`` (B, T, G) are the key logits of G key channels, ``v`` (B, T, G, R) the R value channels each
    key channel weighs, ``bias_rows(t, g)`` the bias rows ``w[t, :]`` (m, T) of those entries (-inf =
    excluded). Returns (m, R). float64 makes ``K + w`` exact for fp32 inputs of any magnitude.
    """
    dt = torch.float32 if k.device.type == "mps" else torch.float64
    kt, vt = k.transpose(1, 2), v.permute(0, 2, 1, 3)  # (B, G, T), (B, G, T, R)
    step = max(1, _FALLBACK_ELEMS // (k.shape[1] * v.shape[-1]))
    out = []
    for i in range(0, b.numel(), step):  # chunks of entries, never tokens
        bi, ti, gi = b[i : i + step], t[i : i + step], g[i : i + step]
        p = (kt[bi, gi].to(dt) + bias_rows(ti, gi).to(dt)).softmax(-1)
        out.append(torch.einsum("mt,mtr->mr", p, vt[bi, gi].to(dt)))
    return torch.cat(out).to(k.dtype)


def _ratio(num: Tensor, den: Tensor, k: Tensor, v: Tensor, bias_rows: BiasRows) -> Tensor:
    """``num / den`` (num (B, Tq, G, R), den (B, Tq, G) at Tq query positions) with underflowed entries recomputed
    exactly (:func:`_exact_entries`) from the keys ``k`` (B, T, G), values ``v`` (B, T, G, R) and the bias rows
    ``bias_rows(t, g)`` of query positions t."""
    checks = _data_checks_allowed(den)
    eager = checks and not torch.compiler.is_compiling()
    # the one check the fast path pays; before the clamp, which only touches entries that are replaced below (and
    # keeps their zero gradient finite)
    idx = (den.detach() < _UNDERFLOW).nonzero(as_tuple=True) if eager and den.detach().amin() < _UNDERFLOW else None
    if eager and _no_autograd(num, den):  # in place: no buffer beside the sums
        y = num.div_(den.clamp_min_(_UNDERFLOW).unsqueeze(-1))
        return y if idx is None else y.index_put_(idx, _exact_entries(k, v, bias_rows, *idx))
    den_safe = den.clamp_min(_UNDERFLOW).unsqueeze(-1)
    y = num.div_(den_safe) if _no_autograd(num) else num / den_safe
    if checks and not eager:
        return _repair_compiled(y, den, k, v, bias_rows)
    return y if idx is None else y.index_put(idx, _exact_entries(k, v, bias_rows, *idx))


def _repair_compiled(y: Tensor, den: Tensor, k: Tensor, v: Tensor, bias_rows: BiasRows) -> Tensor:
    """:func:`_ratio`'s repair of underflowed entries in a form ``torch.compile`` captures whole: no branch on
    the data (which would split the graph in every block), fixed shapes. A fixed number of slots
    (``torch.nonzero_static``, unused slots padded with -1) takes the underflowed entries; every slot is
    recomputed exactly, the used ones replace their entry (as in eager mode, the replaced value passes no
    gradient) and the unused ones a spare row that is dropped. More underflowed entries than slots stop the
    call with an error rather than leave one unrepaired."""
    under = (den.detach() < _UNDERFLOW).reshape(-1)
    n, (tq, g) = under.numel(), den.shape[1:]
    slots = min(n, max(_COMPILED_MIN_SLOTS, _COMPILED_REPAIR_ELEMS // (k.shape[1] * v.shape[-1])))
    torch._assert_async(
        under.sum() <= slots,
        f"AFT: more than {slots} outputs underflowed (keys or biases of extreme magnitude), more than a compiled "
        "model repairs; run it without torch.compile, which repairs any number exactly",
    )
    flat = torch.nonzero_static(under, size=slots, fill_value=-1)[:, 0]  # (slots,) entry numbers, -1 unused
    entry = flat.clamp_min(0)
    exact = _exact_entries(k, v, bias_rows, entry // (tq * g), entry // g % tq, entry % g)
    rows = torch.cat([y.reshape(n, -1), y.new_zeros(1, y.shape[-1])])  # + a spare row for the unused slots
    rows = rows.index_put((torch.where(flat >= 0, flat, n),), exact)
    return rows[:n].view(y.shape)


def _data_checks_allowed(t: Tensor) -> bool:
    """Whether a data-dependent branch may run: not on the meta device (MAC counting) and not while a graph is
    traced or exported (TorchScript trace, ONNX), which records the fast path only."""
    return t.device.type != "meta" and not traced_or_exported()


def _no_autograd(*tensors: Tensor) -> bool:
    """Whether autograd records nothing on ``tensors`` (inference, no_grad): the cores may then reuse their own
    intermediates in place (fewer allocations, less memory traffic); the values are the same."""
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def _gate(q: Tensor, y: Tensor) -> Tensor:
    """``sigmoid(Q) ⊙ Y``, the output gate of every AFT core (in place on the sigmoid without autograd)."""
    return torch.sigmoid(q).mul_(y) if _no_autograd(q, y) else torch.sigmoid(q) * y


def _key_context(k: Tensor, v: Tensor) -> Tensor:
    """``[e^{K - colmax} ⊙ V, e^{K - colmax}]`` (B, T, 2C), the right-hand side of AFT-full's two sums under
    autograd."""
    ek = (k - k.detach().amax(1, keepdim=True)).exp()
    return torch.cat([ek * v, ek], -1)


def _bias_weights(w: Tensor, start: int, stop: int, causal: bool) -> Tensor:
    """``e^{w[t, t'] - max_t' w[t, t']}`` for the query rows t = start .. stop-1 of ``w`` (T, T); causal: pairs
    t' > t are 0 and the columns stop at ``stop`` (the rest would be 0 too)."""
    rows = w[start:stop, :stop] if causal else w[start:stop]
    if causal:
        rows = _mask_future(rows, torch.arange(start, stop, device=w.device))
    # the ratio does not depend on the shifts, so they carry no gradient
    top = rows.detach().amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    return (rows - top).exp_()  # exp in place on a fresh difference: autograd saves the result either way


# AFT-full without autograd forms ``e^{w - rowmax}`` a band of about this many elements at a time: the whole
# (T, T) matrix is the mixer's largest tensor at long sequences (64 MB at T = 4096, 16x its activations)
_BIAS_BAND_ELEMS = 1 << 18


def _weighted_sums(w: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    """AFT-full's numerator ``e^{w - rowmax} @ (e^{K - colmax} ⊙ V)`` and denominator ``e^{w - rowmax} @
    e^{K - colmax}`` (B, T, C) each, without autograd.

    Short sequences, captured graphs and GPUs: ``e^{w - rowmax}`` formed once, the denominator's product first,
    then ``e^K`` becomes ``e^K ⊙ V`` in its own buffer: one-activation buffers, at most three alive (a stacked
    (2B, T, C) key context and its (2B, T, C) product held four, in blocks of two sizes that fragment the heap
    more across calls: T = 197, B = 8, side by side, RSS increment 33.6 -> 29.0 MB, median of 5 fresh
    processes). Long sequences on the CPU: the weights are formed a band of rows at a time (:func:`_in_bands`),
    each band multiplied into both halves of the stacked key context, so that it is formed once."""
    n = w.shape[0]
    step = max(1, _BIAS_BAND_ELEMS // n)
    if step >= n or capturing_graph() or k.device.type != "cpu":
        ew = _bias_weights(w, 0, n, causal)
        ek = torch.sub(k, k.amax(1, keepdim=True)).exp_()  # contiguous: exp on a strided view ran ~4x slower
        den = torch.matmul(ew, ek)
        return torch.matmul(ew, ek.mul_(v)), den
    b, _, c = k.shape
    ctx = k.new_empty(2, b, n, c)  # [e^K ⊙ V ; e^K], each half contiguous
    ek = torch.sub(k, k.amax(1, keepdim=True), out=ctx[1]).exp_()
    torch.mul(ek, v, out=ctx[0])
    del ek
    sums = _in_bands(w, ctx.view(2 * b, n, c), causal, step).view(2, b, n, c)
    return sums[0], sums[1]  # indexing, not split: ONNX export cannot fold a split of a traced size


def _in_bands(w: Tensor, ctx: Tensor, causal: bool, step: int) -> Tensor:
    """``e^{w - rowmax} @ ctx[i]`` for each matrix of ``ctx`` (M, T, C), the weights formed ``step`` rows at a
    time, one band alive, each multiplied into its rows of the result (causal: only the columns t' <= the
    band's last row). On the CPU only: on a GPU a product per band and matrix would be a kernel launch each."""
    n = w.shape[0]
    out = torch.empty_like(ctx)
    for start in range(0, n, step):
        stop = min(n, start + step)
        ew = _bias_weights(w, start, stop, causal)
        for i in range(ctx.shape[0]):
            torch.mm(ew, ctx[i, : ew.shape[1]], out=out[i, start:stop])
        del ew  # before the next band is formed: one band at a time
    return out


def aft_full(q: Tensor, k: Tensor, v: Tensor, w: Tensor, causal: bool = False) -> Tensor:
    """AFT-full / AFT-local core, paper Eq. (2): ``sigmoid(Q_t) * Σ_t' e^{K_t'+w[t,t']} V_t' / Σ_t' e^{K_t'+w[t,t']}``.

    ``q, k, v`` (B, T, C) fp32; ``w`` (T, T), ``w[t, t']`` with t = output position, -inf = pair excluded.
    ``causal`` keeps t' <= t. Computed as ``e^{w - rowmax} @ [e^{K - colmax} V, e^{K - colmax}]``
    (the maxima cancel in the ratio): O(T² C) time; O(T² + T C) memory under autograd, which keeps
    ``e^{w - rowmax}``, else O(T C) (:func:`_weighted_sums`).
    """
    b, n, c = k.shape
    if _no_autograd(q, k, v, w):
        num, den = _weighted_sums(w, k, v, causal)
    else:  # one (T, T) @ (T, B·2C) product for numerator and denominator (a faster backward)
        ctx = _key_context(k, v).transpose(0, 1).reshape(n, b * 2 * c)
        num, den = (_bias_weights(w, 0, n, causal) @ ctx).view(n, b, 2 * c).transpose(0, 1).split(c, -1)
    rows = (lambda t, g: _mask_future(w[t], t)) if causal else (lambda t, g: w[t])
    y = _ratio(num.unsqueeze(-1), den, k, v.unsqueeze(-1), rows)
    return _gate(q, y.squeeze(-1))


def aft_local_banded(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w_band: Tensor,
    window: int,
    outside_zero: bool,
    bias_rows: BiasRows,
    causal: bool = False,
) -> Tensor:
    """AFT-local core in O(T·b·C): paper Eq. (2) with ``w[t, t'] = 0`` (``outside_zero``, else -inf) for
    ``|t - t'| >= window`` (``causal``: and t' <= t only).

    ``q, k, v`` (B, T, C) fp32; ``w_band`` (nb, b, 2b causal, else 3b) the raw bias on the band of
    :func:`~vitlab.mixers.aft_banded.band_positions` with ``b >= window``; ``bias_rows(t, g)`` the full rows
    of the effective bias (future -inf when causal) for the exact fallback of underflowed entries
    (:func:`_ratio`). The sums are :func:`~vitlab.mixers.aft_banded.banded_sums`.
    """
    num, den = banded_sums(k, v, w_band, window, outside_zero, causal)
    y = _ratio(num.unsqueeze(-1), den, k, v.unsqueeze(-1), bias_rows)
    return _gate(q, y.squeeze(-1))


def _mask_future(rows: Tensor, t: Tensor) -> Tensor:
    """Bias rows (m, n) of the query positions ``t`` (m,) with the pairs t' > t excluded (-inf): causal AFT."""
    return rows.masked_fill(torch.arange(rows.shape[-1], device=t.device) > t[:, None], float("-inf"))


def aft_simple(q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
    """AFT-simple core: ``sigmoid(Q_t) * Σ_t' softmax_t'(K)_t' V_t'`` (paper §3.2, w = 0), O(T·C).

    Non-causal: one softmax-weighted sum over tokens, broadcast over t. Causal: cumulative sums over
    t' <= t of ``e^{K - max} V`` and ``e^{K - max}``.
    """
    if not causal:
        return torch.sigmoid(q) * (k.softmax(1) * v).sum(1, keepdim=True)
    ek = (k - k.detach().amax(1, keepdim=True)).exp()
    num, den = (ek * v).cumsum(1), ek.cumsum(1)
    y = _ratio(
        num.unsqueeze(-1), den, k, v.unsqueeze(-1), lambda t, g: _mask_future(k.new_zeros(len(t), k.shape[1]), t)
    )
    return _gate(q, y.squeeze(-1))


def _outside_window_sum(x: Tensor, s: int) -> Tensor:
    """For every pixel of ``x`` (B, C, H, W), the sum of ``x`` over the grid outside the ``s x s`` window centred on it.

    With the 0/1 band matrices ``A_H[r, r'] = |r - r'| <= s//2`` (and ``A_W``), the outside sum is
    ``(1 - A_H) X 1 + A_H X (1 - A_W)`` (rows outside the window's rows, plus the window's rows outside its
    columns): small matrix products with non-negative coefficients, never ``total - window``, which cancels.
    """
    h, w = x.shape[-2:]
    near_h, near_w = (window_band(n, s // 2, x) for n in (h, w))
    return (1 - near_h) @ x.sum(-1, keepdim=True) + near_h @ (x @ (1 - near_w))


def _conv_bias_rows(
    w: Tensor, grid: tuple[int, int], num_prefix: int, n: int, outside: float, t: Tensor, g: Tensor
) -> Tensor:
    """(m, N) rows ``w_eff[t, :]`` of AFT-conv's implied pair-wise bias for query t, head g.

    ``w_eff[t, t'] = w[g, dy + s//2, dx + s//2]`` when both are patches and t' = t + (dy, dx) lies in the
    window; ``outside`` otherwise (prefix tokens and pairs outside the window): 0, or -inf for the ablation.
    """
    s, p = w.shape[-1], w.shape[-1] // 2
    gw = grid[1]
    key = torch.arange(n, device=t.device) - num_prefix  # (N,)
    qry = t - num_prefix  # (m,)
    dy = key.div(gw, rounding_mode="floor")[None] - qry.div(gw, rounding_mode="floor")[:, None] + p
    dx = (key % gw)[None] - (qry % gw)[:, None] + p
    inside = (dy >= 0) & (dy < s) & (dx >= 0) & (dx < s) & (key >= 0)[None] & (qry >= 0)[:, None]
    vals = w[g[:, None], dy.clamp(0, s - 1), dx.clamp(0, s - 1)]
    return torch.where(inside, vals, outside)


def aft_conv(
    qkv: Tensor,
    w: Tensor,
    grid: tuple[int, int],
    num_prefix: int = 0,
    global_context: bool = True,
    query: bool = True,
) -> Tensor:
    """AFT-conv core, paper Eq. (6), per head i with one key channel K^i and kernel w^i::

        Y^i_t = sigmoid(Q^i_t) * [conv(e^{K^i} V^i, e^{w^i} - 1) + Σ_t' e^{K^i_t'} V^i_t']
                               / [conv(e^{K^i}, e^{w^i} - 1) + Σ_t' e^{K^i_t'}]

    ``qkv`` (B, N, C + h + C) is the fused projection ``[Q | K | V]`` (``[K | V]`` with ``query=False``): Q, V
    head-major, one key channel per head; ``w`` (h, s, s) the (re-parameterised) bias, s odd. conv is
    PyTorch's cross-correlation with zero padding s//2 over the patch grid: query (r, c) meets key
    (r + dy, c + dx) with bias ``w[i, dy + s//2, dx + s//2]``. The ``num_prefix`` leading tokens (class
    token) take part in the global sums only: no local term for a pair involving a prefix token.

    Computed without cancellation as ``e^{-m} · (Σ_{outside window} e^K V) + conv(e^K V, e^{w - m})``
    with ``m = max(max w^i, 0)`` (same value as Eq. 6, whose ``e^w - 1`` form cancels for w << 0).

    ``global_context=False`` is the paper's ablation with ``w = -inf`` outside the window: only the local
    term remains (there is then no pair for a prefix token, so ``num_prefix`` must be 0). ``query=False`` is
    the paper's Table 12 ablation without the query term: the gate ``sigmoid(Q)`` is left out.

    In eager mode the sums are the operator of :mod:`~vitlab.mixers.aft_conv_sums` on the token-major key
    context, under autograd :class:`~vitlab.mixers.aft_conv_sums.AFTConvCore` (closed-form backward, the
    gradient of ``qkv`` in one buffer). Should a denominator underflow there, the call is recomputed by
    :func:`_aft_conv_composite`, which repairs those entries exactly (:func:`_ratio`); graphs being captured
    (compile, trace, ONNX) and the meta device take that composite form directly.
    """
    if not global_context and num_prefix:
        raise ValueError("aft_conv: global_context=False has no pairs for prefix tokens; use num_prefix=0")
    if capturing_graph() or qkv.device.type == "meta":
        return _aft_conv_composite(qkv, w, grid, num_prefix, global_context, query)
    args = (qkv, w, grid, num_prefix, global_context, query, _UNDERFLOW)
    out, den_min = conv_core(*args) if _no_autograd(qkv, w) else AFTConvCore.apply(*args)
    if den_min < _UNDERFLOW:  # keys or biases of extreme magnitude: the composite form repairs
        return _aft_conv_composite(qkv, w, grid, num_prefix, global_context, query)
    return out


def _aft_conv_composite(
    qkv: Tensor, w: Tensor, grid: tuple[int, int], num_prefix: int, global_context: bool, query: bool
) -> Tensor:
    """:func:`aft_conv` as composite operations on token-major ``(B, N, C + h)`` key contexts: what autograd
    differentiates and graph capture records, with the exact repair of underflowed entries (:func:`_ratio`)."""
    h, s = w.shape[0], w.shape[-1]
    q, k, v = split_qkv(qkv, h, query)
    b, n, c = v.shape
    r = c // h
    ek = (k - k.detach().amax(1, keepdim=True)).exp()  # (B, N, h)
    x = torch.cat([(ek.unsqueeze(-1) * v.view(b, n, h, r)).flatten(2), ek], -1)  # (B, N, C + h)
    kernel, scale = kernel_and_scale(w, global_context)  # (h, s, s) <= 1; e^{-m} (h,) or None
    per_chan = torch.cat([torch.arange(h, device=w.device).repeat_interleave(r), torch.arange(h, device=w.device)])
    x_pre, x_grid = x[:, :num_prefix], x[:, num_prefix:].transpose(1, 2).reshape(b, c + h, *grid)
    nd = F.conv2d(x_grid, kernel[per_chan].unsqueeze(1), padding=s // 2, groups=c + h)  # (B, C + h, H, W)
    if scale is not None:
        outside = _outside_window_sum(x_grid, s) + x_pre.sum(1)[..., None, None]
        nd = nd + scale[per_chan][:, None, None] * outside
        prefix = scale[per_chan] * x.sum(1, keepdim=True).expand(b, num_prefix, c + h)
        nd = torch.cat([prefix, nd.flatten(2).transpose(1, 2)], 1)  # (B, N, C + h)
    else:  # no prefix tokens without the global context
        nd = nd.flatten(2).transpose(1, 2)
    rows = partial(_conv_bias_rows, w, grid, num_prefix, n, 0.0 if global_context else float("-inf"))
    y = _ratio(nd[..., :c].view(b, n, h, r), nd[..., c:], k, v.view(b, n, h, r), rows)
    return y.reshape(b, n, c) if q is None else _gate(q, y.reshape(b, n, c))


# --------------------------------------------------------------------------- elementwise FLOPs of the cores


def aft_full_flops(batch: int, tokens: int, channels: int) -> int:
    """AFT-full / AFT-local core (Eq. 2 as two products with ``e^w``, which are MACs): ``e^{K - max}`` and
    ``e^{w - max}`` (max, subtract, exp: 3 per element), ``e^K ⊙ V`` 1, the division 1, ``sigmoid(Q)`` 3 and the
    gate 1 per output element."""
    return 9 * batch * tokens * channels + 3 * tokens * tokens


def aft_simple_flops(batch: int, tokens: int, channels: int) -> int:
    """AFT-simple core: softmax of K over the tokens 5, ``⊙ V`` 1, the sum over tokens 1, ``sigmoid(Q)`` 3 and
    the gate 1 per element (the causal form: exp 3, ``⊙ V`` 1, two cumulative sums 2, divide 1, sigmoid 3, gate 1)."""
    return 11 * batch * tokens * channels


def aft_conv_flops(
    batch: int,
    tokens: int,
    channels: int,
    heads: int,
    kernel: int,
    grid: tuple[int, int],
    global_context: bool = True,
    query: bool = True,
) -> int:
    """AFT-conv core besides its convolution and band-matrix products (MACs): ``e^{K - max}`` 3 per key,
    ``e^K ⊙ V`` 1 per value, the kernel ``e^{w - m}`` 2 per tap, the row sums of the outside-window term 1 and
    ``local + e^{-m} · outside`` 2 per grid element of the C + h channels, the prefix tokens' global sums
    1 per token and channel, then divide 1, ``sigmoid(Q)`` 3 and the gate 1 per output element (without the
    query term, Table 12: the division only)."""
    width = channels + heads
    cells = grid[0] * grid[1]
    total = 3 * batch * tokens * heads + batch * tokens * channels + 2 * heads * kernel * kernel
    if global_context:
        total += 3 * batch * width * cells
    total += batch * tokens * width  # prefix: the sum over all tokens
    return total + (5 if query else 1) * batch * tokens * channels


# --------------------------------------------------------------------------- incremental decoding (causal)

# AFT-full/local decoding rescales its cache only when a key exceeds the running reference by this much (nats):
# the cached terms stay <= e^20 (sums of T of them are far from fp32 overflow) and the O(t·d) rescale is rare
RESCALE_MARGIN = 20.0


class RunningSums:
    """Decoding state of causal AFT-simple (and AFT-local without a bias): running per-channel sums
    ``Σ e^{K_t'-m} V_t'`` and ``Σ e^{K_t'-m}`` with their running maximum m, O(d) state and work per step.
    When a new key exceeds m, both sums are rescaled by ``e^{m-m'}``."""

    def __init__(self) -> None:
        self.m = self.num = self.den = None

    def advance(self, q: Tensor, k: Tensor, v: Tensor, t: int) -> Tensor:
        """Take in position t's key and value (B, C); its output before the projection."""
        if self.m is None:
            self.m, self.num, self.den = k, v, torch.ones_like(k)
        else:
            m = torch.maximum(self.m, k)
            old, new = (self.m - m).exp(), (k - m).exp()
            self.m, self.num, self.den = m, self.num * old + new * v, self.den * old + new
        return torch.sigmoid(q) * self.num / self.den  # den >= 1: the maximal key contributes e^0


class PrefixCache:
    """Decoding state of causal AFT-full/local: the prefix's ``[e^{K-m} V, e^{K-m}]`` (B, T, 2C) and the raw
    K, V (for the exact fallback of :func:`_ratio`). m is a per-channel reference, raised (and the cache
    rescaled) when a key exceeds it by more than :data:`RESCALE_MARGIN`. Position t's output is one weighted
    sum over the cache with the bias row ``e^{w[t, :t+1] - max}`` (paper Eq. 2) of ``bias_row(t)``."""

    def __init__(
        self, bias_row: Callable[[int], Tensor], batch: int, max_len: int, channels: int, like: Tensor
    ) -> None:
        self.bias_row = bias_row
        self.ctx = like.new_zeros(batch, max_len, 2 * channels, dtype=torch.float32)
        self.k = like.new_zeros(batch, max_len, channels, dtype=torch.float32)
        self.v = like.new_zeros(batch, max_len, channels, dtype=torch.float32)
        self.m: Tensor | None = None

    def advance(self, q: Tensor, k: Tensor, v: Tensor, t: int) -> Tensor:
        """Take in position t's key and value (B, C); its output before the projection."""
        c = k.shape[-1]
        if self.m is None:
            self.m = k
        elif bool((k > self.m + RESCALE_MARGIN).any()):  # rescale the cached terms to the new maximum
            m = torch.maximum(self.m, k)
            scale = (self.m - m).exp()[:, None]
            self.ctx[:, :t, :c] *= scale
            self.ctx[:, :t, c:] *= scale
            self.m = m
        ek = (k - self.m).exp()  # <= e^RESCALE_MARGIN
        self.ctx[:, t, :c] = ek * v
        self.ctx[:, t, c:] = ek
        self.k[:, t], self.v[:, t] = k, v
        row = self.bias_row(t)
        weights = (row - row.max()).exp()  # (t + 1,), the row maximum is finite (w[t, t] is never excluded)
        b = self.ctx.shape[0]
        num, den = torch.bmm(weights.expand(b, 1, t + 1), self.ctx[:, : t + 1])[:, 0].chunk(2, -1)
        # one query position; an underflowed entry is recomputed from the raw prefix with this row
        prefix_k, prefix_v = self.k[:, : t + 1], self.v[:, : t + 1, :, None]
        y = _ratio(num[:, None, :, None], den[:, None], prefix_k, prefix_v, lambda ti, g: row.expand(len(ti), -1))
        return torch.sigmoid(q) * y[:, 0, :, 0]


def _decode_step(mixer: AFTFull | AFTSimple, x: Tensor, t: int, state: RunningSums | PrefixCache) -> Tensor:
    """One causal AFT position: project the new token, read the state, project back."""
    q, k, v = (p.float() for p in mixer.qkv(x).chunk(3, -1))
    return mixer.proj(state.advance(q, k, v, t).to(x.dtype))


def _resample_tokens(t: Tensor, n: int, layout: TokenLayout, dim: int) -> Tensor:
    """Resample axis ``dim`` of a position table (length L) to ``n`` tokens; prefix rows are kept.

    Patch rows are resampled in 2-D (bicubic, as ViT position embeddings) when ``layout.grid`` is given and
    ``L - num_prefix`` is a perfect square (the stored square grid), else by 1-D linear interpolation.
    """
    p = layout.num_prefix
    t = t.movedim(dim, 0)
    length, rest_shape = t.shape[0], t.shape[1:]
    if p >= min(length, n):
        raise ValueError(f"cannot resample a {length}-token position table to {n} tokens with {p} prefix tokens")
    rest = t[p:].reshape(length - p, -1).T.unsqueeze(0)  # (1, F, L - p)
    side = math.isqrt(length - p)
    if layout.grid is not None and side * side == length - p:
        img = rest.reshape(1, -1, side, side)
        rest = F.interpolate(img, size=layout.grid, mode="bicubic", align_corners=False).flatten(2)
    else:
        rest = F.interpolate(rest, size=n - p, mode="linear", align_corners=False)
    rest = rest[0].T.reshape(n - p, *rest_shape)
    return torch.cat([t[:p], rest]).movedim(0, dim)


def _no_autocast(x: Tensor) -> AbstractContextManager:
    """Context that runs the AFT core in fp32 even under autocast (exp of half-precision logits is lossy)."""
    # the CPU and CUDA always have autocast; asking only for other devices (e.g. the meta device that counts
    # MACs) keeps torch.compile from a graph break (dynamo in torch 2.11 cannot trace the availability query)
    if x.device.type not in ("cpu", "cuda") and not torch.amp.is_autocast_available(x.device.type):
        return nullcontext()
    return torch.autocast(device_type=x.device.type, enabled=False)


class AFTFull(TokenMixer):
    """AFT-full (paper Eq. 2) with a learned pair-wise position bias ``w`` (max_len x max_len).

    Args:
        dim: token width C.
        max_len: T, the number of tokens ``w`` is built for.
        hidden_dim: width of Q, K, V (default ``dim``); ``proj`` maps it back to ``dim``.
        bias_dim: d' of the factorised bias ``w = u vᵀ``, ``u, v ~ N(0, 0.01²)`` (paper Eq. 7, d' = 128
            on ImageNet); ``None`` = a full ``max_len x max_len`` parameter ``w ~ N(0, 0.01²)`` (Table 3).
        causal: autoregressive (t' <= t). A causal model accepts N <= max_len tokens and uses the
            top-left N x N block of ``w``: exactly the model on the shorter sequence.
        qkv_bias: bias of the fused ``qkv`` projection.
        resample: accept other token counts by resampling ``u, v`` (or ``w``) to N (see
            :func:`_resample_tokens`). Without it, a non-causal model needs N == max_len.

    ``return_aux=True`` gives ``aux["keys"]``: K, (B, N, hidden_dim). A causal mixer decodes incrementally
    (:meth:`step`) from a cache of its prefix (:class:`PrefixCache`).
    """

    flops_label = "AFT"

    def __init__(
        self,
        dim: int,
        max_len: int,
        hidden_dim: int | None = None,
        bias_dim: int | None = 128,
        causal: bool = False,
        qkv_bias: bool = True,
        resample: bool = False,
    ) -> None:
        super().__init__(dim)
        name = type(self).__name__
        if max_len <= 0:
            raise ValueError(f"{name}: max_len must be positive, got {max_len}")
        if bias_dim is not None and bias_dim <= 0:
            raise ValueError(f"{name}: bias_dim must be positive or None (full w), got {bias_dim}")
        self.max_len = max_len
        self.hidden_dim = hidden = hidden_dim or dim
        self.causal = causal
        self.resample = resample
        self.qkv = nn.Linear(dim, 3 * hidden, bias=qkv_bias)
        self.proj = nn.Linear(hidden, dim)
        if bias_dim is None:
            self.w = nn.Parameter(torch.randn(max_len, max_len) * 0.01)
            self.register_parameter("u", None)
            self.register_parameter("v", None)
        else:
            self.register_parameter("w", None)
            self.u = nn.Parameter(torch.randn(max_len, bias_dim) * 0.01)
            self.v = nn.Parameter(torch.randn(max_len, bias_dim) * 0.01)

    def no_weight_decay(self) -> set[str]:
        """Position biases are not weight-decayed (AFT §6.1: weight decay on the linear weights only)."""
        return {n for n in ("u", "v", "w") if getattr(self, n) is not None}

    def extra_repr(self) -> str:
        d = None if self.u is None else self.u.shape[1]
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}, max_len={self.max_len}, bias_dim={d}, " + (
            f"causal={self.causal}, resample={self.resample}"
        )

    @property
    def biased(self) -> bool:
        """Whether there is a position bias (AFT-local with window 0 has none: it is AFT-simple)."""
        return self.u is not None or self.w is not None

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        return (aft_full_flops if self.biased else aft_simple_flops)(batch, tokens, self.hidden_dim)

    def _fit(self, n: int, layout: TokenLayout) -> Callable[[Tensor, int], Tensor]:
        """How a table's token axis becomes n long: as is, prefix block (causal) or resampled."""
        if n == self.max_len:
            return lambda t, dim: t
        if self.causal and n < self.max_len:
            return lambda t, dim: t.narrow(dim, 0, n)
        if self.resample:
            return lambda t, dim: _resample_tokens(t, n, layout, dim)
        name = type(self).__name__
        need = f"N <= max_len = {self.max_len}" if self.causal else f"N == max_len = {self.max_len}"
        raise ValueError(
            f"{name}: got N = {n} tokens but the position bias is built for {need}; "
            f"build it with max_len={n} or pass resample=True to interpolate the bias"
        )

    def position_bias(self, n: int | None = None, layout: TokenLayout | None = None) -> Tensor | None:
        """The bias ``w[t, t']`` (n, n) the model uses for n tokens (fp32; -inf = pair excluded), or None.

        Causal masking is applied by the core, not here.
        """
        n = n or self.max_len
        fit = self._fit(n, layout or TokenLayout())
        if self.w is not None:
            w = fit(fit(self.w.float(), 0), 1)
        elif self.u is not None:
            w = fit(self.u.float(), 0) @ fit(self.v.float(), 0).T
        else:
            return None
        pos = torch.arange(n, device=w.device)
        return self._restrict(w, pos[:, None], pos[None])

    def bias_row(self, t: int) -> Tensor:
        """Row ``w[t, :t+1]`` (fp32) of the bias: what causal position t weighs its prefix with."""
        row = self.u[t].float() @ self.v[: t + 1].float().T if self.u is not None else self.w[t, : t + 1].float()
        return self._restrict(row, t, torch.arange(t + 1, device=row.device))

    def _restrict(self, w: Tensor, t: Tensor | int, tk: Tensor) -> Tensor:
        """The bias ``w`` of query positions ``t`` and key positions ``tk`` (broadcast) as the model uses it."""
        return w

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        q, k, v = fused_linear(self.qkv, x).chunk(3, -1)
        with _no_autocast(x):
            y = self._core(q.float(), k.float(), v.float(), layout)
        out = fused_linear(self.proj, y.to(q.dtype)).to(x.dtype)
        return out, ({"keys": k} if return_aux else {})

    def _core(self, q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout) -> Tensor:
        """The AFT core on fp32 ``q, k, v`` (B, N, hidden), autocast off."""
        w = self.position_bias(k.shape[1], layout)
        return aft_simple(q, k, v, self.causal) if w is None else aft_full(q, k, v, w, self.causal)

    def init_state(self, batch: int, max_len: int, like: Tensor) -> RunningSums | PrefixCache:
        if not self.biased:
            return RunningSums()
        return PrefixCache(self.bias_row, batch, max_len, self.hidden_dim, like)

    def step(self, x: Tensor, t: int, state: RunningSums | PrefixCache) -> Tensor:
        return _decode_step(self, x, t, state)


class AFTLocal(AFTFull):
    """AFT-local: AFT-full with ``w[t, t']`` kept for ``|t - t'| < window`` (paper §3.2).

    ``outside="zero"`` (paper default) sets w = 0 outside the window, so every pair keeps weight
    ``e^{K_t'}`` (global connectivity); ``outside="-inf"`` drops those pairs (the paper's ablation).
    ``window=0`` is AFT-simple: no position bias (and no bias parameters) at all, any token count.
    Default window 32 (paper's best on Enwik8, Table 5). The window is in token order (|t - t'|), whatever
    the layout.

    Sequences longer than the window whose bias is a block of the stored table (:meth:`uses_band`) take the
    O(N·s·d) path :func:`aft_local_banded` (only the band of pairs inside the window is formed; same outputs as
    the dense O(N² d) path the other cases take: shorter sequences, and the resampled bias of ``resample=True``).
    ``recompute=True`` keeps only that core's inputs for the backward pass and recomputes its intermediates
    there (activation checkpointing, as flash attention recomputes its map): less memory in training, one
    more core forward per step. Other arguments as :class:`AFTFull`.
    """

    def __init__(
        self,
        dim: int,
        max_len: int,
        window: int = 32,
        outside: str = "zero",
        hidden_dim: int | None = None,
        bias_dim: int | None = 128,
        causal: bool = False,
        qkv_bias: bool = True,
        resample: bool = False,
        recompute: bool = False,
    ) -> None:
        super().__init__(dim, max_len, hidden_dim, bias_dim, causal, qkv_bias, resample)
        if window < 0:
            raise ValueError(f"AFTLocal: window must be >= 0, got {window}")
        if outside not in ("zero", "-inf"):
            raise ValueError(f"AFTLocal: outside must be 'zero' or '-inf', got {outside!r}")
        self.window = window
        self.outside = outside
        self.recompute = recompute
        if window == 0:  # unused parameters would break DDP and waste the optimiser's state
            self.u = self.v = self.w = None

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f", window={self.window}, outside={self.outside!r}"
            + (", recompute=True" if self.recompute else "")
        )

    def _fit(self, n: int, layout: TokenLayout) -> Callable[[Tensor, int], Tensor]:
        if self.window == 0:  # no table: any token count
            return lambda t, dim: t
        return super()._fit(n, layout)

    def _restrict(self, w: Tensor, t: Tensor | int, tk: Tensor) -> Tensor:
        far = (t - tk).abs() >= self.window
        return w.masked_fill(far, 0.0 if self.outside == "zero" else float("-inf"))

    def uses_band(self, tokens: int) -> bool:
        """Whether N = ``tokens`` takes the O(N·s·d) band path: N longer than the window, and the band needs
        ``w[:N, :N]`` of the table as is, whatever the layout: causal ``N <= max_len`` (the top-left block) or
        ``N == max_len``. Other N take the dense path, where ``_fit`` resamples (or rejects) the bias."""
        return 0 < self.window < tokens <= self.max_len and (self.causal or tokens == self.max_len)

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        if self.uses_band(tokens):
            return banded_flops(batch, tokens, self.hidden_dim, band_block(self.window), self.causal)
        return super().extra_flops(batch, tokens, layout)

    def _core(self, q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout) -> Tensor:
        n = k.shape[1]
        if not self.uses_band(n):
            return super()._core(q, k, v, layout)
        band = local_bias_band(n, band_block(self.window), self.u, self.v, self.w, self.causal).float()
        args = (q, k, v, band, self.window, self.outside == "zero", partial(self._bias_rows, n), self.causal)
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(aft_local_banded, *args, use_reentrant=False)
        return aft_local_banded(*args)

    def _bias_rows(self, n: int, t: Tensor, g: Tensor | None = None) -> Tensor:
        """Full rows ``w[t, :]`` (m, n), the future excluded when causal; only underflowed entries need them."""
        rows = self.position_bias(n)[t]
        return _mask_future(rows, t) if self.causal else rows


class AFTSimple(TokenMixer):
    """AFT-simple (paper §3.2): ``Y_t = sigmoid(Q_t) * Σ_t' softmax_t'(K)_t' V_t'``, O(T·d), any N.

    ``causal=True`` restricts the sum to t' <= t (and decodes incrementally from running sums,
    :class:`RunningSums`). ``return_aux=True`` gives ``aux["keys"]`` (B, N, hidden).
    """

    flops_label = "AFT"

    def __init__(self, dim: int, hidden_dim: int | None = None, causal: bool = False, qkv_bias: bool = True) -> None:
        super().__init__(dim)
        self.hidden_dim = hidden = hidden_dim or dim
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * hidden, bias=qkv_bias)
        self.proj = nn.Linear(hidden, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}, causal={self.causal}"

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        plain = type(self.qkv) is nn.Linear
        if plain and not (self.causal or return_aux or capturing_graph()) and _no_autograd(x, *self.parameters()):
            return self._mix_keys_first(x), {}
        qkv = fused_linear(self.qkv, x)
        with _no_autocast(x):
            if self.causal or capturing_graph():  # a captured graph differentiates the plain operations itself
                y = aft_simple(*qkv.float().chunk(3, -1), self.causal)
            else:
                y = aft_simple_qkv(qkv.float())
        out = fused_linear(self.proj, y.to(qkv.dtype)).to(x.dtype)
        return out, ({"keys": qkv.chunk(3, -1)[1]} if return_aux else {})

    def _mix_keys_first(self, x: Tensor) -> Tensor:
        """Non-causal AFT-simple without autograd: ``[K | V]`` projected, reduced to the context ``s`` and freed,
        then Q projected and gated in place. Q never coexists with K, V and ``e^K``: at most 3 activations alive
        instead of 5 (the fused projection, ``e^K``, the gate), the same speed on the CPU."""
        c = self.hidden_dim
        kv = linear_rows(self.qkv, x, c, 3 * c)
        dtype = kv.dtype  # the projections' (autocast's); the core runs in fp32
        with _no_autocast(x):
            s = _simple_context(*kv.float().chunk(2, -1))[0]
        del kv
        q = linear_rows(self.qkv, x, 0, c)
        with _no_autocast(x):
            y = q.float().sigmoid_().mul_(s)  # q's own buffer (or its fp32 copy)
        return fused_linear(self.proj, y.to(dtype)).to(x.dtype)

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        return aft_simple_flops(batch, tokens, self.hidden_dim)

    def init_state(self, batch: int, max_len: int, like: Tensor) -> RunningSums:
        return RunningSums()

    def step(self, x: Tensor, t: int, state: RunningSums) -> Tensor:
        return _decode_step(self, x, t, state)


class AFTConv(TokenMixer):
    """AFT-conv-h-s (paper Eq. 6) over the patch grid: h heads, one key channel per head (K: dim -> h),
    a 2-D ``s x s`` relative bias per head shared by the head's dim/h channels.

    The bias is re-parameterised per head (paper §3.2, Eq. 8):
    ``w^i = gamma_i (w^i - mean w^i) / sqrt(var w^i + eps) + beta_i`` with the population variance over
    the s x s entries, ``eps = 1e-8`` (guards s = 1; the raw ``w ~ N(0, 0.01²)`` has var 1e-4 >> eps,
    and the standardisation makes its scale otherwise irrelevant). ``gamma, beta`` start at 0, so at
    initialisation ``e^w - 1 = 0`` and AFT-conv is AFT-simple with each key repeated over its head.

    Ablations (docs/semantics.md, Decision A4): ``reparam=False`` uses the raw kernel ``w`` (paper Table 10; no
    gamma, beta); ``query=False`` drops the query term, ``Y = Σ ... / Σ ...`` without ``sigmoid(Q)``, and Q's
    projection with it (Table 12). ``outside="-inf"`` is the paper's global-connectivity ablation (w = -inf outside
    the window: a purely local operator). Needs ``layout.grid``; prefix tokens (class token) join the global sums only. Any grid size (the
    paper evaluates at 384 a model trained at 224). ``return_aux=True`` gives ``aux["keys"]`` (B, N, h).
    """

    needs_grid = True
    eps = 1e-8
    flops_label = "AFT"

    def __init__(
        self,
        dim: int,
        num_heads: int,
        kernel_size: int = 11,
        qkv_bias: bool = True,
        outside: str = "zero",
        reparam: bool = True,
        query: bool = True,
    ) -> None:
        super().__init__(dim)
        check_divisible("AFTConv", dim, num_heads)
        if outside not in ("zero", "-inf"):
            raise ValueError(f"AFTConv: outside must be 'zero' (global connectivity) or '-inf', got {outside!r}")
        self.outside = outside
        if kernel_size <= 0 or kernel_size % 2 == 0:
            raise ValueError(
                f"AFTConv: kernel_size must be a positive odd number (zero padding k//2), got {kernel_size}"
            )
        self.num_heads = num_heads
        self.kernel_size = kernel_size
        self.reparam = reparam
        self.query = query
        # fused [Q (dim, unless query=False) | K (num_heads) | V (dim)]
        self.qkv = nn.Linear(dim, qkv_width(dim, num_heads, query), bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.w = nn.Parameter(torch.randn(num_heads, kernel_size, kernel_size) * 0.01)
        self.gamma = nn.Parameter(torch.zeros(num_heads)) if reparam else None
        self.beta = nn.Parameter(torch.zeros(num_heads)) if reparam else None

    def no_weight_decay(self) -> set[str]:
        """The kernel and its re-parameterisation gains are not weight-decayed (decay would pull gamma to 0)."""
        return {"w", "gamma", "beta"} if self.reparam else {"w"}

    def extra_repr(self) -> str:
        ablations = ("" if self.reparam else ", reparam=False") + ("" if self.query else ", query=False")
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, kernel_size={self.kernel_size}, outside={self.outside!r}"
            + ablations
        )

    def position_bias(self) -> Tensor:
        """The re-parameterised bias w (h, s, s), fp32 (Eq. 8); the raw kernel when ``reparam=False``."""
        w = self.w.float()
        if not self.reparam:
            return w
        mean = w.mean((1, 2), keepdim=True)
        var = w.var((1, 2), unbiased=False, keepdim=True)
        return (
            self.gamma.float()[:, None, None] * (w - mean) * torch.rsqrt(var + self.eps)
            + self.beta.float()[:, None, None]
        )

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        """:func:`aft_conv_flops` on the layout's grid (without one, N x 1)."""
        grid = layout.grid if layout is not None and layout.grid is not None else (tokens, 1)
        return aft_conv_flops(
            batch, tokens, self.dim, self.num_heads, self.kernel_size, grid, self.outside == "zero", self.query
        )

    def effective_kernel(self) -> Tensor:
        """``exp(w) - 1`` per head (h, s, s): the relative weight the paper plots (Fig. 1)."""
        return torch.expm1(self.position_bias())

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        if self.outside == "-inf" and layout.num_prefix:
            raise ValueError("AFTConv(outside='-inf') has no pairs for prefix tokens: use it without a class token")
        qkv = fused_linear(self.qkv, x)  # [Q | K | V]: the core takes it fused (one gradient buffer)
        with _no_autocast(x):
            w = self.position_bias()
            y = aft_conv(qkv.float(), w, layout.grid, layout.num_prefix, self.outside == "zero", self.query)
        out = fused_linear(self.proj, y.to(qkv.dtype)).to(x.dtype)
        return out, ({"keys": split_qkv(qkv, self.num_heads, self.query)[1]} if return_aux else {})
