"""A training run's checkpoints, the same for ``vitlab train`` and ``vitlab lm train``: written, pruned, resumed.

:func:`write_run_checkpoint` is collective: every rank calls it. Without sharding the run's state, weights
and optimizer state included, goes into one file written by rank 0 (:func:`vitlab.checkpoint.save_checkpoint`).
A sharded run (FSDP) keeps its weights and optimizer state out of the file: every rank writes its part into
``shards/<name>`` beside it (:mod:`.sharded`), and the file records that folder with ``model`` and
``optimizer`` None. The file is written last, so it is the commit point: a run killed while the shards are
written still has its previous checkpoint. A resumed run loads the weights and optimizer state back,
re-sliced for its own number of processes, with :func:`restore_optimization`.

Every rank's RNG streams are saved (:func:`gather_rng_states`) and continue where the number of processes is
unchanged (:func:`restore_rng_streams`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..checkpoint.format import save_checkpoint
from ..checkpoint.load import load_checkpoint, load_state_checked, shard_folder
from ..checkpoint.sharded import SHARDS, load_sharded, remove_unused_shards, save_sharded
from ..common.distributed import World, gather_objects
from .optim import Optimization


def write_run_checkpoint(
    path: str | Path,
    state: dict[str, Any],
    world: World,
    sharded: str | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path | None:
    """A training run's checkpoint at ``path`` (collective: every rank calls it; rank 0 writes the file and
    gets its path back, the others None).

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


def optimization_state(model: nn.Module, opt: Optimization, sharded: bool) -> dict[str, Any]:
    """The checkpoint entries of the weights and the optimization (``model`` and ``optimizer`` None when the
    run is sharded: :func:`write_run_checkpoint` writes them as shards)."""
    return {
        "model": None if sharded else model.state_dict(),
        "optimizer": None if sharded else opt.optimizer.state_dict(),
        "scheduler": opt.sched.state_dict(),
        "scaler": opt.scaler.state_dict(),
    }


def restore_optimization(ckpt: dict[str, Any], model: nn.Module, opt: Optimization) -> None:
    """The weights, optimizer state, schedule and gradient scaler a checkpoint holds, loaded in place."""
    restore_weights_and_optimizer(ckpt, model, opt.optimizer)
    opt.sched.load_state_dict(ckpt["scheduler"])
    if ckpt.get("scaler"):
        opt.scaler.load_state_dict(ckpt["scaler"])


# --------------------------------------------------------------------------- random streams


def rng_state(device: torch.device) -> dict[str, Tensor | None]:
    """This process's torch RNG state (and its GPU's)."""
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict[str, Tensor | None] | Tensor, device: torch.device) -> None:
    """Set what :func:`rng_state` returned (or a bare CPU state, as ``vitlab lm train`` wrote before)."""
    state = {"torch": state} if isinstance(state, Tensor) else state
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def gather_rng_states(device: torch.device, world: World) -> list[dict[str, Tensor | None]]:
    """Every rank's RNG state, in rank order (collective: every rank calls it)."""
    return gather_objects(rng_state(device), world)


def restore_rng_streams(states: Any, world: World, device: torch.device) -> bool:
    """Continue this rank's RNG stream from :func:`gather_rng_states`' list; False (nothing set) when the
    checkpoint was written by another number of processes, whose streams cannot be dealt out again."""
    states = [states] if isinstance(states, Tensor) else list(states or [])  # one bare state: older lm files
    if len(states) != world.size:
        return False
    set_rng_state(states[world.rank], device)
    return True
