"""The one safe loader: reading weights files and sharded-checkpoint indexes without running code.

A file is recognised by its first bytes before anything is unpickled: a zip archive (``torch.save``), torch's
legacy format (a pickle of its magic number first) or safetensors (an 8-byte little-endian header length, then
a JSON header). Pickles are read with ``torch.load(weights_only=True)``: tensors, containers and plain values
only. A file that asks to import any other Python object is refused (unpickling it could run code), and every
exception raised while reading becomes one ``ValueError`` line naming the file; nothing else escapes.
Checkpoints written by vitlab carry a checksum of their contents (:mod:`vitlab.checkpoint.format`), verified
on every read.

The index of a sharded checkpoint (``torch.distributed.checkpoint``'s ``.metadata``) is a protocol-4 pickle
that torch's weights-only unpickler cannot read; :func:`load_index` reads it with an unpickler that resolves
only an exact list of (module, name) pairs, DCP's own record classes, never a dotted path inside them.
Its non-tensor entries go through :func:`load_bytes` (``weights_only=True``). Every loader of the package
reads through this module.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from .format import leaves, verify_checksum

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


# ------------------------------------------------------------------------------------- non-finite weights
class NonFiniteWeightsWarning(UserWarning):
    """Weights holding NaN or infinity: the model's outputs will be NaN."""


def warn_non_finite(obj: Any, where: str) -> list[str]:
    """Warn (one line naming the tensors) when floating-point tensors anywhere in ``obj`` hold NaN or inf."""
    bad = [
        path.lstrip("/")
        for path, v in leaves(obj)
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


# ------------------------------------------------------------------------------------- sharded checkpoints
class IndexRefused(ValueError):
    """A sharded-checkpoint index that asks for an object outside the allowed ones (its name is the message)."""


# what DCP's index (``.metadata``) may ask the unpickler for: its own record classes, torch.Size, dtypes and
# layouts, paths; nothing that runs code when called. Exact pairs only: a dotted name (``os.system`` looked
# up inside an allowed module) would reach anything that module imported.
_INDEX_MODULE = "torch.distributed.checkpoint.metadata"
_INDEX_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata")
_INDEX_CLASSES += ("BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
_INDEX_GLOBALS = {(_INDEX_MODULE, name) for name in _INDEX_CLASSES} | {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _INDEX_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise IndexRefused(f"{module}.{name}")


def load_index(path: str | os.PathLike) -> Any:
    """The object in a sharded checkpoint's index file, read with only DCP's record classes allowed.

    Raises FileNotFoundError for a missing file, :class:`IndexRefused` (its message: the refused name) for
    one asking to import anything else, and a one-line ValueError for a damaged one."""
    try:
        with open(path, "rb") as f:
            return _IndexUnpickler(f).load()
    except (FileNotFoundError, IndexRefused):
        raise
    except Exception as e:  # truncated or garbled: the end of what reads as a pickle
        raise ValueError(f"{path} is damaged ({type(e).__name__}: {e})") from None


def load_bytes(stream: BinaryIO) -> Any:
    """A non-tensor entry of a sharded checkpoint (optimizer settings), read ``weights_only``."""
    return torch.load(stream, weights_only=True)
