"""What every analysis of ``vitlab analyze`` is built from: :class:`Analysis` (checked on the first batch, fed
every batch, turned into JSON + PNG), the :class:`Context` it reads, and the helpers for maps and JSON."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor, nn


# ------------------------------------------------------------------------------------------- helpers
def to_json(t: Tensor | np.ndarray) -> Any:
    """Nested lists of a tensor's values: float32 values exactly (as doubles), NaN/inf as null."""
    a = t.detach().float().cpu().numpy() if isinstance(t, Tensor) else np.asarray(t, dtype=np.float32)
    a = a.astype(np.float64)
    if np.isfinite(a).all():
        return a.tolist()
    return np.where(np.isfinite(a), a, None).tolist()


def pad_stack(arrays: Sequence[Any]) -> np.ndarray:
    """Stack tensors, arrays or :func:`to_json` lists whose shapes differ (heads, kernel sizes) into one
    float32 array, NaN-padded (a JSON null is NaN too)."""
    arrays = [np.asarray(a.detach().float().cpu() if isinstance(a, Tensor) else a, dtype=np.float32) for a in arrays]
    shape = [max(a.shape[d] for a in arrays) for d in range(arrays[0].ndim)]
    out = np.full((len(arrays), *shape), np.nan, dtype=np.float32)
    for i, a in enumerate(arrays):
        out[(i, *(slice(0, s) for s in a.shape))] = a
    return out


class RunningMean:
    """Mean over images of per-batch means (each batch weighted by its size)."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.count = 0

    def add(self, value: Tensor, n: int) -> None:
        v = value.detach().double().cpu() * n
        self.total = v if self.total is None else self.total + v
        self.count += n

    @property
    def value(self) -> Tensor:
        assert self.total is not None
        return self.total / self.count


@dataclass
class Context:
    """What every analysis may read besides the model's intermediates."""

    model: nn.Module
    images: Tensor  # (N, C, H, W) in [0, 1], what the model saw before normalisation
    query: str | None
    threshold: float
    slots: list[int]
    max_heads: int


def self_attention_maps(out: dict) -> list[tuple[int, Tensor]]:
    """(block, map (B, H, N, N)) for every block whose mixer materialised a self-attention map."""
    n = out["tokens"][0].shape[1]
    return [
        (i, aux["attn"])
        for i, aux in enumerate(out["aux"])
        if "attn" in aux and aux["attn"].dim() == 4 and aux["attn"].shape[-2:] == (n, n)
    ]


def memory_attention_maps(out: dict) -> list[tuple[int, Tensor]]:
    """(block, map (B, heads, N, S)) for every external-attention block (single-head maps get a head axis)."""
    return [
        (i, a.unsqueeze(1) if a.dim() == 3 else a)
        for i, aux in enumerate(out["aux"])
        if (a := aux.get("memory_attn")) is not None
    ]


# ------------------------------------------------------------------------------------------ analyses
class Analysis:
    """One analysis: checked on the first batch, fed every batch, then turned into JSON + PNG."""

    name = ""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def start(self, out: dict) -> str | None:
        """None, or why the analysis does not apply to this model."""
        return None

    def update(self, out: dict, n: int) -> None:
        pass

    def result(self) -> dict[str, Any]:
        raise NotImplementedError

    def plot(self, result: dict[str, Any], path: Path) -> None:
        raise NotImplementedError

    def summary(self, result: dict[str, Any]) -> str:
        return ""
