"""vitlab's models in timm's registry: ``timm.create_model("vitlab.refiner_vit_s")`` after :func:`register`.

timm splits a model name at its first dot into an architecture and a pretrained tag
(``"vitlab.refiner_vit_s"`` -> ``"vitlab"``, ``"refiner_vit_s"``), so vitlab registers one architecture,
``vitlab``, whose tags are the vitlab model names, each with its ``pretrained_cfg`` (input size, crop,
interpolation, mean/std: so timm's ``resolve_data_config`` and ``train.py --model vitlab.NAME`` use the
model's own input, 32 px for the ``*_mini`` models). The entry point builds the model with
:func:`vitlab.create_model`; ``pretrained=True`` reads the local weights folder (never the network), and
timm's ``pretrained_cfg_overlay={"file": ...}`` (``train.py --pretrained-path``) names a local file.

Only the registry functions ``register_model`` and ``generate_default_cfgs`` of ``timm.models`` are used.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ..extras import require
from ..models import build_model, list_models
from ..pretrained import create_model

#: the timm architecture name; models are "vitlab.<name>"
ARCH = "vitlab"
#: timm PretrainedCfg fields filled from a vitlab pretrained_cfg (timm's name <- vitlab's)
TIMM_FIELDS = {
    "input_size": "input_size",
    "interpolation": "interpolation",
    "crop_pct": "crop_pct",
    "crop_mode": "crop_mode",
    "mean": "mean",
    "std": "std",
    "num_classes": "num_classes",
    "first_conv": "first_conv",
    "classifier": "classifier",
    "origin_url": "weights_url",
    "paper_name": "paper",
}
#: what timm's registry reads from this module (set by register)
default_cfgs: dict[str, Any] = {}


def timm_pretrained_cfg(name: str) -> dict[str, Any]:
    """The timm ``pretrained_cfg`` dict of a vitlab model (built on the meta device: no memory used)."""
    with torch.device("meta"):
        cfg = build_model(name).pretrained_cfg
    out = {timm: cfg[ours] for timm, ours in TIMM_FIELDS.items() if cfg.get(ours) not in (None, "")}
    if cfg.get("top1") is not None:
        out["notes"] = (f"ImageNet top-1 {cfg['top1']} % reported for this configuration",)
    return out


def _model_name(pretrained_cfg: Any) -> str:
    """The vitlab model timm asks for: the pretrained tag (a string, or a cfg object / dict carrying it)."""
    tag = pretrained_cfg
    if tag is not None and not isinstance(tag, str):
        tag = tag.get("tag") if isinstance(tag, dict) else getattr(tag, "tag", None)
    if not tag:
        raise ValueError(
            f"name a vitlab model after the dot: timm.create_model('{ARCH}.<name>'), e.g. '{ARCH}.deit_mini'"
        )
    return tag


def vitlab(
    pretrained: bool = False, pretrained_cfg: Any = None, pretrained_cfg_overlay: dict | None = None, **kwargs: Any
) -> nn.Module:
    """timm's entry point for every vitlab model (timm passes the tag as ``pretrained_cfg``)."""
    kwargs.pop("cache_dir", None)  # timm's hub cache: vitlab reads its local weights folder only
    return create_model(
        _model_name(pretrained_cfg), pretrained=pretrained, pretrained_cfg_overlay=pretrained_cfg_overlay, **kwargs
    )


vitlab.__module__ = __name__


def register(timm_models: Any = None) -> list[str]:
    """Register every vitlab model in timm's registry as ``vitlab.<name>``; returns those names.

    ``timm_models``: the module holding ``register_model`` and ``generate_default_cfgs`` (default:
    ``timm.models``). Registering twice does nothing more.
    """
    if timm_models is None:
        timm_models = require("timm.models", purpose="the timm plug-in")
    names = [f"{ARCH}.{n}" for n in list_models()]
    if ARCH not in default_cfgs:
        default_cfgs.update(
            timm_models.generate_default_cfgs({n: timm_pretrained_cfg(n[len(ARCH) + 1 :]) for n in names})
        )
        timm_models.register_model(sys.modules[__name__].vitlab)
    return names
