"""Causal sequence models over bytes and sub-pixels (AFT paper §4.1-4.2, arXiv 2105.14103).

A decoder stack: token embedding + learned position embedding, dropout, L pre-LN blocks (one causal token
mixer + FFN x4 each, :class:`~vitlab.layers.Block`), final LayerNorm and a ``vocab``-way head. The mixer
is causal AFT-local, AFT-simple, AFT-full or multi-head attention (SDPA, ``is_causal``).

Conventions:

* every sequence is predicted from a begin-of-sequence token: input ``[BOS, x_0 .. x_{T-2}]``, target
  ``x_0 .. x_{T-1}``, so all T symbols are scored (the first from no context). BOS is token id ``vocab``.
* images are H x W x 3 sub-pixel sequences (raster order, RGB interleaved); the paper shares one token
  embedding and one 256-way head across R, G, B (``channels=1``). ``channels=3`` gives each channel its
  own embedding rows and head (position t's symbol belongs to channel ``t % channels``).
* dropout (paper: 0.1) is applied to the embeddings, after each mixer (residual dropout) and inside the FFN;
  the Transformer baseline also drops attention weights (``attn_dropout``, by default the same rate, as
  ``nn.Transformer`` and GPT-2 do; with a rate > 0, SDPA on CPU takes its math path, which stores the T x T
  maps like the paper's 2021 baseline; ``attn_dropout=0`` keeps the flash kernel).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...common.registry import Registry
from ...layers import Block
from ...layers.recompute import recompute_active, recomputed
from ...mixers import build
from ...mixers.base import TokenLayout
from .baselines import BASELINE_KINDS, BASELINE_ROWS

MixerSpec = str | tuple[str, dict[str, Any]] | list
KINDS = ("aft_local", "aft_simple", "aft_full", "attention", *BASELINE_KINDS)
#: the mixers the ``window`` / ``bias_dim`` overrides of :func:`lm_config` apply to
OVERRIDE_KINDS = {"window": ("aft_local", "local_attention"), "bias_dim": ("aft_local", "aft_full")}


def parse_mixer(mixer: MixerSpec) -> tuple[str, dict[str, Any]]:
    """``"aft_simple"`` or ``("aft_local", {"window": 256})`` -> (kind, options)."""
    kind, opts = (mixer, {}) if isinstance(mixer, str) else (mixer[0], dict(mixer[1]) if len(mixer) > 1 else {})
    if kind not in KINDS:
        raise ValueError(
            f"unknown causal mixer {kind!r} (or one with no causal form); expected one of {', '.join(KINDS)}"
        )
    return kind, opts


class DecoderBlock(Block):
    """Pre-LN block: ``x += drop(mixer(LN(x))); x += MLP(LN(x))`` (dropout inside the MLP too).

    A :class:`~vitlab.layers.Block` (same parts, same state-dict keys) with residual dropout after the mixer.
    """

    def __init__(self, dim: int, mixer: nn.Module, ffn_mult: float, dropout: float) -> None:
        super().__init__(dim, mixer, mlp_ratio=ffn_mult, drop=dropout)
        self.drop_mix = nn.Dropout(dropout)

    def forward(self, x: Tensor, layout: TokenLayout) -> Tensor:
        x = x + self.drop_mix(self.mixer(self.norm1(x), layout))
        return x + self.mlp(self.norm2(x))


class CausalLM(nn.Module):
    """Autoregressive decoder over ``vocab_size`` symbols (256: bytes or sub-pixel intensities).

    Args:
        vocab_size: number of output symbols V; the embedding has V + 1 rows (the last is BOS).
        max_len: longest sequence (the learned position table and the AFT position biases).
        dim, depth, heads: width d, number of blocks L, heads of the attention baseline (AFT has none).
        mixer: one of :data:`KINDS` (``"aft_local"``, ``"attention"``, ``"performer"``...) or ``(kind, options)``; options go
            to the mixer (e.g. ``{"window": 256, "bias_dim": 64}``). Every mixer is built causal.
        ffn_mult: FFN hidden width / d (paper: 4).
        dropout: embedding, residual and FFN dropout (paper: 0.1).
        attn_dropout: dropout on the attention weights of the ``attention`` mixer (None: ``dropout``); AFT has
            no attention weights and ignores it.
        tie_head: the head reuses the token embedding (V rows) as its weight.
        channels: 1 = one embedding and head shared by all positions (the paper's RGB sharing);
            c > 1 = separate embedding rows and head per channel ``t % c``.
    """

    grad_checkpointing = False  # set_grad_checkpointing

    def __init__(
        self,
        vocab_size: int = 256,
        max_len: int = 3072,
        dim: int = 256,
        depth: int = 24,
        mixer: MixerSpec = ("aft_local", {"window": 256, "bias_dim": 64}),
        heads: int = 1,
        ffn_mult: float = 4.0,
        dropout: float = 0.1,
        attn_dropout: float | None = None,
        tie_head: bool = False,
        channels: int = 1,
    ) -> None:
        super().__init__()
        for name, val in (
            ("vocab_size", vocab_size),
            ("max_len", max_len),
            ("dim", dim),
            ("depth", depth),
            ("heads", heads),
            ("channels", channels),
        ):
            if int(val) != val or val < 1:
                raise ValueError(f"CausalLM: {name} must be a positive integer, got {val!r}")
        attn_dropout = dropout if attn_dropout is None else attn_dropout
        for name, val in (("dropout", dropout), ("attn_dropout", attn_dropout)):
            if not 0.0 <= val < 1.0:
                raise ValueError(f"CausalLM: {name} must be in [0, 1), got {val}")
        if tie_head and channels != 1:
            raise ValueError("CausalLM: tie_head needs channels=1 (one embedding shared by all positions)")
        kind, opts = parse_mixer(mixer)
        self.config = {
            "vocab_size": vocab_size,
            "max_len": max_len,
            "dim": dim,
            "depth": depth,
            "mixer": [kind, opts],
            "heads": heads,
            "ffn_mult": ffn_mult,
            "dropout": dropout,
            "attn_dropout": attn_dropout,
            "tie_head": tie_head,
            "channels": channels,
        }
        self.vocab_size, self.max_len, self.dim, self.channels = vocab_size, max_len, dim, channels
        self.bos = channels * vocab_size  # the last embedding row
        self.mixer_kind = kind
        self.embed = nn.Embedding(channels * vocab_size + 1, dim)
        self.pos_embed = nn.Parameter(torch.zeros(max_len, dim))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            self.blocks.append(
                DecoderBlock(dim, self._mixer(kind, opts, dim, heads, max_len, attn_dropout), ffn_mult, dropout)
            )
        self.norm = nn.LayerNorm(dim)
        self.head = None if tie_head else nn.Linear(dim, channels * vocab_size)
        self.init_weights()

    @staticmethod
    def _mixer(kind: str, opts: dict[str, Any], dim: int, heads: int, max_len: int, attn_dropout: float) -> nn.Module:
        if "causal" in opts:
            raise ValueError(f"mixer {kind!r}: every CausalLM mixer is causal; drop the 'causal' option")
        defaults = {"num_heads": heads, "max_len": max_len, "attn_drop": attn_dropout}  # each mixer takes what it has
        return build(kind, dim, defaults=defaults, causal=True, **opts)

    def init_weights(self) -> None:
        """N(0, 0.02) for linear weights and embeddings (GPT/Image Transformer), zero biases; the AFT position
        factors keep their own N(0, 0.01²) (paper §4.1)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        nn.init.normal_(self.pos_embed, std=0.02)

    def no_weight_decay(self) -> set[str]:
        """Embeddings and position tables (the paper decays only the linear transformation weights)."""
        names = {"embed.weight", "pos_embed"}
        names |= {n for n, _ in self.named_parameters() if n.split(".")[-1] in ("u", "v", "w") and ".mixer." in n}
        return names

    # ------------------------------------------------------------------ pieces shared with incremental decoding

    def check_tokens(self, tokens: Tensor, start: int = 0) -> None:
        if (
            not isinstance(tokens, Tensor)
            or tokens.dim() != 2
            or tokens.dtype not in (torch.int64, torch.int32, torch.uint8, torch.int16)
        ):
            what = f"{tokens.dtype} {tuple(tokens.shape)}" if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"CausalLM: expected integer tokens of shape (B, T), got {what}")
        n = tokens.shape[1]
        if n == 0 or start + n > self.max_len:
            raise ValueError(f"CausalLM: positions {start}..{start + n - 1} must lie in [0, max_len={self.max_len})")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) > self.vocab_size):
            raise ValueError(f"CausalLM: token ids must lie in [0, {self.vocab_size}] ({self.vocab_size} = BOS)")

    def embed_tokens(self, inputs: Tensor, start: int = 0) -> Tensor:
        """Embeddings of input tokens (B, n) at positions ``start..start+n-1`` (id ``vocab_size`` = BOS)."""
        idx = inputs.long()
        if self.channels > 1:  # the input at position t is symbol t-1, of channel (t-1) % c
            pos = torch.arange(start, start + inputs.shape[1], device=inputs.device)
            chan = ((pos - 1) % self.channels) * self.vocab_size
            idx = torch.where(idx == self.vocab_size, self.bos, idx + chan)
        x = self.embed(idx) + self.pos_embed[start : start + inputs.shape[1]]
        return self.drop(x)

    def logits(self, x: Tensor, start: int = 0) -> Tensor:
        """Final norm + head: features (B, n, d) at positions ``start..`` -> logits (B, n, V)."""
        x = self.norm(x)
        if self.head is None:
            return F.linear(x, self.embed.weight[: self.vocab_size])
        out = self.head(x)
        if self.channels == 1:
            return out
        b, n, _ = out.shape
        chan = torch.arange(start, start + n, device=x.device) % self.channels
        out = out.view(b, n, self.channels, self.vocab_size)
        return out.gather(2, chan.view(1, n, 1, 1).expand(b, n, 1, self.vocab_size)).squeeze(2)

    # ------------------------------------------------------------------ forward

    def forward(self, inputs: Tensor) -> Tensor:
        """Logits (B, T, V) for input tokens (B, T); position t's logits predict the symbol at position t
        (the input holds BOS and the symbols before it: see :func:`shift_right`)."""
        self.check_tokens(inputs)
        x = self.embed_tokens(inputs)
        layout = TokenLayout.sequence()
        ckpt = recompute_active(self.grad_checkpointing)
        for block in self.blocks:
            x = recomputed(block, block, x, layout) if ckpt else block(x, layout)
        return self.logits(x)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block in backward instead of keeping its activations (timm's method name)."""
        self.grad_checkpointing = bool(enable)

    def loss(self, targets: Tensor) -> Tensor:
        """Mean cross-entropy (nats) of the model on symbol sequences (B, T), predicted from BOS."""
        logits = self(shift_right(targets, self.vocab_size))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten().long())


