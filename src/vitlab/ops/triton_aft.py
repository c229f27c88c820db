"""AFT-full and AFT-local (paper Eq. 2) as Triton kernels, forward and backward, causal and not.

The kernels compute the two max-shifted sums of Eq. 2 for every query t and channel c::

    num[t, c] = Σ_t' e^{w[t,t'] - m_t} e^{K[t',c] - k_c} V[t', c],     den[t, c] = Σ_t' e^{w[t,t'] - m_t} e^{K[t',c] - k_c}

with ``k_c`` the keys' maximum over the tokens and ``m_t`` the maximum of the query's bias row (the shifts cancel in
``num / den``), tile by tile: a program owns a tile of queries, a batch row and a block of channels, forms each
(queries x keys) tile of the bias from the factors ``u vᵀ`` (paper Eq. 7; one product in fp32, no tile of w is ever
stored) or reads it from the table ``w``, raises ``m_t`` as the tiles go (rescaling the running sums, as flash
attention does) and adds ``e^{w - m} @ [e^{K-k} ⊙ V, e^{K-k}]`` with ``tl.dot``. Causal: only the key tiles
t' <= t are visited. AFT-local (``window`` s): only the key tiles that meet the band ``|t - t'| < s`` are visited;
in them the pairs outside the band carry w = 0 (or are excluded, the -inf ablation); the keys of the tiles not
visited enter with weight ``e^{-m_t}`` through prefix (and suffix) sums over the tokens formed outside the kernel
(:func:`_far_sums`), with ``m_t >= 0`` for every row that has such pairs. O(T·s·C) for AFT-local, O(T²·C) for
AFT-full, O(T·C) memory in both.

The ratio, the exact float64 recomputation of the rare underflowed denominators and the gate are those of
:mod:`vitlab.ops.aft` (:func:`~vitlab.ops.aft._ratio`), so the results are exact in the same sense as the CPU
cores. Backward, with ``gn, gd`` the gradients of ``num, den`` and ``a = e^{w - m}``, ``e = e^{K - k}``::

    ∂/∂V = e ⊙ (aᵀ gn),   ∂/∂K = e ⊙ (V ⊙ aᵀ gn + aᵀ gd),   ∂/∂w = a ⊙ Σ_b (gn (e ⊙ V)ᵀ + gd eᵀ)

(``∂/∂u = ∂/∂w v``, ``∂/∂v = ∂/∂wᵀ u``, accumulated tile by tile). The products' precisions: :func:`_precisions`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from .aft import _gate, _ratio, mask_future
from .triton_support import launch

_PAD = tl.constexpr(-1.0e30)  # the running maximum of a row before any pair: finite, so that _PAD - _PAD is 0, not NaN
_INF = float("inf")


@triton.jit
def _key_tiles(i, T, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLK: tl.constexpr):
    """The key tiles [j0, j1) that query tile i visits (:func:`visited_tokens` is the same rule in Python)."""
    lo = 0
    hi = T
    if CAUSAL:
        hi = tl.minimum(T, (i + 1) * BLK)
    if WINDOW:
        lo = tl.maximum(0, i * BLK - window + 1)
        if not CAUSAL:
            hi = tl.minimum(T, (i + 1) * BLK + window - 1)
    return lo // BLK, (hi + BLK - 1) // BLK


def visited_tokens(i: int, n: int, window: int, causal: bool, blk: int) -> tuple[int, int]:
    """The key tokens [lo, hi) in the tiles query tile i visits: the rule of ``_key_tiles``, in token units."""
    lo, hi = 0, min(n, (i + 1) * blk) if causal else n
    if window:
        lo = max(0, i * blk - window + 1)
        hi = hi if causal else min(n, (i + 1) * blk + window - 1)
    return lo // blk * blk, min(n, -(-hi // blk) * blk)


@triton.jit
def _bias(U, VB, W, t, tk, T, R, u_s, v_s, w_s, window,
          CAUSAL: tl.constexpr, WINDOW: tl.constexpr, OUTSIDE_ZERO: tl.constexpr, FACTORED: tl.constexpr,
          BR: tl.constexpr, BIAS_PREC: tl.constexpr):  # fmt: skip
    """The effective bias of the (queries t x keys tk) tile (-inf = pair excluded), and which pairs carry w."""
    valid = (t[:, None] < T) & (tk[None, :] < T)
    if FACTORED:  # u vᵀ over the rank in blocks of BR: a block of each factor's rows in shared memory, not all R
        w = tl.zeros(valid.shape, tl.float32)
        for r0 in range(0, R, BR):
            r = r0 + tl.arange(0, BR)
            u = tl.load(U + t[:, None] * u_s + r[None, :], mask=(t[:, None] < T) & (r[None, :] < R), other=0.0)
            vb = tl.load(VB + tk[:, None] * v_s + r[None, :], mask=(tk[:, None] < T) & (r[None, :] < R), other=0.0)
            w += tl.dot(u.to(tl.float32), tl.trans(vb.to(tl.float32)), input_precision=BIAS_PREC)
    else:
        w = tl.load(W + t[:, None] * w_s + tk[None, :], mask=valid, other=0.0).to(tl.float32)
    if CAUSAL:
        valid = valid & (tk[None, :] <= t[:, None])
    carries = valid
    if WINDOW:
        lag = t[:, None] - tk[None, :]
        carries = valid & (lag < window) & (lag > -window)
        w = tl.where(carries, w, 0.0 if OUTSIDE_ZERO else -float("inf"))
    return tl.where(valid, w, -float("inf")), carries


@triton.jit
def _kv_tile(K, V, KMAX, kv_b, kv_t, b, tk, c, T, C):
    """``e^{K - k}`` and ``V`` (keys tk x channels c, fp32) of batch row b; 0 outside the tensors."""
    mask = (tk[:, None] < T) & (c[None, :] < C)
    at = b * kv_b + tk[:, None] * kv_t + c[None, :]
    kmax = tl.load(KMAX + b * C + c, mask=c < C, other=0.0)
    k = tl.load(K + at, mask=mask, other=-float("inf")).to(tl.float32)
    return tl.exp(k - kmax[None, :]), tl.load(V + at, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _sums_fwd(K, V, KMAX, U, VB, W, FAR_N, FAR_D, NUM, DEN, SHIFT,
              kv_b, kv_t, u_s, v_s, w_s, T, C, R, window, n_tiles,
              CAUSAL: tl.constexpr, WINDOW: tl.constexpr, OUTSIDE_ZERO: tl.constexpr, FACTORED: tl.constexpr,
              BLK: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr, BIAS_PREC: tl.constexpr):  # fmt: skip
    i, b, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = i * BLK + tl.arange(0, BLK)
    c = cb * BC + tl.arange(0, BC)
    m = tl.full((BLK,), _PAD, tl.float32)
    if OUTSIDE_ZERO and WINDOW:  # rows with pairs outside the window weigh them e^{0 - m}: m >= 0
        far = t >= window
        if not CAUSAL:
            far = far | (t + window <= T - 1)
        m = tl.where(far, 0.0, _PAD)
    acc_n = tl.zeros((BLK, BC), tl.float32)
    acc_d = tl.zeros((BLK, BC), tl.float32)
    j0, j1 = _key_tiles(i, T, window, CAUSAL, WINDOW, BLK)
    for j in range(j0, j1):
        tk = j * BLK + tl.arange(0, BLK)
        w, _ = _bias(
            U, VB, W, t, tk, T, R, u_s, v_s, w_s, window, CAUSAL, WINDOW, OUTSIDE_ZERO, FACTORED, BR, BIAS_PREC
        )
        m_new = tl.maximum(m, tl.max(w, 1))
        alpha = tl.exp(m - m_new)
        a = tl.exp(w - m_new[:, None])
        e, v = _kv_tile(K, V, KMAX, kv_b, kv_t, b, tk, c, T, C)
        acc_n = acc_n * alpha[:, None] + tl.dot(a, e * v, input_precision=PREC)
        acc_d = acc_d * alpha[:, None] + tl.dot(a, e, input_precision=PREC)
        m = m_new
    if OUTSIDE_ZERO and WINDOW:  # the tokens of the tiles not visited: outside every row's window, w = 0
        scale = tl.exp(-tl.maximum(m, 0.0))[:, None]  # (rows without such pairs have far sums 0 and m < 0)
        at = (b * n_tiles + i) * C + c
        acc_n += scale * tl.load(FAR_N + at, mask=c < C, other=0.0)[None, :]
        acc_d += scale * tl.load(FAR_D + at, mask=c < C, other=0.0)[None, :]
    mask = (t[:, None] < T) & (c[None, :] < C)
    out = (b * T + t[:, None]) * C + c[None, :]
    tl.store(NUM + out, acc_n, mask=mask)
    tl.store(DEN + out, acc_d, mask=mask)
    if (b == 0) & (cb == 0):  # every program of the query tile has the same row maxima
        tl.store(SHIFT + t, m, mask=t < T)


@triton.jit
def _sums_bwd_kv(K, V, KMAX, U, VB, W, SHIFT, GN, GD, GK, GV,
                 kv_b, kv_t, u_s, v_s, w_s, T, C, R, window, n_tiles,
                 CAUSAL: tl.constexpr, WINDOW: tl.constexpr, OUTSIDE_ZERO: tl.constexpr, FACTORED: tl.constexpr,
                 BLK: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr, BIAS_PREC: tl.constexpr):  # fmt: skip
    j, b, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tk = j * BLK + tl.arange(0, BLK)
    c = cb * BC + tl.arange(0, BC)
    s_n = tl.zeros((BLK, BC), tl.float32)  # aᵀ gn and aᵀ gd of this key tile
    s_d = tl.zeros((BLK, BC), tl.float32)
    for i in range(0, n_tiles):
        j0, j1 = _key_tiles(i, T, window, CAUSAL, WINDOW, BLK)
        if (j >= j0) & (j < j1):
            t = i * BLK + tl.arange(0, BLK)
            w, _ = _bias(
                U, VB, W, t, tk, T, R, u_s, v_s, w_s, window, CAUSAL, WINDOW, OUTSIDE_ZERO, FACTORED, BR, BIAS_PREC
            )
            a = tl.exp(w - tl.load(SHIFT + t, mask=t < T, other=0.0)[:, None])
            mask = (t[:, None] < T) & (c[None, :] < C)
            at = (b * T + t[:, None]) * C + c[None, :]
            a_t = tl.trans(a)
            s_n += tl.dot(a_t, tl.load(GN + at, mask=mask, other=0.0), input_precision=PREC)
            s_d += tl.dot(a_t, tl.load(GD + at, mask=mask, other=0.0), input_precision=PREC)
    e, v = _kv_tile(K, V, KMAX, kv_b, kv_t, b, tk, c, T, C)
    mask = (tk[:, None] < T) & (c[None, :] < C)
    out = (b * T + tk[:, None]) * C + c[None, :]
    tl.store(GV + out, e * s_n, mask=mask)
    tl.store(GK + out, e * (v * s_n + s_d), mask=mask)


@triton.jit
def _sums_bwd_w(K, V, KMAX, U, VB, W, SHIFT, GN, GD, GU, GVB, GW,
                kv_b, kv_t, u_s, v_s, w_s, T, C, R, window, B,
                CAUSAL: tl.constexpr, WINDOW: tl.constexpr, OUTSIDE_ZERO: tl.constexpr, FACTORED: tl.constexpr,
                BLK: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr, BIAS_PREC: tl.constexpr):  # fmt: skip
    i, j = tl.program_id(0), tl.program_id(1)
    j0, j1 = _key_tiles(i, T, window, CAUSAL, WINDOW, BLK)
    if (j >= j0) & (j < j1):
        t = i * BLK + tl.arange(0, BLK)
        tk = j * BLK + tl.arange(0, BLK)
        w, carries = _bias(
            U, VB, W, t, tk, T, R, u_s, v_s, w_s, window, CAUSAL, WINDOW, OUTSIDE_ZERO, FACTORED, BR, BIAS_PREC
        )
        a = tl.exp(w - tl.load(SHIFT + t, mask=t < T, other=0.0)[:, None])
        g = tl.zeros((BLK, BLK), tl.float32)  # Σ_b (gn (e ⊙ V)ᵀ + gd eᵀ)
        for b in range(0, B):
            for c0 in range(0, C, BC):
                c = c0 + tl.arange(0, BC)
                e, v = _kv_tile(K, V, KMAX, kv_b, kv_t, b, tk, c, T, C)
                mask = (t[:, None] < T) & (c[None, :] < C)
                at = (b * T + t[:, None]) * C + c[None, :]
                g += tl.dot(tl.load(GN + at, mask=mask, other=0.0), tl.trans(e * v), input_precision=PREC)
                g += tl.dot(tl.load(GD + at, mask=mask, other=0.0), tl.trans(e), input_precision=PREC)
        gw = tl.where(carries, a * g, 0.0)
        if FACTORED:  # ∂/∂u = ∂/∂w v, ∂/∂v = ∂/∂wᵀ u, summed over the key (query) tiles by atomic adds
            for r0 in range(0, R, BR):
                r = r0 + tl.arange(0, BR)
                u_at, v_at = (t[:, None] < T) & (r[None, :] < R), (tk[:, None] < T) & (r[None, :] < R)
                u = tl.load(U + t[:, None] * u_s + r[None, :], mask=u_at, other=0.0)
                vb = tl.load(VB + tk[:, None] * v_s + r[None, :], mask=v_at, other=0.0)
                gu = tl.dot(gw, vb.to(tl.float32), input_precision=BIAS_PREC)
                gv = tl.dot(tl.trans(gw), u.to(tl.float32), input_precision=BIAS_PREC)
                tl.atomic_add(GU + t[:, None] * R + r[None, :], gu, mask=u_at)
                tl.atomic_add(GVB + tk[:, None] * R + r[None, :], gv, mask=v_at)
        else:
            tl.store(GW + t[:, None] * T + tk[None, :], gw, mask=(t[:, None] < T) & (tk[None, :] < T))


def _blocks(k: Tensor, r: int) -> tuple[int, int, int]:
    """Token tile, channel block and bias-rank block (``tl.dot`` needs at least 16 of each; at most 64 of the
    rank: the factors' whole rows of rank 256 asked 256 KiB of shared memory, unpipelined, for sm_90's 227); the
    interpreter (CPU tensors) takes the smallest, so that the tests' short sequences and ranks span several."""
    n, c = k.shape[1:]
    cpu = k.device.type == "cpu"
    blk = 64 if n > 32 and not cpu else 16
    return blk, min(64, max(16, triton.next_power_of_2(c))), 16 if cpu else min(64, max(16, triton.next_power_of_2(r)))


