"""Kernelised attention: the Linear Transformer and the Performer (baselines of AFT's Table 4).

Both replace ``softmax(q kᵀ)`` by a feature map φ applied to queries and keys separately, so attention becomes
(Katharopoulos et al. 2020, Eq. 4-6; Choromanski et al. 2021, Eq. 2)::

    out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ  /  φ(q_i)ᵀ Σ_j φ(k_j)         (j ≤ i when causal)

which costs O(N d²) instead of O(N² d). The causal form is the same sums taken over prefixes; they are
computed chunk by chunk (:func:`linear_attention`): within a chunk of C positions the masked quadratic form,
across chunks the running sums, so memory stays O(N·C + N/C·d²) instead of an (N, d, d) prefix-sum tensor.

* :class:`LinearAttention` -- φ(x) = elu(x) + 1 (Linear Transformer);
* :class:`Performer` -- FAVOR+ positive orthogonal random features, an unbiased estimate of the softmax kernel
  ``exp(q·k/√d)``, redrawn every ``redraw_every`` training forwards (:mod:`vitlab.mixers.random_features`).

Both decode one token at a time from the running sums (O(d²) per step, :class:`KernelSums`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import TokenLayout, TokenMixer, check_divisible, merge_heads, split_heads
from .random_features import advance_draw, favor_features, orthogonal_gaussian

CHUNK = 64  # positions per chunk of the causal form


def linear_attention(
    fq: Tensor, fk: Tensor, v: Tensor, causal: bool, key_scale: Tensor | None = None, chunk: int = CHUNK
) -> Tensor:
    """``φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / φ(q_i)ᵀ Σ_j φ(k_j)`` for features fq, fk (B, H, N, m) and values (B, H, N, d).

    The features must be positive (both maps here are), so the denominator is too. ``key_scale`` (B, H, N): the
    log-scale each key's features are given at (φ(k_j) = fk_j · exp(key_scale_j); None: 0). The keys are brought
    to a common scale, the largest of those they are summed with, so no factor exceeds 1. ``causal``: j ≤ i, in
    chunks of ``chunk`` positions: the sums of ``φ(k)ᵀ v`` and ``φ(k)`` over the chunks before (each chunk at
    its own largest scale, rescaled to the running largest: nothing a later chunk holds changes an earlier
    chunk's scale), plus the masked products inside each chunk."""
    if key_scale is None:
        key_scale = fk.new_zeros(fk.shape[:-1])
    if not causal:
        fk = fk * (key_scale - key_scale.amax(-1, keepdim=True)).exp().unsqueeze(-1)
        kv = fk.transpose(-2, -1) @ v  # (B, H, m, d)
        num = fq @ kv
        den = fq @ fk.sum(-2, keepdim=True).transpose(-2, -1)
        return num / den.clamp_min(torch.finfo(den.dtype).tiny)
    b, h, n, _ = fq.shape
    pad = -n % chunk
    if pad:
        fq, fk, v = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, v))
        key_scale = F.pad(key_scale, (0, pad), value=float("-inf"))  # padded keys weigh 0
    c = (n + pad) // chunk
    fq, fk, v = (t.reshape(b, h, c, chunk, t.shape[-1]) for t in (fq, fk, v))
    scale = key_scale.reshape(b, h, c, chunk)
    top = scale.amax(-1)  # (B, H, c): each chunk's largest scale
    fk = fk * (scale - top.unsqueeze(-1)).exp().unsqueeze(-1)
    running = top.cummax(-1).values  # the largest scale up to each chunk
    earlier = torch.ones(c, c, dtype=torch.bool, device=fq.device).tril(-1)  # chunk s before chunk t
    carry = (top.unsqueeze(-2) - running.unsqueeze(-1)).masked_fill(~earlier, float("-inf")).exp()  # (B, H, t, s)
    kv_before = torch.einsum("bhts,bhsmd->bhtmd", carry, fk.transpose(-2, -1) @ v)
    z_before = torch.einsum("bhts,bhsm->bhtm", carry, fk.sum(-2))
    own = (top - running).exp()[..., None, None]  # the chunk's own keys at the running scale
    scores = (fq @ fk.transpose(-2, -1)).tril() * own  # within the chunk, j ≤ i
    num = fq @ kv_before + scores @ v
    den = (fq @ z_before.unsqueeze(-1)).squeeze(-1) + scores.sum(-1)
    out = num / den.clamp_min(torch.finfo(den.dtype).tiny).unsqueeze(-1)
    return out.reshape(b, h, c * chunk, -1)[:, :, :n]


@dataclass
class KernelSums:
    """Decoding state of a causal kernelised mixer: ``Σ_j φ(k_j) v_jᵀ`` (B, H, m, d) and ``Σ_j φ(k_j)`` (B, H, m)
    over the positions decoded so far; ``shift`` (B, H, 1) is the log-scale the Performer's key features
    are stored at (0 for the Linear Transformer)."""

    kv: Tensor
    z: Tensor
    shift: Tensor


