"""The registry of named vision models: :class:`ModelConfig` rows (written in :mod:`vitlab.models.zoo`),
one constructor per architecture, and the description of a model's expected input (``pretrained_cfg``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..common.registry import Registry
from ..data.datasets import IMAGENET_MEAN, IMAGENET_STD
from .base import feature_extractor, has_fixed_mixer, supports_dynamic_size
from .efficientnet import EfficientNet
from .pyramid import PyramidCPVT
from .regnet import RegNet
from .resnet import ResNet
from .t2t import T2TViT
from .timm_cfg import TIMM_CFG_KEYS
from .tnt import TNT
from .vit import VisionTransformer

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "vit": VisionTransformer,
    "tnt": TNT,
    "t2t": T2TViT,
    "pyramid": PyramidCPVT,
    "resnet": ResNet,  # the convolutional baselines (models/convnet.py: their stages are the blocks)
    "regnet": RegNet,
    "efficientnet": EfficientNet,
}
#: vitlab's own entries beside them (the published result, the paper, the training data of a checkpoint)
VITLAB_CFG_KEYS = ("top1", "weights_url", "paper", "data", "holdout")
#: what ``pretrained_cfg_overlay`` may change
CFG_KEYS = TIMM_CFG_KEYS + VITLAB_CFG_KEYS
LUMINANCE = (0.299, 0.587, 0.114)  # ITU-R 601: RGB statistics -> one grey channel


def channel_stats(values: Sequence[float], chans: int) -> tuple[float, ...]:
    """Per-channel normalisation statistics for ``chans`` input channels: RGB ones are combined by luminance
    for one channel; otherwise their mean is used for every channel."""
    values = tuple(float(v) for v in values)
    if len(values) == chans:
        return values
    if chans == 1 and len(values) == 3:
        return (sum(w * v for w, v in zip(LUMINANCE, values)),)
    return (sum(values) / len(values),) * chans


@dataclass(frozen=True)
class ModelConfig:
    """One named configuration: the architecture, its arguments, where they come from, and the evaluation
    protocol and result of its paper / official checkpoint (docs/models.md)."""

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
    crop_pct: float = 0.875  # evaluation: resize the shorter side to size / crop_pct, centre-crop size
    interpolation: str = "bicubic"
    top1: float | None = None  # the ImageNet top-1 (%) the paper / official README reports for this config
    weights_url: str = ""  # where the official checkpoint is published ("" = none)

    @property
    def input_size(self) -> tuple[int, int, int]:
        size = self.kwargs.get("img_size", 224)
        h, w = (size, size) if isinstance(size, int) else size
        return (self.kwargs.get("in_chans", 3), h, w)

    @property
    def weights_file(self) -> str:
        """The official checkpoint's file name, where its address names one."""
        name = self.weights_url.rsplit("/", 1)[-1]
        direct = self.weights_url.startswith("https://") and name.endswith((".pth", ".tar", ".bin", ".safetensors"))
        return name if direct else ""

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

    def pretrained_cfg(self, model: nn.Module) -> dict[str, Any]:
        """timm's ``pretrained_cfg`` of ``model`` built from this row: its input as built, the evaluation
        protocol (crop, interpolation, normalisation for its channels), head, and the published result."""
        chans = model.in_chans
        return {
            **dict.fromkeys(TIMM_CFG_KEYS),  # every timm field, unset unless below
            "custom_load": False,
            "architecture": self.name,
            "tag": self.name,
            **input_cfg(model),
            "interpolation": self.interpolation,
            "crop_pct": self.crop_pct,
            "crop_mode": "center",
            "mean": channel_stats(self.mean, chans),
            "std": channel_stats(self.std, chans),
            "num_classes": model.num_classes,
            "first_conv": model.first_conv,
            "classifier": model.classifier_names(),
            "paper": self.paper,
            "source": self.source,
            "top1": self.top1,
            "weights_url": self.weights_url,
            "file": self.weights_file,
            "origin_url": self.weights_url or None,
            "paper_name": self.paper or None,
            "license": None,  # the official checkpoints' licences differ; see each source
        }


