"""Named model configurations: a table of rows, one constructor per architecture."""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from torch import nn

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# architecture -> "module:Class", imported on first use
ARCHITECTURES = {
    "vit": "vitlab.models.vit:VisionTransformer",
    "tnt": "vitlab.models.tnt:TNT",
    "t2t": "vitlab.models.t2t:T2TViT",
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


_REGISTRY: dict[str, ModelConfig] = {}


def register(*configs: ModelConfig) -> None:
    for cfg in configs:
        if cfg.name in _REGISTRY:
            raise ValueError(f"model {cfg.name!r} registered twice")
        if cfg.arch not in ARCHITECTURES:
            raise ValueError(f"model {cfg.name!r}: unknown architecture {cfg.arch!r}")
        _REGISTRY[cfg.name] = cfg


def _ensure_loaded() -> None:
    if not _REGISTRY:
        importlib.import_module("vitlab.models.configs")


def list_models(pattern: str = "*") -> list[str]:
    """Registered model names matching the shell-style ``pattern``, sorted."""
    _ensure_loaded()
    return sorted(n for n in _REGISTRY if fnmatch.fnmatch(n, pattern))


def get_config(name: str) -> ModelConfig:
    _ensure_loaded()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=5, cutoff=0.5)
        hint = f"; closest: {', '.join(close)}" if close else ""
        raise ValueError(f"unknown model {name!r}{hint} (vitlab.list_models() lists all {len(_REGISTRY)})")
    return _REGISTRY[name]


def architecture(arch: str) -> type[nn.Module]:
    module, cls = ARCHITECTURES[arch].split(":")
    return getattr(importlib.import_module(module), cls)


def create_model(name: str, **overrides: Any) -> nn.Module:
    """Build the named model; ``overrides`` replace config arguments (num_classes, img_size, in_chans,
    drop_path_rate, ...). The model carries ``model.meta`` (paper, source, input size, mean/std)."""
    cfg = get_config(name)
    cls = architecture(cfg.arch)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(set(overrides) - accepted)
    if unknown:
        raise ValueError(
            f"{name}: unknown option(s) {', '.join(unknown)}; {cls.__name__} accepts: {', '.join(sorted(accepted))}"
        )
    model = cls(**{**cfg.kwargs, **overrides})
    meta = cfg.meta()
    if "img_size" in overrides or "in_chans" in overrides:
        meta["input_size"] = ModelConfig(name, cfg.arch, {**cfg.kwargs, **overrides}, "", "").input_size
    model.meta = meta
    return model