def _precisions(k: Tensor) -> dict[str, str]:
    """``tl.dot``'s input precision: for the bias, fp32-accurate (3 TF32 passes on the GPU: a bias of magnitude
    1e4 must keep its units); for the sums, the same for fp32 and fp64 inputs and one TF32 pass for bf16/fp16
    inputs (whose own rounding is coarser; a float64 model on one pass was 1.5e-4 off its CPU twin on an H200).
    The interpreter computes in full fp32 whatever the name."""
    if k.device.type != "cuda":
        return {"PREC": "ieee", "BIAS_PREC": "ieee"}
    low = k.dtype in (torch.bfloat16, torch.float16)
    return {"PREC": "tf32" if low else "tf32x3", "BIAS_PREC": "tf32x3"}


class _Config:
    """One call's shapes, strides and compile-time flags, shared by its three kernels."""

    def __init__(self, k: Tensor, u: Tensor | None, vb: Tensor | None, w: Tensor | None, causal: bool,
                 window: int, outside_zero: bool) -> None:  # fmt: skip
        n, c = k.shape[1:]
        self.far = window > 0 and outside_zero
        self.blk, self.bc, br = _blocks(k, 1 if u is None else u.shape[1])
        self.tiles = (u, vb, u) if w is None else (w, w, w)  # U, VB, W (the absent ones point at a present one)
        u_s, v_s = (0, 0) if u is None else (u.stride(0), vb.stride(0))
        w_s, r = (0, u.shape[1]) if w is None else (w.stride(0), 1)
        self.args = (k.stride(0), k.stride(1), u_s, v_s, w_s, n, c, r, window)
        self.n_tiles = triton.cdiv(n, self.blk)
        self.flags = dict(CAUSAL=causal, WINDOW=window > 0, OUTSIDE_ZERO=outside_zero, FACTORED=w is None,
                          BLK=self.blk, BC=self.bc, BR=br, **_precisions(k))  # fmt: skip

    def grid(self, b: int, c: int) -> tuple[int, int, int]:
        return self.n_tiles, b, triton.cdiv(c, self.bc)


