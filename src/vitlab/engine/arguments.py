"""The training run's flags, built from :class:`~vitlab.engine.config.TrainConfig`'s fields (``vitlab train``'s,
and the base of ``vitlab seg train`` and ``vitlab points train``), read back into a config, and the run they
start (:func:`train_from_args`)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ..common.device import add_device_argument
from ..common.options import key_value
from ..data.spec import SPEC_HELP, DataSpec
from .loop import AMP_CHOICES, OPTION_CHECKS, TrainConfig

HELP = {
    "model": "registered model name (see `vitlab models`)",
    "data": f"dataset spec: {SPEC_HELP}",
    "out": "output folder: last.pt (each epoch), log.csv/log.json, summary.json (default runs/train/<model>)",
    "epochs": "training epochs",
    "batch_size": "global batch size (split over torchrun processes)",
    "lr": "peak learning rate (after warmup)",
    "base_lr": "scale the learning rate by the global batch: lr = BASE_LR x global batch / 512 (DeiT's rule)",
    "accum_steps": "accumulate the gradients of this many batches per optimizer step (global batch = "
    "batch size x accum steps)",
    "min_lr": "learning rate at the end of the cosine",
    "warmup_epochs": "linear warmup length in epochs (fractions allowed)",
    "lr_drop": "step schedule (DETR's): the learning rate stays at its peak after the warmup and drops to a tenth "
    "at this epoch (default: cosine to --min-lr)",
    "weight_decay": "AdamW weight decay (not applied to norms, biases, tokens, position tables)",
    "clip_grad": "clip the gradient norm to this (0: off)",
    "drop_path": "stochastic depth rate of the last block (linear rule)",
    "smoothing": "label smoothing",
    "mixup": "Mixup alpha (0: off)",
    "cutmix": "CutMix alpha (0: off)",
    "ema": "keep an EMA of the weights with this decay, e.g. 0.999 (0: off)",
    "amp": "autocast: auto = fp16 with a gradient scaler on GPU, off on CPU; bf16 on CPU or GPU",
    "seed": "seed of the initial weights, data order and augmentation",
    "threads": "torch threads per process (0: torch's default; default 2, 1 when --workers leave no spare core)",
    "img_size": "train at this input size (default: the data's)",
    "holdout": "held-out images of the embedded MNIST (default 1000)",
    "train_limit": "train on a seeded random N of the training images (quick runs; in-memory data and folders)",
    "crop_padding": "random-crop padding in pixels (0: no crop)",
    "hflip": "horizontal flip probability (default 0 for digits, else 0.5)",
    "auto_augment": "RandAugment spec, e.g. rand-m9-n2-mstd0.5",
    "color_jitter": "colour jitter strength of folder:/wds: data (off under RandAugment)",
    "reprob": "random erasing probability (per-pixel noise), e.g. 0.25",
    "aug_repeats": "repeated augmentation: each image this many times per epoch, on different processes (DeiT: 3)",
    "workers": "DataLoader worker processes per training process decoding folder:/wds: data",
    "shuffle_buffer": "wds: data: each DataLoader worker shuffles its part of the epoch through a buffer of this "
    "many samples (0: the stored order)",
    "num_classes": "wds: shards without a shards.json: their number of classes (labels 0 .. N-1)",
    "crop_pct": "evaluation crop of folder:/wds: data: resize to img-size / CROP_PCT, centre crop (default: the model's)",
    "teacher": "distil from this teacher: a vitlab checkpoint, a torch.export .pt2 or a TorchScript file "
    "(needs --dist-token)",
    "teacher_img_size": "the teacher's input size (default: what its file says, else the training size)",
    "teacher_timeout": "seconds the teacher's first batch may take; past them the run ends with an error (a teacher "
    "that never answers)",
    "distillation": "hard (DeiT: the teacher's argmax) or soft (KL at temperature --distill-tau)",
    "distill_alpha": "weight of the distillation term",
    "distill_tau": "temperature of soft distillation",
    "distill_reduction": "soft distillation's KL: deit (summed, divided by batch x classes, as DeiT's code) or "
    "batchmean (divided by the batch only: classes times larger)",
    "dist_token": "add DeiT's distillation token and head (ViT-family models)",
    "token_label": "token labelling (LV-ViT): dense targets beside the images (<image name>.tl.npy, vitlab relabel), "
    "MixToken with --cutmix, the dense loss on the model's aux head",
    "token_label_weight": "weight of the dense token-labelling loss",
    "dense_root": "folder of the dense target files, laid out as the images (default: beside them)",
    "save_every": "also checkpoint every N optimizer steps within an epoch (0: at epoch ends only)",
    "init_from": "initialise the weights from this checkpoint (e.g. DeiT -> AFT-conv)",
    "eval_batch_size": "batch size of the held-out evaluation",
    "compile": "torch.compile the model (the first steps compile it)",
    "grad_checkpointing": "recompute every block's activations in the backward pass: less memory, more time",
    "tf32": "GPU: TF32 tensor cores for fp32 matrix products and convolutions (10-bit mantissa)",
    "fsdp": "under torchrun: shard the model over the processes with FSDP2 (one unit per block); "
    "sharded checkpoints that resume on any number of processes",
    "tensorboard": "also write the metrics to OUT/tb for TensorBoard (needs the tensorboard extra)",
    "log_every": "steps between writes of OUT/steps.jsonl (one row per step)",
    "progress_every": "seconds between progress lines when the output is not a terminal",
}
HIDDEN = {"progress", "force", "resume", "model_args", "device", "recipe", "task"}


class _Store(argparse._StoreAction):
    """``store`` that also records the option as given on the command line (it then overrides a recipe)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


