"""The data of a training run: its sources, transforms and per-rank loaders.

Streaming specs (``folder:ROOT``, ``wds:PATTERN``) are decoded and augmented per sample in DataLoader workers
(``workers``, pinned memory on CUDA, persistent workers, sharded by rank) with the recipes' transforms:
RandomResizedCrop, flip, RandAugment or colour jitter, random erasing (``reprob``), repeated augmentation
(``aug_repeats``), batch Mixup/CutMix + label smoothing on the main process (MixToken with token labels);
they are evaluated with the model's crop (shorter side resized to ``img_size / crop_pct``, centre crop, the
model's mean/std). The in-memory sets (embedded MNIST, CIFAR-10, MNIST idx) keep their batched path (whole
batches transformed on the device, the dataset's statistics, whole images) behind the same loop.
"""

from __future__ import annotations

from typing import Any

import torch

from ..data import (
    BatchLoader,
    MixToken,
    MixupCutmix,
    RepeatedAugSampler,
    create_loader,
    create_transform,
    load_dataset,
    make_transform,
    open_source,
    resolve_data_config,
)
from ..data.tokenlabel import patch_grid
from .config import Run, TrainConfig, TrainingError

STREAMING = ("folder", "wds")


def is_streaming(spec: str) -> bool:
    """Whether a dataset spec streams through DataLoader workers (``folder:``, ``wds:``)."""
    kind, sep, _ = spec.partition(":")
    return bool(sep) and kind.lower() in STREAMING


