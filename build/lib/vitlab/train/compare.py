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
checkpoint, per-epoch log (CSV/JSON), ``train.log`` and ``result.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

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
    import torch

    from ..measure.flops import count_macs
    from ..models import create_model

    with torch.device("meta"):
        model = create_model(name, **kwargs)
    params = sum(p.numel() for p in model.parameters())
    return params, count_macs(model, input_size).total


# --------------------------------------------------------------------------- cases run in fresh processes


class _Tee:
    def __init__(self, path: Path, stream) -> None:
        self.file, self.stream = open(path, "a"), stream  # noqa: SIM115 -- closed by the case

    def write(self, s: str) -> int:
        self.file.write(s)
        self.file.flush()
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()


def train_case(config: dict[str, Any]):
    """Case for ``vitlab.measure.process``: the timed call trains the variant (its summary goes into ``info``)."""
    from ..measure.process import Prepared
    from .engine import TrainConfig, train

    cfg = TrainConfig.from_dict(config)
    info: dict[str, Any] = {}

    def work() -> None:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        tee = _Tee(out / "train.log", sys.stdout)
        old, sys.stdout = sys.stdout, tee
        try:
            info["summary"] = train(cfg)
        finally:
            sys.stdout = old
            tee.file.close()

    return Prepared(work, info)


def inference_case(checkpoint: str, batch: int = 256):
    """Case for ``vitlab.measure.process``: one eval-mode forward of a batch of held-out-sized inputs."""
    import torch

    from ..checkpoint import load_checkpoint, model_from_checkpoint
    from ..measure.process import Prepared

    model = model_from_checkpoint(load_checkpoint(checkpoint)).eval()
    c, h, w = model.meta["input_size"]
    x = torch.randn(batch, c, h, w)

    def work() -> None:
        with torch.inference_mode():
            model(x)

    return Prepared(work, {"batch": batch})


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


