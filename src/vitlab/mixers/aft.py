"""AFT: An Attention Free Transformer (Zhai et al., arXiv 2105.14103 v1).

AFT replaces dot-product attention by a per-channel weighted average whose
weights combine the keys with learned pair-wise position biases (paper Eq. 2)::

    Y_t = sigmoid(Q_t) * sum_t' exp(K_t' + w[t, t']) V_t' / sum_t' exp(K_t' + w[t, t'])

(``w[t, t']``: t = output position). Variants (paper §3.2):

* :class:`AFTFull`   -- a learned ``T x T`` bias, factorised ``w = u vᵀ`` (Eq. 7);
* :class:`AFTLocal`  -- ``w`` kept for ``|t - t'| < s``, 0 outside (global connectivity kept); sequences
  longer than s take an O(T·s·d) banded path (:func:`vitlab.ops.aft.aft_local_banded`, :mod:`vitlab.ops.aft_banded`);
* :class:`AFTSimple` -- no bias: ``Y_t = sigmoid(Q_t) * sum_t' softmax_t'(K)_t' V_t'``;
* :class:`AFTConv`   -- heads with one key channel each and a shared ``k x k`` relative bias (Eq. 6).

Causal modules also decode one token at a time from a state of the prefix (``init_state`` / ``step``:
:class:`RunningSums`, :class:`PrefixCache`).

The cores, exact for keys and biases of any magnitude, live in :mod:`vitlab.ops.aft` (with their fast paths and
the decoding states); the modules here hold the parameters, the position biases and the projections, and run the
cores in fp32 with autocast off (their projections follow autocast). On CUDA, AFT-full, AFT-local and AFT-simple
run on Triton kernels (:mod:`vitlab.ops.triton_aft`, :mod:`vitlab.ops.triton_aft_simple`) that take the
projections in their dtype and accumulate in fp32; AFT-conv's window sums run on :mod:`vitlab.ops.triton_aft_conv`
and the one-token decoding step on :mod:`vitlab.ops.triton_aft_decode`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from numbers import Integral

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..ops import aft_banded, probe
from ..ops.aft import (
    aft_conv,
    aft_full,
    aft_full_channels,
    aft_local_banded,
    aft_simple,
    aft_simple_context,
    aft_simple_fused,
    linear_transposed,
    mask_future,
    one_band,
)
from ..ops.aft_conv import qkv_width, split_qkv
from ..ops.aft_decode import PrefixCache, RunningSums
from ..ops.aft_simple import aft_simple_projected
from ..ops.linear import fused_linear, fuses_linear, linear_rows, onednn_mode
from ..ops.switch import eager_fast_path, fx_tracing, no_autograd
from ..ops.triton_support import triton_runs_on
from .base import TokenLayout, TokenMixer, check_divisible, token_count

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
    if fx_tracing():  # a symbol without a device: the graph keeps the core's own fp32 computation
        return nullcontext()
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
        if bias_dim is not None and (isinstance(bias_dim, bool) or not isinstance(bias_dim, Integral) or bias_dim <= 0):
            raise ValueError(f"{name}: bias_dim must be a positive integer or None (full w), got {bias_dim!r}")
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
        if not return_aux and self._takes_channel_major(x, layout):
            out = self._mix_channel_major(x, layout)
            if out is not None:
                return out, {}
        apart = self._projects_apart(x)
        if apart:
            h = self.hidden_dim
            q, k, v = (linear_rows(self.qkv, x, i * h, (i + 1) * h) for i in range(3))
        else:
            qkv = fused_linear(self.qkv, x)
            q, k, v = qkv.chunk(3, -1)
        with _no_autocast(x):
            if not apart and triton_runs_on(qkv):
                y = self._triton_core(qkv, layout)
            else:
                y = self._core(q.float(), k.float(), v.float(), layout)
        out = fused_linear(self.proj, y.to(q.dtype)).to(x.dtype)
        return out, ({"keys": k} if return_aux else {})

    def _projects_apart(self, x: Tensor) -> bool:
        """Whether Q, K and V come from three products, each its own contiguous buffer, instead of views of one
        fused projection: eager inference on the CPU. The core then reads contiguous rows (the sigmoid, the keys'
        maxima and ``e^K`` ran 1.2-2.6x slower on the views' strided rows). AFT-full against the community code
        in fresh processes (docs/performance.md, d = 256, AVX2-only EPYC): 0.89 -> 0.97 of its speed at T = 197,
        batch 8; 0.90 -> 1.02 at T = 1024, batch 2. Under glibc's default allocator, where oneDNN takes the
        products, the three buffers page-faulted every call at T = 197 (the same page, open). Training keeps the
        fused product: three would each add a full-size gradient of the shared weight in the backward pass."""
        if fx_tracing():  # first: a torch.fx proxy has no device to ask
            return False
        return (
            x.device.type == "cpu"
            and type(self.qkv) is nn.Linear
            and eager_fast_path()
            and no_autograd(x, *self.parameters())
        )

    def _dense(self, tokens: int) -> bool:
        """Whether N = ``tokens`` runs the dense core on the (N, N) bias (AFT-local: not its band path)."""
        return True

    def _takes_channel_major(self, x: Tensor, layout: TokenLayout) -> bool:
        """Whether this call runs :meth:`_mix_channel_major`: eager fp32 inference on the CPU (nothing recorded,
        autocast off), plain linear layers that run aten's product (not oneDNN's, :func:`fuses_linear`), a position
        bias on the dense core, a sequence whose bias weights are formed in one piece (:func:`one_band`), and a CPU
        where channel-major is the faster layout (:func:`vitlab.ops.probe.aft_channel_major`)."""
        if fx_tracing() or not eager_fast_path():  # first: a torch.fx proxy has no device or shape to ask
            return False
        n = token_count(x, layout)
        return (
            x.dim() == 3
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and self.biased
            and type(self.qkv) is nn.Linear
            and type(self.proj) is nn.Linear
            and one_band(n)
            and self._dense(n)
            and not torch.is_autocast_enabled("cpu")
            and no_autograd(x, *self.parameters())
            and not fuses_linear(x, self.qkv.weight)
            and probe.aft_channel_major().taken  # last: the probe runs only where the path could
        )

    def _mix_channel_major(self, x: Tensor, layout: TokenLayout) -> Tensor | None:
        """Inference with every channel's tokens in one row (:func:`~vitlab.ops.aft.aft_full_channels`): the
        projection computed transposed, the core on contiguous rows, the output projection reading ``Yᵀ`` in place.
        None when a denominator underflowed: :meth:`mix` then runs the token-major core, which repairs it."""
        b, n, _ = x.shape
        qkv_t = linear_transposed(self.qkv, x.reshape(b * n, -1))
        y_t = aft_full_channels(qkv_t, b, self.position_bias(n, layout), self.causal)
        return None if y_t is None else fused_linear(self.proj, y_t.t()).view(b, n, -1)

    def _triton_core(self, qkv: Tensor, layout: TokenLayout) -> Tensor:
        """The core on the GPU kernels (:mod:`vitlab.ops.triton_aft`), from the projection in its own dtype: the
        bias from its factors (or table) fitted to N tokens, never as an (N, N) tensor of the factors' product."""
        from ..ops.triton_aft import aft_biased_triton
        from ..ops.triton_aft_simple import aft_simple_triton

        if not self.biased:
            return aft_simple_triton(qkv, self.causal)
        fit = self._fit(qkv.shape[1], layout)
        u, vb, w = (
            (None, None, fit(fit(self.w, 0), 1)) if self.w is not None else (fit(self.u, 0), fit(self.v, 0), None)
        )
        return aft_biased_triton(*qkv.chunk(3, -1), u, vb, w, self.causal, *self._window())

    def _window(self) -> tuple[int, bool]:
        """The band of the bias kept (0: all pairs) and whether the pairs outside it count with w = 0."""
        return 0, True

    def _core(self, q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout) -> Tensor:
        """The AFT core on fp32 ``q, k, v`` (B, N, hidden), autocast off."""
        w = self.position_bias(token_count(k, layout), layout)
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

    def _window(self) -> tuple[int, bool]:
        return self.window, self.outside == "zero"

    def _restrict(self, w: Tensor, t: Tensor | int, tk: Tensor) -> Tensor:
        far = (t - tk).abs() >= self.window
        return w.masked_fill(far, 0.0 if self.outside == "zero" else float("-inf"))

    def _dense(self, tokens: int) -> bool:
        return not self.uses_band(tokens)

    def uses_band(self, tokens: int) -> bool:
        """Whether N = ``tokens`` takes the O(N·s·d) band path: N longer than the window, and the band needs
        ``w[:N, :N]`` of the table as is, whatever the layout: causal ``N <= max_len`` (the top-left block) or
        ``N == max_len``. Other N take the dense path, where ``_fit`` resamples (or rejects) the bias."""
        band = 0 < self.window < tokens <= self.max_len and (self.causal or tokens == self.max_len)
        return band and not fx_tracing()  # torch.fx records the dense path (the band's blocks loop on data)

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        if self.uses_band(tokens):
            return aft_banded.banded_flops(
                batch, tokens, self.hidden_dim, aft_banded.band_block(self.window), self.causal
            )
        return super().extra_flops(batch, tokens, layout)

    def _core(self, q: Tensor, k: Tensor, v: Tensor, layout: TokenLayout) -> Tensor:
        n = token_count(k, layout)
        if not self.uses_band(n):
            return super()._core(q, k, v, layout)
        band = aft_banded.local_bias_band(n, aft_banded.band_block(self.window), self.u, self.v, self.w, self.causal)
        band = band.float()
        args = (q, k, v, band, self.window, self.outside == "zero", partial(self._bias_rows, n), self.causal)
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(aft_local_banded, *args, use_reentrant=False)
        return aft_local_banded(*args)

    def _bias_rows(self, n: int, t: Tensor, g: Tensor | None = None) -> Tensor:
        """Full rows ``w[t, :]`` (m, n), the future excluded when causal; only underflowed entries need them."""
        rows = self.position_bias(n)[t]
        return mask_future(rows, t) if self.causal else rows


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
        if triton_runs_on(x):
            qkv = fused_linear(self.qkv, x)
            with _no_autocast(x):
                from ..ops.triton_aft_simple import aft_simple_triton

                y = aft_simple_triton(qkv, self.causal)
            out = fused_linear(self.proj, y.to(qkv.dtype)).to(x.dtype)
            return out, ({"keys": qkv.chunk(3, -1)[1]} if return_aux else {})
        plain = type(self.qkv) is nn.Linear
        if plain and not self.causal and eager_fast_path():
            if not return_aux and no_autograd(x, *self.parameters()):
                return self._mix_keys_first(x), {}
            if self._trains_projected(x):
                out = fused_linear(self.proj, aft_simple_projected(x, self.qkv.weight, self.qkv.bias))
                # the keys asked for: their product once more (the core's buffer became the softmax)
                c = self.hidden_dim
                return out, ({"keys": linear_rows(self.qkv, x, c, 2 * c)} if return_aux else {})
        qkv = fused_linear(self.qkv, x)
        with _no_autocast(x):
            y = aft_simple_fused(qkv.float(), self.causal)
        out = fused_linear(self.proj, y.to(qkv.dtype)).to(x.dtype)
        return out, ({"keys": qkv.chunk(3, -1)[1]} if return_aux else {})

    def _mix_keys_first(self, x: Tensor) -> Tensor:
        """Non-causal AFT-simple without autograd: K and V projected, reduced to the context ``s`` and freed, then
        Q projected and gated in place. Q never coexists with K, V and ``e^K``: at most 3 activations alive instead
        of 5 (the fused projection, ``e^K``, the gate). K and V are two products, each its own contiguous buffer:
        the keys' maxima and ``e^K`` read contiguous rows, as in AFT-full (:meth:`AFTFull._projects_apart`); against
        the community code in fresh processes (docs/performance.md, AVX2-only EPYC): 0.92 -> 1.00 of its speed at
        T = 1024, batch 2, 0.97 -> 1.07 at T = 4096. Under glibc's default allocator the two buffers page-faulted
        more than one (the same page, open)."""
        c = self.hidden_dim
        k, v = linear_rows(self.qkv, x, c, 2 * c), linear_rows(self.qkv, x, 2 * c, 3 * c)
        dtype = k.dtype  # the projections' (autocast's); the core runs in fp32
        with _no_autocast(x):
            s = aft_simple_context(k.float(), v.float())
        del k, v
        q = linear_rows(self.qkv, x, 0, c)
        with _no_autocast(x):
            y = q.float().sigmoid_().mul_(s)  # q's own buffer (or its fp32 copy)
        return fused_linear(self.proj, y.to(dtype)).to(x.dtype)

    def _trains_projected(self, x: Tensor) -> bool:
        """Whether this call runs :func:`~vitlab.ops.aft_simple.aft_simple_projected` (projection and core in one
        function, Q, K and V apart): a training call (inference asking for the keys keeps them a view of the fused
        projection) in fp32 on the CPU where the projection would run aten's product (not oneDNN's training
        primitive, :func:`vitlab.ops.linear.onednn_mode`). A training step against the fused form,
        one process, alternating (AVX2-only EPYC, d = 256): 1.11x faster at T = 197, batch 8; 1.13x at T = 1024,
        batch 2; 1.04x at T = 4096, batch 1 (docs/performance.md has the side-by-side pairs)."""
        if fx_tracing():  # first: a torch.fx proxy has no device to ask
            return False
        return (
            torch.is_grad_enabled()
            and x.device.type == "cpu"
            and x.dim() == 3
            and x.dtype == self.qkv.weight.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu")
            and onednn_mode(x, self.qkv.weight) is None
        )

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

    The paper's appendix (Decision A5): ``sparsity=lambda`` makes :meth:`regularization_loss` an L1 penalty on the
    relative weights, ``lambda · mean_{i,a,b} |exp(w^i_ab) - 1|``, which training adds to the loss;
    ``one_point=True`` gives head i a single learned weight at one fixed offset of the s x s window (offset
    ``i mod s²`` in row-major order) and ``w = 0`` (``exp(w) - 1 = 0``) elsewhere: the convolution becomes a
    scaled shift. The single weight starts at 0 (AFT-simple, as the re-parameterised kernel) and is used raw.
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
        sparsity: float = 0.0,
        one_point: bool = False,
    ) -> None:
        super().__init__(dim)
        if not sparsity >= 0.0:
            raise ValueError(f"AFTConv: sparsity is the weight of an L1 penalty, >= 0; got {sparsity}")
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
        self.reparam = reparam and not one_point
        self.query = query
        self.sparsity = float(sparsity)
        self.one_point = one_point
        # fused [Q (dim, unless query=False) | K (num_heads) | V (dim)]
        self.qkv = nn.Linear(dim, qkv_width(dim, num_heads, query), bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        if one_point:  # head i's weight sits at offset i mod s² of its window
            self.w = nn.Parameter(torch.zeros(num_heads))
            offsets = torch.arange(num_heads) % kernel_size**2
            self.register_buffer("point", F.one_hot(offsets, kernel_size**2).view(-1, kernel_size, kernel_size).float(),
                                 persistent=False)  # fmt: skip
        else:
            self.w = nn.Parameter(torch.randn(num_heads, kernel_size, kernel_size) * 0.01)
        self.gamma = nn.Parameter(torch.zeros(num_heads)) if self.reparam else None
        self.beta = nn.Parameter(torch.zeros(num_heads)) if self.reparam else None

    def no_weight_decay(self) -> set[str]:
        """The kernel and its re-parameterisation gains are not weight-decayed (decay would pull gamma to 0)."""
        return {"w", "gamma", "beta"} if self.reparam else {"w"}

    def extra_repr(self) -> str:
        ablations = ("" if self.reparam else ", reparam=False") + ("" if self.query else ", query=False")
        ablations += (f", sparsity={self.sparsity:g}" if self.sparsity else "") + (
            ", one_point=True" if self.one_point else ""
        )
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, kernel_size={self.kernel_size}, outside={self.outside!r}"
            + ablations
        )

    def position_bias(self) -> Tensor:
        """The re-parameterised bias w (h, s, s), fp32 (Eq. 8); the raw kernel when ``reparam=False``; with
        ``one_point`` each head's weight at its offset and 0 elsewhere."""
        w = self.w.float()
        if self.one_point:
            return self.point.to(w.dtype) * w[:, None, None]
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

    def regularization_loss(self) -> Tensor | None:
        """The appendix's sparsity penalty ``sparsity · mean |exp(w) - 1|`` (fp32), or None without one."""
        return self.sparsity * self.effective_kernel().abs().mean() if self.sparsity else None

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        if self.outside == "-inf" and layout.num_prefix:
            raise ValueError("AFTConv(outside='-inf') has no pairs for prefix tokens: use it without a class token")
        qkv = fused_linear(self.qkv, x)  # [Q | K | V]: the core takes it fused (one gradient buffer)
        with _no_autocast(x):
            w = self.position_bias()
            args = (w, layout.grid, layout.num_prefix, self.outside == "zero", self.query)
            if triton_runs_on(qkv):  # the window sums on the GPU kernels, from the projection in its own dtype
                from ..ops.triton_aft_conv import aft_conv_triton

                y = aft_conv_triton(qkv, *args)
            else:
                y = aft_conv(qkv.float(), *args)
        out = fused_linear(self.proj, y.to(qkv.dtype)).to(x.dtype)
        return out, ({"keys": split_qkv(qkv, self.num_heads, self.query)[1]} if return_aux else {})
