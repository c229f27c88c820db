"""Datasets, batch loader and tensor transforms for training small ViTs without torchvision."""

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

__all__ = [
    "ImageDataset",
    "LazyImageFolder",
    "cifar10",
    "image_folder",
    "load_dataset",
    "mnist_embedded",
    "mnist_idx",
    "stratified_holdout",
]
