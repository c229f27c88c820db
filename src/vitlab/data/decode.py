"""Decode one image file straight to the pixels a crop needs: JPEG DCT-domain downscaling, any colour mode.

A JPEG can be decoded at a fraction of its size in the DCT domain (libjpeg-turbo scales by M/8; Pillow's
``draft`` by 1/2, 1/4, 1/8), which skips most of the inverse DCT and colour conversion. ``decode`` asks for
the smallest such scale at which the crop box still spans at least the output size, so nothing is lost
that the resize to the output would keep. Only the power-of-two scales are used (1/2, 1/4, 1/8, as Pillow's
draft): libjpeg-turbo's SIMD inverse DCTs cover those, while its other M/8 scales (7/8, 3/4, ...) run plain C
code and decode *slower* than the full image (measured: 7/8 of a 400x300 JPEG 1.09 ms, the whole image
0.79 ms). simplejpeg (about twice Pillow's speed here) is used where it is installed and the file is a
YCbCr/grayscale JPEG; everything else (PNG, CMYK JPEGs, GIF, 16-bit images...)
goes through Pillow and ends as RGB (alpha dropped, as timm and torchvision do) or grayscale.

A file that cannot be decoded raises :class:`UnreadableImage` naming the path; the loaders count and skip it.
A path is read through :func:`read_image` (:func:`vitlab.data.safe_files.read_regular`): a named pipe or device
given as an image is an unreadable image, never a read that blocks.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .safe_files import read_regular

DECODERS = ("auto", "pillow", "simplejpeg")


class UnreadableImage(ValueError):
    """A file that is not a decodable image (truncated, corrupt, not an image)."""


@dataclass(frozen=True)
class Decoded:
    """Pixels ``uint8 (H', W', C)`` of an image whose full size is ``size = (H, W)``: ``scale = (H'/H, W'/W)``."""

    pixels: np.ndarray
    size: tuple[int, int]

    @property
    def scale(self) -> tuple[float, float]:
        return self.pixels.shape[0] / self.size[0], self.pixels.shape[1] / self.size[1]


def _simplejpeg():
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def resolve_decoder(decoder: str) -> str:
    """``auto`` -> ``simplejpeg`` when it is installed, else ``pillow``."""
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
    if decoder == "auto":
        return "simplejpeg" if _simplejpeg() is not None else "pillow"
    if decoder == "simplejpeg" and _simplejpeg() is None:
        raise ImportError("decoder 'simplejpeg' needs the simplejpeg package: pip install 'vitlab[data]'")
    return decoder


def min_decode_size(size: tuple[int, int], box_hw: tuple[float, float], out_hw: tuple[int, int]) -> tuple[int, int]:
    """The smallest decoded (height, width) at which a ``box_hw`` box of a ``size`` image still spans ``out_hw``
    pixels: decoding at scale ``s >= out / box`` per axis loses nothing the resize to ``out`` would keep."""
    (h, w), (bh, bw), (oh, ow) = size, box_hw, out_hw
    return min(h, math.ceil(h * oh / max(bh, 1e-6))), min(w, math.ceil(w * ow / max(bw, 1e-6)))


def _to_array(im, channels: int) -> np.ndarray:
    """A Pillow image as ``uint8 (H, W, channels)``: 16-bit and float images scaled, not clipped."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        a = np.asarray(im, dtype=np.float64)
        top = 65535.0 if im.mode.startswith("I;16") or a.max() > 255 else 255.0
        a = np.clip(np.round(a * (255.0 / top)), 0, 255).astype(np.uint8)
        a = np.repeat(a[..., None], 3, -1) if channels == 3 else a[..., None]
        return a
    a = np.array(im.convert("RGB" if channels == 3 else "L"))  # writable: torch.from_numpy warns otherwise
    return a if a.ndim == 3 else a[..., None]


def read_image(path: str | Path) -> bytes:
    """The bytes of an image file; :class:`UnreadableImage` naming it when it is missing, unreadable, or not a
    regular file (checked on the opened file, without blocking on a pipe)."""
    try:
        return read_regular(Path(path), "image", "replace it by the image file or remove it from the dataset")
    except (OSError, ValueError) as e:  # FileNotFoundError, DataFileError (a pipe, a device, too large)
        raise UnreadableImage(f"{path}: {type(e).__name__}: {e}") from None


