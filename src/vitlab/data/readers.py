"""Readers for on-disk dataset formats: CIFAR python pickles (restricted unpickler) and MNIST idx files.

Every failure becomes one ``FileNotFoundError``/``ValueError`` sentence naming the file, what is wrong
and what to do; nothing from a data file is ever executed.
"""

from __future__ import annotations

import gzip
import io
import math
import pickle
import warnings
import zlib
from pathlib import Path

import numpy as np

from .safe_files import MAX_UNPACKED_BYTES, read_regular


def _numpy_reconstruct():
    try:  # numpy >= 2 moved the module; the old name still appears inside CIFAR's pickles
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def _latin1_encode(text: str, encoding: str = "utf-8") -> bytes:
    """``_codecs.encode`` as Python 3 protocol-2 pickles use it for bytes: latin-1 text only."""
    if not isinstance(text, str) or encoding.replace("-", "").lower() not in ("latin1", "iso88591"):
        raise pickle.UnpicklingError(f"refusing to load global _codecs.encode with encoding {encoding!r}")
    return text.encode("latin-1")


def _empty_bytes(*args: object) -> bytes:
    """``bytes()`` as protocol-2 pickles use it for an empty byte string (an empty array's buffer): no
    arguments only, so a file cannot ask for ``bytes(10**12)``."""
    if args:
        raise pickle.UnpicklingError("refusing to load global builtins.bytes with arguments")
    return b""


# The only globals a pickled numpy array needs; everything else (os.system, builtins.eval, ...) is refused.
_ALLOWED_GLOBALS = {
    ("_codecs", "encode"): lambda: _latin1_encode,
    ("__builtin__", "bytes"): lambda: _empty_bytes,
    ("builtins", "bytes"): lambda: _empty_bytes,
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
}


class _ArrayOnlyUnpickler(pickle._Unpickler):
    """The pure-Python unpickler: its memo is a dict, so a damaged file's huge memo index costs nothing (the C
    unpickler would allocate, and zero, a table that large), and it reads only what the file holds."""

    def find_class(self, module: str, name: str):
        factory = _ALLOWED_GLOBALS.get((module, name))
        if factory is None:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return factory()


def _detail(e: BaseException) -> str:
    text = " ".join("".join(c if c.isprintable() else " " for c in str(e)).split())
    return f"{type(e).__name__}: {text[:120]}" if text else type(e).__name__


def load_array_pickle(path: Path, what: str, fix: str) -> object:
    """Unpickle ``path`` allowing only plain containers and numpy arrays (protocol 2, bytes keys).

    ``what`` names the file in error messages (e.g. "CIFAR-10 batch"), ``fix`` says what to do. Every failure
    is one ``FileNotFoundError``/``ValueError`` line.
    """
    raw = read_regular(path, what, fix)  # a named pipe in its place is refused, never waited on
    if raw[:2] == b"\x1f\x8b":
        raise ValueError(f"{what} {path} is gzip-compressed, not a batch: extract the downloaded archive; {fix}")
    try:
        return _ArrayOnlyUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except pickle.UnpicklingError as e:
        if "refusing" in str(e):
            raise ValueError(
                f"{what} {path} is not a plain data pickle ({e}): the file asks to run code and vitlab will not "
                f"load it; {fix}"
            ) from None
        raise ValueError(f"{what} {path} is truncated or corrupt ({_detail(e)}); {fix}") from None
    except Exception as e:  # EOFError, struct.error, MemoryError, ...: every one a damaged file
        raise ValueError(f"{what} {path} is truncated or corrupt ({_detail(e)}); {fix}") from None


CIFAR_FIX = "download a complete cifar-10-batches-py folder (python version) from www.cs.toronto.edu/~kriz"


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def class_indices(values: object, num_classes: int, where: str, fix: str, label: str = "labels") -> np.ndarray:
    """``values`` (a list of ints or an integer array, as a pickle holds them) as int64 class indices in
    ``0..num_classes-1``; anything else (floats, huge ints, nested lists, text) is one ``ValueError`` line:
    ``"<where> has <label> outside 0..<num_classes-1> (...)"`` or ``"... that are not integer class indices"``."""
    top = num_classes - 1
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            shape = f"a {values.dtype} array of shape {list(values.shape)}"
            raise ValueError(f"{where} has {label} that are not integer class indices 0..{top} ({shape}); {fix}")
        outside = (values < 0) | (values > top)
        if outside.any():
            raise ValueError(f"{where} has {label} outside 0..{top} ({values[outside][0]}); {fix}")
        return values.astype(np.int64)
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{where} has {label} that are not a list of class indices 0..{top} "
                         f"(a {type(values).__name__}); {fix}")  # fmt: skip
    # checked as Python ints before numpy sees them: 10**30 would overflow int64 with a traceback
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{where} has {label} that are not integer class indices 0..{top} ({_shown(v)}); {fix}")
        if not 0 <= v <= top:
            raise ValueError(f"{where} has {label} outside 0..{top} ({_shown(v)}); {fix}")
    return np.asarray(values, dtype=np.int64)