def load_data(cfg: TrainConfig, split: str):
    """One split of the run's data: a streaming source (file list or shard list only) or an in-memory set."""
    try:
        if is_streaming(cfg.data):
            return open_source(cfg.data, "val" if split == "test" else split, holdout=cfg.holdout, seed=0,
                               dense_root=cfg.dense_root)  # fmt: skip
        return load_dataset(cfg.data, split, img_size=cfg.img_size, holdout=cfg.holdout)
    except ImportError as e:
        raise TrainingError(str(e)) from None
    except (EOFError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise TrainingError(f"cannot read dataset {cfg.data!r} ({e}); check or re-create its files") from None


def open_data(run: Run) -> None:
    """The training subset and the held-out set (nothing decoded for streaming sources)."""
    cfg = run.cfg
    if cfg.batch_size % run.world.size:
        raise TrainingError(f"the global batch {cfg.batch_size} must be divisible by the {run.world.size} processes")
    streaming = is_streaming(cfg.data)
    if cfg.token_label and not streaming:
        raise TrainingError("--token-label reads dense targets beside the images: use --data folder:... or wds:...")
    train_ds, val_ds = load_data(cfg, "train"), load_data(cfg, "test")
    if cfg.train_limit:
        if streaming:
            raise TrainingError("--train-limit applies to in-memory data; for a folder, generate a smaller one")
        pick = torch.randperm(len(train_ds), generator=torch.Generator().manual_seed(cfg.seed))[: cfg.train_limit]
        train_ds = train_ds.subset(pick.sort().values)  # a seeded random subset (the data may be sorted by class)
    if cfg.batch_size > len(train_ds):
        raise TrainingError(
            f"batch size {cfg.batch_size} exceeds the {len(train_ds)} training images; use a smaller --batch-size"
        )
    if val_ds.num_classes != train_ds.num_classes:
        raise TrainingError(f"the held-out data has {val_ds.num_classes} classes, training {train_ds.num_classes}")
    run.train_ds, run.val_ds = train_ds, val_ds


def data_shape(cfg: TrainConfig, train_ds) -> dict[str, int]:
    """The model's input and classes as the data decides them (``img_size``, ``in_chans``, ``num_classes``)."""
    if is_streaming(cfg.data):
        from ..models import get_config

        size = cfg.img_size or get_config(cfg.model).input_size[-1]
        return {"img_size": int(size), "in_chans": 3, "num_classes": int(train_ds.num_classes)}
    size = cfg.img_size or int(train_ds.img_size[0])
    return {"img_size": size, "in_chans": int(train_ds.in_chans), "num_classes": int(train_ds.num_classes)}


def batch_mix(run: Run, dense: bool):
    """The batch-level mixing of the main process: MixToken with token labels, else Mixup/CutMix (or None)."""
    cfg, classes = run.cfg, run.train_ds.num_classes
    if dense:
        if cfg.cutmix <= 0:
            return None
        patch = run.raw.patch_embed.patch_size[0]
        return MixToken(patch, cfg.cutmix, label_smoothing=cfg.smoothing, num_classes=classes)
    if cfg.mixup > 0 or cfg.cutmix > 0:
        return MixupCutmix(cfg.mixup, cfg.cutmix, label_smoothing=cfg.smoothing, num_classes=classes)
    return None


def build_loaders(run: Run) -> None:
    """The training loader of this rank and the held-out loader (whole held-out set, on the ranks that
    evaluate); records the evaluation data configuration in ``run.data_cfg``."""
    cfg, world = run.cfg, run.world
    shard = dict(seed=cfg.seed, rank=world.rank, world_size=world.size, device=run.device)
    if is_streaming(cfg.data):
        stream_loaders(run, shard)
    else:
        memory_loaders(run, shard)
    if len(run.loader) == 0:
        raise TrainingError(
            f"no full batch of {run.per_rank} per process in {len(run.train_ds)} images; use a smaller --batch-size"
        )


def stream_loaders(run: Run, shard: dict[str, Any]) -> None:
    cfg = run.cfg
    run.data_cfg = resolve_data_config({"img_size": run.kwargs["img_size"], "crop_pct": cfg.crop_pct}, model=run.raw)
    hflip = 0.5 if cfg.hflip is None else cfg.hflip
    aug = dict(auto_augment=cfg.auto_augment, re_prob=cfg.reprob, color_jitter=cfg.color_jitter, hflip=hflip)
    train_tf = create_transform(**run.data_cfg, is_training=True, **aug)
    grid = patch_grid((run.kwargs["img_size"],) * 2, run.raw.patch_embed.patch_size[0]) if cfg.token_label else None
    common = dict(workers=cfg.workers, dense_grid=grid, mix=batch_mix(run, grid is not None))
    run.loader = create_loader(run.train_ds, train_tf, run.per_rank, is_training=True, repeats=cfg.aug_repeats,
                               **common, **shard)  # fmt: skip
    eval_tf = create_transform(**run.data_cfg, is_training=False)
    run.val_loader = create_loader(run.val_ds, eval_tf, cfg.eval_batch_size, is_training=False, workers=cfg.workers,
                                   device=run.device)  # fmt: skip


def memory_loaders(run: Run, shard: dict[str, Any]) -> None:
    cfg, train_ds, val_ds = run.cfg, run.train_ds, run.val_ds
    img_size = run.kwargs["img_size"]
    digits = train_ds.num_classes == 10 and train_ds.in_chans == 1
    hflip = cfg.hflip if cfg.hflip is not None else (0.0 if digits else 0.5)
    aug = dict(crop_padding=cfg.crop_padding or None, hflip=hflip, auto_augment=cfg.auto_augment)
    train_tf = make_transform(True, img_size, train_ds.mean, train_ds.std, erase_prob=cfg.reprob, **aug)
    sampler = None
    if cfg.aug_repeats > 1:
        sampler = RepeatedAugSampler(len(train_ds), repeats=cfg.aug_repeats, seed=cfg.seed, rank=shard["rank"],
                                     world_size=shard["world_size"])  # fmt: skip
    run.loader = BatchLoader(train_ds, run.per_rank, shuffle=True, drop_last=True, transform=train_tf,
                             mix=batch_mix(run, False), sampler=sampler, **shard)  # fmt: skip
    eval_tf = make_transform(False, img_size, val_ds.mean, val_ds.std)
    run.val_loader = BatchLoader(val_ds, cfg.eval_batch_size, shuffle=False, transform=eval_tf, device=run.device)
    run.data_cfg = None
