"""Reading weights files without running code, answering every bad file with one line.

A file is recognised by its first bytes before anything is unpickled: a zip archive (``torch.save``), torch's
legacy format (a pickle of its magic number first) or safetensors (an 8-byte little-endian header length, then
a JSON header). Pickles are read with ``torch.load(weights_only=True)``: tensors, containers and plain values
only. A file that asks to import any other Python object is refused (unpickling it could run code), and every
exception raised while reading becomes one ``ValueError`` line naming the file; nothing else escapes.

Checkpoints written by vitlab carry a checksum of their contents (:func:`state_checksum`), verified on every
read (:func:`verify_checksum`), so bytes flipped inside tensor data are caught instead of loaded.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import pickletools
import re
import warnings
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

#: the top-level ``format`` and ``version`` of a vitlab training checkpoint; version 2 on carry a checksum
FORMAT = "vitlab-checkpoint"
VERSION = 2
CHECKSUM_ALGO = "crc32"

ZIP_MAGIC = b"PK\x03\x04"
#: torch's legacy (pre-zip) files open with a pickle of the number 0x1950a86a20f9469cfc6c (LONG1, 10 bytes)
LEGACY_MAGIC = b"\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors refuses larger headers itself
SCAN_LIMIT = 1 << 20  # bytes of a bare pickle scanned for imports (only to word the error)
_IDENTIFIER = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*")
# words of torch's weights-only unpickler when a pickle asks for objects beyond tensors and plain values
_REFUSED = ("GLOBAL", "unrecognized function", "create new object", "is blocked")
# torch's error texts end with advice to load unsafely; nothing from there on is repeated
_ADVICE = re.compile(r"weights.only|Please |Re-running|file an issue|trusted source|This is an internal", re.IGNORECASE)


# ------------------------------------------------------------------------------------- messages
def one_line(text: str, limit: int = 160) -> str:
    """``text`` as one printable line of at most ``limit`` characters."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _reason(e: BaseException) -> str:
    """What went wrong, in a few words: the exception's first sentences, without torch's unsafe advice."""
    text = str(e)
    if "TorchScript" in text:
        return "a TorchScript archive (torch.jit.save), which holds code; vitlab reads weights only"
    if m := re.search(r"Unsupported operand (\d+)", text):
        return f"pickle opcode {int(m[1]):#04x}, which torch's safe loader does not read: saved with protocol 4+, or damaged"
    m = re.search(r"WeightsUnpickler error:\s*(.*)", text)
    text = m[1] if m else text.strip()
    kept = []
    for sentence in re.split(r"(?<=[.:])\s+", text.splitlines()[0] if text else ""):
        if _ADVICE.search(sentence):
            break
        kept.append(sentence)
    detail = one_line(" ".join(kept))
    return f"{type(e).__name__}: {detail}" if detail else type(e).__name__


def refused_message(path: Path | str, name: str | None) -> str:
    """The line for a pickle that asks to import Python objects (``name``: the first one, when known)."""
    what = f": {one_line(name, 80)}" if name else ""
    return (
        f"refusing to load {path}: the file asks to run code and vitlab will not load it (it holds Python "
        f"objects that are not tensors or plain values{what}; unpickling them could run code); "
        "pass weights saved as a plain state_dict or as safetensors"
    )


def corrupt_message(path: Path | str, e: BaseException) -> str:
    return f"cannot read {path}: it is truncated or corrupt ({_reason(e)}); re-create it or pass another file"


# ------------------------------------------------------------------------------------- format check
def file_kind(path: Path) -> tuple[str, bytes]:
    """(kind, first bytes) of ``path``: kind is "zip", "legacy", "safetensors" or "other"."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    if head.startswith(ZIP_MAGIC):
        return "zip", head
    if head[:1] == b"\x80" and LEGACY_MAGIC in head[:16]:
        return "legacy", head
    length = int.from_bytes(head[:8], "little")
    if head[8:9] == b"{" and 2 <= length <= min(size - 8, SAFETENSORS_MAX_HEADER):
        return "safetensors", head
    return "other", head


def pickle_imports(data: bytes) -> Iterator[str]:
    """Every ``module.name`` the pickle in ``data`` asks to import, read from its opcodes (never run), up to
    the first damaged opcode."""
    strings: list[str] = []
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(data)):
            if op.name in ("GLOBAL", "INST"):
                parts = str(arg).split(" ")
            elif op.name == "STACK_GLOBAL":
                parts = strings[-2:]
            else:
                if isinstance(arg, str):
                    strings.append(arg)
                continue
            if len(parts) == 2 and all(_IDENTIFIER.fullmatch(p) for p in parts):
                yield ".".join(["builtins" if parts[0] == "__builtin__" else parts[0], parts[1]])
    except Exception:  # the end of what reads as a pickle
        return


def _torch_safe(name: str) -> bool:
    """Whether torch's weights-only unpickler (as vitlab calls it) accepts the global ``name``."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        allowed = set(_get_allowed_globals())
    except Exception:  # another torch: its own names and containers count as safe
        return name.startswith(("torch.", "collections.", "builtins.", "_codecs.", "argparse.Namespace"))
    return name in allowed or name == "argparse.Namespace"