def _open_pillow(data: bytes | Path):
    from PIL import Image

    return Image.open(io.BytesIO(data if isinstance(data, (bytes, bytearray, memoryview)) else read_image(data)))


def image_size(data: bytes | Path, decoder: str = "pillow") -> tuple[int, int]:
    """(height, width) from the file's header, without decoding the pixels."""
    try:
        if decoder == "simplejpeg" and _is_jpeg(data):
            h, w, _, _ = _simplejpeg().decode_jpeg_header(_as_bytes(data))
            return int(h), int(w)
        with _open_pillow(data) as im:
            return im.size[1], im.size[0]
    except Exception as e:  # any decoder failure is the file's fault
        raise UnreadableImage(f"{_name(data)}: {type(e).__name__}: {e}") from None


def _as_bytes(data: bytes | Path) -> bytes:
    return bytes(data) if isinstance(data, (bytes, bytearray, memoryview)) else read_image(data)


def _is_jpeg(data: bytes | Path) -> bool:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data[:2]) == b"\xff\xd8"
    return Path(data).suffix.lower() in (".jpg", ".jpeg")


def _name(data: bytes | Path) -> str:
    return "image bytes" if isinstance(data, (bytes, bytearray, memoryview)) else str(data)


def decode(
    data: bytes | Path,
    min_size: tuple[int, int] | None = None,
    channels: int = 3,
    decoder: str = "pillow",
) -> Decoded:
    """Decode ``data`` (file bytes or a path) to ``uint8 (H', W', channels)``, as small as DCT scaling allows
    while ``H' >= min_size[0]`` and ``W' >= min_size[1]`` (``None``: full size)."""
    try:
        if decoder == "simplejpeg" and channels == 3 and _is_jpeg(data):
            out = _decode_simplejpeg(_as_bytes(data), min_size)
            if out is not None:
                return out
        return _decode_pillow(data, min_size, channels)
    except UnreadableImage:
        raise
    except Exception as e:  # Pillow and libjpeg raise many types (OSError, SyntaxError, ValueError, ...)
        raise UnreadableImage(f"{_name(data)}: {type(e).__name__}: {e}") from None


def _decode_simplejpeg(data: bytes, min_size: tuple[int, int] | None) -> Decoded | None:
    sj = _simplejpeg()
    h, w, colorspace, _ = sj.decode_jpeg_header(data)
    if colorspace not in ("YCbCr", "Gray", "RGB"):  # CMYK/YCCK: Pillow knows Adobe's inverted CMYK
        return None
    reduce = power_of_two_reduction((h, w), min_size)
    if reduce == 1:
        return Decoded(sj.decode_jpeg(data, "RGB"), (int(h), int(w)))
    # simplejpeg picks the smallest M/8 scale covering the minimum: asking for exactly h / reduce gives 1/reduce
    pixels = sj.decode_jpeg(data, "RGB", min_height=-(-h // reduce), min_width=-(-w // reduce))
    return Decoded(pixels, (int(h), int(w)))


def power_of_two_reduction(size: tuple[int, int], min_size: tuple[int, int] | None) -> int:
    """The largest of 1, 2, 4, 8 by which a JPEG of ``size`` (height, width) can be reduced in decoding (output
    ``ceil(size / r)``) and still be at least ``min_size`` (``None``: 1, the full image)."""
    if min_size is None:
        return 1
    (h, w), (mh, mw) = size, min_size
    r = 1
    while r < 8 and -(-h // (2 * r)) >= mh and -(-w // (2 * r)) >= mw:
        r *= 2
    return r


def _decode_pillow(data: bytes | Path, min_size: tuple[int, int] | None, channels: int) -> Decoded:
    with _open_pillow(data) as im:
        w, h = im.size
        if min_size is not None and im.format == "JPEG":
            im.draft("RGB" if channels == 3 else "L", (int(min_size[1]), int(min_size[0])))
        im.load()
        pixels = _to_array(im, channels)
    return Decoded(pixels, (h, w))
