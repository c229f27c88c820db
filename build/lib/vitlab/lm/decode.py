"""Incremental decoding of a :class:`~vitlab.lm.model.CausalLM`: one token per step, no prefix recomputed.

Each block keeps a state for its mixer; a step projects only the new token (its Q, K, V) and reads the
state:

* AFT-simple: running per-channel sums ``Σ e^{K_t'-m} V_t'`` and ``Σ e^{K_t'-m}`` with their running
  maximum m: O(d) state, O(d) per step. When a new key exceeds m, both sums are rescaled by ``e^{m-m'}``.
* AFT-full / AFT-local: the prefix's ``[e^{K-m} V, e^{K-m}]`` (O(T·d) cache; m is a per-channel
  reference, raised, and the cache rescaled, when a key exceeds it by more than ``RESCALE_MARGIN``).
  Position t's output is one weighted sum over the cache with the bias row ``e^{w[t, :t+1] - max}``
  (paper Eq. 2; for AFT-local w = 0, or -inf, outside the window). A denominator that underflows
  (keys and biases whose maxima sit at different t') is recomputed exactly from the cached raw K and V.
* attention: a key/value cache, one SDPA call per step over it.

The logits of every step equal the full causal forward on the same sequence (``tests/test_lm.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..mixers import AFTFull, AFTLocal, AFTSimple, Attention
from ..mixers.base import merge_heads
from .model import CausalLM

_UNDERFLOW = 1e-20  # as the forward cores: below this the shifted denominator is recomputed exactly
# AFT-full/local caches are rescaled only when a key exceeds the running reference by this much (nats): the
# cached terms stay <= e^20 (sums of T of them are far from fp32 overflow) and the O(t·d) rescale is rare
RESCALE_MARGIN = 20.0


class AttentionState:
    """Key/value cache (B, H, T, d_h) of one causal attention layer."""

    def __init__(self, mixer: Attention, batch: int, max_len: int, ref: Tensor) -> None:
        self.mixer = mixer
        h, dh = mixer.num_heads, mixer.dim // mixer.num_heads
        self.k = ref.new_zeros(batch, h, max_len, dh)
        self.v = ref.new_zeros(batch, h, max_len, dh)

    def step(self, x: Tensor, t: int) -> Tensor:
        q, k, v = self.mixer.qkv_heads(x[:, None])  # (B, H, 1, d_h)
        self.k[:, :, t : t + 1], self.v[:, :, t : t + 1] = k, v
        out = F.scaled_dot_product_attention(q, self.k[:, :, : t + 1], self.v[:, :, : t + 1], scale=self.mixer.scale)
        return self.mixer.proj(merge_heads(out))[:, 0]


class AFTSimpleState:
    """Running max-shifted sums of causal AFT-simple: constant state per step."""

    def __init__(self, mixer: AFTFull | AFTSimple) -> None:
        self.mixer = mixer
        self.m = self.num = self.den = None

    def step(self, x: Tensor, t: int) -> Tensor:
        q, k, v = (p.float() for p in self.mixer.qkv(x).chunk(3, -1))
        if self.m is None:
            self.m, self.num, self.den = k, v, torch.ones_like(k)
        else:
            m = torch.maximum(self.m, k)
            old, new = (self.m - m).exp(), (k - m).exp()
            self.m, self.num, self.den = m, self.num * old + new * v, self.den * old + new
        y = torch.sigmoid(q) * self.num / self.den  # den >= 1: the maximal key contributes e^0
        return self.mixer.proj(y.to(x.dtype))


def bias_row(mixer: AFTFull, t: int) -> Tensor:
    """Row ``w[t, :t+1]`` (fp32) of the position bias an AFT-full/local mixer applies (causal part only)."""
    factorised = mixer.u is not None
    row = mixer.u[t].float() @ mixer.v[: t + 1].float().T if factorised else mixer.w[t, : t + 1].float()
    if isinstance(mixer, AFTLocal):
        far = t - torch.arange(t + 1, device=row.device) >= mixer.window
        row = row.masked_fill(far, 0.0 if mixer.outside == "zero" else float("-inf"))
    return row


class AFTFullState:
    """Cache ``[e^{K-m} V, e^{K-m}]`` (B, T, 2C) plus raw K, V (exact fallback) of causal AFT-full/local."""

    def __init__(self, mixer: AFTFull, batch: int, max_len: int, ref: Tensor) -> None:
        self.mixer = mixer
        c = mixer.hidden_dim
        self.ctx = ref.new_zeros(batch, max_len, 2 * c, dtype=torch.float32)
        self.k = ref.new_zeros(batch, max_len, c, dtype=torch.float32)
        self.v = ref.new_zeros(batch, max_len, c, dtype=torch.float32)
        self.m: Tensor | None = None

    def step(self, x: Tensor, t: int) -> Tensor:
        q, k, v = (p.float() for p in self.mixer.qkv(x).chunk(3, -1))
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
        row = bias_row(self.mixer, t)
        weights = (row - row.max()).exp()  # (t + 1,), the row maximum is finite (w[t, t] is never excluded)
        b = self.ctx.shape[0]
        num, den = torch.bmm(weights.expand(b, 1, t + 1), self.ctx[:, : t + 1])[:, 0].chunk(2, -1)
        y = num / den.clamp_min(_UNDERFLOW)
        low = den < _UNDERFLOW
        if bool(low.any()):  # exact log-sum-exp over the raw prefix, in float64, for the underflowed entries
            logits = self.k[:, : t + 1].double() + row.double()[None, :, None]
            exact = (logits.softmax(1) * self.v[:, : t + 1].double()).sum(1).float()
            y = torch.where(low, exact, y)
        return self.mixer.proj((torch.sigmoid(q) * y).to(x.dtype))


def mixer_state(mixer: nn.Module, batch: int, max_len: int, ref: Tensor):
    """The decoding state of one causal mixer."""
    if not getattr(mixer, "causal", False):
        raise ValueError(f"{type(mixer).__name__} is not causal: incremental decoding needs causal mixers")
    if isinstance(mixer, Attention):
        return AttentionState(mixer, batch, max_len, ref)
    if isinstance(mixer, AFTSimple) or (isinstance(mixer, AFTFull) and mixer.u is None and mixer.w is None):
        return AFTSimpleState(mixer)  # AFT-simple, or AFT-local with window 0 (no bias)
    if isinstance(mixer, AFTFull):
        return AFTFullState(mixer, batch, max_len, ref)
    raise ValueError(f"no incremental decoding for {type(mixer).__name__}")


class IncrementalDecoder:
    """Feeds a :class:`CausalLM` one input token per step; ``step`` returns the next symbol's logits.

    The first input is BOS (``model.vocab_size``) at position 0. The model must be in eval mode.
    """

    def __init__(self, model: CausalLM, batch: int, max_len: int | None = None) -> None:
        if model.training:
            raise ValueError("IncrementalDecoder: put the model in eval mode (dropout) first: model.eval()")
        self.model = model
        self.max_len = min(max_len or model.max_len, model.max_len)
        ref = model.pos_embed
        self.states = [mixer_state(b.mixer, batch, self.max_len, ref) for b in model.blocks]
        self.batch, self.pos = batch, 0

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """Input tokens (B,) at the next position -> logits (B, V) of the symbol at that position."""
        if tokens.shape != (self.batch,):
            raise ValueError(f"expected tokens of shape ({self.batch},), got {tuple(tokens.shape)}")
        if self.pos >= self.max_len:
            raise ValueError(f"decoding past max_len = {self.max_len}")
        m, t = self.model, self.pos
        m.check_tokens(tokens[:, None], t)
        x = m.embed_tokens(tokens[:, None], t)[:, 0]
        for block, state in zip(m.blocks, self.states):
            x = x + block.drop_mix(state.step(block.norm1(x), t))  # the block's forward, one position
            x = x + block.mlp(block.norm2(x))
        self.pos += 1
        return m.logits(x[:, None], t)[:, 0]


def _pick(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    if temperature <= 0:  # greedy
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(
    model: CausalLM,
    length: int,
    prompt: Tensor | None = None,
    batch: int = 1,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    return_logits: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Sample ``length`` symbols after ``prompt`` (B, k) symbols (or from nothing), step by step.

    ``temperature <= 0`` is greedy. Returns the symbols (B, k + length) and, with ``return_logits``, the
    logits of every position (B, k + length, V) (position i's logits predict symbol i).
    """
    k = 0 if prompt is None else prompt.shape[1]
    if prompt is not None:
        if prompt.dim() != 2:
            raise ValueError(f"prompt must be symbols (B, k), got {tuple(prompt.shape)}")
        batch = prompt.shape[0]
    if length < 0 or k + length > model.max_len or k + length == 0:
        raise ValueError(f"prompt ({k}) + length ({length}) must be in [1, max_len = {model.max_len}]")
    was_training = model.training
    model.eval()
    try:
        dec = IncrementalDecoder(model, batch, k + length)
        device = model.pos_embed.device
        seq = torch.empty(batch, k + length, dtype=torch.long, device=device)
        if prompt is not None:
            seq[:, :k] = prompt.to(device).long()
        logits = []
        token = torch.full((batch,), model.vocab_size, dtype=torch.long, device=device)  # BOS
        for i in range(k + length):
            out = dec.step(token)
            logits.append(out)
            if i >= k:
                seq[:, i] = _pick(out, temperature, top_k, generator)
            token = seq[:, i]
    finally:
        model.train(was_training)
    return (seq, torch.stack(logits, 1)) if return_logits else seq
