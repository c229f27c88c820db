"""Self-attention as the papers' ablations change it: the alternatives they compare their method against.

* :class:`TemperatureAttention` -- ``softmax(q kᵀ s / τ_h)`` with a learnable or a scheduled temperature
  (DeepViT's comparison with sharpening the maps instead of re-attention);
* :class:`DropAttention` -- entries of the map dropped at random and the rows renormalised (DeepViT's
  "dropping attention");
* :class:`DoubleNormAttention` -- external attention's double normalisation applied to the self-attention map
  (EA paper: softmax over the queries, then ℓ1 over the keys);
* :class:`RelPos2dAttention` -- 2-D relative position logits (the baseline CPVT compares the PEG with);
* :class:`PEGQKAttention` -- CPVT's "position or capacity" ablation: a PEG feeds the queries and keys only.

Each is :class:`~vitlab.mixers.Attention` (same ``qkv`` / ``proj`` parameters and names) with one change;
docs/semantics.md, Decisions C2, D3 and E3 say how the papers' loose descriptions are read.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.double_norm import double_normalize
from .attention import Attention, attention_softmax_flops
from .base import TokenLayout, grid_residual, split_heads
from .external import double_norm_flops

TEMPERATURES = ("learnable", "scheduled")


class TemperatureAttention(Attention):
    """``softmax(q kᵀ s / τ_h) V`` with a per-head temperature τ (Decision D3).

    ``temperature="learnable"``: ``τ_h = exp(θ_h)``, θ a parameter initialised to 0 (τ = 1, plain attention).
    ``temperature="scheduled"``: one τ for all heads, ``τ = τ_0 + (τ_1 - τ_0) · min(t / T, 1)`` over the first
    ``T = temperature_steps`` training forwards t (counted in the buffer ``steps_done``, saved with the model), from
    ``temperature_start`` τ_0 to ``temperature_end`` τ_1; evaluation uses the current τ. Computed by dividing
    the queries by τ, so the fused SDPA path stays available.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        qk_scale: float | None = None,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        temperature: str = "learnable",
        temperature_start: float = 1.0,
        temperature_end: float = 0.5,
        temperature_steps: int = 10000,
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias, qk_scale, attn_drop, proj_drop)
        if temperature not in TEMPERATURES:
            raise ValueError(f"TemperatureAttention: temperature must be one of {TEMPERATURES}, got {temperature!r}")
        if min(temperature_start, temperature_end) <= 0 or temperature_steps < 1:
            raise ValueError(
                "TemperatureAttention: temperatures must be > 0 and temperature_steps >= 1, got "
                f"{temperature_start}, {temperature_end}, {temperature_steps}"
            )
        self.schedule = (temperature_start, temperature_end, temperature_steps)
        if temperature == "learnable":
            self.log_temperature = nn.Parameter(torch.zeros(num_heads))
        else:
            self.register_parameter("log_temperature", None)
            self.register_buffer("steps_done", torch.zeros((), dtype=torch.long))

    def temperature(self) -> Tensor:
        """τ per head, (H,)."""
        if self.log_temperature is not None:
            return self.log_temperature.exp()
        start, end, steps = self.schedule
        frac = self.steps_done.float().clamp(max=steps) / steps
        return (start + (end - start) * frac).expand(self.num_heads)

    def qkv_heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super().qkv_heads(x)
        tau = self.temperature().to(q.dtype).view(1, -1, 1, 1)
        if self.log_temperature is None and self.training:
            self.steps_done += 1
        return q / tau, k, v

    def no_weight_decay(self) -> set[str]:
        return {"log_temperature"} if self.log_temperature is not None else set()


class RowRenormDropout(nn.Module):
    """DropAttention: in training, each map entry is dropped with probability ``p`` and every row is divided by
    what is left of its sum, so rows still sum to 1 (plain dropout rescales by ``1/(1-p)`` instead). A row that
    would lose every entry keeps all of them. Identity in evaluation."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"DropAttention: drop probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, attn: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return attn
        kept = attn * (torch.rand_like(attn) >= self.p)
        total = kept.sum(-1, keepdim=True)
        empty = total == 0
        return torch.where(empty, attn, kept / torch.where(empty, torch.ones_like(total), total))


class DropAttention(Attention):
    """Attention whose map entries are dropped and rows renormalised in training (:class:`RowRenormDropout`,
    probability ``drop_prob``; DeepViT's "dropping attention", Decision D3). ``attn_drop`` is not used."""

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        qk_scale: float | None = None,
        proj_drop: float = 0.0,
        drop_prob: float = 0.1,
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias, qk_scale, 0.0, proj_drop, fused=False)
        self.attn_drop = RowRenormDropout(drop_prob)


class DoubleNormAttention(Attention):
    """Self-attention normalised as external attention (EA paper §3, "DN" on self-attention; Decision E3):

    ``α̂_ij = exp(l_ij) / Σ_i' exp(l_i'j)`` (softmax over the queries i for each key j), then
    ``α_ij = α̂_ij / (ε + Σ_j' α̂_ij')`` (ℓ1 over the keys), ``l = q kᵀ s``, ε = 1e-9; out = ``proj(α V)``.
    """

    flops_label = "attention softmax"

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        qk_scale: float | None = None,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias, qk_scale, attn_drop, proj_drop, fused=False)

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        return batch * self.num_heads * tokens * tokens + double_norm_flops(batch * self.num_heads, tokens, tokens)

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        q, k, v = self.qkv_heads(x)
        attn = double_normalize((q * self.scale) @ k.transpose(-2, -1), token_dim=-2, memory_dim=-1, inplace=True)
        out = self.project(self.attn_drop(attn) @ v)
        return out, ({"attn": attn} if return_aux else {})


