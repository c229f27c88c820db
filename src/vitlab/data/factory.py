"""The entry points a training loop calls: ``open_source`` -> ``create_transform`` -> ``create_loader``.

::

    train_src = open_source("folder:/data/imagenet", "train")           # or "wds:/shards", "mnist", ...
    val_src = open_source("folder:/data/imagenet", "val")               # classes matched to train's by name
    cfg = vitlab.data.resolve_data_config(model)                         # input_size, crop_pct, mean, std, ...
    train_tf = create_transform(**cfg, is_training=True, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)
    loader = create_loader(train_src, train_tf, 128, is_training=True, workers=8, repeats=3, mix=mixup,
                           rank=rank, world_size=world, seed=seed, device=device)
    val_loader = create_loader(val_src, create_transform(**cfg), 256, is_training=False, workers=8, ...)
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)            # or loader.load_state_dict(ckpt["loader"]) once, when resuming
        for x, y in loader:                # (x, y, dense) with dense token-label targets
            ...
            ckpt["loader"] = loader.state_dict()

This is the one road from a dataset spec to batches: every tool (train, eval, analyze, study, relabel)
opens its data with :func:`open_source` and builds its transform with :func:`create_transform`. Streaming
sources (``folder:``, ``wds:``) go through DataLoader workers (:class:`StreamLoader`); the in-memory sets
(embedded MNIST, CIFAR-10, MNIST idx) keep their batched path (:class:`BatchLoader`: the same transforms on
whole batches, on the device), behind the same interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .augment import RandAugment
from .crop import crop_resize, eval_resize_crop, load_sample
from .datasets import IMAGENET_MEAN, IMAGENET_STD, ImageDataset, load_dataset
from .decode import Decoded, UnreadableImage, read_image, resolve_decoder
from .geometry import DEFAULT_CROP_PCT, CropSpec, train_box
from .loader import BatchLoader, BatchOp
from .samplers import RepeatedAugSampler, ShardedSampler
from .sources import FolderSource, open_folder
from .spec import DataSpec
from .stream import MapStream, StreamLoader
from .transforms import (
    ColorJitter,
    Compose,
    Normalize,
    RandomCrop,
    RandomErasing,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ResizeCenterCrop,
    Transform,
)


@dataclass
class TransformPipeline:
    """A transform in two stages: ``crop`` (per sample: RandomResizedCrop + flip, or resize + centre crop) and
    ``batch`` (float ops on a batch: RandAugment or colour jitter, normalisation, random erasing).

    Called on a PIL image, a path or file bytes it returns one normalised ``(C, H, W)`` tensor (``g`` drives
    the random choices; a file that cannot be read or decoded, a named pipe included, is
    :class:`~vitlab.data.decode.UnreadableImage` naming it); on a ``(B, C, H, W)`` tensor it runs
    :meth:`batched`. ``crop_padding`` (training on in-memory sets only): resize the whole image and cut a
    random crop of the padded image instead of RandomResizedCrop (0: resize only).
    """

    crop: CropSpec
    batch: Compose
    crop_padding: int | None = None

    def batched(self) -> Compose:
        """The whole pipeline as one batch transform (for in-memory uint8 batches)."""
        c = self.crop
        if c.train and self.crop_padding is not None:  # small fixed-size images: keep them whole, shift them
            first = [Resize(c.size, c.interpolation)]
            first += [RandomCrop(c.size, self.crop_padding)] if self.crop_padding else []
        elif c.train:
            first = [RandomResizedCrop(c.size, c.scale, c.ratio, c.interpolation)]
        else:
            first = [ResizeCenterCrop(c.size, c.crop_pct, c.interpolation, c.crop_mode)]
        first += [RandomHorizontalFlip(c.hflip)] if c.train and c.hflip > 0 else []
        return Compose(first + self.batch.steps)

    def __call__(self, img, g: torch.Generator | None = None) -> Tensor:
        if isinstance(img, Tensor):
            return self.batched()(img, g)
        if self.crop.train and self.crop_padding is not None:
            raise ValueError("crop_padding crops batches of in-memory images; one image takes RandomResizedCrop")
        g = g if g is not None else torch.Generator().manual_seed(0)
        if isinstance(img, (bytes, bytearray)):
            x, _ = load_sample(bytes(img), self.crop, g, "pillow")
        elif isinstance(img, (str, Path)):  # read here: a pipe given as an image is refused, never waited on
            try:
                x, _ = load_sample(read_image(img), self.crop, g, "pillow")
            except UnreadableImage as e:
                message = str(e)
                raise UnreadableImage(
                    message if message.startswith(str(img)) else f"{img}: {message.split(': ', 1)[-1]}"
                ) from None
        else:  # a PIL image already opened
            from .decode import _to_array

            pixels = Decoded(_to_array(img, self.crop.channels), (img.size[1], img.size[0]))
            x = crop_resize(pixels, train_box(pixels.size, self.crop, g), self.crop)[0] if self.crop.train else (
                eval_resize_crop(pixels, self.crop))  # fmt: skip
        return self.batch(x[None], g)[0]

    def __repr__(self) -> str:
        pad = "" if self.crop_padding is None else f",\n  crop_padding={self.crop_padding}"
        return f"TransformPipeline(\n  crop={self.crop},\n  batch={self.batch!r}{pad})"


def _input_hw(input_size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(input_size, int):
        return input_size, input_size
    size = tuple(int(s) for s in input_size)
    return size[-2:] if len(size) in (2, 3) else _bad_size(input_size)


def _bad_size(input_size) -> tuple[int, int]:
    raise ValueError(f"input_size must be an int, (H, W) or (C, H, W), got {input_size!r}")


def create_transform(
    input_size: int | Sequence[int] = 224,
    is_training: bool = False,
    *,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    hflip: float = 0.5,
    color_jitter: float | Sequence[float] | None = 0.4,
    force_color_jitter: bool = False,
    auto_augment: str | Transform | None = None,
    interpolation: str = "bicubic",
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    re_prob: float = 0.0,
    re_mode: str = "pixel",
    crop_pct: float | None = None,
    crop_mode: str | None = None,
    in_chans: int | None = None,
    crop_padding: int | None = None,
) -> TransformPipeline:
    """timm's ``create_transform`` for vitlab's loaders; takes ``resolve_data_config(model)``'s dict as keywords.
    The one transform factory: streaming and in-memory data, training and evaluation.

    Training: RandomResizedCrop(``scale``, ``ratio``, ``interpolation``) -- or, with ``crop_padding`` (in-memory
    sets), the whole image resized and a random crop of it padded by ``crop_padding`` pixels --, flip(``hflip``),
    RandAugment (``auto_augment`` like ``"rand-m9-mstd0.5-inc1"``, or a transform) -- or, without it, colour
    jitter (timm drops the jitter when RandAugment is on, unless ``force_color_jitter``) --, normalisation,
    random erasing (``re_prob``, ``re_mode`` "pixel": per-pixel N(0, 1) noise). Evaluation: resize the shorter
    side to ``floor(size / crop_pct)`` (0.875 by default), centre crop, normalisation (``crop_pct=1.0,
    crop_mode="squash"``: the whole image resized to the input size).
    """
    size = _input_hw(input_size)
    channels = in_chans or (int(input_size[0]) if not isinstance(input_size, int) and len(input_size) == 3 else 3)
    channels = 3 if channels not in (1, 3) else channels
    crop = CropSpec(
        size,
        train=is_training,
        scale=tuple(scale),
        ratio=tuple(ratio),
        hflip=hflip if is_training else 0.0,
        crop_pct=DEFAULT_CROP_PCT if crop_pct is None else crop_pct,
        crop_mode=crop_mode or "center",
        interpolation=interpolation,
        channels=channels,
    )
    steps: list = []
    if is_training and auto_augment:
        steps.append(RandAugment.from_spec(auto_augment) if isinstance(auto_augment, str) else auto_augment)
    if is_training and color_jitter and (not auto_augment or force_color_jitter):
        cj = (float(color_jitter),) * 3 if isinstance(color_jitter, (int, float)) else tuple(color_jitter)[:3]
        steps.append(ColorJitter(*cj))
    steps.append(Normalize(mean, std))
    if is_training and re_prob > 0:
        steps.append(RandomErasing(re_prob, mode="pixel" if re_mode == "pixel" else "const"))
    return TransformPipeline(crop, Compose(steps), crop_padding if is_training else None)


def make_transform(
    train: bool,
    img_size: int | tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    *,
    crop_padding: int | None = 4,
    rrc_scale: Sequence[float] | None = None,
    rrc_ratio: Sequence[float] = (3 / 4, 4 / 3),
    hflip: float = 0.5,
    auto_augment: str | Transform | None = None,
    erase_prob: float = 0.0,
    interpolation: str = "bilinear",
) -> Compose:
    """The batch transform of in-memory sets, in the older argument names: :func:`create_transform`'s
    :meth:`~TransformPipeline.batched` (no colour jitter; evaluation resizes the whole image).

    train: [RandomResizedCrop(img_size, rrc_scale) | Resize + RandomCrop(img_size, crop_padding)],
    RandomHorizontalFlip(hflip), RandAugment, Normalize, RandomErasing(erase_prob). eval: Resize, Normalize.
    """
    rrc = rrc_scale is not None
    return create_transform(
        img_size,
        train,
        scale=tuple(rrc_scale) if rrc else (0.08, 1.0),
        ratio=rrc_ratio,
        hflip=hflip,
        color_jitter=None,
        auto_augment=auto_augment,
        interpolation=interpolation,
        mean=mean,
        std=std,
        re_prob=erase_prob,
        crop_pct=1.0,
        crop_mode="squash",
        crop_padding=None if rrc else (crop_padding or 0),
    ).batched()


def open_source(
    spec: str | DataSpec,
    split: str = "train",
    *,
    holdout: int | float | None = None,
    seed: int = 0,
    dense_root: str | Path | None = None,
    classes: list[str] | None = None,
):
    """The data source of a spec (:class:`~vitlab.data.spec.DataSpec` or its text), every kind: ``folder:ROOT``
    (:class:`FolderSource`, file list only), ``wds:PATTERN`` or ``wds:DIR`` (:class:`~vitlab.data.wds.ShardSource`),
    or an in-memory set of :func:`load_dataset`. ``split``: ``train``, ``val`` (``test`` is the same) or ``all``
    (a whole folder without train/val subfolders). ``classes`` (folders): the class names a model was trained
    on; labels follow them by name."""
    spec = DataSpec.parse(spec)
    if spec.kind == "folder":
        holdout = 0.1 if holdout is None else holdout
        return open_folder(spec.path, split, holdout=holdout, seed=seed, dense_root=dense_root, classes=classes)
    if spec.kind == "wds":
        from .wds import open_shards

        return open_shards(spec.path, split)
    if spec.kind in ("cifar100", "pets", "flowers102"):  # the transfer sets (vitlab.data.transfer_sets)
        from . import transfer_sets as sets

        reader = {"cifar100": sets.cifar100, "pets": sets.oxford_pets, "flowers102": sets.flowers102}[spec.kind]
        return reader(spec.path, "test" if split == "val" else split)
    return load_dataset(spec, "test" if split == "val" else split, holdout=holdout, seed=seed)


def create_loader(
    source,
    transform: TransformPipeline,
    batch_size: int,
    *,
    is_training: bool,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    repeats: int = 1,
    workers: int = 0,
    mix: BatchOp | None = None,
    device: torch.device | str | None = None,
    decoder: str = "auto",
    dense_grid: tuple[int, int] | None = None,
    transform_on_device: bool = True,
    drop_last: bool | None = None,
    pin_memory: bool | None = None,
    persistent_workers: bool = True,
    prefetch_factor: int = 2,
    max_bad_fraction: float = 0.01,
    shuffle_buffer: int = 2000,
) -> BatchLoader | StreamLoader:
    """The loader of ``source`` (see the module docstring). Training shuffles, drops the last short batch and
    with ``repeats > 1`` uses repeated augmentation (shards: every sample once per epoch, the last batch short,
    through a ``shuffle_buffer`` of samples; see :mod:`vitlab.data.wds`); evaluation visits every sample exactly
    once over the ranks. ``dense_grid`` (the patch grid) turns on dense token-label targets; ``mix`` runs on the main
    process (MixupCutmix, or MixToken with dense targets). ``transform_on_device`` runs the batch stage where
    the batch is consumed (default; workers send uint8), else in the workers."""
    drop_last = is_training if drop_last is None else drop_last
    if isinstance(source, ImageDataset):
        if dense_grid is not None:
            raise ValueError("dense token-label targets need a folder: or wds: source (files beside the images)")
        sampler = _sampler(len(source), is_training, seed, rank, world_size, repeats, drop_last)
        tf = transform.batched()
        return BatchLoader(source, batch_size, is_training, drop_last, tf, seed, rank, world_size, mix, device, sampler)
    if transform.crop.train and transform.crop_padding is not None:
        raise ValueError("crop_padding applies to in-memory sets; streaming data is cut by RandomResizedCrop")
    decoder = resolve_decoder(decoder)
    common = dict(decoder=decoder, dense_grid=dense_grid, transform_on_device=transform_on_device)
    if isinstance(source, FolderSource):
        dataset = MapStream(source, transform.crop, transform.batch, **common)
        sampler = _sampler(len(source), is_training, seed, rank, world_size, repeats, drop_last)
    else:
        from .wds import ShardStream

        if repeats > 1:
            raise ValueError("repeated augmentation needs an indexable source (folder:), not shards")
        dataset = ShardStream(source, transform.crop, transform.batch, batch_size=batch_size, train=is_training,
                              seed=seed, rank=rank, world_size=world_size, workers=workers,
                              shuffle_buffer=shuffle_buffer, **common)  # fmt: skip
        sampler = None
    return StreamLoader(
        dataset,
        batch_size,
        sampler,
        drop_last=drop_last,
        seed=seed,
        mix=mix,
        device=device,
        workers=workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor,
        max_bad_fraction=max_bad_fraction,
    )


def _sampler(n: int, train: bool, seed: int, rank: int, world: int, repeats: int, drop_last: bool) -> ShardedSampler:
    if train and repeats > 1:
        return RepeatedAugSampler(n, repeats=repeats, seed=seed, rank=rank, world_size=world)
    return ShardedSampler(n, shuffle=train, seed=seed, rank=rank, world_size=world, drop_last=drop_last, pad=train)
