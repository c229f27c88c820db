"""The registry of named vision models: :class:`ModelConfig` rows (written in :mod:`vitlab.models.configs`),
one constructor per architecture."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..data.datasets import IMAGENET_MEAN, IMAGENET_STD
from ..registry import Registry
from .pyramid import PyramidCPVT
from .t2t import T2TViT
from .tnt import TNT
from .vit import VisionTransformer

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "vit": VisionTransformer,
    "tnt": TNT,
    "t2t": T2TViT,
    "pyramid": PyramidCPVT,
}


@dataclass(frozen=True)
class ModelConfig:
    """One named configuration: the architecture, its arguments and where they come from."""

    name: str
    arch: str
    kwargs: dict[str, Any]
    paper: str
    source: str
    params_m: float | None = None  # expected parameters (M), 1000 classes at the default size
    macs_g: float | None = None  # expected MACs (G) at the default size, where known (docs/models.md)
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    notes: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def input_size(self) -> tuple[int, int, int]:
        size = self.kwargs.get("img_size", 224)
        h, w = (size, size) if isinstance(size, int) else size
        return (self.kwargs.get("in_chans", 3), h, w)

    def meta(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "architecture": self.arch,
            "paper": self.paper,
            "source": self.source,
            "input_size": self.input_size,
            "mean": self.mean,
            "std": self.std,
            "params_m": self.params_m,
            "macs_g": self.macs_g,
            "notes": self.notes,
        }


def architecture(arch: str) -> type[nn.Module]:
    return ARCHITECTURES[arch]


MODELS: Registry[ModelConfig] = Registry(
    "model", lambda cfg: (architecture(cfg.arch), cfg.kwargs), listed_by="vitlab.list_models()"
)


def register(*configs: ModelConfig) -> None:
    for cfg in configs:
        if cfg.arch not in ARCHITECTURES:
            raise ValueError(f"model {cfg.name!r}: unknown architecture {cfg.arch!r}")
        MODELS.register(cfg.name, cfg)


def list_models(pattern: str = "*") -> list[str]:
    """Registered model names matching the shell-style ``pattern``, sorted."""
    return MODELS.names(pattern)


def get_config(name: str) -> ModelConfig:
    return MODELS.get(name)


def create_model(name: str, **overrides: Any) -> nn.Module:
    """Build the named model; ``overrides`` replace config arguments (num_classes, img_size, in_chans,
    drop_path_rate, ...). The model carries ``model.meta`` (paper, source, input size, mean/std)."""
    model = MODELS.create(name, **overrides)
    cfg = get_config(name)
    model.meta = dataclasses.replace(cfg, kwargs={**cfg.kwargs, **overrides}).meta()  # input size as built
    return model
