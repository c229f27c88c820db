"""The images an analysis looks at: image files or a dataset's first images, at a model's input size.

Both come through ``vitlab.data``'s one road (``open_source`` -> ``create_transform`` -> ``create_loader``; a
file through the same transform): whole images resized to the input size, a folder's files decoded as
training decodes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from ..data import DataSpec, Normalize, create_loader, create_transform, open_source


def load_images(
    model: nn.Module,
    *,
    data: str | DataSpec | None = None,
    files: Sequence[str | Path] | None = None,
    split: str = "test",
    num_images: int = 4,
) -> tuple[Tensor, Tensor, str]:
    """(images in [0, 1] at the model's size, the normalised model input, a description).

    The first ``num_images`` of ``files``, else of the dataset ``data`` (a spec as ``vitlab train`` takes;
    default mnist) in ``split``; resized to ``model.meta["input_size"]`` and matched to its channels.
    """
    chans, h, w = model.meta["input_size"]
    if num_images < 1:
        raise ValueError(f"--num-images must be at least 1, got {num_images}")
    if files:
        files = list(files)[:num_images]
        images = _read_files(files, (h, w), chans)
        mean, std, what = model.meta["mean"], model.meta["std"], f"{len(files)} image files"
    else:
        images, mean, std, what = _read_dataset(DataSpec.parse(data or "mnist"), split, num_images, (h, w))
    images, mean, std = _match_channels(images, mean, std, chans)
    images = images.clamp(0, 1).contiguous()
    return images, Normalize(mean, std)(images), what


def _whole(size: tuple[int, int], chans: int, interpolation: str):
    """The whole image resized to ``size`` (shorter side, centred), in [0, 1]: no normalisation."""
    return create_transform(size, mean=(0.0,) * chans, std=(1.0,) * chans, crop_pct=1.0, in_chans=chans,
                            interpolation=interpolation)  # fmt: skip


def _read_files(files: Sequence[str | Path], size: tuple[int, int], chans: int) -> Tensor:
    for f in files:
        if not Path(f).expanduser().is_file():
            raise FileNotFoundError(f"image {f} not found")
    chans = chans if chans in (1, 3) else 3  # decoded as grey or RGB, then matched to the model's channels
    tf = _whole(size, chans, "bicubic")
    return torch.stack([tf(Path(f).expanduser()) for f in files])


def _read_dataset(spec: DataSpec, split: str, n: int, size: tuple[int, int]) -> tuple[Tensor, Sequence, Sequence, str]:
    """The first ``n`` images of ``split`` (a flat image folder: of all its images) and the data's statistics."""
    if spec.kind == "folder" and not (Path(spec.path).expanduser() / "train").is_dir():
        split = "all"  # no held-out part to pick from: the folder's first images
    source = open_source(spec, split)
    if len(source) == 0:
        raise ValueError(f"dataset {str(spec)!r} ({split}) has no images")
    chans = int(getattr(source, "in_chans", 3))  # streaming data is decoded as RGB
    tf = _whole(size, chans, "bicubic" if spec.streaming else "bilinear")
    images, _ = next(iter(create_loader(source, tf, min(n, len(source)), is_training=False)))
    return images, source.mean, source.std, f"{spec} ({split}), {len(images)} images"


def _match_channels(x: Tensor, mean: Sequence[float], std: Sequence[float], chans: int):
    """Grey -> RGB by repetition, RGB -> grey by luminance (ITU-R 601), statistics alike."""
    c = x.shape[1]
    if c == chans:
        return x, tuple(mean), tuple(std)
    if c == 1:
        return x.expand(-1, chans, -1, -1), tuple(mean) * chans, tuple(std) * chans
    if c == 3 and chans == 1:
        lum = torch.tensor([0.299, 0.587, 0.114])
        return (
            (x * lum.view(1, 3, 1, 1)).sum(1, keepdim=True),
            (float(lum @ torch.tensor(mean)),),
            (float(lum @ torch.tensor(std)),),
        )
    raise ValueError(f"images with {c} channels cannot be fed to a model with {chans} input channels")
