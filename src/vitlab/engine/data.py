"""The data of a training run: its sources, transforms and per-rank loaders, all through ``vitlab.data``'s one
road (``open_source`` -> ``create_transform`` -> ``create_loader``).

The run's ``--data`` is parsed once (``TrainConfig.spec``, a :class:`~vitlab.data.DataSpec`); the kind of data
then chooses only the recipe of its transforms. Streaming data (``folder:ROOT``, ``wds:PATTERN``) is decoded
and augmented per sample in DataLoader workers (``workers``, pinned memory on CUDA, persistent workers,
sharded by rank) with the recipes' transforms: RandomResizedCrop, flip, RandAugment or colour jitter, random
erasing (``reprob``), repeated augmentation (``aug_repeats``), batch Mixup/CutMix + label smoothing on the main
process (MixToken with token labels); it is evaluated with the model's crop (shorter side resized to
``img_size / crop_pct``, centre crop, the model's mean/std). The in-memory sets (embedded MNIST, CIFAR-10,
MNIST idx) are transformed on whole batches on the device, with the dataset's statistics, whole images
shifted by a padded random crop (``crop_padding``), behind the same loop.
"""

from __future__ import annotations

from typing import Any

import torch

from ..data import (
    MixToken,
    MixupCutmix,
    TransformPipeline,
    create_loader,
    create_transform,
    open_source,
    resolve_data_config,
)
from ..data.tokenlabel import patch_grid
from .config import Run, TrainConfig, TrainingError


def load_data(cfg: TrainConfig, split: str):
    """One split of the run's data (``train`` or ``test``, the held-out part): a streaming source (file or shard
    list only) or an in-memory set, from the data factory."""
    try:
        source = open_source(cfg.spec, "val" if split == "test" else split, holdout=cfg.holdout, seed=0,
                             dense_root=cfg.dense_root)  # fmt: skip
    except ImportError as e:
        raise TrainingError(str(e)) from None
    except (EOFError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise TrainingError(f"cannot read dataset {cfg.data!r} ({e}); check or re-create its files") from None
    if cfg.num_classes is not None:
        if not hasattr(source, "with_num_classes"):
            raise TrainingError(f"--num-classes is for wds: shards without a shards.json; {cfg.data} has its own")
        source = source.with_num_classes(cfg.num_classes)
    return source


def open_data(run: Run) -> None:
    """The training subset and the held-out set (nothing decoded for streaming sources)."""
    cfg = run.cfg
    if cfg.batch_size % run.world.size:
        raise TrainingError(f"the global batch {cfg.batch_size} must be divisible by the {run.world.size} processes")
    if cfg.token_label and not cfg.spec.streaming:
        raise TrainingError("--token-label reads dense targets beside the images: use --data folder:... or wds:...")
    train_ds, val_ds = load_data(cfg, "train"), load_data(cfg, "test")
    if cfg.train_limit:
        if cfg.spec.kind == "wds":
            raise TrainingError("--train-limit picks files at random, which shards cannot; name fewer shards "
                                "(wds:train=PATTERN,val=PATTERN) or use the folder")  # fmt: skip
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
    """The model's input and classes as the data decides them (``img_size``, ``in_chans``, ``num_classes``):
    an in-memory set's own image size and channels, else the model's input size and RGB."""
    native = getattr(train_ds, "img_size", None)  # streaming sources have none: images come in all sizes
    if cfg.img_size:
        size = cfg.img_size
    elif native is not None:
        size = int(native[0])
    else:
        from ..models import get_config

        size = get_config(cfg.model).input_size[-1]
    chans = int(getattr(train_ds, "in_chans", 3))
    return {"img_size": int(size), "in_chans": chans, "num_classes": int(train_ds.num_classes)}


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
    evaluate); records the evaluation data configuration of streaming data in ``run.data_cfg``."""
    cfg, world = run.cfg, run.world
    train_tf, eval_tf = transforms(run)
    grid = patch_grid((run.kwargs["img_size"],) * 2, run.raw.patch_embed.patch_size[0]) if cfg.token_label else None
    run.loader = create_loader(run.train_ds, train_tf, run.per_rank, is_training=True, repeats=cfg.aug_repeats,
                               workers=cfg.workers, dense_grid=grid, mix=batch_mix(run, grid is not None),
                               shuffle_buffer=cfg.shuffle_buffer,
                               seed=cfg.seed, rank=world.rank, world_size=world.size, device=run.device)  # fmt: skip
    run.val_loader = create_loader(run.val_ds, eval_tf, cfg.eval_batch_size, is_training=False, workers=cfg.workers,
                                   device=run.device)  # fmt: skip
    if len(run.loader) == 0:
        raise TrainingError(
            f"no full batch of {run.per_rank} per process in {len(run.train_ds)} images; use a smaller --batch-size"
        )


def transforms(run: Run) -> tuple[TransformPipeline, TransformPipeline]:
    """(training, evaluation) transforms: the recipe of the data's kind (see the module docstring)."""
    cfg, img_size = run.cfg, run.kwargs["img_size"]
    if cfg.spec.streaming:
        run.data_cfg = resolve_data_config({"img_size": img_size, "crop_pct": cfg.crop_pct}, model=run.raw)
        hflip = 0.5 if cfg.hflip is None else cfg.hflip
        aug = dict(auto_augment=cfg.auto_augment, re_prob=cfg.reprob, color_jitter=cfg.color_jitter, hflip=hflip)
        return create_transform(**run.data_cfg, is_training=True, **aug), create_transform(**run.data_cfg)
    ds = run.train_ds
    digits = ds.num_classes == 10 and ds.in_chans == 1  # mirrored digits change meaning
    hflip = cfg.hflip if cfg.hflip is not None else (0.0 if digits else 0.5)
    aug = dict(hflip=hflip, color_jitter=None, auto_augment=cfg.auto_augment, re_prob=cfg.reprob)
    run.data_cfg = None
    train_tf = whole_image(img_size, ds.mean, ds.std, is_training=True, crop_padding=cfg.crop_padding, **aug)
    return train_tf, whole_image(img_size, run.val_ds.mean, run.val_ds.std)


def whole_image(img_size: int, mean, std, is_training: bool = False, **aug: Any) -> TransformPipeline:
    """The transform of in-memory data as ``vitlab train`` uses it: the whole image resized to the input size
    (bilinear; training: ``aug``, e.g. a padded random crop), the data's own statistics."""
    return create_transform(img_size, is_training, mean=mean, std=std, interpolation="bilinear", crop_pct=1.0, **aug)
