"""Hugging Face-style model folders: ``config.json`` + ``model.safetensors`` + ``README.md`` (a model card).

``config.json`` names the registered model and the options it was built with (``model_args``) and holds
its ``pretrained_cfg`` (input size, crop, interpolation, normalisation, ...: timm's fields; vitlab's own
entries, the published result and the training data, under ``vitlab_cfg``); ``model.safetensors`` holds the
state_dict. The layout is timm's hub format too (``architecture`` = ``vitlab.<name>``, ``num_classes``,
``num_features``, ``model_args``), so ``timm.create_model("local-dir:<folder>")`` reads it once the timm
plug-in is registered. Reading a folder is reading JSON and raw tensors: nothing in it can run code.
``vitlab.from_pretrained(folder)`` builds the model again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from ..common.io import check_writable_folder, write_json_atomic, write_safetensors_atomic, write_text_atomic
from .timm_cfg import TIMM_ARCH, TIMM_CFG_KEYS

FORMAT = "vitlab-pretrained"
VERSION = 1
CONFIG, WEIGHTS, CARD = "config.json", "model.safetensors", "README.md"


def to_json(value: Any, what: str) -> Any:
    """``value`` with tuples as lists; ValueError for what JSON cannot hold."""
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"{what}: only string keys can be saved, got {list(value)}")
        return {k: to_json(v, f"{what}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v, what) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise ValueError(f"{what}: a {type(value).__name__} cannot be saved in config.json")


def from_json(value: Any) -> Any:
    """The inverse of :func:`to_json`: JSON lists become tuples (the form the constructors are written for)."""
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(from_json(v) for v in value)
    return value


def model_card(model: nn.Module, folder: Path) -> str:
    cfg = model.pretrained_cfg
    chans, h, w = cfg["input_size"]
    resize = round(min(h, w) / cfg["crop_pct"])
    options = ", ".join(f"{k}={v!r}" for k, v in model.model_kwargs.items()) or "none"
    lines = [
        f"# {model.model_name}",
        "",
        f"A vitlab model: `{model.model_name}`.",
        "",
        f"- paper: {cfg.get('paper') or 'n/a'}",
        f"- configuration: {cfg.get('source') or 'n/a'}; build options: {options}",
        f"- input: {chans} x {h} x {w}; evaluation: resize the shorter side to {resize} px ({cfg['interpolation']}), "
        f"centre-crop {h} x {w}, normalise with mean {tuple(cfg['mean'])}, std {tuple(cfg['std'])}",
        f"- classes: {cfg['num_classes']}",
        f"- weights: {getattr(model, 'meta', {}).get('weights', 'n/a')}",
    ]
    if cfg.get("top1") is not None:
        lines.append(f"- ImageNet top-1 reported for this configuration: {cfg['top1']} %")
    lines += [
        "",
        "```python",
        "import vitlab",
        f'model = vitlab.from_pretrained("{folder.name}")  # reads config.json and model.safetensors; runs no code',
        "```",
        "",
    ]
    return "\n".join(lines)


def save_pretrained(model: nn.Module, folder: str | os.PathLike) -> Path:
    """Write ``model`` as a model folder (see the module docstring); the weights first, ``config.json`` last,
    each file atomically. The model must have been built by ``build_model`` or ``vitlab.create_model``, which record its name."""
    name = getattr(model, "model_name", None)
    if name is None:
        raise ValueError(
            f"this {type(model).__name__} was built from its class, so its configuration is unknown; build it "
            f"with vitlab.create_model(name, **options) to save it as a folder"
        )
    folder = check_writable_folder(Path(folder).expanduser(), "save_pretrained folder")
    cfg = dict(model.pretrained_cfg)
    config = {
        "format": FORMAT,
        "version": VERSION,
        "architecture": f"{TIMM_ARCH}.{name}",
        "num_classes": model.num_classes,
        "num_features": model.num_features,
        "model_name": name,
        "model_args": to_json(dict(model.model_kwargs), "model_args"),
        "pretrained_cfg": to_json({k: v for k, v in cfg.items() if k in TIMM_CFG_KEYS}, "pretrained_cfg"),
        "vitlab_cfg": to_json({k: v for k, v in cfg.items() if k not in TIMM_CFG_KEYS}, "vitlab_cfg"),
    }
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors_atomic(model.state_dict(), folder / WEIGHTS, {"format": "pt", "writer": "vitlab", "model": name})
    write_text_atomic(folder / CARD, model_card(model, folder))
    write_json_atomic(folder / CONFIG, config)
    return folder


def is_model_folder(path: str | os.PathLike) -> bool:
    return (Path(path).expanduser() / CONFIG).is_file()


def is_vitlab_folder(path: str | os.PathLike) -> bool:
    """A folder ``save_pretrained`` wrote (its ``config.json`` says so), not one of another library."""
    try:
        config = json.loads((Path(path).expanduser() / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and config.get("format") == FORMAT


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a model folder, checked: ``{"model_name", "model_kwargs", "pretrained_cfg"}``
    (``model_args`` and ``vitlab_cfg`` as written; a version-1 folder of earlier vitlab names them
    ``model_kwargs`` and keeps every entry in ``pretrained_cfg``)."""
    folder = Path(folder).expanduser()
    path = folder / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a vitlab model folder: no {CONFIG} (written by save_pretrained)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ValueError(f"{path} is not a vitlab model config (format {FORMAT!r} expected)")
    if config.get("version", 0) > VERSION:
        raise ValueError(f"{path} has format version {config['version']}; this vitlab reads up to {VERSION}")
    kwargs = config.get("model_args", config.get("model_kwargs", {}))
    cfg, extra = config.get("pretrained_cfg", {}), config.get("vitlab_cfg", {})
    if not isinstance(config.get("model_name"), str) or not all(isinstance(d, dict) for d in (kwargs, cfg, extra)):
        raise ValueError(f"{path}: model_name must be a string, model_args, pretrained_cfg and vitlab_cfg objects")
    if not (folder / WEIGHTS).is_file():
        raise FileNotFoundError(f"{folder} has no {WEIGHTS}")
    return {
        "model_name": config["model_name"],
        "model_kwargs": from_json(kwargs),
        "pretrained_cfg": from_json(cfg | extra),
    }
