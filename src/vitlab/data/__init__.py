"""Datasets, loaders and transforms for training ViTs without torchvision, from MNIST to ImageNet.

Streaming sources (``folder:`` ImageNet layout, ``wds:`` WebDataset shards) through DataLoader workers::

    src = open_source("folder:/data/imagenet", "train")
    tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)
    loader = create_loader(src, tf, 128, is_training=True, workers=8, repeats=3, seed=0)

The in-memory sets with the batched path (also reachable through ``create_loader``)::

    train = load_dataset("mnist", "train")                  # or "cifar10:<folder>", "folder:<path>", ...
    tf = make_transform(True, 28, train.mean, train.std, crop_padding=2, hflip=0)
    mix = MixupCutmix(0.8, 1.0, label_smoothing=0.1, num_classes=train.num_classes)
    loader = BatchLoader(train, 128, shuffle=True, drop_last=True, transform=tf, mix=mix, seed=0)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = soft_target_cross_entropy(model(x), y)
"""

from .augment import RandAugment
from .config import resolve_data_config
from .crop import load_sample
from .datasets import (
    ImageDataset,
    LazyImageFolder,
    cifar10,
    image_folder,
    load_dataset,
    mnist_embedded,
    mnist_idx,
    stratified_holdout,
)
from .decode import UnreadableImage, decode
from .factory import TransformPipeline, create_loader, create_transform, open_source
from .geometry import Box, CropSpec, eval_geometry
from .loader import BatchLoader
from .mix import MixParams, MixupCutmix, smooth_one_hot, soft_target_cross_entropy
from .samplers import RepeatedAugSampler, ShardedSampler, derive_seed
from .sources import FolderSource, open_folder
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
    make_transform,
    resize,
)

__all__ = [
    "BatchLoader",
    "Box",
    "ColorJitter",
    "Compose",
    "CropSpec",
    "FolderSource",
    "ImageDataset",
    "LazyImageFolder",
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
    "image_folder",
    "load_dataset",
    "load_sample",
    "make_transform",
    "mnist_embedded",
    "mnist_idx",
    "open_folder",
    "open_source",
    "resize",
    "resolve_data_config",
    "smooth_one_hot",
    "soft_target_cross_entropy",
    "stratified_holdout",
]
