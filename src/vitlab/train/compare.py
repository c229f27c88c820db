"""``vitlab compare``: train a set of variants on the same data and budget, evaluate them, one table.

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

Output (``--out``, default ``runs/compare``): ``table.csv``, ``table.json``, ``table.md``, ``curves.png``
(held-out top-1 and training loss per epoch), ``acc_vs_speed.png``, and one folder per variant with its
checkpoint, per-epoch log (CSV/JSON), ``train.log`` and ``result.json``. The command owns ``--out`` while it
runs (:class:`vitlab.rundir.RunLock`; each variant's training owns its folder): a folder holding an earlier
comparison is refused unless ``--resume`` reuses it or ``--force`` moves its files aside first.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import load_checkpoint, load_model
from ..device import add_device_argument, resolve_device
from ..io import open_append, write_csv_atomic, write_figure_atomic, write_json_atomic, write_text_atomic
from ..measure.flops import count_macs
from ..measure.process import CaseRunner, CaseSpec, Prepared
from ..rundir import RunLock
from .engine import RUN_FILES, TrainConfig, load_data, train

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
VARIANT_FILES = (*RUN_FILES, "train.log", "result.json")
COST = {"tnt": 3.0, "eamlp": 3.0, "aft_conv": 2.5, "refiner": 1.5, "deepvit": 1.2, "aft_full": 1.2, "cpvt": 1.1}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models", default=",".join(DEFAULT_MODELS), help="comma-separated registered models (default: %(default)s)"
    )
    p.add_argument("--data", default="mnist", help="dataset spec as for `vitlab train` (default: the embedded MNIST)")
    p.add_argument("--epochs", type=int, default=RECIPE["epochs"], help="epochs per variant (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=RECIPE["batch_size"], help="batch size (default %(default)s)")
    p.add_argument("--lr", type=float, default=RECIPE["lr"], help="peak learning rate (default %(default)s)")
    p.add_argument("--ema", type=float, default=RECIPE["ema"], help="EMA decay, 0 = off (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of every variant (default 0)")
    p.add_argument("--train-limit", type=int, default=None, help="train on a random N of the training images")
    p.add_argument("--out", default="runs/compare", help="output folder (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads to use in all (default %(default)s)")
    add_device_argument(p)
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="variants trained at once, each with threads/jobs threads (default: = --threads)",
    )
    p.add_argument("--no-adapt", action="store_true", help="keep the mini configs as registered on 28-px data")
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse finished variants in --out and resume unfinished ones from their last epoch",
    )
    p.add_argument(
        "--force", action="store_true", help="start over even if --out holds a comparison (its files are moved aside)"
    )
    p.add_argument(
        "--isolation",
        choices=("forkserver", "subprocess"),
        default="forkserver",
        help="how each variant gets its fresh process (default %(default)s)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


# --------------------------------------------------------------------------- variants


def adapt_to_size(name: str, img_size: int) -> dict[str, Any]:
    """Constructor overrides that give a mini config a 4x4 token grid on 28-px images."""
    from ..models import get_config

    cfg = get_config(name)
    if img_size != 28 or not name.endswith("_mini"):
        return {}
    if cfg.arch == "t2t":
        return {"soft_split": ((7, 4, 2), (3, 2, 1), (3, 1, 1))}
    if cfg.arch == "tnt":
        return {"patch_size": 7, "inner_stride": 2}  # 4x4 words of each 7-px patch, as TNT-S's 16 words
    return {"patch_size": 7}


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


def size_of(name: str, kwargs: dict[str, Any], input_size: tuple[int, int, int]) -> tuple[int, int]:
    """(parameters, MACs) of the variant, counted on the meta device."""
    from ..models import create_model

    with torch.device("meta"):
        model = create_model(name, **kwargs)
    params = sum(p.numel() for p in model.parameters())
    return params, count_macs(model, input_size).total


# --------------------------------------------------------------------------- cases run in fresh processes


def train_case(config: dict[str, Any]) -> Prepared:
    """Measured case: the timed call trains the variant; its summary (with the per-epoch log) goes into
    ``info``. Progress lines go to the variant's ``train.log`` and, prefixed with its name, to the output."""
    cfg = TrainConfig.from_dict(config)
    info: dict[str, Any] = {}

    def work() -> None:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        with open_append(out / "train.log") as log_file:

            def log(line: str) -> None:
                log_file.write(line + "\n")
                log_file.flush()
                print(f"[{cfg.model}] {line}", flush=True)

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