class _StoreTrue(argparse._StoreTrueAction):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, option_string)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


def add_arguments(p: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(TrainConfig):
        if f.name in HIDDEN:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=_StoreTrue, help=HELP[f.name])
            continue
        kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
        kind = OPTION_CHECKS.get(f.name, kind)  # the option's range, checked while parsing
        extra: dict = {"choices": AMP_CHOICES} if f.name == "amp" else {}
        default = f.default if f.name != "out" else None
        show = "" if default is None else f" (default {default})"
        p.add_argument(
            flag, action=_Store, type=kind, default=default, metavar=f.name.upper(), help=HELP[f.name] + show, **extra
        )
    p.add_argument(
        "--config",
        default=None,
        metavar="RECIPE",
        help="options from a recipe file (YAML or TOML; flags given here override it): a path, or the name of a "
        "recipe shipped in the package such as deit_tiny (docs/training.md lists them)",
    )
    p.add_argument(
        "--model-arg",
        dest="model_args",
        action="append",
        type=key_value,
        default=[],
        metavar="KEY=VALUE",
        help="model constructor override, repeatable, e.g. --model-arg patch_size=7",
    )
    start = p.add_mutually_exclusive_group()  # continue the run in OUT, or start over: not both
    start.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="CKPT",
        help="continue a run: OUT/last.pt, or the given checkpoint",
    )
    start.add_argument("--force", action="store_true", help="start over even if OUT already holds a run")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar or lines")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the options the run would use (recipe and flags resolved) as JSON and exit without training",
    )
    add_device_argument(p)


def parse_model_args(items: list[str | tuple[str, Any]]) -> dict[str, Any]:
    """``["patch_size=7", "mixer=aft_full"]`` (or the pairs ``--model-arg`` parsed them into) ->
    ``{"patch_size": 7, "mixer": "aft_full"}`` (Python literals)."""
    out = {}
    for item in items:
        try:
            key, value = key_value(item) if isinstance(item, str) else item
        except argparse.ArgumentTypeError:
            raise ValueError(f"--model-arg {item!r}: must be {key_value.what}") from None
        out[key] = value
    return out


# constructor options `vitlab train` sets itself, and from where
SET_BY_TRAIN = {
    "img_size": "--img-size",
    "in_chans": "the data",
    "num_classes": "the data",
    "drop_path_rate": "--drop-path",
    "dist_token": "--dist-token",
}


def refuse_set_by_train(overrides: dict[str, Any], command: str = "vitlab train") -> None:
    """One line for a ``--model-arg`` that the command sets itself (from the data or another flag): it would
    otherwise replace what the data says (a detector's ``num_classes``) without a word."""
    for key, source in SET_BY_TRAIN.items():
        if key in overrides:
            raise ValueError(f"--model-arg {key}: {command} sets {key} from {source}; drop the --model-arg")


