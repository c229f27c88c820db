"""Models with weights in one call: ``vitlab.create_model(name, pretrained=..., checkpoint_path=...)`` and
``vitlab.from_pretrained(folder)``.

Weights never come from the network. ``pretrained=True`` looks in the local weights folder
(``$VITLAB_WEIGHTS``, else ``$XDG_CACHE_HOME/vitlab/weights``, else ``~/.cache/vitlab/weights``) for, in
order, a model folder ``<name>/`` (written by ``save_pretrained``), ``<name>.safetensors``, or the official
checkpoint under its published file name (converted on loading); a missing file is one line naming the
folder and the file names. ``checkpoint_path`` takes any file :func:`vitlab.checkpoint.load_model` reads (a
``vitlab train`` checkpoint, safetensors, an official or timm checkpoint: detected, converted, loaded
strictly with its report) or a model folder.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from .checkpoint import load_folder, load_model
from .models import create_model as build_model
from .models import get_config
from .models.base import FeatureGetter
from .models.folder import is_model_folder
from .models.registry import check_overlay, overlay_cfg

WEIGHTS_ENV = "VITLAB_WEIGHTS"


def weights_dir() -> Path:
    """The local weights folder: ``$VITLAB_WEIGHTS``, else the user cache (``$XDG_CACHE_HOME`` or
    ``~/.cache``) ``/vitlab/weights``."""
    if os.environ.get(WEIGHTS_ENV):
        return Path(os.environ[WEIGHTS_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "vitlab" / "weights"


def weight_candidates(name: str) -> list[str]:
    """The file names ``pretrained=True`` accepts for ``name``, in the order they are tried."""
    official = get_config(name).weights_file
    return [f"{name}/", f"{name}.safetensors"] + ([official] if official else [])


def find_weights(name: str) -> Path:
    """The weights of ``name`` in :func:`weights_dir`; FileNotFoundError naming where it looked and for what."""
    folder = weights_dir()
    for candidate in weight_candidates(name):
        path = folder / candidate.rstrip("/")
        if (candidate.endswith("/") and is_model_folder(path)) or (not candidate.endswith("/") and path.is_file()):
            return path
    where = f"${WEIGHTS_ENV}" if os.environ.get(WEIGHTS_ENV) else f"the user cache (set ${WEIGHTS_ENV} to change it)"
    url = get_config(name).weights_url
    hint = f"; the official checkpoint: {url}" if url else "; no official checkpoint is published for it"
    raise FileNotFoundError(
        f"no pretrained weights for {name} in {folder} ({where}): expected "
        f"{' or '.join(weight_candidates(name))} there (vitlab never downloads){hint}"
    )


def from_pretrained(folder: str | os.PathLike, **overrides: Any) -> nn.Module:
    """The model saved in ``folder`` by ``model.save_pretrained(folder)``, in eval mode (Hugging Face's
    ``from_pretrained``). Only ``config.json`` and ``model.safetensors`` are read; nothing in them runs.
    ``overrides`` change build options that keep the weights' shapes (``drop_path_rate``, ...)."""
    return load_folder(folder, **overrides)


def create_model(
    name: str,
    pretrained: bool = False,
    checkpoint_path: str | os.PathLike | None = None,
    pretrained_cfg_overlay: dict[str, Any] | None = None,
    features_only: bool = False,
    out_indices: int | Sequence[int] | None = None,
    **overrides: Any,
) -> nn.Module:
    """Build the named model (timm's ``create_model``), with weights when asked.

    Args:
        name: a registered model (``vitlab.list_models()``).
        pretrained: load the model's weights from the local weights folder (:func:`find_weights`), or from
            ``pretrained_cfg_overlay["file"]`` when given (timm's way to name a local file).
        checkpoint_path: load these weights instead (see the module docstring).
        pretrained_cfg_overlay: entries replacing the model's ``pretrained_cfg`` (crop_pct, mean, ...).
        features_only, out_indices: return timm's feature extractor of these blocks (default the last 3).
        overrides: build options (num_classes, img_size, in_chans, drop_path_rate, ...). A ``num_classes``
            other than the weights' gets a new, randomly initialised head (fine-tuning), as timm.

    Returns the model in training mode, as ``torch.nn`` builds it; ``model.meta["weights"]`` says where its
    weights came from.
    """
    overlay = check_overlay(pretrained_cfg_overlay)
    local = overlay.pop("file", None) or None
    if pretrained and checkpoint_path:
        raise ValueError("pass either pretrained=True or checkpoint_path=..., not both")
    path = checkpoint_path or (local if pretrained and local else find_weights(name) if pretrained else None)
    if path is None:
        model = build_model(name, pretrained_cfg_overlay=overlay, **overrides)
    else:
        model = _with_weights(name, Path(path).expanduser(), overlay, overrides)
    return FeatureGetter(model, out_indices) if features_only else model


def _with_weights(name: str, path: Path, overlay: dict[str, Any], overrides: dict[str, Any]) -> nn.Module:
    """The model with the weights at ``path``, built as they were (classes included), then given a new head
    for another ``num_classes`` and ``overlay`` on its pretrained_cfg."""
    num_classes = overrides.pop("num_classes", None)
    if not path.exists():
        raise FileNotFoundError(f"weights {path} not found")
    model = load_model(name, path, **overrides)
    if num_classes is not None and num_classes != model.num_classes:
        model.reset_classifier(num_classes)
    overlay_cfg(model, overlay)
    return model.train()
