"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), read without running code.

:func:`save_sharded` has every process write its own shards of the weights and optimizer state into one
folder, and :func:`load_sharded` reads them back into a model spread over *any* number of processes (DCP
re-slices the saved chunks), or into an ordinary model in one process; :func:`read_sharded_weights` gives the
whole weights in one process without a model. DCP records its index with ``pickle`` and its non-tensor
entries with ``torch.load``; both go through :mod:`vitlab.checkpoint.safeload` (:func:`load_index`: only
DCP's own record classes may be unpickled; :func:`load_bytes`: ``weights_only=True``).

A run's checkpoint file points to its shard folder (``shards/<name>`` beside it): :mod:`vitlab.engine.checkpointing` writes both.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..common.distributed import World, barrier
from .safeload import IndexRefused, load_bytes, load_index

SHARDS = "shards"  # the folder, beside a run's checkpoint, that holds its DCP checkpoints


class ShardError(ValueError):
    """A sharded checkpoint that cannot be read (missing, damaged, or asking to run code): one line."""


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeShardReader(FileSystemReader):
        """DCP's file reader whose index is read by :func:`vitlab.checkpoint.safeload.load_index`."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            path = Path(self.path) / ".metadata"
            try:
                metadata = load_index(path)
            except FileNotFoundError:
                raise ShardError(f"{path.parent} holds no sharded checkpoint (no .metadata)") from None
            except IndexRefused as e:
                raise ShardError(
                    f"refusing to read {path}: it asks to import {e}, which a checkpoint index never needs"
                ) from None
            except ValueError as e:
                raise ShardError(str(e)) from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeShardReader


def _planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default planner, with its non-tensor entries (optimizer settings) read ``weights_only``."""

        def load_bytes(self, read_item: Any, value: Any) -> None:
            obj = load_bytes(value)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()


def _dcp_load(state: dict[str, Any], folder: Path, no_dist: bool) -> None:
    import torch.distributed.checkpoint as dcp

    if not folder.is_dir():
        raise ShardError(f"sharded checkpoint {folder} not found (its checkpoint file points to it)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when it runs without a process group
        try:
            dcp.load(state, storage_reader=_reader_class()(folder), planner=_planner(), no_dist=no_dist)
        except ShardError:
            raise
        except Exception as e:  # a missing or short shard file, a key the index lacks
            raise ShardError(f"cannot read sharded checkpoint {folder}: {str(e).splitlines()[0][:200]}") from None


def save_sharded(folder: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
    """Write the weights and optimizer state of ``model`` (sharded by FSDP or whole) into ``folder`` through
    DCP: every rank writes its own shards (collective). An old folder of that name is removed first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = Path(folder)
    if world.main and folder.exists():
        shutil.rmtree(folder)  # leftovers of an interrupted write of the same name (other ranks' files)
    barrier(world)
    model_state, optim_state = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=folder, no_dist=world.size == 1)


def load_sharded(folder: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a :func:`save_sharded` checkpoint into ``model`` (and ``optimizer``), however many processes
    wrote it and however many read it now (collective when the model is sharded)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        state = {"model": get_model_state_dict(model)}
        _dcp_load(state, Path(folder), no_dist=not dist.is_initialized())
        set_model_state_dict(model, state["model"])
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    _dcp_load(state, Path(folder), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def read_sharded_weights(folder: str | os.PathLike) -> dict[str, Tensor]:
    """The whole weights a :func:`save_sharded` checkpoint holds, as a plain state dict, in one process
    (for evaluation, export, conversion)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(folder)
    index = _reader_class()(folder).read_metadata()
    template = {
        key[len("model.") :]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in index.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    state = {"model": template}
    _dcp_load(state, folder, no_dist=True)
    return state["model"]


def remove_unused_shards(run_folder: str | os.PathLike, keep: Iterable[str]) -> None:
    """Remove the sharded checkpoints in ``run_folder/shards`` that no checkpoint file points to any more
    (``keep``: the relative folders still pointed to)."""
    root = Path(run_folder) / SHARDS
    kept = {Path(k).name for k in keep}
    if root.is_dir():
        for entry in root.iterdir():
            if entry.is_dir() and entry.name not in kept:
                shutil.rmtree(entry, ignore_errors=True)