def check_model_args(args: argparse.Namespace) -> None:
    """``--model-arg`` values that cannot make a model, as one line before any work: options the model
    does not take or that ``vitlab train`` sets itself, values of the wrong type or sign (judged from the
    constructor's signature), and whatever the constructor refuses when the model is built on the meta
    device (no memory) at the input size of the data."""
    import torch

    from ..common.options import check_keyword_values
    from ..models import build_model
    from ..models.registry import MAX_DEPTH, MODELS

    overrides = parse_model_args(args.model_args)
    if not overrides:
        return
    refuse_set_by_train(overrides)
    try:
        factory, _ = MODELS.arguments(args.model, overrides)
    except ValueError as e:  # options the model does not take
        raise ValueError(f"--model-arg: {e}") from None
    check_keyword_values(factory, overrides, "--model-arg")
    if isinstance(overrides.get("depth"), int) and overrides["depth"] > MAX_DEPTH:
        raise ValueError(f"--model-arg depth={overrides['depth']}: depth must be at most {MAX_DEPTH}")
    chans, side = DataSpec.parse(args.data).native_shape  # a folder's images are resized to --img-size
    sizes = {"img_size": args.img_size or side, "in_chans": chans}
    try:
        with torch.device("meta"):
            build_model(args.model, **{k: v for k, v in sizes.items() if v is not None}, **overrides)
    except Exception as e:  # whatever the constructor raises for options it cannot build
        given = " ".join(f"{k}={v!r}" for k, v in overrides.items())
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        raise ValueError(f"--model-arg {given}: {args.model} cannot be built with these options ({detail})") from None


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run the parsed flags describe (a recipe's values already under them); flags that contradict each
    other are one line."""
    if {"lr", "base_lr"} <= set(getattr(args, "given", ())):  # the config would keep base_lr and drop lr
        raise ValueError(
            "--lr and --base-lr both set the learning rate (--base-lr scales it: BASE_LR x global batch / 512); "
            "give one of them"
        )
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
    values["model_args"] = parse_model_args(values.get("model_args") or [])
    if values.get("out") is None:
        values["out"] = f"runs/train/{args.model}"
    return TrainConfig(**values)


def run_training(cfg: TrainConfig) -> dict[str, Any]:
    """Train ``cfg`` as a command does (``vitlab train``, ``seg train``, ``points train``): a peer process's
    failure as one line, the process group closed however the run ends."""
    from ..common.distributed import close_distributed, peer_failure
    from .loop import train

    warn_ineffective(cfg)
    try:
        return train(cfg)
    except RuntimeError as e:
        if (line := peer_failure(e)) is None:
            raise
        raise ValueError(line) from None
    finally:
        close_distributed()


def train_task_from_args(args: argparse.Namespace, task: str) -> int:
    """``vitlab <task> train`` (seg, det): a recipe's values under the flags, the run folder
    ``runs/<task>/<model>`` by default, ``--model-arg`` s that the command sets refused, then the run."""
    if args.config:
        from .recipes import apply_recipe

        apply_recipe(args)
    cfg = config_from_args(args)
    if args.out is None:
        cfg.out = f"runs/{task}/{args.model}"
    refuse_set_by_train(cfg.model_args, f"vitlab {task} train")
    run_training(cfg)
    return 0


def warn_ineffective(cfg: TrainConfig) -> None:
    """One warning line (rank 0) for each option that does nothing in this run: ``fsdp`` in a single process
    (nothing to shard over: the model trains whole), ``tf32`` off an NVIDIA GPU (it sets CUDA's matrix units)."""
    import warnings

    from ..common.device import resolve_device
    from ..common.distributed import current_world

    world = current_world()
    if not world.main:
        return
    if cfg.fsdp and world.size == 1:
        warnings.warn(
            "--fsdp shards the model over the processes torchrun starts (torchrun --nproc_per_node=N -m vitlab.cli "
            "train ...); this run is a single process, so it trains the model unsharded",
            stacklevel=2,
        )
    if cfg.tf32 and (device := resolve_device(cfg.device)).type != "cuda":
        warnings.warn(
            f"--tf32 enables the TF32 matrix units of NVIDIA GPUs; it has no effect on this run's device ({device})",
            stacklevel=2,
        )


def train_from_args(args: argparse.Namespace) -> int:
    """Train the run the parsed flags describe (a recipe's values under them, ``--print-config`` only prints it);
    a peer process's failure as one line."""
    from .recipes import apply_recipe, paper_line

    reference = apply_recipe(args) if args.config else {}
    check_model_args(args)
    if args.print_config:
        import json

        cfg = config_from_args(args)
        print(json.dumps({**dataclasses.asdict(cfg), "threads": cfg.auto_threads}, indent=2, default=str))
        return 0
    summary = run_training(config_from_args(args))
    if isinstance(summary, dict) and summary and (line := paper_line(reference, summary)):  # empty off rank 0
        print(line, flush=True)
    return 0
