"""Datasets, batch loader and tensor transforms for training small ViTs without torchvision.

Typical use::

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
from .loader import BatchLoader, derive_seed
from .mix import MixParams, MixupCutmix, smooth_one_hot, soft_target_cross_entropy
from .transforms import (
    Compose,
    Normalize,
    RandomCrop,
    RandomErasing,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    make_transform,
    resize,
)

__all__ = [
    "BatchLoader",
    "Compose",
    "ImageDataset",
    "LazyImageFolder",
    "MixParams",
    "MixupCutmix",
    "Normalize",
    "RandAugment",
    "RandomCrop",
    "RandomErasing",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "cifar10",
    "derive_seed",
    "image_folder",
    "load_dataset",
    "make_transform",
    "mnist_embedded",
    "mnist_idx",
    "resize",
    "resolve_data_config",
    "smooth_one_hot",
    "soft_target_cross_entropy",
    "stratified_holdout",
]
