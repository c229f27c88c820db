"""Training checkpoints: written atomically, read without executing code, tied to the model they hold.

A checkpoint is a dict of tensors and plain Python values (``torch.load(weights_only=True)`` reads it, so a
file from elsewhere can never run code), with a checksum of its contents that every read verifies. It records the model's registered name and the constructor
overrides it was built with, so :func:`model_from_checkpoint` rebuilds the same model and loading it into
another model is a clear error, not a wall of missing-key messages.

:func:`load_model` is the one way the tools get a model with its weights: random, from a vitlab checkpoint,
or from any other weights file (safetensors, an official or timm checkpoint) through :mod:`vitlab.convert`.

Layout (``format: "vitlab-checkpoint"``): ``model_name``, ``model_kwargs``, ``model`` (state_dict), and for
resuming ``optimizer``, ``scheduler``, ``ema``, ``scaler``, ``epoch`` (completed epochs), ``step``, ``rng``
(per-rank torch RNG states), ``config`` (the training options) and ``metrics`` (the last epoch's); since
version 2 ``checksum`` (crc32s of every tensor and of the plain values).

A sharded run (FSDP) keeps its weights and optimizer state out of the file: ``sharded`` names a folder beside
it (``shards/<name>``) written through ``torch.distributed.checkpoint`` by every process
(:func:`write_run_checkpoint`), and ``model`` / ``optimizer`` are None in the file. The file is written last,
so it is the commit point: a run killed while the shards are written still has its previous checkpoint.
:func:`load_checkpoint` reads the whole weights back from the shards in one process; a resumed run loads
them, re-sliced for its own number of processes, with :func:`restore_weights_and_optimizer`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .convert.load import load_reference, read_checkpoint
from .convert.safeload import FORMAT, VERSION, load_file, state_checksum
from .data.config import training_data_cfg
from .distributed import SHARDS, World, load_sharded, read_sharded_weights, remove_unused_shards, save_sharded
from .io import atomic_open
from .models import create_model, get_config, list_models
from .models.folder import WEIGHTS, is_model_folder, read_config
from .models.registry import CFG_KEYS, overlay_cfg


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` to ``path`` atomically (:func:`vitlab.io.atomic_open`): a reader, or a run killed
    mid-write, sees the old complete file or the new complete file, never half. The file carries a checksum
    of its contents (:func:`vitlab.convert.safeload.state_checksum`), verified whenever it is read."""
    full = {"format": FORMAT, "version": VERSION, **state}
    full["checksum"] = state_checksum(full)
    with atomic_open(path, "wb") as f:
        torch.save(full, f)
    return Path(path)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", weights: bool = True) -> dict[str, Any]:
    """Read a vitlab checkpoint without running code (:func:`vitlab.convert.safeload.load_file`: format
    check, ``weights_only=True``, checksum); one clear line for missing, corrupt or foreign files.

    A sharded checkpoint's whole weights are read from its shards into ``model`` unless ``weights`` is
    False (a run that resumes reads them into its sharded model itself: :func:`restore_weights_and_optimizer`)."""
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