class _BiasedSums(torch.autograd.Function):
    """``(num, den, m)`` of this module's docstring from keys and values (B, T, C) and the bias (factors or table)."""

    @staticmethod
    def forward(ctx, k, v, kmax, u, vb, w, causal, window, outside_zero):
        b, n, c = k.shape
        cfg = _Config(k, u, vb, w, causal, window, outside_zero)
        num = k.new_empty(b, n, c, dtype=torch.float32)
        den, shift = torch.empty_like(num), k.new_empty(n, dtype=torch.float32)
        far = _far_sums(k, v, kmax, cfg) if cfg.far else (num, num)
        launch(_sums_fwd, cfg.grid(b, c), k, v, kmax, *cfg.tiles, *far, num, den, shift, *cfg.args, cfg.n_tiles,
               **cfg.flags)  # fmt: skip
        ctx.cfg = cfg
        ctx.save_for_backward(k, v, kmax, u, vb, w, shift)
        ctx.mark_non_differentiable(shift)
        return num, den, shift

    @staticmethod
    @once_differentiable
    def backward(ctx, g_num, g_den, _):
        k, v, kmax, u, vb, w, shift = ctx.saved_tensors
        cfg, (b, n, c) = ctx.cfg, k.shape
        g_num, g_den = (shift.new_zeros(b, n, c) if g is None else g.float().contiguous() for g in (g_num, g_den))
        gk, gv = torch.empty_like(g_num), torch.empty_like(g_num)
        launch(_sums_bwd_kv, cfg.grid(b, c), k, v, kmax, *cfg.tiles, shift, g_num, g_den, gk, gv, *cfg.args,
               cfg.n_tiles, **cfg.flags)  # fmt: skip
        gu = gvb = gw = None
        if w is None:
            gu, gvb = torch.zeros(u.shape, device=k.device), torch.zeros(vb.shape, device=k.device)
        else:
            gw = torch.zeros(n, n, device=k.device)
        outs = (gu, gvb, gu) if w is None else (gw, gw, gw)
        launch(_sums_bwd_w, (cfg.n_tiles, cfg.n_tiles), k, v, kmax, *cfg.tiles, shift, g_num, g_den, *outs,
               *cfg.args, b, **cfg.flags)  # fmt: skip
        if cfg.far:
            _add_far_grads(gk, gv, k, v, kmax, g_num, g_den, shift, cfg)
        grads = (gk, gv, None, gu, gvb, gw)
        like = (k, v, None, u, vb, w)
        return *(None if g is None else g.to(x.dtype) for g, x in zip(grads, like)), None, None, None