# --------------------------------------------------------------------------- table and plots

COLUMNS = [
    ("model", "model", "{}"), ("method", "method", "{}"), ("top1", "top-1 %", "{:.2f}"), ("top5", "top-5 %", "{:.2f}"),
    ("params_m", "params (M)", "{:.3f}"), ("mmacs", "MACs (M)", "{:.2f}"), ("train_img_s", "train img/s", "{:.0f}"),
    ("infer_img_s", "infer img/s", "{:.0f}"), ("peak_mib", "peak MiB", "{:.0f}"), ("train_s", "train s", "{:.0f}"),
]  # fmt: skip


def fmt_row(row: dict[str, Any]) -> list[str]:
    return [("-" if row.get(k) is None else f.format(row[k])) for k, _, f in COLUMNS]


def render_text(rows: list[dict[str, Any]]) -> str:
    cells = [[h for _, h, _ in COLUMNS]] + [fmt_row(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c[i].ljust(widths[i]) if i < 2 else c[i].rjust(widths[i]) for i in range(len(c))) for c in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def render_markdown(rows: list[dict[str, Any]], note: str) -> str:
    head = "| " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---" if i < 2 else "---:" for i in range(len(COLUMNS))) + "|"
    body = ["| " + " | ".join(fmt_row(r)) + " |" for r in rows]
    return "\n".join([head, sep, *body, "", note, ""])


def write_tables(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[Path]:
    write_csv_atomic(out / "table.csv", rows)
    write_json_atomic(out / "table.json", {"meta": meta, "rows": rows})
    note = (
        f"Held-out top-1/top-5 after {meta['epochs']} epochs on {meta['data']} ({meta['train_images']} train / "
        f"{meta['heldout_images']} held-out images), batch {meta['batch_size']}, lr {meta['lr']}; train img/s with "
        f"{meta['threads_per_job']} thread(s) per variant, {meta['jobs']} variant(s) at a time; inference img/s "
        f"with the same {meta['threads_per_job']} thread(s), batch 256, one variant at a time; peak MiB = peak resident memory of the "
        f"variant's training process. Wall time {meta['wall_s']:.0f} s, load average {meta['loadavg']}."
    )
    write_text_atomic(out / "table.md", render_markdown(rows, note))
    return [out / "table.csv", out / "table.json", out / "table.md"]


def plot(out: Path, rows: list[dict[str, Any]], logs: dict[str, list[dict[str, Any]]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, log in logs.items():
        if not log:
            continue
        ep = [r["epoch"] for r in log]
        ax1.plot(ep, [r.get("val_top1") for r in log], marker="o", ms=3, label=name)
        ax2.plot(ep, [r["train_loss"] for r in log], marker="o", ms=3, label=name)
    ax1.set(xlabel="epoch", ylabel="held-out top-1 (%)", title="held-out accuracy")
    ax2.set(xlabel="epoch", ylabel="training loss", title="training loss", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    write_figure_atomic(fig, out / "curves.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 5))
    pts = [r for r in rows if r.get("top1") is not None and r.get("infer_img_s")]
    ax.scatter([r["infer_img_s"] for r in pts], [r["top1"] for r in pts], s=[40 + 200 * r["params_m"] for r in pts])
    for r in pts:
        ax.annotate(r["model"], (r["infer_img_s"], r["top1"]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set(xlabel="inference throughput (img/s)", ylabel="held-out top-1 (%)", title="accuracy vs inference speed")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    write_figure_atomic(fig, out / "acc_vs_speed.png", dpi=120)
    plt.close(fig)
    return [out / "curves.png", out / "acc_vs_speed.png"]


# --------------------------------------------------------------------------- the command

RUN_ONLY = ("force", "resume", "progress")  # options that do not change what a variant computes


@dataclass
class Plan:
    """What ``vitlab compare`` will run: the variants' training configs and sizes, and the setting."""

    out: Path
    names: list[str]
    configs: dict[str, TrainConfig]
    sizes: dict[str, tuple[int, int]]  # (parameters, MACs)
    jobs: int
    per_job: int
    train_images: int
    heldout_images: int


def print_line(line: str) -> None:
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    with RunLock(args.out, "vitlab compare", print_line) as lock:
        old = lock.check_fresh(old_entries(lock.folder), resume=args.resume, force=args.force)
        plan = plan_variants(args)
        lock.move_aside(old)  # the options and the data are fine: the old comparison goes out of the way
        return compare(args, plan, t_start)


def old_entries(out: Path) -> list[str]:
    """What an earlier comparison left in ``out``: its tables and plots, and the folders of its variants."""
    variants = sorted(
        d.name
        for d in out.iterdir()
        if d.is_dir() and not d.name.startswith(".") and any((d / f).exists() for f in VARIANT_FILES)
    )
    return [*OUTPUT_FILES, *variants]


def compare(args: argparse.Namespace, plan: Plan, t_start: float) -> int:
    """Train, time and tabulate the variants of ``plan``."""
    print(
        f"compare: {len(plan.names)} variants x {args.epochs} epochs on {args.data} ({plan.train_images} train "
        f"images), {plan.jobs} at a time x {plan.per_job} thread(s); output in {plan.out}",
        flush=True,
    )
    results = train_variants(plan, args.isolation, args.resume)
    speeds = time_inference(plan, results, args.isolation)
    rows = [table_row(plan, name, results[name], speeds.get(name)) for name in plan.names]
    logs = {name: results[name].get("info", {}).get("summary", {}).get("log", []) for name in plan.names}
    meta = run_meta(args, plan, time.perf_counter() - t_start)
    written = write_tables(plan.out, rows, meta)
    if not args.no_plots:
        written += plot(plan.out, rows, logs)
    print()
    print(render_text(rows))
    for r in rows:
        if "error" in r:
            print(f"{r['model']}: failed: {r['error']}")
    print(f"\nwall time {meta['wall_s']:.0f} s (load average {meta['loadavg']}); wrote {', '.join(map(str, written))}")
    return 1 if any("error" in r for r in rows) else 0


def plan_variants(args: argparse.Namespace) -> Plan:
    """Check the options and the data in this process (one line on a mistake, before any variant starts):
    the data is loaded once, for its sizes; each variant's config is built and its size counted."""
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    jobs = args.jobs or args.threads
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    names = resolve_models(args.models)
    resolve_device(args.device)  # a GPU that is not there: one line before any variant starts
    out = Path(args.out)
    recipe = {**RECIPE, "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "ema": args.ema}
    probe = TrainConfig(data=args.data, **recipe)
    train_ds, val_ds = load_data(probe, "train"), load_data(probe, "test")
    n_train = min(args.train_limit, len(train_ds)) if args.train_limit else len(train_ds)
    if args.batch_size > n_train:
        raise ValueError(f"--batch-size {args.batch_size} exceeds the {n_train} training images")
    img = int(train_ds.img_size[0])
    input_size = (int(train_ds.in_chans), img, img)
    per_job = max(1, args.threads // jobs)
    configs, sizes = {}, {}
    for name in names:
        model_args = {} if args.no_adapt else adapt_to_size(name, img)
        configs[name] = TrainConfig(
            model=name,
            model_args=model_args,
            data=args.data,
            out=str(out / name),
            seed=args.seed,
            threads=per_job,
            progress=False,
            force=True,
            resume=None,
            train_limit=args.train_limit,
            device=args.device,
            **recipe,
        )
        kwargs = dict(img_size=img, in_chans=input_size[0], num_classes=train_ds.num_classes, **model_args)
        sizes[name] = size_of(name, kwargs, input_size)  # also checks that the overrides build
    return Plan(out, names, configs, sizes, jobs, per_job, n_train, len(val_ds))


def train_variants(plan: Plan, isolation: str, resume: bool) -> dict[str, dict[str, Any]]:
    """Train every variant in a fresh process, ``plan.jobs`` at a time, the costliest first; each result is
    also written to ``OUT/<variant>/result.json`` (``--resume`` reuses it)."""
    results: dict[str, dict[str, Any]] = {}
    local = threading.local()
    runners: list[CaseRunner] = []

    def train_one(name: str) -> None:
        if not hasattr(local, "runner"):
            local.runner = CaseRunner(isolation, timeout=3600)
            runners.append(local.runner)
        results[name] = train_variant(plan.configs[name], local.runner, resume)

    by_cost = sorted(plan.names, key=lambda n: -next((c for k, c in COST.items() if n.startswith(k)), 1.0))
    try:
        with concurrent.futures.ThreadPoolExecutor(plan.jobs) as pool:
            for f in [pool.submit(train_one, n) for n in by_cost]:
                f.result()
    finally:
        for r in runners:
            r.close()
    return results


def train_variant(cfg: TrainConfig, runner: CaseRunner, resume: bool) -> dict[str, Any]:
    """One variant: reuse a finished result, continue an unfinished run, or train afresh."""
    out, config = Path(cfg.out), asdict(cfg)
    result_file = out / "result.json"
    done = _reusable(result_file, config) if resume else None
    if done is not None:
        print(f"[{cfg.model}] finished before: reused {result_file}", flush=True)
        return done
    if resume and _resumable(out / "last.pt", config):
        config.update(resume="auto", force=False)
    elif out.exists():  # another variant's or an unusable run: moved aside whole, train.log and result too
        with RunLock(out, "vitlab compare", lambda line: print(f"[{cfg.model}] {line}", flush=True)) as lock:
            lock.move_aside(VARIANT_FILES)
    # one pass, timed, default allocator: the peak RSS is the training process's own, as a user sees it
    res = runner.run(CaseSpec(train_case, {"config": config}, warmup=0, repeats=1, passes=("time",)))
    res["config"] = asdict(cfg)
    write_json_atomic(result_file, res)
    if res["status"] != "ok":
        print(f"[{cfg.model}] failed: {res.get('reason')}", file=sys.stderr, flush=True)
    return res


def time_inference(plan: Plan, results: dict[str, dict[str, Any]], isolation: str) -> dict[str, float]:
    """Inference throughput (img/s): one variant at a time, with the threads each variant trained with."""
    speeds: dict[str, float] = {}
    with CaseRunner(isolation, timeout=600) as runner:
        for name in plan.names:
            if results[name]["status"] != "ok":
                continue
            spec = CaseSpec(
                inference_case,
                {"checkpoint": str(plan.out / name / "last.pt"), "device": plan.configs[name].device},
                warmup=2,
                repeats=20,
                max_time=2.0,
                threads=plan.per_job,
                passes=("time",),
            )
            res = runner.run(spec)
            if res["status"] == "ok":
                speeds[name] = res["info"]["batch"] / res["time_s"]["median"]
    return speeds


def table_row(plan: Plan, name: str, res: dict[str, Any], infer_img_s: float | None) -> dict[str, Any]:
    params, macs = plan.sizes[name]
    row: dict[str, Any] = {"model": name, "method": method_of(name), "params_m": params / 1e6, "mmacs": macs / 1e6}
    if res["status"] != "ok":
        row["error"] = res.get("reason")
        return row
    s = res["info"]["summary"]
    final = s["log"][-1] if s.get("log") else s["final"]
    mem = res["mem"].get("timed", res["mem"])
    row.update(
        top1=final.get("val_top1"),
        top5=final.get("val_top5"),
        ema_top1=final.get("ema_top1"),
        train_img_s=s["train_img_s"],
        infer_img_s=infer_img_s,
        peak_mib=mem["peak"] / MB,
        train_mem_mib=mem["delta"] / MB,
        train_s=s["train_time_s"],
        wall_s=res["time_s"]["median"],
        model_args=json.dumps(plan.configs[name].model_args),
    )
    if "cuda_peak_mib" in s:
        row["cuda_peak_mib"] = s["cuda_peak_mib"]
    return row


def run_meta(args: argparse.Namespace, plan: Plan, wall: float) -> dict[str, Any]:
    return {
        "data": args.data,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "train_images": plan.train_images,
        "heldout_images": plan.heldout_images,
        "jobs": plan.jobs,
        "threads_per_job": plan.per_job,
        "threads": args.threads,
        "recipe": {**RECIPE, "epochs": args.epochs},
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


def _resumable(ckpt_file: Path, config: dict[str, Any]) -> bool:
    """An unfinished run of the same variant that ``resume="auto"`` can continue."""
    if not ckpt_file.exists():
        return False
    try:
        ckpt = load_checkpoint(ckpt_file)
    except ValueError:
        return False
    return ckpt["epoch"] < config["epochs"] and _same_run(ckpt.get("config", {}), config)
