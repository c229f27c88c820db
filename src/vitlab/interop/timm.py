"""vitlab's models in timm's registry: ``timm.create_model("vitlab.refiner_vit_s")`` after :func:`register`.

timm splits a model name at its first dot into an architecture and a pretrained tag
(``"vitlab.refiner_vit_s"`` -> ``"vitlab"``, ``"refiner_vit_s"``), so vitlab registers one architecture,
``vitlab``, whose tags are the vitlab model names, each with its ``pretrained_cfg`` (input size, crop,
interpolation, mean/std, pool size, whether the input size is fixed: so timm's ``resolve_data_config``, its
tests and ``train.py --model vitlab.NAME`` use the model's own input, 32 px for the ``*_mini`` models).
timm lists the tagged names with ``timm.list_models("vitlab.*", include_tags=True)`` (without tags it lists
architectures: ``vitlab``, which as every timm architecture builds its default tag, :data:`DEFAULT_MODEL`).

The entry point builds the model with :func:`vitlab.create_model`; ``pretrained=True`` reads the local
weights folder (never the network), timm's ``pretrained_cfg_overlay={"file": ...}`` (``train.py
--pretrained-path``) names a local file, and ``timm.create_model("local-dir:FOLDER")`` reads a folder written
by vitlab's ``save_pretrained`` or by timm's own ``save_for_hf`` of a vitlab model. ``features_only=True``
(``feature_cls`` None or ``'getter'``), ``in_chans`` (with pretrained weights: the first layer adapted),
``device`` and ``dtype`` follow timm's factory. timm's ``train.py`` and ``validate.py`` take the models once
this module's :func:`register` has run in their process (docs/ecosystem.md shows a wrapper of a few lines).

Only the registry functions ``register_model`` and ``generate_default_cfgs`` of ``timm.models`` are used.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch import nn

from ..common.extras import require
from ..models import build_model, list_models
from ..models.registry import overlay_cfg
from ..models.timm_cfg import TIMM_ARCH, TIMM_CFG_KEYS
from .pretrained import create_model

#: the timm architecture name; models are "vitlab.<name>"
ARCH = TIMM_ARCH
#: what ``timm.create_model("vitlab")`` builds (timm's default tag of an architecture): DeiT-Ti, the baseline
DEFAULT_MODEL = "deit_tiny_patch16_224"
#: entries of a vitlab pretrained_cfg that timm does not get: where vitlab's local weights would be (timm would
#: take a file name for weights it can download)
LOCAL_ONLY = ("file", "url", "architecture", "tag")
#: what timm's registry reads from this module (set by register)
default_cfgs: dict[str, Any] = {}


def timm_pretrained_cfg(name: str) -> dict[str, Any]:
    """The timm ``pretrained_cfg`` dict of a vitlab model (built on the meta device: no memory used)."""
    with torch.device("meta"):
        cfg = build_model(name).pretrained_cfg
    out = {k: v for k, v in cfg.items() if k in TIMM_CFG_KEYS and k not in LOCAL_ONLY and v is not None}
    if cfg.get("top1") is not None:
        out["notes"] = (f"ImageNet top-1 {cfg['top1']} % reported for this configuration",)
    return out


def _model_name(pretrained_cfg: Any) -> str:
    """The vitlab model timm asks for: the pretrained tag (a string, or a cfg object / dict carrying it, or
    an ``architecture`` ``vitlab.<name>`` as timm's hub config has it); the default model without one."""
    tag = pretrained_cfg
    if tag is not None and not isinstance(tag, str):
        get = tag.get if isinstance(tag, dict) else lambda key: getattr(tag, key, None)
        arch = get("architecture") or ""
        tag = get("tag") or (arch[len(ARCH) + 1 :] if arch.startswith(f"{ARCH}.") else None)
    return tag or DEFAULT_MODEL


def _cfg_file(pretrained_cfg: Any) -> str | None:
    """The local weights a pretrained_cfg names (timm's ``local-dir:`` loader sets ``file`` to the folder)."""
    if isinstance(pretrained_cfg, dict):
        return pretrained_cfg.get("file")
    return None if isinstance(pretrained_cfg, str | None) else getattr(pretrained_cfg, "file", None)


def vitlab(
    pretrained: bool = False, pretrained_cfg: Any = None, pretrained_cfg_overlay: dict | None = None, **kwargs: Any
) -> nn.Module:
    """timm's entry point for every vitlab model (timm passes the tag, or a hub config, as ``pretrained_cfg``)."""
    kwargs.pop("cache_dir", None)  # timm's hub cache: vitlab reads its local weights folder only
    kwargs.pop("pretrained_model_args", None)  # timm's record of a hub config's model_args (also in kwargs)
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    name = _model_name(pretrained_cfg)
    overlay = dict(pretrained_cfg_overlay or {})
    if isinstance(overlay.get("num_classes"), int) and overlay["num_classes"] < 0:
        # train.py --pretrained-path passes num_classes=-1 ("adapt the head"): vitlab's head follows the
        # num_classes option already, and a -1 kept in pretrained_cfg would be saved with the model
        del overlay["num_classes"]
    if pretrained and "file" not in overlay and _cfg_file(pretrained_cfg):
        overlay["file"] = _cfg_file(pretrained_cfg)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = create_model(name, pretrained=pretrained, pretrained_cfg_overlay=overlay, **kwargs)
    if dtype is not None:
        model.to(dtype=dtype)
    if not kwargs.get("features_only"):  # timm's hub export names the architecture from here
        overlay_cfg(model, {"architecture": f"{ARCH}.{name}", "tag": name})
    return model


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
        table = {
            n + ("*" if n == f"{ARCH}.{DEFAULT_MODEL}" else ""): timm_pretrained_cfg(n[len(ARCH) + 1 :]) for n in names
        }
        default_cfgs.update(timm_models.generate_default_cfgs(table))
        timm_models.register_model(sys.modules[__name__].vitlab)
    return names