def _visited_ranges(n: int, cfg: _Config, device: torch.device) -> tuple[Tensor, Tensor]:
    """(tiles,) the first and one-past-last key token of the tiles each query tile visits."""
    ranges = [visited_tokens(i, n, cfg.args[-1], cfg.flags["CAUSAL"], cfg.blk) for i in range(cfg.n_tiles)]
    return tuple(torch.tensor(x, device=device) for x in zip(*ranges))


def _far_sums(k: Tensor, v: Tensor, kmax: Tensor, cfg: _Config) -> tuple[Tensor, Tensor]:
    """For every query tile, the sums of ``e^{K-k} V`` and ``e^{K-k}`` (B, tiles, C) over the key tokens of the
    tiles it does not visit (all outside its rows' windows): a prefix sum over the tokens before them and,
    non-causal, a suffix sum over those after them (sums of non-negative terms: nothing cancels)."""
    n, c = k.shape[1:]
    e = (k.float() - kmax[:, None]).exp()
    ctx = torch.cat([e * v.float(), e], -1)  # (B, T, 2C)
    lo, hi = _visited_ranges(n, cfg, k.device)
    far = F.pad(ctx.cumsum(1), (0, 0, 1, 0))[:, lo]  # Σ_{t' < lo}
    if not cfg.flags["CAUSAL"]:
        far = far + F.pad(ctx.flip(1).cumsum(1).flip(1), (0, 0, 0, 1))[:, hi]  # Σ_{t' >= hi}
    return far[..., :c].contiguous(), far[..., c:].contiguous()


