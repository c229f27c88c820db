"""LSH attention (Reformer, Kitaev et al. 2020; a baseline of AFT's Table 4).

Per head, queries and keys share one projection (``k_j = q_j / |q_j|``, §2 "Shared-QK"). Each of ``rounds``
hash rounds buckets the keys by angular LSH, ``h(x) = argmax([x̂R; -x̂R])`` with a random Gaussian R (d, b/2)
(Eq. 4), sorts the positions by (bucket, position), cuts the sorted sequence into chunks of ``chunk_size`` and
lets each query attend to the keys of its own bucket in its own chunk and the chunk before (Eq. 3 with the
chunked P̃_i), j ≤ i when causal. A token attends to itself only when nothing else is in its set (its own
logit is -1e5). The rounds are combined with weights ``softmax_r(logsumexp_j of round r's logits)`` (§2
"Multi-round LSH"; a key found in several rounds counts once per round).

Rotations are redrawn every ``redraw_every`` training forwards (1: every forward, as the paper) from a
generator seeded by the ``rotation_seed`` buffer and the forward count; evaluation uses the last ones.
Decoding recomputes the forward on the prefix at each step (:class:`RecomputeDecoding`): the chunks of a
prefix differ from those of the whole sequence, so step t equals position t of the forward on the first t + 1
tokens, not of the forward on the full sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import TokenLayout, TokenMixer, check_divisible, merge_heads, split_heads
from .random_features import advance_draw, random_rotations

SELF_LOGIT = -1e5  # a token's logit for itself: it attends to itself only when alone


def lsh_buckets(keys: Tensor, rotations: Tensor) -> Tensor:
    """Bucket ids (B, H, R, N) of unit keys (B, H, N, d) under rotations (R, d, b/2): ``argmax([xR; -xR])``."""
    rotated = torch.einsum("bhnd,rdk->bhrnk", keys, rotations.to(keys.dtype))
    return torch.cat([rotated, -rotated], -1).argmax(-1)


def lsh_attention(qk: Tensor, v: Tensor, rotations: Tensor, chunk: int, causal: bool, scale: float) -> Tensor:
    """Reformer attention of shared query/keys qk and values v (B, H, N, d) (module docstring)."""
    b, h, n, d = qk.shape
    rounds = rotations.shape[0]
    keys = F.normalize(qk, dim=-1)
    buckets = lsh_buckets(keys, rotations)  # (B, H, R, N)
    pos = torch.arange(n, device=qk.device)
    order = (buckets * n + pos).argsort(-1)  # sort by bucket, then position
    pad = -n % chunk
    order_p = F.pad(order, (0, pad), value=0)  # pads gather position 0 but get bucket -1 and positions >= n
    slots = torch.arange(n + pad, device=qk.device)
    sorted_pos = torch.where(slots < n, order_p, n + slots)
    sorted_bucket = F.pad(buckets.gather(-1, order), (0, pad), value=-1)
    idx = order_p.unsqueeze(-1).expand(-1, -1, -1, -1, d)

    def chunked(t: Tensor) -> Tensor:  # (B, H, R, N + pad, ...) -> (B, H, R, chunks, chunk, ...)
        return t.reshape(b, h, rounds, -1, chunk, *t.shape[4:])

    def with_previous(t: Tensor) -> Tensor:  # each chunk's keys and the chunk before's (wrapping around)
        return torch.cat([t, t.roll(1, dims=3)], 4) if t.shape[3] > 1 else t

    expand = (b, h, rounds, n, d)
    sq = chunked(qk.unsqueeze(2).expand(expand).gather(3, idx))
    sk = with_previous(chunked(keys.unsqueeze(2).expand(expand).gather(3, idx)))
    sv = with_previous(chunked(v.unsqueeze(2).expand(expand).gather(3, idx)))
    qpos = chunked(sorted_pos.expand(b, h, rounds, -1))
    kpos = with_previous(qpos)
    qb = chunked(sorted_bucket)
    kb = with_previous(qb)
    logits = (sq @ sk.transpose(-2, -1)) * scale
    allowed = qb.unsqueeze(-1) == kb.unsqueeze(-2)
    if causal:
        allowed &= kpos.unsqueeze(-2) <= qpos.unsqueeze(-1)
    is_self = qpos.unsqueeze(-1) == kpos.unsqueeze(-2)
    logits = logits.masked_fill(~allowed, float("-inf")).masked_fill(is_self, SELF_LOGIT)
    lse = logits.logsumexp(-1, keepdim=True)
    out = ((logits - lse).exp() @ sv).flatten(3, 4)[:, :, :, :n]  # (B, H, R, N, d) in sorted order
    lse = lse.flatten(3, 4)[:, :, :, :n]
    unsort = order.argsort(-1).unsqueeze(-1)
    out = out.gather(3, unsort.expand(-1, -1, -1, -1, d))
    weights = lse.gather(3, unsort).softmax(2)  # over the rounds
    return (weights * out).sum(2)


class RecomputeDecoding:
    """Decoding by recomputation for causal mixers with no incremental form: the state keeps the inputs of the
    prefix (B, max_len, C); step t runs the causal forward on the first t + 1 and returns position t."""

    def init_state(self, batch: int, max_len: int, like: Tensor) -> Tensor:
        return like.new_zeros(batch, max_len, self.dim)

    def step(self, x: Tensor, t: int, state: Tensor) -> Tensor:
        state[:, t] = x
        return self(state[:, : t + 1])[:, t]


class LSHAttention(RecomputeDecoding, TokenMixer):
    """Reformer's LSH self-attention (module docstring): ``buckets`` b (even) per round, ``rounds`` hash rounds,
    chunks of ``chunk_size`` sorted positions; the output ``proj(merge_h(·))``."""

    #: what a forward pass may change and a recomputation of it must see as before (:mod:`vitlab.layers.recompute`)
    recompute_buffers = ("forwards", "rotations")

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = True,
        proj_drop: float = 0.0,
        causal: bool = False,
        buckets: int = 16,
        rounds: int = 2,
        chunk_size: int = 64,
        redraw_every: int = 1,
    ) -> None:
        super().__init__(dim)
        head_dim = check_divisible("LSHAttention", dim, num_heads)
        if buckets < 2 or buckets % 2 or rounds < 1 or chunk_size < 1 or redraw_every < 0:
            raise ValueError(
                "LSHAttention: buckets must be even and >= 2, rounds and chunk_size >= 1, redraw_every >= 0; got "
                f"{buckets}, {rounds}, {chunk_size}, {redraw_every}"
            )
        self.num_heads, self.causal, self.scale = num_heads, causal, head_dim**-0.5
        self.buckets, self.rounds, self.chunk_size, self.redraw_every = buckets, rounds, chunk_size, redraw_every
        self.qk = nn.Linear(dim, dim, bias=qkv_bias)
        self.v = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.register_buffer("rotation_seed", torch.randint(0, 2**62, (), device="cpu"))  # as Performer's seed
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))
        self.register_buffer("rotations", self.draw(0))

    def draw(self, count: int) -> Tensor:
        gen = torch.Generator().manual_seed(int(self.rotation_seed) + count)
        return random_rotations(self.dim // self.num_heads, self.buckets, self.rounds, gen)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_heads={self.num_heads}, buckets={self.buckets}, rounds={self.rounds}, "
            f"chunk_size={self.chunk_size}, causal={self.causal}"
        )

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        if self.training:
            advance_draw(self, self.rotations)
        qk, v = split_heads(self.qk(x), self.num_heads), split_heads(self.v(x), self.num_heads)
        # the core in fp32 even under autocast: the self logit -1e5 is -inf in fp16, and a lone token's row with it
        with torch.autocast(x.device.type, enabled=False):
            dtype = v.dtype
            wide = (qk.float(), v.float()) if dtype in (torch.float16, torch.bfloat16) else (qk, v)
            out = lsh_attention(*wide, self.rotations, self.chunk_size, self.causal, self.scale)
        return self.proj_drop(self.proj(merge_heads(out.to(dtype)))), {}


__all__ = ["LSHAttention", "RecomputeDecoding", "lsh_attention", "lsh_buckets"]
