"""What every vitlab classifier shares: building blocks from mixer specs, the block loop, init, the head.

VisionTransformer, TNT and T2TViT differ only in how images become tokens and
in their blocks; the timm-style contract (``forward_features`` /
``forward_head`` / ``forward_intermediates`` / ``reset_classifier`` /
``no_weight_decay``) lives here once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor, nn

from ..layers import Block
from ..mixers import build as build_mixer
from ..mixers.base import TokenLayout, TokenMixer

MixerSpec = str | tuple[str, dict[str, Any]]
POOLS = ("token", "avg")


def mixer_specs(mixer: MixerSpec | Sequence[MixerSpec], depth: int) -> list[tuple[str, dict[str, Any]]]:
    """One ``(kind, kwargs)`` per block from a single spec or a per-block list."""
    specs = [mixer] * depth if isinstance(mixer, str | tuple) else list(mixer)
    if len(specs) != depth:
        raise ValueError(f"got {len(specs)} mixer specs for depth {depth}")
    return [(s, {}) if isinstance(s, str) else (s[0], dict(s[1])) for s in specs]


def drop_path_rates(rate: float, depth: int) -> list[float]:
    """Stochastic depth growing linearly from 0 to ``rate`` over the blocks (DeiT)."""
    return [rate * i / max(depth - 1, 1) for i in range(depth)]


def build_blocks(
    dim: int,
    depth: int,
    mixer: MixerSpec | Sequence[MixerSpec],
    mixer_defaults: dict[str, Any],
    drop_path_rate: float = 0.0,
    **block_kw: Any,
) -> nn.ModuleList:
    """``depth`` pre-norm blocks, block i holding the mixer of spec i; ``mixer_defaults`` (num_heads, qkv_bias,
    max_len, ...) go to the mixers that take them."""
    dpr = drop_path_rates(drop_path_rate, depth)
    return nn.ModuleList(
        Block(dim, build_mixer(kind, dim, defaults=mixer_defaults, **kw), drop_path=dpr[i], **block_kw)
        for i, (kind, kw) in enumerate(mixer_specs(mixer, depth))
    )


def run_blocks(
    blocks: Iterable[nn.Module], x: Tensor, layout: TokenLayout, return_aux: bool, after_block=None
) -> tuple[Tensor, list[Tensor], list[dict[str, Tensor]]]:
    """Run ``blocks`` in order, handing Refined-ViT's attention map from block to block.

    Returns the last output, every block's output and every mixer's aux (empty
    dicts unless ``return_aux``). ``after_block(i, x)`` may transform the output
    of block i (CPVT's PEG).
    """
    tokens, auxes = [], []
    carry = None
    for i, blk in enumerate(blocks):
        chained = blk.mixer.uses_attn_prev
        if return_aux or chained:
            x, aux = blk(x, layout, attn_prev=carry, return_aux=True)
            carry = aux.get("carry", carry) if chained else carry
        else:
            x, aux = blk(x, layout), {}
        if after_block is not None:
            x = after_block(i, x)
        tokens.append(x)
        auxes.append(aux if return_aux else {})
    return x, tokens, auxes


def check_pool(global_pool: str, has_class_token: bool = True) -> str:
    if global_pool not in POOLS:
        raise ValueError(f"global_pool must be 'token' or 'avg', got {global_pool!r}")
    if global_pool == "token" and not has_class_token:
        raise ValueError("global_pool='token' needs a class token; use global_pool='avg' without one")
    return global_pool


class Classifier(nn.Module):
    """The head and the API shared by the models. Subclasses set ``embed_dim``, ``num_prefix``,
    ``global_pool``, ``head`` and ``blocks`` and implement ``forward_intermediates``."""

    embed_dim: int
    num_prefix: int
    global_pool: str
    blocks: nn.ModuleList

    @property
    def num_features(self) -> int:
        return self.embed_dim

    def new_head(self, num_classes: int) -> nn.Module:
        return nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if global_pool is not None:
            self.global_pool = check_pool(global_pool, self.num_prefix > 0)
        self.num_classes = num_classes
        self.head = self.new_head(num_classes)

    def init_trunc_normal(self, *tensors: Tensor | None) -> None:
        """The init of DeiT, TNT and T2T-ViT: trunc-normal(0.02) for the given tokens/tables and every Linear
        weight, zero biases, unit LayerNorms; then mixers with their own init (external attention's
        ``M_v = M_kᵀ``, AFT's factors) re-apply it through ``reset_parameters``."""
        for t in tensors:
            if t is not None:
                nn.init.trunc_normal_(t, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for m in self.modules():
            if isinstance(m, TokenMixer) and hasattr(m, "reset_parameters"):
                m.reset_parameters()

    def no_weight_decay(self) -> set[str]:
        """Tokens and position tables (as the official code), plus what each block's mixer names."""
        names = {n for n, _ in self.named_parameters() if n.split(".")[0] in self.NO_WEIGHT_DECAY}
        for i, blk in enumerate(self.blocks):
            mixer = getattr(blk, "mixer", None)
            if hasattr(mixer, "no_weight_decay"):
                names |= {f"blocks.{i}.mixer.{n}" for n in mixer.no_weight_decay()}
        return names

    NO_WEIGHT_DECAY: tuple[str, ...] = ("pos_embed", "cls_token", "dist_token")

    def forward_intermediates(self, x: Tensor, return_aux: bool = True) -> dict[str, Any]:
        raise NotImplementedError

    def forward_features(self, x: Tensor) -> Tensor:
        """Tokens ``(B, N, C)`` after the final norm."""
        return self.forward_intermediates(x, return_aux=False)["features"]

    def pool(self, x: Tensor) -> Tensor:
        return x[:, self.num_prefix :].mean(1) if self.global_pool == "avg" else x[:, 0]

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Pooled features (``pre_logits``) or logits from ``forward_features`` output."""
        pooled = self.pool(x)
        return pooled if pre_logits else self.head(pooled)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))
