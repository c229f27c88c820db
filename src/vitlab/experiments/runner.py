"""The runner of ``vitlab compare`` and of every study's rows: train a set of variants on the same data and
budget, evaluate them, one table (:mod:`.tables`).

Each variant trains in a fresh process (``vitlab.measure.process``: forked from a server that has only
imported torch), so its peak resident memory is its own. ``--jobs`` variants train at once, each with
``--threads // --jobs`` torch threads: these small models use one core far better than two, so by default the
two cores train two variants side by side. Inference throughput is timed afterwards, one variant at a time
(fresh process, the same threads per variant, batch 256, median of repeats). Timing with as many threads as
the other work on a loaded machine leaves them is unreliable: ops made of many small parallel regions (e.g.
``nn.Unfold`` in T2T/EAMLP, one region per image) then wait for a descheduled thread in each region.

On 28-px data (the embedded MNIST) the ``*_mini`` configs, built for 32 px with patch 4, are adapted to a
4x4 grid of 7-px patches (TNT: 4x4 words per patch, as TNT-S; EAMLP: T2T soft splits 7/4/2, 3/2/1, 3/1/1, the
official first split); ``--no-adapt`` keeps them as registered.

``--seeds N`` trains every variant N times (seeds ``--seed`` .. ``--seed + N - 1``; folders ``VARIANT/seedS``); the
table then gives the mean ± standard deviation over the seeds and the plots their spread. ``vitlab study`` runs
the papers' ablation tables through the same functions (:mod:`vitlab.experiments.reproduce`).

Output (``--out``, default ``runs/compare``): ``table.csv``, ``table.json``, ``table.md``, ``curves.png``
(held-out top-1 and training loss per epoch), ``acc_vs_speed.png``, and one folder per variant (per seed) with
its checkpoint, per-epoch log (CSV/JSON), ``train.log`` and ``result.json``. The command owns ``--out`` while it
runs (:class:`vitlab.common.rundir.RunLock`; each variant's training owns its folder): a folder holding an earlier
comparison is refused unless ``--resume`` reuses it or ``--force`` moves its files aside first.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from ..checkpoint import load_checkpoint
from ..common import options as opt
from ..common.device import add_device_argument, resolve_device
from ..common.io import open_append, write_json_atomic
from ..common.report import Column, render_text
from ..common.rundir import RunDirError, RunLock
from ..data.spec import data_spec
from ..engine.checkpointing import run_is_complete
from ..engine.data import data_shape, load_data
from ..engine.loop import RUN_FILES, TrainConfig, train
from ..engine.tasks import task_hooks
from ..interop.pretrained import load_model
from ..measure.flops import count_macs
from ..measure.process import CaseRunner, CaseSpec, Prepared
from ..tasks.segmentation.data import mask_spec
from .tables import COLUMNS, SEED_MEAN, SEED_SPREAD, TEXT_COLUMNS, compare_note, plot, write_tables

DEFAULT_MODELS = (
    "deit_mini", "refiner_vit_mini", "deepvit_mini", "cpvt_mini", "tnt_mini", "eamlp_mini", "aft_full_mini",
    "aft_conv_mini",
)  # fmt: skip
METHOD = {
    "deit": "DeiT baseline", "refiner": "Refiner", "deepvit": "re-attention (DeepViT)", "cpvt": "CPVT (PEG)",
    "tnt": "TNT", "eamlp": "EAMLP (external attention)", "aft_full": "AFT-full", "aft_simple": "AFT-simple",
    "aft_conv": "AFT-conv", "aft_local": "AFT-local",
}  # fmt: skip
# the compare recipe: short and the same for every variant. Tuned on the embedded MNIST so that the slowest
# learners (TNT, then DeiT/DeepViT/EAMLP) clear 85 % held-out: batch 32 beats 64 at equal images seen, lr 3e-3
# beats 2e-3 and 5e-3, random-crop padding (even 2 px) costs the attention-only models 20 points at this
# budget, EMA and stochastic depth do not help a run this short
RECIPE = dict(
    epochs=8, batch_size=32, lr=3e-3, min_lr=1e-5, warmup_epochs=0.5, weight_decay=0.05, clip_grad=1.0,
    drop_path=0.0, smoothing=0.1, crop_padding=0, ema=0.0,
)  # fmt: skip
MB = 1024 * 1024
# relative training cost per image on one CPU thread (measured on the adapted minis): the costliest start
# first, so that with several jobs the cheap ones fill the gaps and no core idles at the end
# what a comparison writes: its tables and plots, and in each variant's folder the training run and these
OUTPUT_FILES = ("table.csv", "table.json", "table.md", "curves.png", "acc_vs_speed.png")
OWNER_FILE = ".vitlab-owner.json"  # the command whose runs the folder holds (a study's name included)
VARIANT_FILES = (*RUN_FILES, "train.log", "result.json")
COST = {"tnt": 3.0, "eamlp": 3.0, "aft_conv": 2.5, "refiner": 1.5, "deepvit": 1.2, "aft_full": 1.2, "cpvt": 1.1}


def add_run_arguments(
    p: argparse.ArgumentParser, recipe: dict[str, Any] | None, out: str, shown_defaults: dict[str, Any] | None = None
) -> None:
    """The options of a set of training runs, shared with ``vitlab study``. ``recipe`` gives the defaults of the
    training options; None leaves them unset (None), so that a caller can tell a flag from its default, and
    ``shown_defaults`` are then the defaults the help text names."""
    shown_defaults = recipe if shown_defaults is None else shown_defaults

    def default(key: str, fallback: Any = None) -> Any:
        return None if recipe is None else recipe.get(key, fallback)

    def shown(key: str) -> str:
        return f" (default {shown_defaults[key]})" if shown_defaults and key in shown_defaults else ""

    p.add_argument(
        "--data",
        type=any_data,
        default=default("data", "mnist"),
        help="dataset spec as for `vitlab train`, or a VOC / ADE20K folder for a segmentation study "
        "(default: the embedded MNIST)",
    )
    p.add_argument(
        "--img-size", type=opt.image_size, default=None, help="resize the images to this size (default: the data's)"
    )
    p.add_argument(
        "--epochs", type=opt.positive_int, default=default("epochs"), help="epochs per variant" + shown("epochs")
    )
    p.add_argument(
        "--batch-size", type=opt.positive_int, default=default("batch_size"), help="batch size" + shown("batch_size")
    )
    p.add_argument("--lr", type=opt.positive_float, default=default("lr"), help="peak learning rate" + shown("lr"))
    p.add_argument("--ema", type=opt.rate, default=default("ema"), help="EMA decay, 0 = off" + shown("ema"))
    p.add_argument("--seed", type=opt.seed, default=default("seed", 0), help="the first seed (default 0)")
    p.add_argument(
        "--seeds",
        type=opt.positive_int,
        default=default("seeds"),
        help="runs per variant, seeds --seed, --seed+1, ...: mean ± std" + (shown("seeds") or " (default 1)"),
    )
    p.add_argument(
        "--train-limit", type=opt.positive_int, default=None, help="train on a random N of the training images"
    )
    p.add_argument("--out", default=out, help=f"output folder (default {out})")
    p.add_argument(
        "--threads", type=opt.Int(1, 1024), default=2, help="CPU threads to use in all (default %(default)s)"
    )
    add_device_argument(p, default="auto" if recipe is not None else None)
    p.add_argument(
        "--jobs",
        type=opt.positive_int,
        default=None,
        help="variants trained at once, each with threads/jobs threads (default: = --threads)",
    )
    p.add_argument(
        "--workers",
        type=opt.Int(0, 256),
        default=None,
        help="DataLoader worker processes per training process decoding folder:/wds: data (default: a recipe's "
        "workers, at most the threads each variant has)",
    )
    p.add_argument("--no-adapt", action="store_true", help="keep the mini configs as registered on 28-px data")
    start = p.add_mutually_exclusive_group()  # reuse the comparison in --out, or start over: not both
    start.add_argument(
        "--resume",
        action="store_true",
        help="reuse finished variants in --out and resume unfinished ones from their last epoch",
    )
    start.add_argument(
        "--force", action="store_true", help="start over even if --out holds a comparison (its files are moved aside)"
    )
    p.add_argument(
        "--isolation",
        choices=("forkserver", "subprocess"),
        default="forkserver",
        help="how each variant gets its fresh process (default %(default)s)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--nproc-per-node",
        type=opt.positive_int,
        default=1,
        help="train each variant under torchrun with this many processes (DDP; gloo on the CPU), one variant at "
        "a time; --resume continues a stopped one from its last checkpoint (default 1: a fresh process each)",
    )


# --------------------------------------------------------------------------- variants


@dataclass(frozen=True)
class Variant:
    """One row of the table: a registered model, with constructor overrides, under a label (its folder name)."""

    label: str
    model: str
    model_args: dict[str, Any] = field(default_factory=dict)


def adapt_to_size(name: str, img_size: int) -> dict[str, Any]:
    """Constructor overrides that give a mini config a 4x4 token grid on 28-px images."""
    from ..models import get_config

    cfg = get_config(name)
    if img_size != 28 or not name.endswith("_mini") or cfg.arch in ("resnet", "regnet", "efficientnet"):
        return {}  # (a CNN runs at any size: its minis keep a 4x4 or 2x2 last map at 28 px)
    if cfg.arch == "t2t":
        return {"soft_split": ((7, 4, 2), (3, 2, 1), (3, 1, 1))}
    return {"patch_size": 7}  # TNT keeps its word stride: stride 2 cuts a 7-px patch into 4x4 words, as TNT-S's 16


def _any_data(text: str) -> Any:
    """A classification dataset spec (parsed), else a segmentation or detection folder (its text); the
    classification spec's error else (a ``coco:`` folder's own error)."""
    if text.startswith("coco:"):
        from ..tasks.detection.task import coco_spec

        return coco_spec.function(text)
    try:
        return data_spec.function(text)
    except (ValueError, OSError) as e:
        try:
            return mask_spec.function(text)
        except (ValueError, OSError):
            raise e from None


any_data = opt.Validated(_any_data, "a dataset spec, a segmentation folder or coco:ROOT")


def method_of(name: str) -> str:
    base = name.removesuffix("_mini")
    for key in sorted(METHOD, key=len, reverse=True):
        if base.startswith(key):
            return METHOD[key]
    return base


def resolve_models(spec: str) -> list[str]:
    """The requested models; unregistered default ones are skipped with a note, unknown explicit ones fail."""
    from ..models import get_config, list_models

    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ValueError("--models is empty; give comma-separated model names (see `vitlab models`)")
    known = set(list_models())
    out = []
    for n in dict.fromkeys(names):
        if n not in known and spec == ",".join(DEFAULT_MODELS):
            print(f"note: {n} is not registered in this version; skipped", file=sys.stderr)
            continue
        get_config(n)  # raises with the closest names
        out.append(n)
    return out


def study_task(cfg: TrainConfig) -> Any:
    """The hooks of a dense task's study rows (its package registers them when imported)."""
    import importlib

    importlib.import_module(f"vitlab.tasks.{cfg.task}")
    return task_hooks(cfg)


