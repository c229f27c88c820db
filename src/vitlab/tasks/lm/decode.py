"""Incremental decoding of a :class:`~vitlab.tasks.lm.model.CausalLM`: one token per step, no prefix recomputed.

Each block keeps a state for its mixer, and a step asks the mixer itself for the new position's output
(:meth:`~vitlab.mixers.base.TokenMixer.init_state` / :meth:`~vitlab.mixers.base.TokenMixer.step`): it
projects only the new token and reads the state -- attention a key/value cache, AFT-simple running sums
(O(d) per step), AFT-full/local a cache of its prefix weighted by one row of its position bias.

The logits of every step equal the full causal forward on the same sequence (``tests/test_lm.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .model import CausalLM


def mixer_state(mixer: nn.Module, batch: int, max_len: int, ref: Tensor) -> Any:
    """The decoding state of one causal mixer (tensors on ``ref``'s device)."""
    if not getattr(mixer, "causal", False):
        raise ValueError(f"{type(mixer).__name__} is not causal: incremental decoding needs causal mixers")
    return mixer.init_state(batch, max_len, ref)


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
            x = x + block.drop_mix(block.mixer.step(block.norm1(x), t, state))  # the block's forward, one position
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