def refused_import(path: Path, kind: str) -> str | None:
    """The first Python object ``path`` (a bare pickle, or the pickle inside a torch zip) asks to import beyond
    what torch's safe loader accepts, or None; found by reading opcodes, never by unpickling."""
    try:
        if kind == "zip":
            with zipfile.ZipFile(path) as z:
                name = next(n for n in z.namelist() if n.endswith("data.pkl"))
                data = z.read(name)
        else:
            with open(path, "rb") as f:
                data = f.read(SCAN_LIMIT)
    except Exception:  # a damaged archive: no words about imports
        return None
    return next((g for g in pickle_imports(data) if not _torch_safe(g)), None)


# ------------------------------------------------------------------------------------- reading
def load_file(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """The object inside a weights file (torch zip or legacy pickle, or safetensors), read without running code.

    Raises FileNotFoundError for a missing file and ValueError (one line) for anything else: a directory, an
    unknown format, a pickle asking to import Python objects, a truncated or corrupt file, a checksum mismatch.
    Tensors holding NaN or inf give a :class:`NonFiniteWeightsWarning` naming them.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not path.is_file():
        raise ValueError(
            f"{path} is {'a directory' if path.is_dir() else 'not a regular file'}, expected a checkpoint file"
        )
    kind, head = file_kind(path)
    if not head:
        raise ValueError(f"cannot read {path}: the file is empty; re-create it or pass another file")
    if kind == "other":
        name = refused_import(path, kind)
        if name is not None:
            raise ValueError(refused_message(path, name))
        raise ValueError(
            f"cannot read {path}: it is truncated, corrupt or not a PyTorch file (neither a torch.save archive "
            f"nor safetensors; it starts with {head[:8]!r}); pass a file written by torch.save, safetensors or vitlab"
        )
    obj = _load_safetensors(path) if kind == "safetensors" else _load_torch(path, map_location)
    verify_checksum(obj, path)
    warn_non_finite(obj, str(path))
    return obj


def _load_torch(path: Path, map_location: Any) -> Any:
    try:
        with open(path, "rb") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a foreign pickle's protocol warning would only precede the error
            # a file object, not the path: torch would pick its reader by the file name's suffix
            with torch.serialization.safe_globals([argparse.Namespace]):  # timm/DeiT keep their args in one
                return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        refused = any(word in str(e) for word in _REFUSED)
        name = m[1] if (m := re.search(r"GLOBAL (\S+)", str(e))) else refused_import(path, "zip")
        if refused or name is not None:  # torch stopped at another opcode before the import: still a refusal
            raise ValueError(refused_message(path, name)) from None
        raise ValueError(corrupt_message(path, e)) from None
    except Exception as e:  # KeyError, IndexError, struct.error, MemoryError...: all mean a damaged file
        raise ValueError(corrupt_message(path, e)) from None


def _load_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file as load_safetensors

    try:
        return load_safetensors(str(path))
    except BaseException as e:  # safetensors' own errors, and a Rust panic (a BaseException)
        if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
            raise
        raise ValueError(
            f"cannot read {path} as safetensors: it is truncated or corrupt ({_reason(e)}); re-create it"
        ) from None


# ------------------------------------------------------------------------------------- checksum
def _leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of every leaf of nested dicts, lists and tuples, in order; containers as their kind."""
    if isinstance(obj, Mapping):
        yield path, f"map[{len(obj)}]"
        for key, value in obj.items():
            yield from _leaves(value, f"{path}/{key}")
    elif isinstance(obj, (list, tuple)):
        yield path, f"sequence[{len(obj)}]"
        for i, value in enumerate(obj):
            yield from _leaves(value, f"{path}/{i}")
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
    for path, value in _leaves({k: v for k, v in state.items() if k != "checksum"}):
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


# ------------------------------------------------------------------------------------- non-finite weights
class NonFiniteWeightsWarning(UserWarning):
    """Weights holding NaN or infinity: the model's outputs will be NaN."""


def warn_non_finite(obj: Any, where: str) -> list[str]:
    """Warn (one line naming the tensors) when floating-point tensors anywhere in ``obj`` hold NaN or inf."""
    bad = [
        path.lstrip("/")
        for path, v in _leaves(obj)
        if isinstance(v, Tensor) and (v.is_floating_point() or v.is_complex()) and not bool(torch.isfinite(v).all())
    ]
    if bad:
        more = f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""
        # the warning's place stays this line, so Python shows it once even when a file is read twice
        warnings.warn(
            f"{where} holds non-finite values (NaN or inf) in {', '.join(bad[:5])}{more}: a model with these "
            "weights outputs NaN; re-create the file",
            NonFiniteWeightsWarning,
            stacklevel=1,
        )
    return bad