def read_cifar_arrays(
    path: Path, what: str, label_key: str, num_classes: int, fix: str
) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR batch (CIFAR-10's ``data_batch_*``, CIFAR-100's ``train``/``test``) -> (uint8 images
    ``(N, 3, 32, 32)``, int64 labels ``(N,)``): the pickle ``{b"data": uint8 (N, 3072), b"<label_key>": [...]}``
    (rows R(1024) G(1024) B(1024)), at least one image, labels in ``0..num_classes-1``."""
    d = load_array_pickle(path, what, fix)
    if isinstance(d, dict):
        d = {(k.decode(errors="replace") if isinstance(k, bytes) else k): v for k, v in d.items()}
    data, labels = (d.get("data"), d.get(label_key)) if isinstance(d, dict) else (None, None)
    if not isinstance(data, np.ndarray) or labels is None:
        raise ValueError(f"{what} {path} has no 'data' array and '{label_key}' list; {fix}")
    labels = class_indices(labels, num_classes, f"{what} {path}", fix, label_key.replace("_", " "))
    n = len(labels)
    if data.dtype != np.uint8 or data.shape != (n, 3072):
        raise ValueError(
            f"{what} {path} holds data {data.dtype}{list(data.shape)} for {n} labels, expected uint8[{n}, 3072]; {fix}"
        )
    if n == 0:
        raise ValueError(f"{what} {path} holds no images; {fix}")
    return data.reshape(n, 3, 32, 32), labels


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 batch -> (uint8 images (N, 3, 32, 32), int64 labels (N,)).

    The pickle holds a dict ``{b"data": uint8 (N, 3072) rows R(1024) G(1024) B(1024), b"labels": [int]}``.
    """
    return read_cifar_arrays(path, "CIFAR-10 batch", "labels", 10, CIFAR_FIX)


def read_label_names(
    path: Path, what: str, key: str, count: int, fix: str, missing_ok: bool = True
) -> list[str] | None:
    """The ``count`` class names under ``key`` in a CIFAR meta pickle, or None when they cannot be read.

    A missing file is None (with a warning unless ``missing_ok``); a file that is damaged, asks to run code,
    or holds no list of ``count`` names gives one warning line naming it, then None: the data is still usable,
    only its classes are unnamed."""
    try:
        d = load_array_pickle(path, what, fix)
    except FileNotFoundError as e:
        if not missing_ok:
            warnings.warn(f"{e}; the classes stay unnamed", stacklevel=3)
        return None
    except ValueError as e:
        warnings.warn(f"{e}; the classes stay unnamed", stacklevel=3)
        return None
    names = d.get(key.encode()) if isinstance(d, dict) else None
    if not isinstance(names, list) or len(names) != count or not all(isinstance(n, (bytes, str)) for n in names):
        warnings.warn(
            f"{what} {path} holds no list of {count} class names under '{key}'; the classes stay unnamed; {fix}",
            stacklevel=3,
        )
        return None
    return [n.decode(errors="replace") if isinstance(n, bytes) else n for n in names]


def read_cifar_meta(path: Path) -> list[str] | None:
    """Class names from ``batches.meta``: None when the file is absent, None and a warning when it is unusable."""
    return read_label_names(path, "CIFAR-10 meta file", "label_names", 10, CIFAR_FIX)


# idx dtype codes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT")
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
MNIST_FIX = "download the complete MNIST idx files (train-/t10k- images and labels, .gz or raw)"


def read_idx(path: Path, fix: str = MNIST_FIX) -> np.ndarray:
    """An idx file (optionally gzip-compressed) -> numpy array of the shape its header gives."""
    raw = read_regular(path, "idx file", fix)  # a named pipe in its place is refused, never waited on
    if path.suffix == ".gz":
        try:  # read at most the limit: a small damaged or hostile stream can inflate without end
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as stream:
                raw = stream.read(MAX_UNPACKED_BYTES + 1)
        except (OSError, EOFError, zlib.error, MemoryError) as e:
            raise ValueError(f"idx file {path} is a truncated or corrupt gzip file ({_detail(e)}); {fix}") from None
        if len(raw) > MAX_UNPACKED_BYTES:
            raise ValueError(f"idx file {path} unpacks to more than {MAX_UNPACKED_BYTES >> 20} MiB, which no idx "
                             f"file needs: it is damaged or hostile; {fix}")  # fmt: skip
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an idx file (bad magic number {raw[:4].hex()}); {fix}")
    ndim, dtype = raw[3], np.dtype(_IDX_DTYPES[raw[2]])
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"idx file {path} is truncated inside its header; {fix}")
    shape = tuple(int(s) for s in np.frombuffer(raw, ">u4", ndim, 4))
    expected = header + math.prod(shape) * dtype.itemsize  # exact: a damaged header cannot overflow
    if len(raw) != expected:
        raise ValueError(
            f"idx file {path} holds {len(raw)} bytes but its header {list(shape)} needs {expected}: it is "
            f"truncated or corrupt; {fix}"
        )
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))
