"""The vitlab checkpoint file: its format tag, the checksum it carries, and its atomic write.

A checkpoint is a dict of tensors and plain Python values saved with ``torch.save``, so that
``torch.load(weights_only=True)`` reads it (:mod:`vitlab.checkpoint.safeload`) and a file from elsewhere can
never run code. Layout (``format: "vitlab-checkpoint"``): ``model_name``, ``model_kwargs``, ``model``
(state_dict), and for resuming ``optimizer``, ``scheduler``, ``ema``, ``scaler``, ``epoch`` (completed
epochs), ``step``, ``rng`` (per-rank torch RNG states), ``config`` (the training options) and ``metrics``;
since version 2 ``checksum`` (crc32s of every tensor and of the plain values), verified on every read so
bytes flipped inside tensor data are caught instead of loaded. A sharded run's file names its shard folder
in ``sharded`` instead of holding ``model`` and ``optimizer`` (:mod:`vitlab.checkpoint.sharded`).

This module is the bottom of the package: it imports nothing else of it.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..common.io import atomic_open

#: the top-level ``format`` and ``version`` of a vitlab training checkpoint; version 2 on carry a checksum
FORMAT = "vitlab-checkpoint"
VERSION = 2
CHECKSUM_ALGO = "crc32"


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` to ``path`` atomically (:func:`vitlab.common.io.atomic_open`): a reader, or a run killed
    mid-write, sees the old complete file or the new complete file, never half. The file carries a checksum
    of its contents (:func:`state_checksum`), verified whenever it is read."""
    full = {"format": FORMAT, "version": VERSION, **state}
    full["checksum"] = state_checksum(full)
    with atomic_open(path, "wb") as f:
        torch.save(full, f)
    return Path(path)


# ------------------------------------------------------------------------------------- checksum
def leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of every leaf of nested dicts, lists and tuples, in order; containers as their kind."""
    if isinstance(obj, Mapping):
        yield path, f"map[{len(obj)}]"
        for key, value in obj.items():
            yield from leaves(value, f"{path}/{key}")
    elif isinstance(obj, (list, tuple)):
        yield path, f"sequence[{len(obj)}]"
        for i, value in enumerate(obj):
            yield from leaves(value, f"{path}/{i}")
    else:
        yield path, obj


def _tensor_crc(t: Tensor) -> int:
    """crc32 of a tensor's dtype, shape and bytes (as stored: on any device, in any layout)."""
    crc = zlib.crc32(f"{t.dtype}{tuple(t.shape)}{t.layout}".encode())
    if t.layout != torch.strided or not t.numel():
        return crc
    flat = t.detach().cpu().contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy(), crc)


def _digests(state: Mapping[str, Any]) -> tuple[list[str], list[int], int]:
    """(tensor paths, their crc32s, one crc32 over the plain values and the layout), ``checksum`` left out."""
    names, crcs, plain = [], [], 0
    for path, value in leaves({k: v for k, v in state.items() if k != "checksum"}):
        if isinstance(value, Tensor):
            names.append(path)
            crcs.append(_tensor_crc(value))
            value = "<tensor>"
        elif isinstance(value, (set, frozenset)):
            value = sorted(map(repr, value))
        plain = zlib.crc32(f"{path}={type(value).__name__}:{value!r}\n".encode("utf-8", "replace"), plain)
    return names, crcs, plain


def state_checksum(state: Mapping[str, Any]) -> dict[str, Any]:
    """The checksum a vitlab checkpoint carries: a crc32 of every tensor (dtype, shape, bytes), in key order,
    and ``value``, a crc32 over those and over every plain value (epoch, options, metrics) and key."""
    _, crcs, plain = _digests(state)
    value = zlib.crc32(b"".join(c.to_bytes(4, "big") for c in crcs), plain)
    return {"algo": CHECKSUM_ALGO, "value": value, "tensors": crcs}


def verify_checksum(obj: Any, path: Path | str) -> None:
    """Raise a one-line ValueError when a checkpoint's contents differ from the checksum written with it.

    Checkpoints without one (other writers, vitlab before version 2) pass unchecked.
    """
    if not isinstance(obj, Mapping):
        return
    stored = obj.get("checksum")
    if stored is None:
        if obj.get("format") == FORMAT and isinstance(obj.get("version"), int) and obj["version"] >= 2:
            raise ValueError(
                f"checkpoint {path} is corrupt: its checksum is missing; re-create it or pass another file"
            )
        return
    if not isinstance(stored, Mapping) or stored.get("algo") != CHECKSUM_ALGO:
        raise ValueError(f"checkpoint {path} is corrupt: its checksum entry is unreadable; re-create it")
    recorded = stored.get("tensors")
    recorded = list(recorded) if isinstance(recorded, (list, tuple)) else []
    now = state_checksum(obj)
    if now["value"] == stored.get("value") and now["tensors"] == recorded:
        return
    names, crcs, _ = _digests(obj)
    first = next((n for n, a, b in zip(names, crcs, recorded) if a != b), None)
    where = f"tensor {first.lstrip('/')}" if first else "its recorded values (options, counters or metrics)"
    raise ValueError(
        f"checkpoint {path} is corrupt: {where} differs from the checksum written with it (the file changed "
        "after it was saved); re-create it or pass another file"
    )
