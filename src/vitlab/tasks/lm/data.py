"""Sequence data for the causal models: bytes of any file, and CIFAR-10 images as sub-pixel sequences.

Both give symbol sequences ``uint8 (B, T)`` (256 symbols); the model adds BOS itself.

* :class:`ByteData`: a file's bytes (enwik8-style: no tokenisation, every byte a symbol), split into a
  training part and a held-out tail. Training batches are random windows; evaluation walks non-overlapping
  windows, so every byte is scored once.
* :class:`ImageSequences`: images ``(N, 3, H, W)`` as H x W x 3 sequences (raster order, RGB interleaved,
  paper §4.1). Training batches use the paper's augmentation: a random horizontal flip, then one random
  integer in [-10, 10] added to all sub-pixels of the image, clipped to [0, 255].
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor


def images_to_sequences(images: Tensor) -> Tensor:
    """uint8 (N, C, H, W) -> (N, H*W*C): pixels in raster order, channels interleaved (R, G, B, R, ...)."""
    if images.dim() != 4:
        raise ValueError(f"expected images (N, C, H, W), got {tuple(images.shape)}")
    return images.permute(0, 2, 3, 1).reshape(images.shape[0], -1)


def sequences_to_images(seqs: Tensor, size: tuple[int, int], channels: int = 3) -> Tensor:
    """Inverse of :func:`images_to_sequences`: (N, H*W*C) -> (N, C, H, W)."""
    h, w = size
    if seqs.dim() != 2 or seqs.shape[1] != h * w * channels:
        raise ValueError(f"expected sequences (N, {h * w * channels}) for {h}x{w}x{channels}, got {tuple(seqs.shape)}")
    return seqs.reshape(-1, h, w, channels).permute(0, 3, 1, 2)


def augment_images(images: Tensor, generator: torch.Generator | None = None, max_shift: int = 10) -> Tensor:
    """Paper §4.1: random horizontal flip, then one shift in [-max_shift, max_shift] per image, clipped."""
    n = images.shape[0]
    flip = torch.rand(n, generator=generator) < 0.5
    out = torch.where(flip[:, None, None, None], images.flip(-1), images).to(torch.int16)
    shift = torch.randint(-max_shift, max_shift + 1, (n, 1, 1, 1), generator=generator, dtype=torch.int16)
    return (out + shift).clamp(0, 255).to(torch.uint8)


class Splits:
    """A training and a held-out part (``parts``), looked up by split name."""

    parts: dict[str, Tensor]

    def part(self, split: str) -> Tensor:
        if split not in self.parts:
            raise ValueError(f"split must be one of {', '.join(map(repr, self.parts))}, got {split!r}")
        return self.parts[split]


class ByteData(Splits):
    """Bytes of a file; the last ``holdout`` of them (fraction in (0, 1) or a byte count) are held out (the
    ``test`` part), and with ``valid`` the bytes just before them form a ``valid`` part (enwik8's usual split:
    the first 90M bytes train, the next 5M validation, the last 5M test: ``holdout=valid=5_000_000``).

    Args:
        path: any file (text, enwik8, binary).
        seq_len: window length T.
        holdout: held-out tail (fraction or bytes); it must hold at least one window.
        valid: validation part before the tail (fraction or bytes; 0: none); at least one window when given.
    """

    kind = "bytes"

    def __init__(self, path: str | Path, seq_len: int, holdout: float = 0.05, valid: float = 0.0) -> None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"text/byte file {path} not found")
        raw = path.read_bytes()
        if not raw:  # torch.frombuffer refuses an empty buffer with a message about buffers
            raise ValueError(f"{path} is empty: byte data needs a file with at least 2 x seq_len={seq_len} bytes")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        n_hold = int(holdout) if holdout >= 1 else round(len(data) * holdout)
        n_valid = int(valid) if valid >= 1 else round(len(data) * valid)
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if holdout <= 0:
            raise ValueError(f"holdout must be a fraction in (0, 1) or a byte count of at least seq_len, got {holdout}")
        if valid < 0 or (valid > 0 and n_valid < seq_len):
            raise ValueError(f"valid must be 0 or hold at least seq_len={seq_len} bytes, got {valid} ({n_valid} bytes)")
        if n_hold < seq_len or len(data) - n_hold - n_valid < seq_len:
            raise ValueError(
                f"{path} has {len(data)} bytes: need at least seq_len={seq_len} bytes for training and "
                f"{seq_len} held out (holdout={holdout} gives {n_hold}, valid={valid} {n_valid}); use a shorter "
                "--seq-len or other --holdout / --valid"
            )
        self.path, self.seq_len = path, seq_len
        end_train, end_valid = len(data) - n_hold - n_valid, len(data) - n_hold
        self.parts = {"train": data[:end_train], **({"valid": data[end_train:end_valid]} if n_valid else {})}
        self.parts["test"] = data[end_valid:]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k} {len(v)} bytes" for k, v in self.parts.items())
        return f"ByteData({self.path}: {sizes}; T={self.seq_len})"

    def sample(self, batch: int, generator: torch.Generator | None = None) -> Tensor:
        """``batch`` random training windows (batch, T)."""
        data = self.parts["train"]
        start = torch.randint(0, len(data) - self.seq_len + 1, (batch,), generator=generator)
        return data[start[:, None] + torch.arange(self.seq_len)]

    def eval_batches(self, split: str, batch: int, max_symbols: int | None = None) -> Iterator[Tensor]:
        """Non-overlapping windows covering the split from its start (at most ``max_symbols`` symbols)."""
        data = self.part(split)
        count = len(data) // self.seq_len
        if max_symbols:
            count = max(1, min(count, max_symbols // self.seq_len))
        windows = data[: count * self.seq_len].view(count, self.seq_len)
        yield from windows.split(batch)


class ImageSequences(Splits):
    """Images as sub-pixel sequences (T = H·W·3), with a held-out split.

    Args:
        train, test: uint8 images (N, 3, H, W).
        img_size: optional smaller side s (a divisor of H): images are average-pooled to s x s first
            (quick CPU experiments; the paper's setting is the full 32 x 32, T = 3072).
        augment: the paper's flip + shift augmentation on training batches.
    """

    kind = "images"

    def __init__(
        self, train: Tensor, test: Tensor, img_size: int | None = None, augment: bool = True, source: str = ""
    ) -> None:
        self.parts = {"train": self._resize(train, img_size), "test": self._resize(test, img_size)}
        self.size = tuple(self.parts["train"].shape[-2:])
        self.channels = self.parts["train"].shape[1]
        self.seq_len = self.size[0] * self.size[1] * self.channels
        self.augment, self.source = augment, source

    @staticmethod
    def _resize(images: Tensor, img_size: int | None) -> Tensor:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be uint8 (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        h = images.shape[-1]
        if not img_size or img_size == h:
            return images
        if img_size < 1 or h % img_size or images.shape[-2] != h:
            raise ValueError(f"img_size must divide the square image side {h}, got {img_size}")
        pooled = F.avg_pool2d(images.float(), h // img_size)
        return pooled.round().clamp(0, 255).to(torch.uint8)

    @classmethod
    def cifar10(cls, root: str | Path, img_size: int | None = None, augment: bool = True) -> ImageSequences:
        """CIFAR-10 from a local ``cifar-10-batches-py`` folder: train = data batches, test = test batch."""
        from ...data import cifar10

        train, test = cifar10(root, "train"), cifar10(root, "test")
        return cls(train.images, test.images, img_size, augment, f"{train.source}; {test.source}")

    def __repr__(self) -> str:
        n = {k: len(v) for k, v in self.parts.items()}
        return f"ImageSequences({n['train']} train / {n['test']} test images {self.size}, T={self.seq_len})"

    def sample(self, batch: int, generator: torch.Generator | None = None) -> Tensor:
        """``batch`` random training images as sequences (augmented unless ``augment=False``)."""
        images = self.parts["train"]
        imgs = images[torch.randint(0, len(images), (batch,), generator=generator)]
        if self.augment:
            imgs = augment_images(imgs, generator)
        return images_to_sequences(imgs)

    def eval_batches(self, split: str, batch: int, max_symbols: int | None = None) -> Iterator[Tensor]:
        """The split's first images (at most ``max_symbols`` sub-pixels), unaugmented."""
        images = self.part(split)
        count = len(images) if not max_symbols else max(1, min(len(images), max_symbols // self.seq_len))
        for chunk in images[:count].split(batch):
            yield images_to_sequences(chunk)


def open_data(
    spec: str | Path,
    seq_len: int | None = None,
    holdout: float = 0.05,
    img_size: int | None = None,
    augment: bool = True,
    valid: float = 0.0,
) -> ByteData | ImageSequences:
    """A folder with CIFAR-10 batches (or ``cifar10:<folder>``) -> images; any file -> bytes (T = ``seq_len``)."""
    spec = str(spec)
    if spec.startswith("cifar10:"):
        return ImageSequences.cifar10(spec.split(":", 1)[1], img_size, augment)
    path = Path(spec).expanduser()
    if path.is_dir():
        return ImageSequences.cifar10(path, img_size, augment)
    if not path.exists():
        raise FileNotFoundError(f"data {spec} not found: pass a text/byte file or a CIFAR-10 batches folder")
    if seq_len is None:
        raise ValueError("byte data needs a sequence length (--seq-len)")
    return ByteData(path, seq_len, holdout, valid)