def write_tables(out: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    import csv

    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "table.csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)
    (out / "table.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    note = (
        f"Held-out top-1/top-5 after {meta['epochs']} epochs on {meta['data']} ({meta['train_images']} train / "
        f"{meta['heldout_images']} held-out images), batch {meta['batch_size']}, lr {meta['lr']}; train img/s with "
        f"{meta['threads_per_job']} thread(s) per variant, {meta['jobs']} variant(s) at a time; inference img/s "
        f"with the same {meta['threads_per_job']} thread(s), batch 256, one variant at a time; peak MiB = peak resident memory of the "
        f"variant's training process. Wall time {meta['wall_s']:.0f} s, load average {meta['loadavg']}."
    )
    (out / "table.md").write_text(render_markdown(rows, note))


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
    fig.savefig(out / "curves.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 5))
    pts = [r for r in rows if r.get("top1") is not None and r.get("infer_img_s")]
    ax.scatter([r["infer_img_s"] for r in pts], [r["top1"] for r in pts], s=[40 + 200 * r["params_m"] for r in pts])
    for r in pts:
        ax.annotate(r["model"], (r["infer_img_s"], r["top1"]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set(xlabel="inference throughput (img/s)", ylabel="held-out top-1 (%)", title="accuracy vs inference speed")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "acc_vs_speed.png", dpi=120)
    plt.close(fig)
    return [out / "curves.png", out / "acc_vs_speed.png"]


# --------------------------------------------------------------------------- the command


RUN_ONLY = ("force", "resume", "progress", "tag")  # options that do not change what a variant computes


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    strip = lambda d: {k: v for k, v in json.loads(json.dumps(d)).items() if k not in RUN_ONLY}  # noqa: E731
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
    from ..checkpoint import load_checkpoint

    if not ckpt_file.exists():
        return False
    try:
        ckpt = load_checkpoint(ckpt_file)
    except ValueError:
        return False
    return ckpt["epoch"] < config["epochs"] and _same_run(ckpt.get("config", {}), config)


def run(args: argparse.Namespace) -> int:
    from ..measure.process import CaseRunner, CaseSpec
    from .engine import TrainConfig, load_data

    t_start = time.perf_counter()
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    jobs = args.jobs or args.threads
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    per_job = max(1, args.threads // jobs)
    names = resolve_models(args.models)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # fail fast, in this process, on bad data or options (one line), before any variant starts
    probe = TrainConfig(data=args.data, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, ema=args.ema)
    train_ds, val_ds = load_data(probe, "train"), load_data(probe, "test")
    n_train = min(args.train_limit, len(train_ds)) if args.train_limit else len(train_ds)
    if args.batch_size > n_train:
        raise ValueError(f"--batch-size {args.batch_size} exceeds the {n_train} training images")
    img = int(train_ds.img_size[0])
    input_size = (int(train_ds.in_chans), img, img)

    configs, sizes = {}, {}
    for name in names:
        model_args = {} if args.no_adapt else adapt_to_size(name, img)
        cfg = TrainConfig(
            model=name,
            model_args=model_args,
            data=args.data,
            out=str(out / name),
            seed=args.seed,
            threads=per_job,
            progress=False,
            force=True,
            resume=None,
            tag=f"[{name}] ",
            train_limit=args.train_limit,
            **{**RECIPE, "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "ema": args.ema},
        )
        kwargs = dict(img_size=img, in_chans=input_size[0], num_classes=train_ds.num_classes, **model_args)
        sizes[name] = size_of(name, kwargs, input_size)  # also checks the overrides build
        configs[name] = cfg
    del train_ds, val_ds
    print(
        f"compare: {len(names)} variants x {args.epochs} epochs on {args.data} ({n_train} train images), "
        f"{jobs} at a time x {per_job} thread(s); output in {out}",
        flush=True,
    )

    results: dict[str, dict[str, Any]] = {}
    local = threading.local()
    runners: list[CaseRunner] = []
    lock = threading.Lock()

    def runner() -> CaseRunner:
        if not hasattr(local, "runner"):
            local.runner = CaseRunner(args.isolation, timeout=3600)
            with lock:
                runners.append(local.runner)
        return local.runner

    def train_one(name: str) -> None:
        cfg = configs[name]
        config = asdict(cfg)
        result_file = out / name / "result.json"
        done = _reusable(result_file, config) if args.resume else None
        if done is not None:
            print(f"[{name}] finished before: reused {result_file}", flush=True)
            results[name] = done
            return
        if args.resume and _resumable(out / name / "last.pt", config):
            config["resume"] = "auto"
            config["force"] = False
        elif (out / name).exists():
            for stale in ("log.json", "log.csv", "train.log", "summary.json", "result.json"):
                (out / name / stale).unlink(missing_ok=True)
        # one pass, timed, default allocator: the peak RSS is the training process's own, as a user sees it
        spec = CaseSpec("vitlab.train.compare:train_case", {"config": config}, warmup=0, repeats=1, passes=("time",))
        res = runner().run(spec)
        res["config"] = asdict(cfg)
        (out / name).mkdir(parents=True, exist_ok=True)
        result_file.write_text(json.dumps(res, indent=1) + "\n")
        results[name] = res
        if res["status"] != "ok":
            print(f"[{name}] failed: {res.get('reason')}", file=sys.stderr, flush=True)

    try:
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            by_cost = sorted(names, key=lambda n: -next((c for k, c in COST.items() if n.startswith(k)), 1.0))
            for f in [pool.submit(train_one, n) for n in by_cost]:
                f.result()
        # inference throughput: one variant at a time, the threads each variant trained with
        infer: dict[str, float] = {}
        with CaseRunner(args.isolation, timeout=600) as r:
            for name in names:
                if results[name]["status"] != "ok":
                    continue
                spec = CaseSpec(
                    "vitlab.train.compare:inference_case",
                    {"checkpoint": str(out / name / "last.pt")},
                    warmup=2,
                    repeats=20,
                    max_time=2.0,
                    threads=per_job,
                    passes=("time",),
                )
                res = r.run(spec)
                if res["status"] == "ok":
                    infer[name] = res["info"]["batch"] / res["time_s"]["median"]
    finally:
        for r in runners:
            r.close()

    rows, logs = [], {}
    for name in names:
        res, (params, macs) = results[name], sizes[name]
        log_file = out / name / "log.json"
        logs[name] = json.loads(log_file.read_text()) if log_file.exists() else []
        row: dict[str, Any] = {"model": name, "method": method_of(name), "params_m": params / 1e6, "mmacs": macs / 1e6}
        if res["status"] == "ok":
            s = res["info"]["summary"]
            final = logs[name][-1] if logs[name] else s["final"]
            mem = res["mem"].get("timed", res["mem"])
            row.update(
                top1=final.get("val_top1"),
                top5=final.get("val_top5"),
                ema_top1=final.get("ema_top1"),
                train_img_s=s["train_img_s"],
                infer_img_s=infer.get(name),
                peak_mib=mem["peak"] / MB,
                train_mem_mib=mem["delta"] / MB,
                train_s=s["train_time_s"],
                wall_s=res["time_s"]["median"],
                model_args=json.dumps(configs[name].model_args),
            )
            if "cuda_peak_mib" in s:
                row["cuda_peak_mib"] = s["cuda_peak_mib"]
        else:
            row["error"] = res.get("reason")
        rows.append(row)

    wall = time.perf_counter() - t_start
    meta = {
        "data": args.data,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "train_images": n_train,
        "heldout_images": len(load_data(probe, "test")),
        "jobs": jobs,
        "threads_per_job": per_job,
        "threads": args.threads,
        "recipe": {**RECIPE, "epochs": args.epochs},
        "wall_s": wall,
        "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }
    write_tables(out, rows, meta)
    written = [out / "table.csv", out / "table.json", out / "table.md"]
    if not args.no_plots:
        written += plot(out, rows, logs)
    print()
    print(render_text(rows))
    for r in rows:
        if "error" in r:
            print(f"{r['model']}: failed: {r['error']}")
    print(f"\nwall time {wall:.0f} s (load average {meta['loadavg']}); wrote {', '.join(str(p) for p in written)}")
    return 1 if any("error" in r for r in rows) else 0
