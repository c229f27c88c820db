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

A process that dies or hangs must not leave the others waiting forever: ``torchrun`` stops the others when
one of its workers exits, and every collective (and the process group's set-up) gives up after
``VITLAB_DIST_TIMEOUT`` seconds (default 900: long enough for rank 0 to write a large checkpoint while the
others wait at a barrier), raising an error that :func:`peer_failure` turns into one line.

A sharded model is checkpointed through ``torch.distributed.checkpoint`` by :mod:`vitlab.checkpoint.sharded`
(which uses this module, never the other way).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


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


DEFAULT_TIMEOUT_S = 900


def collective_timeout() -> float:
    """Seconds a collective waits for the other processes: ``VITLAB_DIST_TIMEOUT`` (default 900)."""
    text = os.environ.get("VITLAB_DIST_TIMEOUT", "")
    try:
        seconds = float(text) if text.strip() else DEFAULT_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 10**8:  # timedelta and the process group's clock take no infinity (nor nan)
        raise ValueError(f"VITLAB_DIST_TIMEOUT must be a number of seconds > 0, got {text!r}")
    return seconds


def init_distributed(device: torch.device) -> World:
    """Join the process group of a ``torchrun`` launch (NCCL for GPUs, gloo for the CPU), every collective
    bounded by :func:`collective_timeout`; alone, nothing but the check of ``VITLAB_DIST_TIMEOUT``."""
    from datetime import timedelta

    world = current_world()
    collective_timeout()  # checked alone too: a wrong VITLAB_DIST_TIMEOUT is said now, not at the first torchrun
    if world.size > 1 and not dist.is_initialized():
        end_with_launcher()
        timeout = timedelta(seconds=collective_timeout())
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    return world


def end_with_launcher() -> None:
    """Have the kernel kill this process when the process that launched it dies (Linux; elsewhere nothing).

    torchrun starts its workers in sessions of their own, so killing a job's process group (a scheduler's
    SIGKILL, Ctrl-C of ``vitlab study``) ends torchrun but leaves the workers training until their next
    collective times out; tied to their launcher, they stop with it."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the request was made
        os.kill(os.getpid(), signal.SIGKILL)


def peer_failure(e: BaseException) -> str | None:
    """One line for an error of the process group (another process died, hung past the timeout, or the
    connection broke); None for any other error."""
    if not isinstance(e, dist.DistError) and not any(
        w in str(e) for w in ("Connection closed by peer", "Connection reset by peer", "Timed out waiting")
    ):
        return None
    first = " ".join(str(e).strip().split("\n")[0].split())[:200]
    return (f"another process of this run stopped or stopped answering ({first}); see its own error, and "
            f"VITLAB_DIST_TIMEOUT ({collective_timeout():g} s) for how long a process waits")  # fmt: skip


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
    """The units FSDP shards one by one: the model's ``blocks`` (every vitlab model has them), a pyramid's
    stages (lists of blocks, never called themselves) opened into their blocks."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, Iterable) or not len(blocks):
        raise ValueError(f"FSDP shards a model block by block, but {type(model).__name__} has no .blocks")
    return _opened(blocks)


def _opened(blocks: Iterable[nn.Module]) -> list[nn.Module]:
    return [unit for b in blocks for unit in (_opened(b) if type(b) is nn.ModuleList else [b])]


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
