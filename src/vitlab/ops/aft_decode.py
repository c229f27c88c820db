"""The decoding states of causal AFT (paper Eq. 2 with t' <= t): one new token per step, no prefix recomputed.

:class:`RunningSums` (AFT-simple, AFT-local without a bias) keeps O(d) running sums; :class:`PrefixCache`
(AFT-full/local) keeps its prefix's max-shifted terms and weighs them with one row of the position bias. Both give
every position's output equal to the full causal forward (:mod:`vitlab.ops.aft`), whose exact repair of underflowed
denominators the cache shares. On CUDA (and on CPU tensors under Triton's interpreter) a step is one Triton kernel
(:mod:`vitlab.ops.triton_aft_decode`); the one switch of :mod:`vitlab.ops.switch` turns it off.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .aft import _ratio
from .triton_support import triton_runs_on

# AFT-full/local decoding rescales its cache only when a key exceeds the running reference by this much (nats):
# the cached terms stay <= e^20 (sums of T of them are far from fp32 overflow) and the O(t·d) rescale is rare
RESCALE_MARGIN = 20.0


class RunningSums:
    """Decoding state of causal AFT-simple (and AFT-local without a bias): running per-channel sums
    ``Σ e^{K_t'-m} V_t'`` and ``Σ e^{K_t'-m}`` with their running maximum m, O(d) state and work per step.
    When a new key exceeds m, both sums are rescaled by ``e^{m-m'}``. On CUDA the step is one Triton kernel
    (:func:`~vitlab.ops.triton_aft_decode.running_step`)."""

    def __init__(self) -> None:
        self.m = self.num = self.den = None

    def advance(self, q: Tensor, k: Tensor, v: Tensor, t: int) -> Tensor:
        """Take in position t's key and value (B, C); its output before the projection."""
        if triton_runs_on(q, k, v):
            from .triton_aft_decode import running_step

            self.m, self.num, self.den, y = running_step(q, k, v, self.m, self.num, self.den)
            return y
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
    sum over the cache with the bias row ``e^{w[t, :t+1] - max}`` (paper Eq. 2) of ``bias_row(t)``. On CUDA the
    cache update and the sums are one Triton kernel (:func:`~vitlab.ops.triton_aft_decode.prefix_step`, which
    raises m per channel)."""

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
        row = self.bias_row(t)
        if triton_runs_on(k, v, row, self.ctx):
            from .triton_aft_decode import prefix_step

            self.m, num, den = prefix_step(k, v, row, self.m, self.ctx, self.k, self.v, t, RESCALE_MARGIN)
        else:
            num, den = self._sums(k, v, row, t)
        # one query position; an underflowed entry is recomputed from the raw prefix with this row
        prefix_k, prefix_v = self.k[:, : t + 1], self.v[:, : t + 1, :, None]
        y = _ratio(num[:, None, :, None], den[:, None], prefix_k, prefix_v, lambda ti, g: row.expand(len(ti), -1))
        return torch.sigmoid(q) * y[:, 0, :, 0]

    def _sums(self, k: Tensor, v: Tensor, row: Tensor, t: int) -> tuple[Tensor, Tensor]:
        """The cache updated with position t and the weighted sums ``num, den`` (B, C) of its output."""
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
        weights = (row - row.max()).exp()  # (t + 1,), the row maximum is finite (w[t, t] is never excluded)
        b = self.ctx.shape[0]
        num, den = torch.bmm(weights.expand(b, 1, t + 1), self.ctx[:, : t + 1])[:, 0].chunk(2, -1)
        return num, den
