"""Reading a vitlab checkpoint back: the file (and a sharded run's shards), and the model it holds.

:func:`load_checkpoint` reads a file written by :func:`vitlab.checkpoint.save_checkpoint` without running
code (:mod:`.safeload`) and checks it is one; a sharded checkpoint's whole weights are gathered from its
shard folder (:mod:`.sharded`). A checkpoint records the model's registered name and the constructor
overrides it was built with, so :func:`model_from_checkpoint` rebuilds the same model, and loading it into
another model is a clear error, not a wall of missing-key messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models import build_model
from .format import FORMAT
from .safeload import load_file
from .sharded import read_sharded_weights


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", weights: bool = True) -> dict[str, Any]:
    """Read a vitlab checkpoint without running code (:func:`vitlab.checkpoint.safeload.load_file`: format
    check, ``weights_only=True``, checksum); one clear line for missing, corrupt or foreign files.

    A sharded checkpoint's whole weights are read from its shards into ``model`` unless ``weights`` is
    False (a run that resumes reads them into its sharded model itself: :func:`vitlab.engine.checkpointing.restore_weights_and_optimizer`)."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "last.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} not found; pass the last.pt of a `vitlab train` or `vitlab lm train` run (or its folder)"
        )
    ckpt = load_file(path, map_location)
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT or "model_name" not in ckpt:
        raise ValueError(
            f"{path} is not a vitlab checkpoint (no model name recorded); pass a file written by `vitlab train`"
        )
    ckpt["path"] = str(path)
    if ckpt.get("sharded") and weights:
        ckpt["model"] = read_sharded_weights(shard_folder(ckpt))
    if not isinstance(ckpt.get("model"), dict) and not (ckpt.get("sharded") and not weights):
        raise ValueError(f"checkpoint {path} holds no model weights; pass a file written by `vitlab train`")
    return ckpt


def shard_folder(ckpt: dict[str, Any]) -> Path:
    """The folder of a sharded checkpoint's weights and optimizer state (beside the checkpoint file)."""
    rel = Path(ckpt["sharded"])
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"checkpoint {ckpt['path']} points outside its folder ({rel}); it was not written by vitlab")
    return Path(ckpt["path"]).parent / rel


def describe_mismatch(missing: list[str], unexpected: list[str], shapes: list[str]) -> str:
    """The keys that do not fit, a few of each kind, in one line."""
    parts = []
    for what, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes)):
        if keys:
            more = f" (+{len(keys) - 3} more)" if len(keys) > 3 else ""
            parts.append(f"{what}: {', '.join(keys[:3])}{more}")
    return "; ".join(parts)


def load_state_checked(model: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """``load_state_dict(strict=True)`` with one readable line on a mismatch instead of a long RuntimeError."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or unexpected or shapes:
        raise ValueError(f"{what} does not fit the model: {describe_mismatch(missing, unexpected, shapes)}")
    model.load_state_dict(state)


def is_lm_checkpoint(ckpt: Mapping[str, Any]) -> bool:
    """Whether ``ckpt`` was written by ``vitlab lm train`` (a sequence model over a vocabulary)."""
    kwargs = ckpt.get("model_kwargs")
    return "data" in ckpt and isinstance(kwargs, Mapping) and "vocab_size" in kwargs


def check_image_classifier(ckpt: Mapping[str, Any]) -> None:
    """One line pointing to ``vitlab lm`` when ``ckpt`` holds a sequence model, not an image classifier."""
    if is_lm_checkpoint(ckpt):
        raise ValueError(
            f"{ckpt.get('path', 'the checkpoint')} was written by `vitlab lm train` (the sequence model "
            f"{ckpt.get('model_name')!r}), not by `vitlab train`; use `vitlab lm eval` or `vitlab lm sample` with it"
        )


def check_model_name(ckpt: dict[str, Any], model_name: str) -> None:
    """One line when ``ckpt`` holds another model than ``model_name`` (or a sequence model)."""
    check_image_classifier(ckpt)
    if ckpt["model_name"] != model_name:
        raise ValueError(
            f"checkpoint {ckpt.get('path', '')} holds a {ckpt['model_name']!r} model, not {model_name!r}; "
            f"use --model {ckpt['model_name']} or a checkpoint of {model_name}"
        )


def model_from_checkpoint(ckpt: dict[str, Any], ema: bool = False, **overrides: Any) -> nn.Module:
    """Rebuild the checkpoint's model (its name and constructor overrides, plus ``overrides``) with its
    weights (the EMA weights with ``ema=True``)."""
    model = build_model(ckpt["model_name"], **{**ckpt.get("model_kwargs", {}), **overrides})
    if ema:
        if not ckpt.get("ema"):
            raise ValueError(f"checkpoint {ckpt.get('path', '')} has no EMA weights (trained without --ema)")
        state = ckpt["ema"]["module"]
    else:
        state = ckpt["model"]
    load_state_checked(model, state, f"checkpoint {ckpt.get('path', '')}")
    return model
