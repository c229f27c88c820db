"""Training across processes and machines, on PyTorch's own engine.

``torchrun`` starts the processes (``--nproc_per_node`` per machine, ``--nnodes`` machines meeting at a
``--rdzv-endpoint``) and tells each its rank through the environment; :func:`init_distributed` joins the
process group they form (NCCL on GPUs, gloo on the CPU). A model is then spread over the processes by
:func:`parallelize`:

* **DDP** (``DistributedDataParallel``): every process holds the whole model and optimizer, gradients are
  averaged after each backward pass;
* **FSDP2** (``torch.distributed.fsdp.fully_shard``): every block of the model is one unit whose parameters,
  gradients and optimizer state are split over the processes and gathered for the block's forward and
  backward only, so a model too large for one device trains on several. The model keeps its class; its
  parameters become ``DTensor`` shards.

A sharded model is checkpointed through ``torch.distributed.checkpoint`` (DCP): :func:`save_sharded` has
every process write its own shards of the weights and optimizer state into one folder, and
:func:`load_sharded` reads them back into a model spread over *any* number of processes (DCP re-slices the
saved chunks), or into an ordinary model in one process; :func:`read_sharded_weights` gives the whole
weights in one process without a model. DCP records its index with ``pickle`` and its non-tensor entries
with ``torch.load``; both are read here without running code (:class:`SafeShardReader`: only DCP's own
index classes may be unpickled; :class:`SafeLoadPlanner`: ``weights_only=True``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

SHARDS = "shards"  # the folder, beside a run's checkpoint, that holds its DCP checkpoints


@dataclass(frozen=True)
class World:
    """This process's place among those ``torchrun`` started (one process alone: rank 0 of 1)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """The process that writes files and prints (rank 0)."""
        return self.rank == 0


def current_world() -> World:
    """The rank, world size and local rank ``torchrun`` put in the environment."""
    env = os.environ
    return World(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")))


def init_distributed(device: torch.device) -> World:
    """Join the process group of a ``torchrun`` launch (NCCL for GPUs, gloo for the CPU); alone, nothing."""
    world = current_world()
    if world.size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return world


def close_distributed() -> None:
    """Leave the process group (if this process joined one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


def broadcast_object(obj: Any, world: World) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if world.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any, world: World) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if world.size == 1:
        return [obj]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(t: Tensor, world: World) -> Tensor:
    """The sum of ``t`` over the ranks (in place; ``t`` alone in one process)."""
    if world.size > 1:
        dist.all_reduce(t)
    return t


# --------------------------------------------------------------------------- spreading a model


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The units FSDP shards one by one: the model's ``blocks`` (every vitlab model has them)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, Iterable) or not len(blocks):
        raise ValueError(f"FSDP shards a model block by block, but {type(model).__name__} has no .blocks")
    return list(blocks)


def parallelize(model: nn.Module, device: torch.device, world: World, fsdp: bool = False) -> nn.Module:
    """The module a training step calls: ``model`` itself alone, wrapped in DDP, or (``fsdp``) ``model``
    sharded in place by FSDP2, one unit per block plus the root (embeddings, norm, head)."""
    if world.size == 1:
        return model
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world.size,))
        for block in blocks_of(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Around a backward pass: whether gradients are averaged (DDP) or reduce-scattered (FSDP) over the
    processes. Gradient accumulation turns it off for all but the last micro-batch of a step, so that the
    communication happens once per step (the result is the same)."""
    if enabled or not dist.is_initialized():
        yield
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 has sharded ``model`` (its parameters are DTensor shards)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The whole weights of ``model`` on the CPU, sharded or not (collective under FSDP: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


# --------------------------------------------------------------------------- sharded checkpoints (DCP)


class ShardError(ValueError):
    """A sharded checkpoint that cannot be read (missing, damaged, or asking to run code): one line."""


# what DCP's index (``.metadata``) may ask the unpickler for: its own record classes, torch.Size, dtypes and
# layouts, paths; nothing that runs code when called
_INDEX_MODULE = "torch.distributed.checkpoint.metadata"
_INDEX_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _Refused(Exception):
    """An index that asks for an object outside the allowed ones (its name is the message)."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module == _INDEX_MODULE or (module, name) in _INDEX_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeShardReader(FileSystemReader):
        """DCP's file reader whose index is unpickled with only DCP's own record classes allowed."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            path = Path(self.path) / ".metadata"
            try:
                with open(path, "rb") as f:
                    metadata = _IndexUnpickler(f).load()
            except FileNotFoundError:
                raise ShardError(f"{path.parent} holds no sharded checkpoint (no .metadata)") from None
            except _Refused as e:
                raise ShardError(
                    f"refusing to read {path}: it asks to import {e}, which a checkpoint index never needs"
                ) from None
            except Exception as e:
                raise ShardError(f"{path} is damaged ({type(e).__name__}: {e})") from None
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
            obj = torch.load(value, weights_only=True)
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