def input_cfg(model: nn.Module) -> dict[str, Any]:
    """timm's description of a model's input as built: ``input_size``, ``pool_size`` (the token grid
    ``forward_features`` ends on), ``fixed_input_size`` (it computes at this size only) and the test / minimum
    sizes (none: evaluated at the training size; any multiple of the patch size where not fixed)."""
    chans = model.in_chans
    return {
        "input_size": (chans, *model.img_size),
        "pool_size": tuple(model.grid),
        "fixed_input_size": not accepts_any_size(model),
        "test_input_size": None,
        "min_input_size": None,
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


def list_models(filter: str | Sequence[str] = "*", exclude_filters: str | Sequence[str] = ()) -> list[str]:
    """Registered model names matching the shell-style ``filter`` (or any of a list) and none of
    ``exclude_filters``, sorted (timm's ``list_models``)."""
    return MODELS.names(filter or "*", exclude_filters or ())


def get_config(name: str) -> ModelConfig:
    return MODELS.get(name)


def check_overlay(overlay: dict[str, Any] | None) -> dict[str, Any]:
    overlay = dict(overlay or {})
    unknown = sorted(set(overlay) - set(CFG_KEYS))
    if unknown:
        raise ValueError(f"pretrained_cfg_overlay: unknown key(s) {', '.join(unknown)}; known: {', '.join(CFG_KEYS)}")
    return overlay


MAX_DEPTH = 1024  # a bound for blocks (the papers' deepest model has 32), so a typo cannot exhaust the memory


def build_model(
    name: str,
    pretrained_cfg_overlay: dict[str, Any] | None = None,
    features_only: bool = False,
    out_indices: int | Sequence[int] | None = None,
    feature_cls: str | None = None,
    **overrides: Any,
) -> nn.Module:
    """Build the named model with random weights; ``overrides`` replace config arguments (num_classes,
    img_size, in_chans, drop_path_rate, ...).

    The model carries how it was built (``model_name``, ``model_kwargs``: what ``save_pretrained`` writes),
    timm's ``pretrained_cfg`` (``pretrained_cfg_overlay`` replaces entries of it) and ``model.meta`` (paper,
    source, input size, mean/std). ``features_only=True`` returns timm's feature extractor
    (:class:`~vitlab.models.base.FeatureGetter`, timm's ``feature_cls='getter'``) of the blocks ``out_indices``
    (default: the last 3).
    The public ``vitlab.create_model`` (:mod:`vitlab.interop.pretrained`) is this plus weights (``pretrained=``,
    ``checkpoint_path=``); the layers below the public front build through this one.
    """
    overlay = check_overlay(pretrained_cfg_overlay)
    cfg = get_config(name)
    depth = overrides.get("depth")
    if isinstance(depth, int) and depth > MAX_DEPTH:  # from a command line, a saved config or a checkpoint
        raise ValueError(f"{name}: depth={depth} is more than {MAX_DEPTH} blocks (a typo, or a damaged saved "
                         "configuration); building it would exhaust the memory")  # fmt: skip
    model = MODELS.create(name, **overrides)
    describe(model, cfg, overrides, overlay)
    return feature_extractor(model, out_indices, feature_cls) if features_only else model


def accepts_any_size(model: nn.Module) -> bool:
    """Whether ``model`` as built runs at input sizes other than its own: :func:`supports_dynamic_size`, or a
    learned position table resampled on the fly (``dynamic_img_size``) with no mixer built for a token count."""
    if supports_dynamic_size(model):
        return True
    return bool(getattr(model, "dynamic_img_size", False)) and not has_fixed_mixer(model)


def describe(model: nn.Module, cfg: ModelConfig, overrides: dict[str, Any], overlay: dict[str, Any]) -> None:
    """Attach the build description (``model_name``, ``model_kwargs``, ``pretrained_cfg``, ``meta``)."""
    model.model_name = cfg.name
    model.model_kwargs = dict(overrides)
    model.pretrained_cfg = cfg.pretrained_cfg(model)
    model.meta = dataclasses.replace(cfg, kwargs={**cfg.kwargs, **overrides}).meta()  # input size as built
    overlay_cfg(model, overlay)


def overlay_cfg(model: nn.Module, overlay: dict[str, Any]) -> None:
    """Replace entries of ``model.pretrained_cfg`` (and the normalisation ``model.meta`` reports)."""
    model.pretrained_cfg = {**model.pretrained_cfg, **check_overlay(overlay)}
    model.meta = {**model.meta, "mean": model.pretrained_cfg["mean"], "std": model.pretrained_cfg["std"]}
