"""The images an analysis looks at: image files or a dataset's first images, at a model's input size."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from ..data import load_dataset, make_transform, resize
from ..data.config import spec_kind
from ..data.datasets import load_image


def load_images(
    model: nn.Module,
    *,
    data: str | None = None,
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
        raw = _read_files(files, max(h, w), chans)
        mean, std, what = model.meta["mean"], model.meta["std"], f"{len(files)} image files"
    else:
        raw, mean, std, what = _read_dataset(data or "mnist", split, num_images, max(h, w), chans)
    images = resize(raw.float() / 255, (h, w))
    images, mean, std = _match_channels(images, mean, std, chans)
    images = images.clamp(0, 1).contiguous()
    return images, make_transform(False, (h, w), mean, std)(images), what


def _read_files(files: Sequence[str | Path], size: int, chans: int) -> Tensor:
    for f in files:
        if not Path(f).expanduser().is_file():
            raise FileNotFoundError(f"image {f} not found")
    return torch.stack([load_image(Path(f).expanduser(), size, chans) for f in files])


def _read_dataset(spec: str, split: str, n: int, size: int, chans: int) -> tuple[Tensor, Sequence, Sequence, str]:
    if spec_kind(spec) == "folder":  # decode only the images used, not the whole tree
        try:
            ds = load_dataset(spec, split, img_size=size, channels=chans, lazy=True)
        except ValueError:  # no train/test subfolders: every image of the folder
            ds = load_dataset(spec, "all", img_size=size, channels=chans, lazy=True)
    else:
        ds = load_dataset(spec, split)
    if len(ds) == 0:
        raise ValueError(f"dataset {spec!r} ({split}) has no images")
    raw, _ = ds.get_batch(torch.arange(min(n, len(ds))))
    return raw, ds.mean, ds.std, f"{spec} ({split}), {len(raw)} images"


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
