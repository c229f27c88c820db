"""The evaluation data configuration of a model, in timm's format: what the image transform needs.

:func:`resolve_data_config` reads only the model's ``pretrained_cfg`` attribute (any object with one: a
vitlab model, a timm model, a feature extractor), so the data layer stays independent of the models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .datasets import CIFAR10_MEAN, CIFAR10_STD, IMAGENET_MEAN, IMAGENET_STD, MNIST_MEAN, MNIST_STD
from .spec import SPEC_HELP, DataSpec  # noqa: F401  (SPEC_HELP: its older home)

DEFAULT_CROP_PCT = 0.875


def _size(value: Any) -> tuple[int, int]:
    return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))


def resolve_data_config(
    args: Mapping[str, Any] | Any | None = None,
    pretrained_cfg: Mapping[str, Any] | None = None,
    model: Any = None,
) -> dict[str, Any]:
    """``{"input_size": (C, H, W), "interpolation", "mean", "std", "crop_pct", "crop_mode"}`` (timm's keys).

    Taken from ``pretrained_cfg`` (default: ``model.pretrained_cfg``), each entry replaced by ``args`` when
    given there (``input_size``, or ``img_size`` with ``in_chans``, ``interpolation``, ``mean``, ``std``,
    ``crop_pct``, ``crop_mode``; None entries ignored). ``resolve_data_config(model)`` works too. Defaults
    where neither says: 3 x 224 x 224, bicubic, ImageNet statistics, crop 0.875, centre crop.
    """
    if args is not None and not isinstance(args, Mapping):  # resolve_data_config(model)
        model, args = args, None
    args = {k: v for k, v in dict(args or {}).items() if v is not None}
    cfg = dict(pretrained_cfg if pretrained_cfg is not None else getattr(model, "pretrained_cfg", None) or {})
    chans, h, w = cfg.get("input_size", (3, 224, 224))
    chans = int(args.get("in_chans", chans))
    if "input_size" in args:
        chans, h, w = (int(v) for v in args["input_size"])
    elif "img_size" in args:
        h, w = _size(args["img_size"])
    out = {
        "input_size": (chans, int(h), int(w)),
        "interpolation": args.get("interpolation") or cfg.get("interpolation") or "bicubic",
        "mean": tuple(args.get("mean") or cfg.get("mean") or IMAGENET_MEAN),
        "std": tuple(args.get("std") or cfg.get("std") or IMAGENET_STD),
        "crop_pct": float(args.get("crop_pct") or cfg.get("crop_pct") or DEFAULT_CROP_PCT),
        "crop_mode": args.get("crop_mode") or cfg.get("crop_mode") or "center",
    }
    for key in ("mean", "std"):
        if len(out[key]) == 1 and chans > 1:
            out[key] = out[key] * chans
        if len(out[key]) != chans:
            raise ValueError(f"{key} {out[key]} has {len(out[key])} values for {chans}-channel images")
    if out["crop_pct"] <= 0:
        raise ValueError(f"crop_pct must be positive, got {out['crop_pct']}")
    return out


def spec_kind(spec: str | DataSpec) -> str:
    """The kind of a dataset spec (a bare folder by its contents): :attr:`DataSpec.kind`."""
    return DataSpec.parse(spec).kind


def spec_stats(spec: str | DataSpec, channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The normalisation ``vitlab train`` uses for a dataset spec (without reading the data): the dataset's
    statistics for MNIST and CIFAR-10, ImageNet's (grey: 0.5) for image folders and shards."""
    try:
        kind = DataSpec.parse(spec).kind
    except ValueError:  # a checkpoint's bare folder that is gone: normalised as the image folder it was
        kind = "folder"
    if kind in ("mnist", "mnist-idx"):
        return MNIST_MEAN, MNIST_STD
    if kind == "cifar10":
        return CIFAR10_MEAN, CIFAR10_STD
    if kind == "cifar100":
        from .transfer_sets import CIFAR100_MEAN, CIFAR100_STD

        return CIFAR100_MEAN, CIFAR100_STD
    return (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.5,) * channels, (0.5,) * channels)


def training_data_cfg(spec: str | DataSpec, channels: int, holdout: int | float | None = None) -> dict[str, Any]:
    """The data configuration of a model trained by ``vitlab train`` on ``spec`` (``holdout``: the images it
    held out for evaluation): its normalisation, and whole images resized to the input size (crop 1.0,
    bilinear), as training and evaluation there see them."""
    mean, std = spec_stats(spec, channels)
    held = {} if holdout is None else {"holdout": holdout}
    return {"data": str(spec), **held, "mean": mean, "std": std, "crop_pct": 1.0, "interpolation": "bilinear"}