def _add_far_grads(
    gk: Tensor,
    gv: Tensor,
    k: Tensor,
    v: Tensor,
    kmax: Tensor,
    g_num: Tensor,
    g_den: Tensor,
    shift: Tensor,
    cfg: _Config,
) -> None:
    """The far sums' share of the gradients of K and V, added in place: query tile i's far sums enter its rows
    with weight ``e^{-m_t}`` (:func:`_far_sums`), so key t' receives ``Σ_{i: t' far from i} Σ_{t ∈ i} e^{-m_t}
    ∂L/∂num_t`` (and den): per-tile sums scattered to the tiles' visit limits, then a (reverse) cumulative sum
    over the tokens. Closed form, so that autograd keeps none of the far sums' intermediates."""
    b, n, c = g_num.shape
    scale = (-shift.clamp_min(0)).exp()[None, :, None]
    g = F.pad(torch.cat([g_num, g_den], -1) * scale, (0, 0, 0, -n % cfg.blk)).view(b, cfg.n_tiles, cfg.blk, 2 * c)
    per_tile = g.sum(2)  # (B, tiles, 2C)
    lo, hi = _visited_ranges(n, cfg, k.device)
    at_lo = per_tile.new_zeros(b, n + 1, 2 * c).index_add_(1, lo, per_tile)
    far = at_lo.flip(1).cumsum(1).flip(1)[:, 1:]  # token t' < lo_i receives tile i's sum
    if not cfg.flags["CAUSAL"]:
        far += per_tile.new_zeros(b, n + 1, 2 * c).index_add_(1, hi, per_tile).cumsum(1)[:, :n]  # t' >= hi_i
    e = (k.float() - kmax[:, None]).exp()
    gv.addcmul_(e, far[..., :c])
    gk.add_(e * (v.float() * far[..., :c] + far[..., c:]))