class LinearAttention(TokenMixer):
    """Linear Transformer attention (Katharopoulos et al. 2020): φ(x) = elu(x) + 1 in :func:`linear_attention`.

    Same ``qkv`` / ``proj`` parameters as :class:`~vitlab.mixers.Attention`; ``causal=True`` restricts the sums
    to j ≤ i and decodes incrementally (:class:`KernelSums`).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        proj_drop: float = 0.0,
        causal: bool = False,
    ) -> None:
        super().__init__(dim)
        check_divisible(type(self).__name__, dim, num_heads)
        self.num_heads, self.causal = num_heads, causal
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_heads={self.num_heads}, causal={self.causal}"

    def features(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """φ(x) of queries or keys (B, H, N, d) and the log-scale (B, H, N) it is returned at (0: none here)."""
        return F.elu(x) + 1, x.new_zeros(x.shape[:-1])

    def heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv(x).chunk(3, -1)
        return split_heads(q, self.num_heads), split_heads(k, self.num_heads), split_heads(v, self.num_heads)

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        q, k, v = self.heads(x)
        # the features and the (prefix) sums in fp32 even under autocast: exponentials and long sums
        with torch.autocast(x.device.type, enabled=False):
            dtype = v.dtype
            if dtype in (torch.float16, torch.bfloat16):
                q, k, v = q.float(), k.float(), v.float()
            fk, key_scale = self.features(k)
            out = linear_attention(self.features(q)[0], fk, v, self.causal, key_scale)
        return self.proj_drop(self.proj(merge_heads(out.to(dtype)))), {}

    def init_state(self, batch: int, max_len: int, like: Tensor) -> KernelSums:
        """Zero sums for ``batch`` sequences."""
        with torch.no_grad():
            m = self.features(like.new_zeros(1, self.num_heads, 1, self.dim // self.num_heads))[0].shape[-1]
        d = self.dim // self.num_heads
        return KernelSums(
            like.new_zeros(batch, self.num_heads, m, d),
            like.new_zeros(batch, self.num_heads, m),
            like.new_full((batch, self.num_heads, 1), float("-inf")),
        )

    def step(self, x: Tensor, t: int, state: KernelSums) -> Tensor:
        """Position t of the causal form: add φ(k_t) v_tᵀ and φ(k_t) to the sums, read them with φ(q_t)."""
        q, k, v = self.heads(x[:, None])  # (B, H, 1, d)
        fk, shift = self.features(k)
        new = torch.maximum(state.shift, shift)  # keep the sums at the larger scale (-inf before the first key)
        old = (state.shift - new).exp()
        fk = fk * (shift - new).exp().unsqueeze(-1)
        state.kv.mul_(old.unsqueeze(-1)).add_(fk.transpose(-2, -1) @ v)
        state.z.mul_(old).add_(fk[:, :, 0])
        state.shift.copy_(new)
        fq = self.features(q)[0]
        den = (fq @ state.z.unsqueeze(-1)).clamp_min(torch.finfo(fq.dtype).tiny)
        out = (fq @ state.kv) / den
        return self.proj(merge_heads(out))[:, 0]


class Performer(LinearAttention):
    """Performer attention, FAVOR+ (Choromanski et al. 2021): softmax attention with ``exp(q·k/√d)`` estimated
    by positive orthogonal random features (:func:`~vitlab.mixers.random_features.favor_features`).

    ``num_features`` m random directions per head (default ``d_h · ln d_h``, the paper's choice, at least d_h);
    ``redraw_every``: new features every that many training forwards (0: never), drawn from a generator seeded
    by the ``feature_seed`` buffer and the redraw count, so every process and every resumed run draws the same.
    Evaluation and decoding use the current features; an activation recomputation replays the draw of the
    forward pass (``recompute_buffers``, :mod:`vitlab.layers.recompute`). Each key's features come at the
    log-scale of its largest exponent and :func:`linear_attention` sums them at the largest scale seen so far
    (a common factor of numerator and denominator, so it cancels), never overflowing and, in the causal form,
    never rescaled by a later chunk's keys.
    """

    #: what a forward pass may change and a recomputation of it must see as before (the draw and its counter)
    recompute_buffers = ("forwards", "projection")

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        proj_drop: float = 0.0,
        causal: bool = False,
        num_features: int | None = None,
        redraw_every: int = 1000,
    ) -> None:
        super().__init__(dim, num_heads, qkv_bias, proj_drop, causal)
        d = dim // num_heads
        self.num_features = max(d, int(d * math.log(d))) if num_features is None else num_features
        if self.num_features < 1 or redraw_every < 0:
            raise ValueError(
                f"Performer: num_features must be >= 1 and redraw_every >= 0, got {num_features}, {redraw_every}"
            )
        self.redraw_every = redraw_every
        # the seed and the draws are made on the CPU whatever the default device (a meta-device build included)
        self.register_buffer("feature_seed", torch.randint(0, 2**62, (), device="cpu"))
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))
        self.register_buffer("projection", self.draw(0))

    def draw(self, count: int) -> Tensor:
        """The ``count``-th set of orthogonal random directions (m, d_h)."""
        gen = torch.Generator().manual_seed(int(self.feature_seed) + count)
        return orthogonal_gaussian(self.num_features, self.dim // self.num_heads, gen)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_features={self.num_features}, redraw_every={self.redraw_every}"

    def features(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return favor_features(x, self.projection.to(x.dtype))

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        if self.training:
            advance_draw(self, self.projection)
        return super().mix(x, layout, attn_prev, return_aux)


__all__ = ["KernelSums", "LinearAttention", "Performer", "linear_attention"]
