"""Datasets, loaders and transforms for training ViTs without torchvision, from MNIST to ImageNet.

One road from a dataset spec to batches: :class:`DataSpec` (``DataSpec.parse("folder:/data/imagenet")``) ->
:func:`open_source` -> :func:`create_transform` -> :func:`create_loader`, for every kind of data.

Streaming sources (``folder:`` ImageNet layout, ``wds:`` WebDataset shards) through DataLoader workers::

    src = open_source("folder:/data/imagenet", "train")
    tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)
    loader = create_loader(src, tf, 128, is_training=True, workers=8, repeats=3, seed=0)

The in-memory sets take the same calls (their batched path: whole batches transformed on the device)::

    train = open_source("mnist", "train")                   # or "cifar10:<folder>", "mnist-idx:<folder>"
    tf = create_transform(28, True, mean=train.mean, std=train.std, crop_padding=2, hflip=0, color_jitter=None)
    mix = MixupCutmix(0.8, 1.0, label_smoothing=0.1, num_classes=train.num_classes)
    loader = create_loader(train, tf, 128, is_training=True, mix=mix, seed=0)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = soft_target_cross_entropy(model(x), y)
"""

from .augment import RandAugment
from .crop import load_sample
from .data_config import resolve_data_config
from .datasets import ImageDataset, cifar10, load_dataset, mnist_embedded, mnist_idx, stratified_holdout
from .decode import UnreadableImage, decode
from .factory import TransformPipeline, create_loader, create_transform, make_transform, open_source
from .geometry import Box, CropSpec, eval_geometry
from .loader import BatchLoader
from .mix import MixParams, MixupCutmix, smooth_one_hot, soft_target_cross_entropy
from .samplers import RepeatedAugSampler, ShardedSampler, derive_seed
from .sources import FolderSource, open_folder
from .spec import DataSpec, parse_data
from .stream import StreamLoader
from .tokenlabel import MixToken, crop_dense, dense_targets
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
    resize,
)

__all__ = [
    "BatchLoader",
    "Box",
    "ColorJitter",
    "Compose",
    "CropSpec",
    "DataSpec",
    "FolderSource",
    "ImageDataset",
    "MixParams",
    "MixToken",
    "MixupCutmix",
    "Normalize",
    "RandAugment",
    "RandomCrop",
    "RandomErasing",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "RepeatedAugSampler",
    "Resize",
    "ResizeCenterCrop",
    "ShardedSampler",
    "StreamLoader",
    "TransformPipeline",
    "UnreadableImage",
    "cifar10",
    "create_loader",
    "create_transform",
    "crop_dense",
    "decode",
    "dense_targets",
    "derive_seed",
    "eval_geometry",
    "load_dataset",
    "load_sample",
    "make_transform",
    "mnist_embedded",
    "mnist_idx",
    "open_folder",
    "open_source",
    "parse_data",
    "resize",
    "resolve_data_config",
    "smooth_one_hot",
    "soft_target_cross_entropy",
    "stratified_holdout",
]
