"""Per-sample crops: the crop box of one image, decoded at the smallest scale that covers it, resampled.

The box (:mod:`vitlab.data.geometry`) is drawn from the file's header *before* decoding, so the decoder
can skip what the resize would throw away (:mod:`vitlab.data.decode`).

Resampling is PyTorch's antialiased uint8 interpolation (bicubic by default), which matches Pillow's resize
to within a few levels at the box edges and is several times faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .decode import Decoded, UnreadableImage, decode, image_size, min_decode_size
from .geometry import Box, CropSpec, cut_crop, eval_box, eval_geometry, train_boxes


def _resample(x: Tensor, out: tuple[int, int], mode: str) -> Tensor:
    if tuple(x.shape[-2:]) == tuple(out):
        return x
    if mode == "nearest":
        return F.interpolate(x, size=out, mode="nearest")
    return F.interpolate(x, size=out, mode=mode, antialias=True, align_corners=False)


def crop_resize(img: Decoded, box: Box, spec: CropSpec) -> tuple[Tensor, Box]:
    """Cut ``box`` out of the decoded pixels and resample it to ``spec.size``: ``uint8 (C, h, w)``.

    At a decoded scale below 1 the box edges are rounded to whole decoded pixels (at most half a decoded
    pixel); the box actually used, in original coordinates, is returned for dense targets to follow.
    """
    x = torch.from_numpy(np.ascontiguousarray(img.pixels)).permute(2, 0, 1)
    return crop_resize_pixels(x, img.scale, box, spec)


def crop_resize_pixels(x: Tensor, scale: tuple[float, float], box: Box, spec: CropSpec) -> tuple[Tensor, Box]:
    """:func:`crop_resize` of pixels ``uint8 (C, H', W')`` on any device, decoded at ``scale = (H'/H, W'/W)``."""
    x = x[None]
    sy, sx = scale
    top, left = round(box.top * sy), round(box.left * sx)
    bottom, right = round((box.top + box.height) * sy), round((box.left + box.width) * sx)
    top, left = min(max(top, 0), x.shape[2] - 1), min(max(left, 0), x.shape[3] - 1)
    bottom, right = max(min(bottom, x.shape[2]), top + 1), max(min(right, x.shape[3]), left + 1)
    out = _resample(x[:, :, top:bottom, left:right], spec.size, spec.interpolation)[0]
    if box.flip:
        out = out.flip(-1)
    used = Box(top / sy, left / sx, (bottom - top) / sy, (right - left) / sx, box.size, box.flip)
    return out.contiguous(), used


def eval_resize_crop(img: Decoded, spec: CropSpec) -> Tensor:
    """The evaluation transform exactly as the formula: resize the decoded image to (H_r, W_r), cut the crop."""
    (rh, rw), (top, left) = eval_geometry(img.size, spec)
    x = torch.from_numpy(np.ascontiguousarray(img.pixels)).permute(2, 0, 1)[None]
    x = _resample(x, (rh, rw), spec.interpolation)
    return cut_crop(x[0], (top, left), spec.size).contiguous()


def read_bytes(data: bytes | Path) -> bytes:
    """A file's bytes (read once: the header and the pixels are decoded from the same buffer)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    try:
        return Path(data).read_bytes()
    except OSError as e:
        raise UnreadableImage(f"{data}: {type(e).__name__}: {e}") from None


def decode_crop(data: bytes, box: Box, spec: CropSpec, decoder: str) -> tuple[Tensor, Box]:
    """Decode at the smallest scale covering ``box`` and cut it (training)."""
    img = decode(data, min_decode_size(box.size, (box.height, box.width), spec.size), spec.channels, decoder)
    return crop_resize(img, box, spec)


def decode_eval(data: bytes, size: tuple[int, int], spec: CropSpec, decoder: str) -> tuple[Tensor, Box]:
    """Decode at the smallest scale covering the evaluation resize and apply it (evaluation)."""
    (rh, rw), _ = eval_geometry(size, spec)
    img = decode(data, (min(rh, size[0]), min(rw, size[1])), spec.channels, decoder)
    return eval_resize_crop(img, spec), eval_box(size, spec)


def load_samples(
    files: Sequence[bytes | Path], spec: CropSpec, g: torch.Generator | None, decoder: str = "pillow"
) -> list[tuple[Tensor, Box] | UnreadableImage]:
    """Image files -> ``uint8 (C, h, w)`` after the spec's crop and the boxes used (original coordinates), or
    the :class:`UnreadableImage` error of a file that cannot be decoded. The training boxes of all readable
    files are drawn from ``g`` in one go, from their headers, before any pixel is decoded."""
    out: list = []
    readable = []
    for f in files:
        try:
            data = read_bytes(f)
            out.append((data, image_size(data, decoder)))
            readable.append(len(out) - 1)
        except UnreadableImage as e:
            out.append(
                UnreadableImage(f"{f if isinstance(f, (str, Path)) else 'image bytes'}: {str(e).split(': ', 1)[-1]}")
            )
    boxes = train_boxes([out[k][1] for k in readable], spec, g) if spec.train and readable else []
    for j, k in enumerate(readable):
        data, size = out[k]
        try:
            out[k] = (
                decode_crop(data, boxes[j], spec, decoder) if spec.train else decode_eval(data, size, spec, decoder)
            )
        except UnreadableImage as e:
            out[k] = _named(e, files[k])
    return out


def _named(e: UnreadableImage, f: bytes | Path) -> UnreadableImage:
    """The error naming the file it came from (decoding worked on its bytes)."""
    name = f if isinstance(f, (str, Path)) else "image bytes"
    return UnreadableImage(f"{name}: {str(e).split(': ', 1)[-1]}")


def load_sample(
    data: bytes | Path, spec: CropSpec, g: torch.Generator | None, decoder: str = "pillow"
) -> tuple[Tensor, Box]:
    """One image file -> ``uint8 (C, h, w)`` and the box used; raises :class:`UnreadableImage`."""
    result = load_samples([data], spec, g, decoder)[0]
    if isinstance(result, UnreadableImage):
        raise result
    return result
