"""Key maps from the reference implementations' state_dicts to vitlab's.

Each source is a list of regex rewrites applied in order to every key; a
rewrite to ``None`` drops the key (tensors the reference keeps but never uses).
Value transforms (fusing separate q/k and v projections) are separate functions.
"""

from __future__ import annotations

import re

from torch import Tensor

from ..mixers.refiner import OFFICIAL_KEY_PREFIXES as REFINER_PREFIXES

Rule = tuple[str, str | None]

_VIT: list[Rule] = [(r"^blocks\.(\d+)\.attn\.", r"blocks.\1.mixer.")]

KEY_RULES: dict[str, list[Rule]] = {
    # timm / DeiT ViT (also DeiT-style CPVT built from timm blocks)
    "timm_vit": _VIT,
    # CPVT composed as the paper's Algorithm 1: one PEG after block 0 as `pos_block` (Twins' PosCNN keys)
    # Twins' PosCNN on its own
    "twins_peg": [(r"^proj\.0\.", "proj.")],
    # zhoudaquan/dvit_repo: re-attention keeps the official submodule names
    "deepvit": _VIT,
    # zhoudaquan/Refiner_ViT: DLA submodules renamed, the MLP's scale_channel is the MLP LayerScale
    "refiner": [
        *[(rf"^blocks\.(\d+)\.attn\.{re.escape(old)}", rf"blocks.\1.mixer.{new}") for old, new in REFINER_PREFIXES.items()],
        *_VIT,
        (r"^blocks\.(\d+)\.mlp\.scale_channel$", r"blocks.\1.ls2.gamma"),
    ],
    "cpvt": [*_VIT, (r"^pos_block\.proj\.0\.", "pegs.0.proj."), (r"^pos_block\.(\d+)\.proj\.0\.", r"pegs.\1.proj.")],
}


def rename_keys(state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """Apply ``KEY_RULES[source]`` to every key; keys rewritten to None are dropped."""
    if source not in KEY_RULES:
        raise ValueError(f"unknown checkpoint source {source!r}; known: {', '.join(sorted(KEY_RULES))}")
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        new: str | None = key
        for pattern, repl in KEY_RULES[source]:
            if new is not None and re.search(pattern, new):
                new = None if repl is None else re.sub(pattern, repl, new)
        if new is not None:
            out[new] = value
    return out