def shift_right(targets: Tensor, bos: int) -> Tensor:
    """Model input for symbol sequences (B, T): ``[BOS, x_0 .. x_{T-2}]``."""
    b = targets.shape[0]
    return torch.cat([targets.new_full((b, 1), bos), targets[:, :-1]], 1)


LN2 = math.log(2.0)


def bits_per_dim(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean negative log-likelihood in bits per predicted symbol: ``CE(nats) / ln 2`` (bits/dim, bits/char)."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)} + (V,)")
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten().long()) / LN2


# ---------------------------------------------------------------------------- named configurations

_CIFAR = {"vocab_size": 256, "max_len": 3072, "dropout": 0.1}
_ENWIK8 = {"vocab_size": 256, "max_len": 1024, "dropout": 0.1}
_TINY = {"vocab_size": 256, "max_len": 256, "dim": 32, "depth": 2, "dropout": 0.0}

# name -> (CausalLM arguments, where it comes from)
_ROWS: dict[str, tuple[dict[str, Any], str]] = {
    # CIFAR-10 (paper Table 2; factorised bias d' = 64, window 256)
    "aft_local_256_cifar": (
        {**_CIFAR, "dim": 256, "depth": 24, "mixer": ("aft_local", {"window": 256, "bias_dim": 64})},
        "Table 2: AFT-local-256, L=24, d=256 (best, 2.74 bits/dim test)",
    ),
    "aft_local_256_cifar_l12": (
        {**_CIFAR, "dim": 512, "depth": 12, "mixer": ("aft_local", {"window": 256, "bias_dim": 64})},
        "Table 2: AFT-local-256, L=12, d=512",
    ),
    "aft_simple_cifar": (
        {**_CIFAR, "dim": 256, "depth": 24, "mixer": "aft_simple"},
        "Table 2: AFT-simple, L=24, d=256",
    ),
    "transformer_cifar": (
        {**_CIFAR, "dim": 256, "depth": 24, "heads": 2, "mixer": "attention"},
        "Table 2: Transformer, L=24, d=256, h=2",
    ),
    "transformer_cifar_l12": (
        {**_CIFAR, "dim": 512, "depth": 12, "heads": 4, "mixer": "attention"},
        "Table 2: Transformer, L=12, d=512, h=4",
    ),
    # enwik8 (paper Tables 4-6; window 32, d' = 256, T = 1024)
    "aft_local_32_enwik8": (
        {**_ENWIK8, "dim": 256, "depth": 24, "mixer": ("aft_local", {"window": 32, "bias_dim": 256})},
        "Table 4: AFT-local-32, L=24, d=256",
    ),
    "aft_local_32_enwik8_l12": (
        {**_ENWIK8, "dim": 512, "depth": 12, "mixer": ("aft_local", {"window": 32, "bias_dim": 256})},
        "Table 4: AFT-local-32, L=12, d=512",
    ),
    "aft_full_enwik8": (
        {**_ENWIK8, "dim": 256, "depth": 24, "mixer": ("aft_full", {"bias_dim": 256})},
        "AFT-full, L=24, d=256, in Table 4's enwik8 setting (the paper gives no AFT-full row there)",
    ),
    "aft_simple_enwik8": (
        {**_ENWIK8, "dim": 256, "depth": 24, "mixer": "aft_simple"},
        "Table 4: AFT-simple, L=24, d=256",
    ),
    "transformer_enwik8": (
        {**_ENWIK8, "dim": 256, "depth": 24, "heads": 4, "mixer": "attention"},
        "Table 4: Transformer, L=24, d=256, h=4",
    ),
    "transformer_enwik8_l12": (
        {**_ENWIK8, "dim": 512, "depth": 12, "heads": 8, "mixer": "attention"},
        "Table 4: Transformer base, L=12, d=512, h=8",
    ),
    # tiny models for tests and quick CPU runs
    "tiny_aft_local": ({**_TINY, "mixer": ("aft_local", {"window": 8, "bias_dim": 16})}, "tests: AFT-local-8"),
    "tiny_aft_simple": ({**_TINY, "mixer": "aft_simple"}, "tests: AFT-simple"),
    "tiny_aft_full": ({**_TINY, "mixer": ("aft_full", {"bias_dim": 16})}, "tests: AFT-full"),
    "tiny_transformer": ({**_TINY, "heads": 2, "mixer": "attention"}, "tests: Transformer, 2 heads"),
    **BASELINE_ROWS,
}