def write_run_checkpoint(
    path: str | Path,
    state: dict[str, Any],
    world: World,
    sharded: str | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path | None:
    """A training run's checkpoint at ``path`` (collective: every rank calls it; rank 0 writes the file).

    Without ``sharded``, ``state`` (weights and optimizer state included) goes into the one file. With it,
    ``model`` and ``optimizer`` are written by every rank through ``torch.distributed.checkpoint`` into the
    folder ``shards/<sharded>`` beside ``path``, and the file records that folder instead of the tensors
    (:func:`prune_shards` then removes the shard folders no checkpoint file points to any more)."""
    path = Path(path)
    if sharded is not None:
        save_sharded(path.parent / SHARDS / sharded, model, optimizer, world)
        state = {**state, "model": None, "optimizer": None, "sharded": f"{SHARDS}/{sharded}"}
    if not world.main:
        return None
    save_checkpoint(state, path)
    return path


def prune_shards(folder: str | Path) -> None:
    """Remove the shard folders in ``folder/shards`` that no checkpoint file of ``folder`` points to."""
    folder = Path(folder)
    if not (folder / SHARDS).is_dir():
        return
    pointed = []
    for file in folder.glob("*.pt"):
        try:
            pointed.append(load_checkpoint(file, weights=False).get("sharded") or "")
        except (ValueError, FileNotFoundError):
            continue
    remove_unused_shards(folder, pointed)


def restore_weights_and_optimizer(ckpt: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a run's checkpoint into ``model`` and ``optimizer``: from the file, or from its shards, re-sliced
    for this run's processes or whole (collective under FSDP)."""
    if ckpt.get("sharded"):
        load_sharded(shard_folder(ckpt), model, optimizer)
    else:
        load_state_checked(model, ckpt["model"], f"checkpoint {ckpt['path']}")
        optimizer.load_state_dict(ckpt["optimizer"])


def describe_mismatch(missing: list[str], unexpected: list[str], shapes: list[str]) -> str:
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
    check_image_classifier(ckpt)
    if ckpt["model_name"] != model_name:
        raise ValueError(
            f"checkpoint {ckpt.get('path', '')} holds a {ckpt['model_name']!r} model, not {model_name!r}; "
            f"use --model {ckpt['model_name']} or a checkpoint of {model_name}"
        )


def model_from_checkpoint(ckpt: dict[str, Any], ema: bool = False, **overrides: Any) -> nn.Module:
    """Rebuild the checkpoint's model (its name and constructor overrides, plus ``overrides``) with its
    weights (the EMA weights with ``ema=True``)."""
    model = create_model(ckpt["model_name"], **{**ckpt.get("model_kwargs", {}), **overrides})
    if ema:
        if not ckpt.get("ema"):
            raise ValueError(f"checkpoint {ckpt.get('path', '')} has no EMA weights (trained without --ema)")
        state = ckpt["ema"]["module"]
    else:
        state = ckpt["model"]
    load_state_checked(model, state, f"checkpoint {ckpt.get('path', '')}")
    return model


# ------------------------------------------------------------------------------------- load_model
def load_model(
    name_or_path: str | Path,
    weights: str | Path | Mapping[str, Any] | None = None,
    *,
    ema: bool = False,
    **overrides: Any,
) -> nn.Module:
    """A model with its weights, in eval mode on the CPU; ``model.meta["weights"]`` says where they came from.

    ``name_or_path`` is a registered model name, or a ``vitlab train`` checkpoint (a file, or a run folder
    holding ``last.pt``) that is then also the weights. ``weights`` is

    - None: random init (seed torch first for a repeatable draw);
    - a ``vitlab train`` checkpoint (a path, or the dict :func:`load_checkpoint` returns): it must hold
      this model; the model is rebuilt with the recorded constructor options plus ``overrides``, with the
      EMA weights when ``ema``;
    - a model folder written by ``save_pretrained`` (config.json + model.safetensors): it must hold this model;
    - any other weights file (safetensors, a state dict in vitlab's or an official implementation's names):
      read without running code and mapped by :func:`vitlab.convert.load_reference` (strict), the number of
      classes taken from its ``head.weight`` unless ``overrides`` set it.

    ``name_or_path`` may also be a model folder.

    ``overrides`` are constructor options (``img_size``, ``in_chans``, ``num_classes``, ...).
    """
    if isinstance(weights, Mapping):
        check_image_classifier(weights)  # before its name is looked up among the image models
    if not isinstance(name_or_path, str) or not _is_model_name(name_or_path):
        if weights is not None:
            raise ValueError(f"{name_or_path} is a checkpoint, not a model name; pass the weights only once")
        if is_model_folder(name_or_path):
            return load_folder(name_or_path, **overrides)
        return _from_vitlab(load_checkpoint(name_or_path), ema, overrides)
    if weights is None:
        if ema:
            raise ValueError("--ema needs a checkpoint written by `vitlab train`; no weights were given")
        return _ready(create_model(name_or_path, **overrides), "random init")
    if isinstance(weights, Mapping):
        if weights.get("format") != FORMAT or "model_name" not in weights:
            raise ValueError("weights given as a dict must be a checkpoint read by vitlab.checkpoint.load_checkpoint")
        check_model_name(dict(weights), name_or_path)
        return _from_vitlab(dict(weights), ema, overrides)
    if not isinstance(weights, Mapping) and is_model_folder(weights):
        model = load_folder(weights, **overrides)
        if model.model_name != name_or_path:
            raise ValueError(f"{weights} holds a {model.model_name!r} model, not {name_or_path!r}")
        return model
    path = _weights_file(weights)
    if (ckpt := _training_checkpoint(path)) is not None:
        check_model_name(ckpt, name_or_path)
        return _from_vitlab(ckpt, ema, overrides)
    if ema:
        raise ValueError(f"--ema needs a checkpoint written by `vitlab train`; {path} holds plain weights")
    return _from_weights_file(name_or_path, path, overrides)


def load_folder(folder: str | Path, **overrides: Any) -> nn.Module:
    """The model saved in ``folder`` by ``save_pretrained`` (config.json + model.safetensors), in eval mode.

    Only JSON and raw tensors are read: nothing in the folder runs. ``overrides`` change build options
    that do not change the weights' shapes (``drop_path_rate``, ``dynamic_img_size``, ...)."""
    folder = Path(folder).expanduser()
    config = read_config(folder)
    cfg = {k: v for k, v in config["pretrained_cfg"].items() if k in CFG_KEYS}
    model = create_model(config["model_name"], pretrained_cfg_overlay=cfg, **{**config["model_kwargs"], **overrides})
    load_state_checked(model, read_checkpoint(folder / WEIGHTS), f"{folder / WEIGHTS}")
    return _ready(model, f"{folder} (vitlab model folder)")


def _is_model_name(name: str) -> bool:
    """A registered name; raises the registry's "unknown model" error for what is neither a name nor a path."""
    if name in list_models():
        return True
    if Path(name).expanduser().exists() or any(sep in name for sep in ("/", "\\")) or name.endswith((".pt", ".pth")):
        return False
    get_config(name)  # an unknown name, with the closest registered ones
    return True


def _weights_file(weights: str | Path) -> Path:
    path = Path(weights).expanduser()
    if path.is_dir() and (path / "last.pt").is_file():  # a `vitlab train` output folder
        path = path / "last.pt"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} not found")
    return path


def _training_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint dict when ``path`` was written by ``vitlab train``, else None (plain weights)."""
    if path.suffix == ".safetensors":
        return None
    try:
        return load_checkpoint(path)
    except ValueError:  # not a training checkpoint (or unreadable: the plain reader explains why)
        return None


def _from_vitlab(ckpt: dict[str, Any], ema: bool, overrides: dict[str, Any]) -> nn.Module:
    """The checkpoint's model as it was trained: its build options, and its data (spec, normalisation) in
    ``pretrained_cfg``."""
    check_image_classifier(ckpt)
    model = model_from_checkpoint(ckpt, ema=ema, **overrides)
    config = ckpt.get("config", {})
    if spec := config.get("data"):
        data_cfg = training_data_cfg(spec, model.in_chans, config.get("holdout"))
        streamed = {k: v for k, v in (ckpt.get("data_cfg") or {}).items() if k != "input_size"}
        names = {"label_names": list(ckpt["label_names"])} if ckpt.get("label_names") else {}
        overlay_cfg(model, {**data_cfg, **streamed, **names})  # streaming data: evaluated with the model's crop
    epoch = ckpt.get("epoch", "?")
    return _ready(model, f"{ckpt.get('path', 'checkpoint')} (vitlab checkpoint, epoch {epoch}{', EMA' if ema else ''})")


def _from_weights_file(name: str, path: Path, overrides: dict[str, Any]) -> nn.Module:
    state = read_checkpoint(path)
    head = state.get("head.weight")
    if "num_classes" not in overrides and isinstance(head, Tensor) and head.dim() == 2:
        overrides = {**overrides, "num_classes": head.shape[0]}
    model = create_model(name, **overrides)
    try:
        report = load_reference(model, state, source="auto")
    except ValueError as e:
        first = str(e).splitlines()[0]
        raise ValueError(f"{first}; check the model name and --img-size / --in-chans / --num-classes") from None
    return _ready(model, f"{path} ({report.source} weights)")


def _ready(model: nn.Module, weights: str) -> nn.Module:
    model.meta = {**getattr(model, "meta", {}), "weights": weights}
    return model.eval()
