"""Readers for on-disk dataset formats: CIFAR python pickles (restricted unpickler) and MNIST idx files.

Every failure becomes one ``FileNotFoundError``/``ValueError`` sentence naming the file, what is wrong
and what to do; nothing from a data file is ever executed.
"""

from __future__ import annotations

import gzip
import io
import math
import pickle
import zlib
from pathlib import Path

import numpy as np


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


# The only globals a pickled numpy array needs; everything else (os.system, builtins.eval, ...) is refused.
_ALLOWED_GLOBALS = {
    ("_codecs", "encode"): lambda: _latin1_encode,
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
    if not path.is_file():
        if path.exists():
            raise ValueError(f"{what} {path} is not a regular file; {fix}")
        raise FileNotFoundError(f"{what} {path} does not exist; {fix}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path} ({e.strerror or e}); {fix}") from None
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


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 batch -> (uint8 images (N, 3, 32, 32), int64 labels (N,)).

    The pickle holds a dict ``{b"data": uint8 (N, 3072) rows R(1024) G(1024) B(1024), b"labels": [int]}``.
    """
    d = load_array_pickle(path, "CIFAR-10 batch", CIFAR_FIX)
    if isinstance(d, dict):
        d = {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}
    data, labels = (d.get("data"), d.get("labels")) if isinstance(d, dict) else (None, None)
    if not isinstance(data, np.ndarray) or labels is None:
        raise ValueError(f"CIFAR-10 batch {path} has no 'data' array and 'labels' list; {CIFAR_FIX}")
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    if data.dtype != np.uint8 or data.shape != (n, 3072):
        raise ValueError(
            f"CIFAR-10 batch {path} holds data {data.dtype}{list(data.shape)} for {n} labels, expected "
            f"uint8[{n}, 3072]; {CIFAR_FIX}"
        )
    if n and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"CIFAR-10 batch {path} has labels outside 0..9; {CIFAR_FIX}")
    return data.reshape(n, 3, 32, 32), labels


def read_cifar_meta(path: Path) -> list[str] | None:
    """Class names from ``batches.meta``, or None when the file is absent or unusable."""
    try:
        d = load_array_pickle(path, "CIFAR-10 meta file", CIFAR_FIX)
    except (FileNotFoundError, ValueError):
        return None
    names = d.get(b"label_names") if isinstance(d, dict) else None
    if not isinstance(names, list):
        return None
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


# idx dtype codes (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT")
_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
MNIST_FIX = "download the complete MNIST idx files (train-/t10k- images and labels, .gz or raw)"


def read_idx(path: Path, fix: str = MNIST_FIX) -> np.ndarray:
    """An idx file (optionally gzip-compressed) -> numpy array of the shape its header gives."""
    if not path.is_file():
        raise FileNotFoundError(f"idx file {path} does not exist; {fix}")
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error, MemoryError) as e:
        raise ValueError(f"idx file {path} is a truncated or corrupt gzip file ({_detail(e)}); {fix}") from None
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