LMS: Registry[tuple[dict[str, Any], str]] = Registry("LM config", lambda row: (CausalLM, row[0]), rows=_ROWS)
#: the named configurations (read-only): name -> (CausalLM arguments, where it comes from)
LM_CONFIGS = LMS.rows


def list_lms(pattern: str = "*") -> list[str]:
    """Named LM configs matching the shell-style ``pattern``, sorted."""
    return LMS.names(pattern)


def lm_config(name: str, **overrides: Any) -> dict[str, Any]:
    """The :class:`CausalLM` arguments of a named config, with ``overrides``.

    Besides the constructor arguments, ``window`` and ``bias_dim`` override the mixer's options (of the kinds in
    :data:`OVERRIDE_KINDS`).
    """
    table_args = LMS.get(name)[0]
    kind, opts = parse_mixer(overrides.pop("mixer", table_args["mixer"]))
    for key, kinds in OVERRIDE_KINDS.items():
        if key in overrides:
            if kind not in kinds:
                raise ValueError(f"option {key} does not apply to the {kind} mixer")
            opts[key] = overrides.pop(key)
    return LMS.arguments(name, {**overrides, "mixer": (kind, opts)})[1]


def create_lm(name: str, **overrides: Any) -> CausalLM:
    """Build a named causal LM (see :data:`LM_CONFIGS`), e.g. ``create_lm("aft_local_256_cifar", depth=4)``."""
    return CausalLM(**lm_config(name, **overrides))
