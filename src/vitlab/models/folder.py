"""Hugging Face-style model folders: ``config.json`` + ``model.safetensors`` + ``README.md`` (a model card).

``config.json`` names the registered model and the options it was built with (``model_args``) and holds
its ``pretrained_cfg`` (input size, crop, interpolation, normalisation, ...: timm's fields; vitlab's own
entries, the published result and the training data, under ``vitlab_cfg``); ``model.safetensors`` holds the
state_dict. The layout is timm's hub format too (``architecture`` = ``vitlab.<name>``, ``num_classes``,
``num_features``, ``model_args``), so ``timm.create_model("local-dir:<folder>")`` reads it once the timm
plug-in is registered. Reading a folder is reading JSON and raw tensors: nothing in it can run code.
``vitlab.from_pretrained(folder)`` builds the model again. Every entry of ``config.json`` the reader uses is
checked first (:func:`read_config`): a wrong type or value is one line naming the file and the entry.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from ..common.io import check_writable_folder, write_json_atomic, write_safetensors_atomic, write_text_atomic
from ..data.geometry import CROP_MODES, INTERPOLATIONS, MAX_CROP_PCT
from ..data.safe_files import read_regular
from .timm_cfg import TIMM_ARCH, TIMM_CFG_KEYS

FORMAT = "vitlab-pretrained"
VERSION = 1
CONFIG, WEIGHTS, CARD = "config.json", "model.safetensors", "README.md"
CONFIG_FIX = "write the folder again with save_pretrained (or vitlab convert --format folder)"
#: keywords of the build itself, never constructor options: a config.json naming one in model_args is refused
BUILD_KEYWORDS = ("pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "features_only", "out_indices",
                  "feature_cls", "checkpoint_path", "name")  # fmt: skip
#: constructor options that are counts: an integer >= 0 (not a bool, not 10.5, not "ten")
COUNT_OPTIONS = ("num_classes", "in_chans", "depth", "embed_dim", "num_heads", "patch_size")
CONFIG_LIMIT = 16 << 20  # a config.json holds a few kB (label names of 21k classes: ~1 MB)


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
    try:  # read_regular: a pipe named config.json is not waited on
        config = json.loads(read_regular(Path(path).expanduser() / CONFIG, "model config", CONFIG_FIX, CONFIG_LIMIT))
    except (OSError, ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return False
    return isinstance(config, dict) and config.get("format") == FORMAT


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and value == value and abs(value) != float("inf")
    )


def _check_cfg(cfg: dict[str, Any], bad) -> None:
    """The pretrained_cfg entries a model's data configuration reads (timm's meaning)."""
    # crop_pct and input_size are required where present; their test_ / min_ variants may be null
    for key in ("crop_pct", "test_crop_pct"):
        value = cfg.get(key)
        present = key in cfg and (value is not None or key == "crop_pct")
        if present and (not _is_number(value) or not 0 < value <= MAX_CROP_PCT):
            bad(f"pretrained_cfg.{key}", f"a number in (0, {MAX_CROP_PCT}]", value)
    for key in ("input_size", "test_input_size", "min_input_size"):
        value = cfg.get(key)
        present = key in cfg and (value is not None or key == "input_size")
        if present and (not isinstance(value, list) or len(value) != 3 or not all(_is_int(v) and v > 0 for v in value)):
            bad(f"pretrained_cfg.{key}", "[channels, height, width], positive integers", value)
    for key in ("mean", "std"):
        value = cfg.get(key)
        if key in cfg and (not isinstance(value, list) or not value or not all(_is_number(v) for v in value)):
            bad(f"pretrained_cfg.{key}", "a list of numbers, one per channel", value)
    if "std" in cfg and not all(v > 0 for v in cfg["std"]):
        bad("pretrained_cfg.std", "positive numbers", cfg["std"])
    if "interpolation" in cfg and cfg["interpolation"] not in INTERPOLATIONS:
        bad("pretrained_cfg.interpolation", f"one of {', '.join(INTERPOLATIONS)}", cfg["interpolation"])
    if "crop_mode" in cfg and cfg["crop_mode"] not in CROP_MODES:
        bad("pretrained_cfg.crop_mode", f"one of {', '.join(CROP_MODES)}", cfg["crop_mode"])
    if "num_classes" in cfg and not (_is_int(cfg["num_classes"]) and cfg["num_classes"] >= 0):
        bad("pretrained_cfg.num_classes", "an integer >= 0", cfg["num_classes"])
    names = cfg.get("label_names")
    if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        bad("pretrained_cfg.label_names", "a list of class names (or null)", names)
    if cfg.get("data") is not None and not isinstance(cfg["data"], str):
        bad("vitlab_cfg.data", "a dataset spec such as 'cifar10:/data' (or null)", cfg["data"])
    if cfg.get("holdout") is not None and not (_is_number(cfg["holdout"]) and cfg["holdout"] >= 0):
        bad("vitlab_cfg.holdout", "a count or fraction >= 0 (or null)", cfg["holdout"])


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a model folder, checked: ``{"model_name", "model_kwargs", "pretrained_cfg",
    "num_classes"}`` (``model_args`` and ``vitlab_cfg`` as written; a version-1 folder of earlier vitlab names
    them ``model_kwargs`` and keeps every entry in ``pretrained_cfg``; ``num_classes``: the top-level entry,
    None when absent). Every entry used is checked (types, ranges, build keywords such as
    ``pretrained_cfg_overlay`` in ``model_args``): one ValueError line naming the file and the entry."""
    folder = Path(folder).expanduser()
    path = folder / CONFIG
    if not path.exists():
        raise FileNotFoundError(f"{folder} is not a vitlab model folder: no {CONFIG} (written by save_pretrained)")
    raw = read_regular(path, "model config", CONFIG_FIX, CONFIG_LIMIT)
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path} is not valid JSON ({' '.join(str(e).split())[:120]}); {CONFIG_FIX}") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ValueError(f"{path} is not a vitlab model config (format {FORMAT!r} expected)")

    def bad(entry: str, expected: str, value: Any) -> None:
        raise ValueError(f"{path}: {entry} must be {expected}, got {_shown(value)}; {CONFIG_FIX}")

    version = config.get("version", VERSION)
    if not _is_int(version) or version < 1:
        bad("version", f"an integer format version 1..{VERSION}", version)
    if version > VERSION:
        raise ValueError(f"{path} has format version {version}; this vitlab reads up to {VERSION}")
    kwargs = config.get("model_args", config.get("model_kwargs", {}))
    cfg, extra = config.get("pretrained_cfg", {}), config.get("vitlab_cfg", {})
    if not isinstance(config.get("model_name"), str) or not all(isinstance(d, dict) for d in (kwargs, cfg, extra)):
        raise ValueError(f"{path}: model_name must be a string, model_args, pretrained_cfg and vitlab_cfg objects")
    for key in ("num_classes", "num_features"):
        if key in config and not (_is_int(config[key]) and config[key] >= 0):
            bad(key, "an integer >= 0", config[key])
    reserved = sorted(set(kwargs) & set(BUILD_KEYWORDS))
    if reserved:
        bad(
            f"model_args.{reserved[0]}",
            "absent (a keyword of the build, not a constructor option)",
            kwargs[reserved[0]],
        )
    for key in COUNT_OPTIONS:
        if key in kwargs and not (_is_int(kwargs[key]) and kwargs[key] >= 0):
            bad(f"model_args.{key}", "an integer >= 0", kwargs[key])
    if "num_classes" in config and "num_classes" in kwargs and config["num_classes"] != kwargs["num_classes"]:
        bad("num_classes", f"the num_classes of model_args ({kwargs['num_classes']})", config["num_classes"])
    _check_cfg(cfg | extra, bad)
    if not (folder / WEIGHTS).exists():
        raise FileNotFoundError(f"{folder} has no {WEIGHTS}")
    return {
        "model_name": config["model_name"],
        "model_kwargs": from_json(kwargs),
        "pretrained_cfg": from_json(cfg | extra),
        "num_classes": config.get("num_classes"),
    }
