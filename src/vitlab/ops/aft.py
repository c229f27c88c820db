"""The AFT cores (paper Eq. 2 and 6), exact for keys and biases of any magnitude (decoding states: :mod:`.aft_decode`).

AFT replaces dot-product attention by a per-channel weighted average whose weights combine the keys with learned
pair-wise position biases::

    Y_t = sigmoid(Q_t) * sum_t' exp(K_t' + w[t, t']) V_t' / sum_t' exp(K_t' + w[t, t'])

The cores (:func:`aft_full`, :func:`aft_local_banded`, :func:`aft_simple`, :func:`aft_conv`) take fp32 ``q, k, v``
and never form a ``(B, T, T, d)`` tensor: AFT-full/local are two matrix products with ``exp(w)``, AFT-simple is
O(T·d), AFT-conv is a depth-wise convolution plus sums outside the window (no cancellation, unlike the literal
``e^w - 1`` form). They subtract maxima before every exponential; an entry whose shifted denominator still
underflows (possible when the maxima of K and of w sit at different t', or with causal cumulative sums) is
recomputed exactly by a per-entry log-sum-exp in float64 (:func:`_exact_entries`). In normal use no entry takes
that path, and non-causal AFT-full skips even the check on the denominators when its bias rows are too narrow for
any to underflow (:func:`_bias_bounds_sums`; one reduction over the (T, T) bias instead of one over the (B, T, C)
sums). Under ``torch.compile`` the check and the repair are branch-free (:func:`_repair_compiled`), so a
compiled block stays one graph.

Fast paths (:mod:`vitlab.ops.switch`): without autograd the sums are formed in place (and in bands of bias rows at
long sequences on the CPU); AFT-simple's and AFT-conv's eager cores have closed-form backward passes
(:mod:`vitlab.ops.aft_simple`, :mod:`vitlab.ops.aft_conv`). With the switch off the composite forms run.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from .aft_banded import banded_sums
from .aft_conv import AFTConvCore, conv_core, kernel_and_scale, split_qkv, window_band
from .aft_simple import aft_simple_qkv, context
from .switch import capturing_graph, eager_fast_path, fx_tracing, no_autograd, traced_or_exported

# Every max-shifted weight is <= 1. A shifted denominator >= 1e-20 is a sum whose contributing terms are products
# of normal fp32 factors (accurate); below it the leading terms may have underflowed: the entry is recomputed.
_UNDERFLOW = 1e-20
# A shifted denominator holds, for every channel, the term of the key's maximum: e^{w[t, t'] - rowmax_t} >=
# e^{-(rowmax_t - rowmin_t)}. Bias rows spanning less than this cannot underflow it (e^-40 = 4e-18 >> _UNDERFLOW)
_SAFE_SPAN = 40.0
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
    return torch.cat(out).to(torch.promote_types(k.dtype, torch.float32))  # bf16 keys (GPU kernels): fp32 results


def _ratio(num: Tensor, den: Tensor, k: Tensor, v: Tensor, bias_rows: BiasRows, may_underflow: bool = True) -> Tensor:
    """``num / den`` (num (B, Tq, G, R), den (B, Tq, G) at Tq query positions) with underflowed entries recomputed
    exactly (:func:`_exact_entries`) from the keys ``k`` (B, T, G), values ``v`` (B, T, G, R) and the bias rows
    ``bias_rows(t, g)`` of query positions t. ``may_underflow=False``: the caller has proved every ``den`` >=
    :data:`_UNDERFLOW` (:func:`_bias_bounds_sums`), the plain quotient."""
    if not may_underflow:
        return num.div_(den.unsqueeze(-1)) if no_autograd(num, den) else num / den.unsqueeze(-1)
    checks = _data_checks_allowed(den)
    eager = checks and not torch.compiler.is_compiling()
    # the one check the fast path pays; the clamp only where it found entries, which are replaced below (the clamp
    # keeps their zero gradient finite)
    idx = (den.detach() < _UNDERFLOW).nonzero(as_tuple=True) if eager and den.detach().amin() < _UNDERFLOW else None
    if eager and no_autograd(num, den):  # in place: no buffer beside the sums
        if idx is None:
            return num.div_(den.unsqueeze(-1))
        y = num.div_(den.clamp_min_(_UNDERFLOW).unsqueeze(-1))
        return y.index_put_(idx, _exact_entries(k, v, bias_rows, *idx))
    den_safe = den.clamp_min(_UNDERFLOW).unsqueeze(-1)
    y = num.div_(den_safe) if no_autograd(num) else num / den_safe
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


def _bias_bounds_sums(w: Tensor, sums: Tensor, causal: bool) -> bool:
    """Whether the bias ``w`` (T, T) alone proves that no shifted denominator of AFT-full underflows: every row spans
    less than :data:`_SAFE_SPAN`, whatever the keys. Asked in eager mode, non-causal (masked pairs are -inf), and
    only where ``w`` has no more elements than the denominators ``sums``, whose own check it replaces."""
    if causal or not _data_checks_allowed(w) or torch.compiler.is_compiling() or w.numel() > sums.numel():
        return False
    w = w.detach()
    return bool((w.amax(-1) - w.amin(-1)).amax() < _SAFE_SPAN)  # -inf, inf or nan anywhere: False


def _data_checks_allowed(t: Tensor) -> bool:
    """Whether a data-dependent branch may run: not on the meta device (MAC counting) and not while a graph is
    traced or exported (TorchScript trace, ONNX), which records the fast path only."""
    return not fx_tracing() and t.device.type != "meta" and not traced_or_exported()


def _gate(q: Tensor, y: Tensor) -> Tensor:
    """``sigmoid(Q) ⊙ Y``, the output gate of every AFT core (in place on the sigmoid without autograd)."""
    return torch.sigmoid(q).mul_(y) if no_autograd(q, y) else torch.sigmoid(q) * y


def _key_context(k: Tensor, v: Tensor) -> Tensor:
    """``[e^{K - colmax} ⊙ V, e^{K - colmax}]`` (B, T, 2C), the right-hand side of AFT-full's two sums under
    autograd."""
    ek = (k - k.detach().amax(1, keepdim=True)).exp()
    return torch.cat([ek * v, ek], -1)


def _bias_weights(w: Tensor, start: int, stop: int, causal: bool) -> Tensor:
    """``e^{w[t, t'] - max_t' w[t, t']}`` for the query rows t = start .. stop-1 of ``w`` (T, T); causal: pairs
    t' > t are 0 and the columns stop at ``stop`` (the rest would be 0 too)."""
    # the whole table as is, not w[0:T]: a slice's backward pass allocates a zero (T, T) matrix and copies into it
    # (torch.fx: the sizes are symbols, no values to compare; the graph records the slice)
    whole = not fx_tracing() and start == 0 and stop == w.shape[0]
    rows = w if whole else w[start:stop, :stop] if causal else w[start:stop]
    if causal:
        rows = mask_future(rows, torch.arange(start, stop, device=w.device))
    # the ratio does not depend on the shifts, so they carry no gradient
    top = rows.detach().amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    # exp in place on a fresh difference (autograd saves the result either way); causal rows are the mask's fresh
    # output, whose backward pass needs only the mask: shifted in place too, one (T, T) buffer fewer
    shifted = rows.sub_(top) if causal else rows - top
    return shifted.exp_()


# AFT-full without autograd forms ``e^{w - rowmax}`` a band of about this many elements (4 MB) at a time: the whole
# (T, T) matrix is the mixer's largest tensor at long sequences (64 MB at T = 4096, 16x its activations). Bands of
# 1 MB cost time in more, smaller products: inference against the community AFT code side by side (fresh
# processes, d = 256, 2 threads; docs/performance.md) went from 0.84x to 1.00x its speed at T = 1024 (one band) and
# from 1.21x to 1.37x at T = 4096 (bands of 256 rows) when the bands grew from 1 MB to 4 MB
_BIAS_BAND_ELEMS = 1 << 20


def one_band(tokens: int) -> bool:
    """Whether inference forms the bias weights of ``tokens`` tokens in one piece (:func:`_weighted_sums`)."""
    return tokens * tokens <= _BIAS_BAND_ELEMS


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
    if one_band(n) or capturing_graph() or k.device.type != "cpu":
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
    if no_autograd(q, k, v, w):
        num, den = _weighted_sums(w, k, v, causal)
    else:  # one (T, T) @ (T, B·2C) product for numerator and denominator (a faster backward)
        ctx = _key_context(k, v).transpose(0, 1).reshape(n, b * 2 * c)
        num, den = (_bias_weights(w, 0, n, causal) @ ctx).view(n, b, 2 * c).transpose(0, 1).split(c, -1)
    rows = (lambda t, g: mask_future(w[t], t)) if causal else (lambda t, g: w[t])
    bounded = _bias_bounds_sums(w, den, causal)
    y = _ratio(num.unsqueeze(-1), den, k, v.unsqueeze(-1), rows, may_underflow=not bounded)
    return _gate(q, y.squeeze(-1))


def linear_transposed(linear: torch.nn.Linear, x: Tensor) -> Tensor:
    """``linear(x)`` transposed, ``W xᵀ + b`` (out_features, M) for rows ``x`` (M, in_features): one product, the
    transpose read in place by the BLAS, each output feature a contiguous row of M values, as
    :func:`aft_full_channels` takes its projection. For a plain ``nn.Linear`` on aten's product."""
    if linear.bias is None:
        return torch.mm(linear.weight, x.t())
    return torch.addmm(linear.bias.unsqueeze(1), linear.weight, x.t())


def aft_full_channels(qkv_t: Tensor, batch: int, w: Tensor, causal: bool = False) -> Tensor | None:
    """AFT-full's core (paper Eq. 2) without autograd on a channel-major projection: ``qkv_t`` (3C, B·T) holds
    ``[Qᵀ; Kᵀ; Vᵀ]``, each channel's B·T token values in one row (:func:`linear_transposed`), and
    is consumed in place. Returns ``Yᵀ`` (C, B·T), a view of the rows of Q, or None when a shifted denominator
    underflowed (the caller then runs :func:`aft_full`, which recomputes those entries exactly).

    With K and V as rows of T tokens, ``e^{K - rowmax}`` and ``e^{K - rowmax} ⊙ V`` are formed in place as one
    (2·C·B, T) matrix and both sums come from one product with ``(e^{w - rowmax})ᵀ``; every pass reads contiguous
    rows. The token-major core instead reads Q, K and V as strided columns of the fused projection and makes two
    batched products of B small ones (AFT-full inference against the community code, d = 256, fresh processes,
    docs/performance.md: 0.92 -> 0.96 of its speed at T = 197, batch 8; 1.00 -> 1.04 at T = 1024, batch 2)."""
    c, n = qkv_t.shape[0] // 3, w.shape[0]
    q, kv = qkv_t[:c], qkv_t[c:].view(2, c * batch, n)
    ek, ekv = kv[0], kv[1]
    ek.sub_(ek.amax(-1, keepdim=True)).exp_()
    ekv.mul_(ek)
    sums = torch.mm(kv.view(2 * c * batch, n), _bias_weights(w, 0, n, causal).t())  # [den; num], column t
    den, num = sums[: c * batch], sums[c * batch :]
    if not _bias_bounds_sums(w, den, causal) and den.amin() < _UNDERFLOW:
        return None
    return num.div_(den).view(c, -1).mul_(q.sigmoid_())


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
    :func:`~vitlab.ops.aft_banded.band_positions` with ``b >= window``; ``bias_rows(t, g)`` the full rows
    of the effective bias (future -inf when causal) for the exact fallback of underflowed entries
    (:func:`_ratio`). The sums are :func:`~vitlab.ops.aft_banded.banded_sums`.
    """
    num, den = banded_sums(k, v, w_band, window, outside_zero, causal)
    y = _ratio(num.unsqueeze(-1), den, k, v.unsqueeze(-1), bias_rows)
    return _gate(q, y.squeeze(-1))


def mask_future(rows: Tensor, t: Tensor) -> Tensor:
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
    y = _ratio(num.unsqueeze(-1), den, k, v.unsqueeze(-1), lambda t, g: mask_future(k.new_zeros(len(t), k.shape[1]), t))
    return _gate(q, y.squeeze(-1))


def aft_simple_fused(qkv: Tensor, causal: bool = False) -> Tensor:
    """:func:`aft_simple` from the fused projection ``qkv`` (B, T, 3C) = ``[Q | K | V]``: non-causal and eager with
    the fast paths on, :func:`~vitlab.ops.aft_simple.aft_simple_qkv` (the gradient of ``qkv`` in one buffer);
    otherwise the composite form on its three views, which a captured graph differentiates itself."""
    if causal or not eager_fast_path():
        q, k, v = qkv.chunk(3, -1)  # unpacked by name: torch.fx cannot star-unpack a symbol
        return aft_simple(q, k, v, causal)
    return aft_simple_qkv(qkv)


def aft_simple_context(k: Tensor, v: Tensor) -> Tensor:
    """AFT-simple's context vector ``s = Σ_t softmax_t(K) V_t`` (B, 1, C) from keys and values (B, T, C)."""
    return context(k, v)[0]


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

    In eager mode the sums are the operator of :mod:`~vitlab.ops.aft_conv` on the token-major key
    context, under autograd :class:`~vitlab.ops.aft_conv.AFTConvCore` (closed-form backward, the
    gradient of ``qkv`` in one buffer). Should a denominator underflow there, the call is recomputed by
    :func:`_aft_conv_composite`, which repairs those entries exactly (:func:`_ratio`); graphs being captured
    (compile, trace, ONNX) and the meta device take that composite form directly.
    """
    if not global_context and num_prefix:
        raise ValueError("aft_conv: global_context=False has no pairs for prefix tokens; use num_prefix=0")
    if not eager_fast_path() or qkv.device.type == "meta":
        return _aft_conv_composite(qkv, w, grid, num_prefix, global_context, query)
    args = (qkv, w, grid, num_prefix, global_context, query, _UNDERFLOW)
    out, den_min = conv_core(*args) if no_autograd(qkv, w) else AFTConvCore.apply(*args)
    if den_min < _UNDERFLOW:  # keys or biases of extreme magnitude: the composite form repairs
        return _aft_conv_composite(qkv, w, grid, num_prefix, global_context, query)
    return out


# ``patch_sums(x, x_pre, kernel, scale, per_chan, grid)``: L(x) of the patches (B, H·W, C + h) of
# :func:`_aft_conv_composite`; ``per_chan`` (C + h,) is the head of each channel of the key context
PatchSums = Callable[[Tensor, Tensor, Tensor, Tensor | None, Tensor, tuple[int, int]], Tensor]


def _conv_patch_sums(
    x: Tensor, x_pre: Tensor, kernel: Tensor, scale: Tensor | None, per_chan: Tensor, grid: tuple[int, int]
) -> Tensor:
    """AFT-conv's sums of the patches (B, H·W, C + h) from their key context ``x`` (B, H·W, C + h) and the prefix
    tokens' ``x_pre`` (B, P, C + h): the window's depth-wise convolution with ``kernel`` (h, s, s) plus ``scale``
    (h,) times the sum outside the window and over the prefix (None: the window only)."""
    b, _, cx = x.shape
    s = kernel.shape[-1]
    x_grid = x.transpose(1, 2).reshape(b, cx, *grid)
    nd = F.conv2d(x_grid, kernel[per_chan].unsqueeze(1), padding=s // 2, groups=cx)  # (B, C + h, H, W)
    if scale is not None:
        outside = _outside_window_sum(x_grid, s) + x_pre.sum(1)[..., None, None]
        nd = nd + scale[per_chan][:, None, None] * outside
    return nd.flatten(2).transpose(1, 2)


def _aft_conv_composite(
    qkv: Tensor,
    w: Tensor,
    grid: tuple[int, int],
    num_prefix: int,
    global_context: bool,
    query: bool,
    patch_sums: PatchSums = _conv_patch_sums,
) -> Tensor:
    """:func:`aft_conv` as composite operations on token-major ``(B, N, C + h)`` key contexts: what autograd
    differentiates and graph capture records, with the exact repair of underflowed entries (:func:`_ratio`).
    ``patch_sums`` forms the patches' sums (the GPU kernels: :func:`vitlab.ops.triton_aft_conv.aft_conv_triton`)."""
    h = w.shape[0]
    q, k, v = split_qkv(qkv, h, query)
    b, n, c = v.shape
    r = c // h
    ek = (k - k.detach().amax(1, keepdim=True)).exp()  # (B, N, h)
    x = torch.cat([(ek.unsqueeze(-1) * v.view(b, n, h, r)).flatten(2), ek], -1)  # (B, N, C + h)
    kernel, scale = kernel_and_scale(w, global_context)  # (h, s, s) <= 1; e^{-m} (h,) or None
    per_chan = torch.cat([torch.arange(h, device=w.device).repeat_interleave(r), torch.arange(h, device=w.device)])
    nd = patch_sums(x[:, num_prefix:], x[:, :num_prefix], kernel, scale, per_chan, grid)  # (B, H·W, C + h)
    if num_prefix:  # (only with the global context) every prefix token's sums: all tokens, weighted e^{-m}
        prefix = scale[per_chan] * x.sum(1, keepdim=True).expand(b, num_prefix, c + h)
        nd = torch.cat([prefix, nd], 1)  # (B, N, C + h)
    rows = partial(_conv_bias_rows, w, grid, num_prefix, n, 0.0 if global_context else float("-inf"))
    y = _ratio(nd[..., :c].view(b, n, h, r), nd[..., c:], k, v.view(b, n, h, r), rows)
    return y.reshape(b, n, c) if q is None else _gate(q, y.reshape(b, n, c))