class RelPos2dAttention(Attention):
    """Attention with 2-D relative position logits (the RPE baseline of CPVT; Decision C2).

    For patch tokens i, j at grid positions (y, x): ``l_ij = s · q_i · (k_j + r^row_{Δy} + r^col_{Δx})`` with
    ``Δy = clip(y_j - y_i, ±K)``, ``Δx = clip(x_j - x_i, ±K)`` and two learned tables ``(2K + 1, d_h)`` shared by
    the heads (Shaw et al.'s key term, split into rows and columns as in 2-D relative attention); every pair with
    a prefix token (class token) gets one more learned entry instead, ``s · q_i · r^prefix``. ``K = max_distance``;
    offsets beyond it share the last entry, so any grid works. Needs ``layout.grid``.
    """

    needs_grid = True

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        qk_scale: float | None = None,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        max_distance: int = 13,
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias, qk_scale, attn_drop, proj_drop)
        if max_distance < 0:
            raise ValueError(f"RelPos2dAttention: max_distance must be >= 0, got {max_distance}")
        self.max_distance = max_distance
        head_dim = dim // num_heads
        self.rel_row = nn.Parameter(torch.zeros(2 * max_distance + 1, head_dim))
        self.rel_col = nn.Parameter(torch.zeros(2 * max_distance + 1, head_dim))
        self.rel_prefix = nn.Parameter(torch.zeros(head_dim))
        for table in (self.rel_row, self.rel_col, self.rel_prefix):
            nn.init.trunc_normal_(table, std=0.02)

    def no_weight_decay(self) -> set[str]:
        return {"rel_row", "rel_col", "rel_prefix"}

    def offsets(self, grid: tuple[int, int], device: torch.device) -> tuple[Tensor, Tensor]:
        """Table indices ``(M, M)`` of the row and column offsets between the M = H·W patches (row-major)."""
        ys, xs = torch.meshgrid(
            torch.arange(grid[0], device=device), torch.arange(grid[1], device=device), indexing="ij"
        )
        ys, xs = ys.flatten(), xs.flatten()
        k = self.max_distance
        return ((ys[None] - ys[:, None]).clamp(-k, k) + k), ((xs[None] - xs[:, None]).clamp(-k, k) + k)

    def relative_logits(self, q: Tensor, layout: TokenLayout) -> Tensor:
        """``s · q_i · (r^row_{Δy} + r^col_{Δx})`` as a (B, H, N, N) bias; ``s · q_i · r^prefix`` where a prefix
        token takes part."""
        b, h, n, _ = q.shape
        p = layout.num_prefix
        rows, cols = self.offsets(layout.grid, q.device)
        qs = q * self.scale
        prefix = (qs @ self.rel_prefix.to(q.dtype)).unsqueeze(-1).expand(b, h, n, n)
        m = n - p
        idx = (b, h, m, m)
        patches = qs[:, :, p:]
        grid = (patches @ self.rel_row.to(q.dtype).T).gather(-1, rows.expand(idx)) + (
            patches @ self.rel_col.to(q.dtype).T
        ).gather(-1, cols.expand(idx))
        # assembled, not written into a copy: the same values, and torch.fx traces it
        return torch.cat([prefix[:, :, :p], torch.cat([prefix[:, :, p:, :p], grid], -1)], 2)

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        q, k, v = self.qkv_heads(x)
        return self.attend(q, k, v, return_aux, self.relative_logits(q, layout))

    def extra_flops(
        self, batch: int, tokens: int, layout: TokenLayout | None = None, *, with_attn_prev: bool = False
    ) -> int:
        """The softmax and the bias add; the two table products are MACs."""
        return attention_softmax_flops(batch, self.num_heads, tokens, tokens) + batch * self.num_heads * tokens**2


class PEGQKAttention(Attention):
    """Attention whose queries and keys see a PEG and whose values do not (CPVT's "PEG on Q, K only"; Decision C2).

    ``q, k`` come from ``x + DWConv_k×k(x)`` on the patch grid (zero padding k//2, prefix tokens unchanged, the
    conv initialised as CPVT's PEG), ``v`` from ``x``; the rest is :class:`Attention`. The residual stream never
    receives the position encoding directly. Needs ``layout.grid``.
    """

    needs_grid = True

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        qk_scale: float | None = None,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        peg_kernel: int = 3,
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias, qk_scale, attn_drop, proj_drop)
        if peg_kernel < 1 or peg_kernel % 2 == 0:
            raise ValueError(f"PEGQKAttention: peg_kernel must be a positive odd number, got {peg_kernel}")
        self.peg = nn.Conv2d(dim, dim, peg_kernel, 1, peg_kernel // 2, groups=dim)
        nn.init.normal_(self.peg.weight, 0.0, math.sqrt(2.0 / peg_kernel**2))
        nn.init.zeros_(self.peg.bias)

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        c = self.dim
        w, b = self.qkv.weight, self.qkv.bias
        qk = F.linear(grid_residual(x, layout, self.peg), w[: 2 * c], None if b is None else b[: 2 * c])
        v = F.linear(x, w[2 * c :], None if b is None else b[2 * c :])
        q, k = qk.chunk(2, -1)  # unpacked by name: torch.fx traces it
        q, k = split_heads(q, self.num_heads), split_heads(k, self.num_heads)
        return self.attend(q, k, split_heads(v, self.num_heads), return_aux)


__all__ = [
    "DoubleNormAttention",
    "DropAttention",
    "PEGQKAttention",
    "RelPos2dAttention",
    "RowRenormDropout",
    "TemperatureAttention",
]