def size_of(name: str, kwargs: dict[str, Any], input_size: tuple[int, int, int], task: str = "classification"
            ) -> tuple[int, int | None]:  # fmt: skip
    """(parameters, MACs) of the variant (a segmentation model or detector over the backbone ``name`` for those
    tasks), counted on the meta device; a detector's MACs are None."""
    from ..models import build_model

    hooks = study_task(TrainConfig(task=task)) if task != "classification" else None
    with torch.device("meta"):
        model = hooks.build_model(name, kwargs) if hooks is not None else build_model(name, **kwargs)
    params = sum(p.numel() for p in model.parameters())
    if task == "detection":  # a detector's work depends on its images' sizes and its proposals: parameters only
        return params, None
    return params, count_macs(model, input_size).total


# --------------------------------------------------------------------------- cases run in fresh processes


def train_case(config: dict[str, Any]) -> Prepared:
    """Measured case: the timed call trains the variant; its summary (with the per-epoch log) goes into
    ``info``. Progress lines go to the variant's ``train.log`` and, prefixed with its run id, to the output."""
    cfg = TrainConfig.from_dict(config)
    if cfg.task != "classification":  # this fresh process has not imported the task that trains the row
        study_task(cfg)
    info: dict[str, Any] = {}
    tag = config.get("run_id", cfg.model)

    def work() -> None:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        with open_append(out / "train.log") as log_file:

            def log(line: str) -> None:
                log_file.write(line + "\n")
                log_file.flush()
                print(f"[{tag}] {line}", flush=True)

            info["summary"] = train(cfg, log)

    return Prepared(work, info)