def aft_biased_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    u: Tensor | None = None,
    vb: Tensor | None = None,
    w: Tensor | None = None,
    causal: bool = False,
    window: int = 0,
    outside_zero: bool = True,
) -> Tensor:
    """AFT-full (``window=0``) or AFT-local, paper Eq. 2, on the kernels of this module: (B, T, C) fp32.

    ``q, k, v`` (B, T, C) of any float dtype (channels contiguous); the bias from the factors ``u, vb`` (T, r),
    ``w = u vbᵀ`` (paper Eq. 7), or the table ``w`` (T, T). AFT-local keeps w for ``|t - t'| < window`` and sets
    it to 0 outside (``outside_zero``) or excludes those pairs. ``causal`` keeps t' <= t. Underflowed
    denominators are recomputed exactly (:func:`vitlab.ops.aft._ratio`) from the bias rows of those entries."""
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    kmax = k.detach().amax(1).float()
    num, den, _ = _BiasedSums.apply(k, v, kmax, u, vb, w, causal, window, outside_zero)
    rows = _bias_rows(u, vb, w, causal, window, outside_zero)
    y = _ratio(num.unsqueeze(-1), den, k, v.unsqueeze(-1), rows)
    return _gate(q.float(), y.squeeze(-1))  # fp32 whatever the projection's dtype


def _bias_rows(u: Tensor | None, vb: Tensor | None, w: Tensor | None, causal: bool, window: int, outside_zero: bool):
    """``rows(t, g)``: the effective bias rows (m, T) of query positions t, for the exact recomputation."""

    def rows(t: Tensor, g: Tensor) -> Tensor:
        r = (u[t].float() @ vb.float().T) if w is None else w[t].float()
        if window:
            far = (t[:, None] - torch.arange(r.shape[1], device=t.device)).abs() >= window
            r = r.masked_fill(far, 0.0 if outside_zero else -_INF)
        return mask_future(r, t) if causal else r

    return rows