def inference_case(checkpoint: str, batch: int = 256, device: str = "cpu") -> Prepared:
    """Measured case: one eval-mode forward of a batch of inputs of the model's size on ``device``."""
    dev = resolve_device(device)
    model = load_model(checkpoint).to(dev)
    c, h, w = model.meta["input_size"]
    x = torch.randn(batch, c, h, w, device=dev)

    def work() -> None:
        with torch.inference_mode():
            model(x)

    return Prepared(work, {"batch": batch}, device=str(dev))


def train_step_case(checkpoint: str, batch: int, device: str = "cpu") -> Prepared:
    """Measured case: one training step (forward, cross-entropy, backward, AdamW update) of the trained model
    on a batch of the run's size, inputs made on the device: the model's own training speed, without the data
    pipeline or another variant training beside it."""
    dev = resolve_device(device)
    model = load_model(checkpoint).to(dev).train()
    c, h, w = model.meta["input_size"]
    x = torch.randn(batch, c, h, w, device=dev)
    y = torch.randint(0, model.num_classes, (batch,), device=dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def work() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    return Prepared(work, {"batch": batch}, device=str(dev))


# --------------------------------------------------------------------------- the command

# options that do not change what a variant computes (a row trained in another folder, e.g. on another machine,
# with other threads, is the same run)
RUN_ONLY = ("force", "resume", "progress", "run_id", "out", "threads", "teacher_timeout")


@dataclass
class Plan:
    """What ``vitlab compare`` (or ``vitlab study``) will run: every variant's training runs (one per seed) and
    their configs, the variants' sizes, and the setting."""

    out: Path
    variants: list[Variant]
    runs: dict[str, list[str]]  # variant label -> its run ids (one per seed; the run's folder under ``out``)
    configs: dict[str, TrainConfig]  # run id -> training config
    sizes: dict[str, tuple[int, int]]  # variant label -> (parameters, MACs)
    jobs: int
    per_job: int
    train_images: int
    heldout_images: int
    img_size: int
    seeds: list[int]
    recipe: dict[str, Any]
    speed: bool = True  # time inference after training
    nproc: int = 1  # > 1: each variant trains under torchrun with this many processes

    @property
    def names(self) -> list[str]:
        return [v.label for v in self.variants]


class Report(Protocol):
    """What a caller of :func:`compare` adds to the table (``vitlab study``: the paper's numbers, extra measures)."""

    columns: list[Column]
    text_columns: int
    files: tuple[str, ...]  # what it writes into --out besides compare's tables and plots

    def add(self, plan: Plan, rows: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> None: ...

    def note(self, meta: dict[str, Any]) -> str: ...

    def plot(self, out: Path, rows: list[dict[str, Any]]) -> list[Path]: ...


def print_line(line: str) -> None:
    print(line, flush=True)


def run_variants(
    args: argparse.Namespace,
    variants: list[Variant],
    recipe: dict[str, Any],
    command: str,
    report: Report | None = None,
    speed: bool = True,
) -> int:
    """Own ``--out``, check everything, then train, time and tabulate ``variants`` (compare's and study's body)."""
    t_start = time.perf_counter()
    with RunLock(args.out, command, print_line) as lock:
        extra = report.files if report is not None else ()
        check_owner(lock.folder, command, args.resume)
        old = lock.check_fresh(old_entries(lock.folder, extra), resume=args.resume, force=args.force)
        plan = plan_variants(args, variants, recipe, speed)
        lock.move_aside(old)  # the options and the data are fine: the old run goes out of the way
        write_json_atomic(lock.folder / OWNER_FILE, {"command": command})
        return compare(args, plan, t_start, report)


def check_owner(out: Path, command: str, resume: bool) -> None:
    """Refuse a folder that belongs to something else: a ``vitlab train`` run (its files would sit among the
    variants'), or, on ``--resume``, another study's or compare's tables (they would be written over)."""
    train_files = [n for n in ("last.pt", "run.json", "summary.json") if (out / n).exists()]
    if train_files:
        raise RunDirError(
            f"{out} holds a `vitlab train` run ({', '.join(train_files)}); give {command} a folder of its own "
            "with --out"
        )
    try:
        owner = json.loads((out / OWNER_FILE).read_text()).get("command")
    except (OSError, ValueError, AttributeError):
        owner = None
    if resume and owner not in (None, command):
        raise RunDirError(
            f"{out} holds the runs of `{owner}`, not `{command}`: --resume continues the same command's runs only; "
            "pass another --out, or --force to move its files aside"
        )


def old_entries(out: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """What an earlier run left in ``out``: its tables and plots (and ``extra`` files), and the folders of its
    variants (with their seeds' folders)."""

    def holds_runs(d: Path) -> bool:
        return any((d / f).exists() for f in VARIANT_FILES) or any(
            (s / f).exists() for s in d.glob("seed*") for f in VARIANT_FILES
        )

    variants = sorted(d.name for d in out.iterdir() if d.is_dir() and not d.name.startswith(".") and holds_runs(d))
    return [*OUTPUT_FILES, *extra, *variants]


def compare(args: argparse.Namespace, plan: Plan, t_start: float, report: Report | None = None) -> int:
    """Train, time and tabulate the variants of ``plan``; ``report`` adds its columns, note and plots."""
    seeds = f" x {len(plan.seeds)} seeds" if len(plan.seeds) > 1 else ""
    print(
        f"{'study' if report else 'compare'}: {len(plan.names)} variants{seeds} x {plan.recipe['epochs']} epochs on "
        f"{args.data} ({plan.train_images} train images at {plan.img_size} px), {plan.jobs} at a time x "
        f"{plan.per_job} thread(s); output in {plan.out}",
        flush=True,
    )
    results = train_variants(plan, args.isolation, args.resume)
    speeds = time_speeds(plan, results, args.isolation) if plan.speed else {}
    rows = [
        table_row(plan, v, [results[r] for r in plan.runs[v.label]], speeds.get(v.label, {})) for v in plan.variants
    ]
    logs = {v.label: [run_log(results[r]) for r in plan.runs[v.label]] for v in plan.variants}
    columns, text_columns = COLUMNS, TEXT_COLUMNS
    if report is not None:
        report.add(plan, rows, results)
        columns, text_columns = report.columns, report.text_columns
    meta = run_meta(args, plan, time.perf_counter() - t_start) | {"text_columns": text_columns}
    note = report.note(meta) if report is not None else compare_note(meta)
    written = write_tables(plan.out, rows, meta, columns, note)
    if not args.no_plots:
        written += plot(plan.out, rows, logs)
        if report is not None:
            written += report.plot(plan.out, rows)
    print()
    print(render_text(rows, columns, text_columns))
    for r in rows:
        if "error" in r:
            print(f"{r['model']}: failed: {r['error']}")
    print(f"\nwall time {meta['wall_s']:.0f} s (load average {meta['loadavg']}); wrote {', '.join(map(str, written))}")
    return 1 if any("error" in r for r in rows) else 0


def run_log(result: dict[str, Any]) -> list[dict[str, Any]]:
    return result.get("info", {}).get("summary", {}).get("log", [])


def plan_variants(
    args: argparse.Namespace, variants: list[Variant], recipe: dict[str, Any], speed: bool = True
) -> Plan:
    """Check the options and the data in this process (one line on a mistake, before any variant starts):
    the data is loaded once, for its sizes; each run's config is built and each variant's size counted."""
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    jobs = args.jobs or args.threads
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    n_seeds = 1 if args.seeds is None else args.seeds
    if n_seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {n_seeds}")
    if args.img_size is not None and args.img_size < 1:
        raise ValueError(f"--img-size must be positive, got {args.img_size}")
    resolve_device(args.device)  # a GPU that is not there: one line before any variant starts
    out = Path(args.out)
    per_job = max(1, args.threads // jobs)
    recipe = {**recipe, "img_size": args.img_size}
    if getattr(args, "workers", None) is not None:
        recipe["workers"] = args.workers
    elif recipe.get("workers", 0) > per_job:  # a paper recipe's 8 workers are a GPU node's, not this share
        print(f"note: {recipe['workers']} DataLoader workers (the recipe's) capped at {per_job}, the threads each "
              "variant has; --workers sets them", flush=True)  # fmt: skip
        recipe["workers"] = per_job
    probe = TrainConfig(data=args.data, **recipe)
    dense = probe.task != "classification"
    if dense:  # the rows of a segmentation or detection study: the task's own data and score
        task = study_task(probe)
        train_ds, val_ds = task.open_split(probe, "train"), task.open_split(probe, "val")
    else:
        train_ds, val_ds = load_data(probe, "train"), load_data(probe, "test")
    n_train = min(args.train_limit, len(train_ds)) if args.train_limit else len(train_ds)
    if recipe["batch_size"] > n_train:
        raise ValueError(f"--batch-size {recipe['batch_size']} exceeds the {n_train} training images")
    shape = data_shape(probe, train_ds)
    img = shape["img_size"]
    input_size = (shape["in_chans"], img, img)
    seeds = [args.seed + i for i in range(n_seeds)]
    runs, configs, sizes = {}, {}, {}
    for v in variants:
        model_args = {**({} if args.no_adapt or dense else adapt_to_size(v.model, img)), **v.model_args}
        runs[v.label] = [v.label if n_seeds == 1 else f"{v.label}/seed{s}" for s in seeds]
        for run_id, seed in zip(runs[v.label], seeds):
            configs[run_id] = TrainConfig(
                model=v.model,
                model_args=model_args,
                data=args.data,
                out=str(out / run_id),
                seed=seed,
                threads=per_job,
                progress=False,
                force=True,
                resume=None,
                train_limit=args.train_limit,
                device=args.device,
                **recipe,
            )
        kwargs = dict(img_size=img, in_chans=input_size[0], num_classes=train_ds.num_classes, **model_args)
        sizes[v.label] = size_of(v.model, kwargs, input_size, probe.task)  # also checks that the overrides build
    nproc = getattr(args, "nproc_per_node", 1) or 1
    if nproc > 1 and recipe["batch_size"] % nproc:
        raise ValueError(f"--batch-size {recipe['batch_size']} must be divisible by --nproc-per-node {nproc}")
    return Plan(out, variants, runs, configs, sizes, 1 if nproc > 1 else jobs, per_job, n_train, len(val_ds), img,
                seeds, recipe, speed, nproc)  # fmt: skip


def train_variants(plan: Plan, isolation: str, resume: bool) -> dict[str, dict[str, Any]]:
    """Train every run in a fresh process, ``plan.jobs`` at a time, the costliest first; each result is
    also written to ``OUT/<run>/result.json`` (``--resume`` reuses it)."""
    results: dict[str, dict[str, Any]] = {}
    local = threading.local()
    runners: list[CaseRunner] = []

    def train_one(run_id: str) -> None:
        if not hasattr(local, "runner"):
            local.runner = CaseRunner(isolation, timeout=3600)
            runners.append(local.runner)
        results[run_id] = train_variant(plan.configs[run_id], local.runner, resume, run_id, plan.nproc)

    def cost(run_id: str) -> float:
        return -next((c for k, c in COST.items() if plan.configs[run_id].model.startswith(k)), 1.0)

    try:
        with concurrent.futures.ThreadPoolExecutor(plan.jobs) as pool:
            for f in [pool.submit(train_one, r) for r in sorted(plan.configs, key=cost)]:
                f.result()
    finally:
        for r in runners:
            r.close()
    return results


def train_variant(
    cfg: TrainConfig, runner: CaseRunner, resume: bool, run_id: str | None = None, nproc: int = 1
) -> dict[str, Any]:
    """One run: reuse a finished result, continue an unfinished run, or train afresh (under torchrun with
    ``nproc`` > 1 processes: :mod:`vitlab.experiments.launch`)."""
    out, config = Path(cfg.out), asdict(cfg)
    tag = run_id or cfg.model
    result_file = out / "result.json"
    done = _reusable(result_file, config) if resume else None
    if done is not None:
        print(f"[{tag}] finished before: reused {result_file}", flush=True)
        return done
    trained = _trained_epochs(out / "last.pt", config) if resume else None
    if trained == cfg.epochs:
        return finished_run(cfg, tag, result_file)
    resumable = trained is not None
    if resumable:
        config.update(resume="auto", force=False)
    elif out.exists():  # another variant's or an unusable run: moved aside whole, train.log and result too
        with RunLock(out, "vitlab compare", lambda line: print(f"[{tag}] {line}", flush=True)) as lock:
            lock.move_aside(VARIANT_FILES)
    if nproc > 1:
        from .launch import launch_row

        res = launch_row(cfg, nproc, resumable, tag)
    else:  # one pass, timed, default allocator: the peak RSS is the training process's own, as a user sees it
        spec = CaseSpec(train_case, {"config": {**config, "run_id": tag}}, warmup=0, repeats=1, passes=("time",))
        res = runner.run(spec)
    res["config"] = asdict(cfg)
    write_json_atomic(result_file, res)
    if res["status"] != "ok":
        print(f"[{tag}] failed: {res.get('reason')}", file=sys.stderr, flush=True)
    return res


def finished_run(cfg: TrainConfig, tag: str, result_file: Path) -> dict[str, Any]:
    """The result of a run trained to its last epoch but stopped before its result.json was written: the
    engine completes its log and summary from the checkpoint where they are missing (nothing is trained
    again), and the figures are those the run recorded. The process that trained is gone, so its peak memory
    is not known: the row leaves it blank rather than print the completing process's."""
    out = Path(cfg.out)
    if not run_is_complete(out, cfg.epochs):
        train(replace(cfg, resume="auto", force=False), lambda line: print(f"[{tag}] {line}", flush=True))
    summary = {**json.loads((out / "summary.json").read_text()), "log": json.loads((out / "log.json").read_text())}
    print(f"[{tag}] trained before it was stopped: reported from {out / 'last.pt'} (peak memory not measured)")
    res = {"status": "ok", "info": {"summary": summary}, "mem": None, "config": asdict(cfg)}
    write_json_atomic(result_file, res)
    return res


def time_speeds(plan: Plan, results: dict[str, dict[str, Any]], isolation: str) -> dict[str, dict[str, float]]:
    """Training and inference throughput (img/s) of each variant's first run, one variant at a time in a fresh
    process, with the threads it trained with: variants that trained side by side shared the machine, so their
    epochs' speeds compare their neighbours' luck; these compare the models."""
    speeds: dict[str, dict[str, float]] = {}
    cases = (("train_img_s", train_step_case, plan.recipe["batch_size"]), ("infer_img_s", inference_case, 256))
    with CaseRunner(isolation, timeout=600) as runner:
        for label in plan.names:
            first = plan.runs[label][0]
            if results[first]["status"] != "ok":
                continue
            checkpoint, device = str(plan.out / first / "last.pt"), plan.configs[first].device
            for key, case, batch in cases:
                args = {"checkpoint": checkpoint, "batch": batch, "device": device}
                spec = CaseSpec(case, args, warmup=2, repeats=20, max_time=2.0, threads=plan.per_job, passes=("time",))
                res = runner.run(spec)
                if res["status"] == "ok":
                    speeds.setdefault(label, {})[key] = res["info"]["batch"] / res["time_s"]["median"]
    return speeds


def wilson_interval(percent: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval (in %) of an accuracy measured on ``n`` held-out images: the range of
    accuracies the held-out sample cannot tell apart from the one measured (it stays inside 0..100 near 100 %)."""
    p = percent / 100
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * max(0.0, centre - half), 100 * min(1.0, centre + half)


def run_figures(res: dict[str, Any]) -> dict[str, Any]:
    """The measured figures of one finished run."""
    s = res["info"]["summary"]
    final = s["log"][-1] if s.get("log") else s["final"]
    mem = res["mem"] or {}  # None: not measured (a finished run completed from its checkpoint)
    mem = mem.get("timed", mem)
    figures = {
        "top1": final.get("val_top1"),
        "miou": final.get("val_miou"),
        "box_ap": final.get("val_box_ap"),
        "mask_ap": final.get("val_mask_ap"),
        "top5": final.get("val_top5"),
        "ema_top1": final.get("ema_top1"),
        "epoch_img_s": s["train_img_s"],  # the epochs' own speed, with whatever trained beside them
        "val_n": final.get("val_n"),
        "peak_mib": mem["peak"] / MB if mem else None,
        "train_mem_mib": mem["delta"] / MB if mem else None,
        "train_s": s["train_time_s"],
        "wall_s": s.get("wall_s", (res.get("time_s") or {}).get("median")),  # the whole run's, resumes included
    }
    if "cuda_peak_mib" in s:
        figures["cuda_peak_mib"] = s["cuda_peak_mib"]
    return figures


def table_row(plan: Plan, v: Variant, results: list[dict[str, Any]], speeds: dict[str, float]) -> dict[str, Any]:
    """One variant's row: its size, its figures (one run), or their means over the seeds with the standard
    deviation and every seed's value of top-1 / top-5, the 95 % interval of top-1 on the held-out images, and
    its speeds timed alone (:func:`time_speeds`)."""
    params, macs = plan.sizes[v.label]
    row: dict[str, Any] = {
        "model": v.label,
        "method": method_of(v.model),
        "params_m": params / 1e6,
        "mmacs": None if macs is None else macs / 1e6,
    }
    if v.label != v.model:
        row["registered_model"] = v.model
    failed = [r for r in results if r["status"] != "ok"]
    if failed:
        row["error"] = failed[0].get("reason")
        return row
    runs = [run_figures(r) for r in results]
    for key in runs[0]:
        values = [f[key] for f in runs if f.get(key) is not None]
        row[key] = statistics.fmean(values) if values and key in SEED_MEAN else (values[0] if values else None)
    if len(runs) > 1:
        for key in SEED_SPREAD:
            values = [f[key] for f in runs if f.get(key) is not None]
            row[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else None
            row[f"{key}_seeds"] = values
    if row.get("top1") is not None and row.get("val_n"):  # seeds: the interval of one seed's held-out set
        row["top1_lo"], row["top1_hi"] = wilson_interval(row["top1"], row["val_n"])
        row["top1_ci"] = f"{row['top1_lo']:.1f}-{row['top1_hi']:.1f}"
    row.update(infer_img_s=speeds.get("infer_img_s"), train_img_s=speeds.get("train_img_s"))
    row["model_args"] = json.dumps(plan.configs[plan.runs[v.label][0]].model_args)
    return row


def run_meta(args: argparse.Namespace, plan: Plan, wall: float) -> dict[str, Any]:
    return {
        "data": str(args.data),
        "img_size": plan.img_size,
        "epochs": plan.recipe["epochs"],
        "batch_size": plan.recipe["batch_size"],
        "lr": sorted({cfg.peak_lr for cfg in plan.configs.values()}),  # what ran: a recipe's base_lr scaled
        "seed": args.seed,
        "seeds": len(plan.seeds),
        "train_images": plan.train_images,
        "heldout_images": plan.heldout_images,
        "jobs": plan.jobs,
        "threads_per_job": plan.per_job,
        "threads": args.threads,
        "recipe": plan.recipe,
        "speed": plan.speed,
        "wall_s": wall,
        "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def strip(d: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in json.loads(json.dumps(d)).items() if k not in RUN_ONLY}

    return strip(a) == strip(b)


def _reusable(result_file: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    if not result_file.exists():
        return None
    try:
        res = json.loads(result_file.read_text())
    except ValueError:
        return None
    return res if res.get("status") == "ok" and _same_run(res.get("config", {}), config) else None


def _trained_epochs(ckpt_file: Path, config: dict[str, Any]) -> int | None:
    """The epochs a run of the same variant trained, when ``resume="auto"`` can continue or complete it."""
    if not ckpt_file.exists():
        return None
    try:
        ckpt = load_checkpoint(ckpt_file)
    except ValueError:
        return None
    usable = ckpt["epoch"] <= config["epochs"] and _same_run(ckpt.get("config", {}), config)
    return int(ckpt["epoch"]) if usable else None
