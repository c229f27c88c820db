"""Training-step benchmark of the causal models in the paper's CIFAR-10 configuration (Table 2: L=24, d=256).

Cases: AFT-local-256 (d' = 64; also with its core recomputed in the backward pass, ``aft_local_rc``),
AFT-simple and the Transformer baseline (h = 2, SDPA) at T = 1024 and T = 3072, batch scaled to this
machine. The baseline ``transformer`` is the paper's configuration: dropout 0.1 everywhere, the attention
weights included (``nn.Transformer``/GPT-2 convention), for which SDPA on CPU takes its math path and stores
the T x T maps, as the paper's 2021 baseline did. ``--flash`` adds ``transformer_flash`` (no attention
dropout: SDPA's flash kernel, which stores no map; its MLP and norms store what AFT's do, so no mixer can
use much less memory than it). One case = one training step (forward, cross-entropy, backward,
AdamW step, dropout 0.1) in a **fresh process** (:mod:`vitlab.measure.process`): its time (the fastest of the
timed steps over ``--rounds`` interleaved runs: other processes only add time) and its memory = peak resident memory - resident memory before the model was built, measured
after a warm-up step of a tiny model (so: weights, gradients, optimizer state and activations; the paper's
GB/GPU counts the same things). ``--dtypes bf16`` runs the step under bf16 autocast (fp16: autocast and a
gradient scaler, GPU only); ``--device cuda`` runs it on a GPU, timed with CUDA events, its memory the GPU
allocator's peak - what was allocated before the model was built.

``--baselines`` adds the efficient-attention baselines of AFT's Tables 2 and 4 (Linear Transformer, Performer,
Reformer, Synthesizer, strided, local and 2-D local sparse attention, these three block by block:
:data:`BASELINES`) and the AFT rows of Table 4 (AFT-full, AFT-local-32, AFT-simple: :data:`AFT_ENWIK8`), each in
its named config's mixer at the same L, d and ``--heads`` as the rest, so that one table compares them all; the
paper's ratios stand beside each row the paper has.

Ratios are taken against the Transformer of the same run and T, measured side by side. Targets
(:mod:`vitlab.tasks.lm.targets`): AFT-local <= 0.6x the Transformer's memory at T = 3072 and faster per step
(paper: 12.8 / 30.4 GB = 0.42x, 1.67 / 1.36 it/s = 1.23x).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ...common import options as opt
from ...common.device import add_device_argument, resolve_device
from ...measure.machine import machine_info
from ...measure.process import MB, PRELOAD, CaseRunner, CaseSpec, Prepared, current_rss_bytes
from ...measure.sweep import (
    csv_list,
    options,
    require_at_least,
    require_positive_items,
    run_sweep,
    with_wall_time,
    write_json,
    write_text,
)
from .targets import judge, paper_ratios, verdict_lines

# benchmark model -> (named config, extra mixer options)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "aft_local": ("aft_local_256_cifar", {}),
    "aft_local_rc": ("aft_local_256_cifar", {"recompute": True}),
    "aft_simple": ("aft_simple_cifar", {}),
    "transformer": ("transformer_cifar", {}),
    "transformer_flash": ("transformer_cifar", {"attn_drop": 0.0}),
    # enwik8 (paper Table 4, T = 1024)
    "aft_local_32": ("aft_local_32_enwik8", {}),
    "aft_full": ("aft_full_enwik8", {}),
    "transformer_enwik8_flash": ("transformer_enwik8", {"attn_drop": 0.0}),
    # the AFT cores without their Triton kernels (what vitlab ran on a GPU before them)
    "aft_local_pre": ("aft_local_256_cifar", {"triton_kernels": False}),
    "aft_simple_pre": ("aft_simple_cifar", {"triton_kernels": False}),
    "aft_local_32_pre": ("aft_local_32_enwik8", {"triton_kernels": False}),
    "aft_full_pre": ("aft_full_enwik8", {"triton_kernels": False}),
}
#: the efficient-attention baselines (``--baselines``): benchmark model -> (named config, extra mixer options)
BASELINES: dict[str, tuple[str, dict[str, Any]]] = {
    "linear_transformer": ("linear_transformer_enwik8", {}),
    "performer": ("performer_enwik8", {}),
    "reformer": ("reformer_enwik8", {}),
    "synthesizer": ("synthesizer_enwik8", {}),
    "sparse_strided": ("sparse_strided_cifar", {}),
    "local_attention": ("image_transformer_local_cifar", {}),
    "local2d_attention": ("image_transformer_local2d_cifar", {}),
}
MODELS.update(BASELINES)
#: the AFT rows of the enwik8 table the baselines are read against (``--baselines`` adds them too)
AFT_ENWIK8 = ("aft_full", "aft_local_32", "aft_simple")
BASELINE = "transformer"
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def prepare_case(
    model: str,
    T: int,
    layers: int,
    dim: int,
    batch: int,
    dropout: float = 0.1,
    seed: int = 0,
    dtype: str = "fp32",
    device: str = "cpu",
    heads: int = 2,
) -> Prepared:
    """Build the model, its AdamW optimizer and a batch of sub-pixel sequences on ``device``; return one
    training step (autocast to ``dtype`` unless fp32)."""
    import torch

    from .model import create_lm, lm_config

    dev = torch.device(device)
    name, extra = MODELS[model]
    if not extra.get("triton_kernels", True):
        _triton_kernels_off()
    extra = {k: v for k, v in extra.items() if k != "triton_kernels"}
    kind, opts = lm_config(name)["mixer"]
    # what every case starts on its first step (thread pool, autograd engine, lazily imported modules, optimizer
    # code) is started before the reference memory, so that it is not counted as the model's
    for warm in ("tiny_aft_local", "tiny_transformer"):
        _step(create_lm(warm, max_len=32).to(dev), torch.randint(0, 256, (1, 32), device=dev), dtype)()
    gc.collect()
    before = current_rss_bytes()
    gpu_before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    torch.manual_seed(seed)
    mixer = (kind, {**opts, **extra})
    lm = create_lm(name, depth=layers, dim=dim, heads=heads, max_len=T, dropout=dropout, mixer=mixer)
    step = _step(lm.to(dev), torch.randint(0, 256, (batch, T), device=dev), dtype)
    info = {
        "params": sum(p.numel() for p in lm.parameters()),
        "mixer": [kind, {**opts, **extra}],
        "rss_before_model": before,
        "cuda_before_model": gpu_before,
    }
    return Prepared(step, info, device=str(dev))


def _triton_kernels_off() -> None:
    """The AFT modules of this (fresh, one-case) process keep to the paths they took before the Triton kernels:
    the kernels' own gate answers no, every other fast path stays as it is."""
    from ...mixers import aft

    aft.triton_runs_on = lambda *tensors: False


def _step(lm, seqs, dtype: str):
    """One training step of ``lm`` on ``seqs``: loss (under autocast to ``dtype`` unless fp32), backward,
    AdamW (lr 3e-3, wd 0.1; fused on a GPU)."""
    from ...common.device import autocast, grad_scaler
    from ...engine.optim import create_optimizer

    lm.train()
    opt = create_optimizer(lm, 3e-3, 0.1)
    low = LOW_PRECISION.get(dtype)
    scaler = grad_scaler(seqs.device, low)

    def step() -> None:
        with autocast(seqs.device, low):
            loss = lm.loss(seqs)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=opt.positive_int, nargs="+", default=[1024, 3072], help="sequence lengths T")
    p.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=["aft_local", "aft_local_rc", "aft_simple", "transformer"],
        help="aft_local_rc: AFT-local with its core recomputed in the backward pass",
    )
    p.add_argument(
        "--baselines",
        action="store_true",
        help=f"also the efficient-attention baselines of AFT's Tables 2 and 4 ({', '.join(BASELINES)}) and the "
        f"AFT rows they are read against ({', '.join(AFT_ENWIK8)})",
    )
    p.add_argument(
        "--heads", type=opt.positive_int, default=2, help="heads of every multi-head mixer (Table 2's Transformer: 2)"
    )
    p.add_argument(
        "--baseline",
        choices=list(MODELS),
        default=BASELINE,
        help="the model the ratios are taken against (transformer_flash / transformer_enwik8_flash: SDPA's flash "
        "kernel; *_pre: an AFT model without its Triton kernels)",
    )
    p.add_argument(
        "--flash",
        action="store_true",
        help="also the Transformer without attention dropout (SDPA's flash kernel: no T x T maps stored)",
    )
    p.add_argument(
        "--layers",
        type=opt.Int(1, 1024),
        default=4,
        help="blocks L (paper 24; fewer keeps the run short, ratios stay side by side)",
    )
    p.add_argument("--dim", type=opt.positive_int, default=256, help="width d (paper 256)")
    p.add_argument(
        "--dtypes",
        type=csv_list(str, ("fp32", *LOW_PRECISION)),
        default=["fp32"],
        help="fp32,bf16,fp16: the step in fp32, or under autocast (fp16 with a gradient scaler, GPU only; default fp32)",
    )
    add_device_argument(p, default="cpu")
    p.add_argument("--batch", type=opt.positive_int, default=1, help="sequences per step (paper 32 on 8 GPUs)")
    p.add_argument("--warmup", type=opt.non_negative_int, default=1, help="untimed steps per case")
    p.add_argument("--repeats", type=opt.positive_int, default=2, help="timed steps per case")
    p.add_argument(
        "--rounds",
        type=opt.positive_int,
        default=1,
        help="run every case this many times, interleaved (noisy machines)",
    )
    p.add_argument("--threads", type=opt.threads, default=1, help="torch threads per case (0: torch's default)")
    p.add_argument("--timeout", type=opt.positive_float, default=900.0, help="seconds before a case is killed")
    p.add_argument("--out", default="runs/bench-lm", help="folder for lm_bench.json and lm_bench.md")
    p.add_argument("--quick", action="store_true", help="smoke run: L=1, d=64, T = 256 and 512")


def bench_models(args: argparse.Namespace) -> list[str]:
    """The benchmark models a run measures: ``--models``, what ``--flash`` and ``--baselines`` add, and the
    model every ratio is taken against."""
    extra = [*(["transformer_flash"] if args.flash else []), *((*BASELINES, *AFT_ENWIK8) if args.baselines else [])]
    models = list(dict.fromkeys([*args.models, *extra]))
    return models if args.baseline in models else [*models, args.baseline]


def run_cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every model at every T, ``args.rounds`` times, each in a fresh process, one progress line each."""
    models = bench_models(args)
    # side by side: for each T, every model once per round
    cases = [
        {"model": m, "T": t, "layers": args.layers, "dim": args.dim, "batch": args.batch, "dtype": d, "round": k}
        for t in args.tokens
        for d in args.dtypes
        for k in range(args.rounds)
        for m in models
    ]
    with CaseRunner("forkserver", args.timeout, (*PRELOAD, __name__)) as runner:
        return run_sweep(
            cases,
            lambda c: measure_case(runner, c, args),
            lambda c: f"{c['model']:<20} T={c['T']:<5} {c['dtype']} L={c['layers']} d={c['dim']} B={c['batch']}",
            describe,
        )


def measure_case(runner: CaseRunner, case: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One training step's time and memory (``mem_mb``): peak RSS - RSS before the model was built, or on a
    GPU the allocator's peak - what was allocated before the model was built."""
    params = {**{k: v for k, v in case.items() if k != "round"}, "device": args.device, "heads": args.heads}
    spec = CaseSpec(prepare_case, params, warmup=args.warmup, repeats=args.repeats, threads=args.threads or None)
    r = {**case, "loadavg_1m": os.getloadavg()[0], **with_wall_time(lambda: runner.run(spec))}
    if r["status"] == "ok":
        mem, info = r["mem"], r["info"]
        if "cuda" in mem:
            r["mem_mb"] = (mem["cuda"]["peak"] - info["cuda_before_model"]) / MB
        else:
            r["mem_mb"] = (mem["peak"] - (info["rss_before_model"] or mem["import"])) / MB
    return r


def describe(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r.get('reason')}"
    return f"{r['time_s']['median']:.2f} s/step (best {r['time_s']['min']:.2f}), {r['mem_mb']:.0f} MB"


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (model, T) over its rounds: ``step_s`` = the fastest timed step (load from other
    processes only ever adds time), ``median_s`` over all timed steps, ``mem_mb`` = the largest peak."""
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in results:
        if r["status"] == "ok":
            groups.setdefault((r["model"], r["T"], r.get("dtype", "fp32")), []).append(r)
    out = []
    for (model, t, dtype), rs in groups.items():
        times = [x for r in rs for x in r["time_s"]["times"]]
        out.append(
            {
                "model": model,
                "T": t,
                "dtype": dtype,
                "status": "ok",
                "step_s": min(times),
                "median_s": statistics.median(times),
                "mem_mb": max(r["mem_mb"] for r in rs),
                "steps_timed": len(times),
            }
        )
    return out


def ratios(results: list[dict[str, Any]], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """Per (model, T, dtype): memory / the baseline's and speed = the baseline's step time / the model's
    (the baseline, by default the Transformer, of the same T and dtype)."""

    def key(r: dict[str, Any]) -> tuple[int, str]:
        return r["T"], r.get("dtype", "fp32")

    base = {key(r): r for r in results if r["model"] == baseline and r["status"] == "ok"}
    rows = []
    for r in results:
        b = base.get(key(r))
        if r["status"] != "ok" or b is None:
            continue
        rows.append(
            {
                "model": r["model"],
                "T": r["T"],
                "dtype": key(r)[1],
                "step_s": r["step_s"],
                "median_s": r.get("median_s"),
                "mem_mb": r["mem_mb"],
                "mem_ratio": r["mem_mb"] / b["mem_mb"],
                "speed_ratio": b["step_s"] / r["step_s"],
            }
        )
    return rows


def table(rows: list[dict[str, Any]], layers: int, dim: int, batch: int, baseline: str = BASELINE) -> str:
    lines = [
        f"Training step, L={layers}, d={dim}, batch {batch} (ratios vs {baseline} of the same T and "
        "dtype; step = fastest timed step, median in brackets)",
        "",
        "| model | T | dtype | step (s) | memory (MB) | memory ratio | speed ratio | paper mem / speed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = paper_ratios(r["model"], r["T"])
        paper = f"{p['mem']:.2f}x / {p['speed']:.2f}x" if p else ""
        med = f" ({r['median_s']:.2f})" if r.get("median_s") else ""
        lines.append(
            f"| {r['model']} | {r['T']} | {r['dtype']} | {r['step_s']:.2f}{med} | {r['mem_mb']:.0f} | {r['mem_ratio']:.2f}x | "
            f"{r['speed_ratio']:.2f}x | {paper} |"
        )
    lines += ["", "paper: the paper's ratios against its Transformer of the same shape (8 x V100): Table 2 at "
              "T = 3072, Table 4 at T = 1024; rows the paper does not have (AFT-full is not in Table 4) stay "
              "empty."]  # fmt: skip
    return "\n".join(lines)


def resolve(args: argparse.Namespace) -> None:
    """``--quick``'s settings; every size must be positive."""
    if args.quick:
        args.layers, args.dim, args.tokens, args.repeats = 1, 64, [256, 512], 1
    require_at_least(args, ("layers", "dim", "batch", "repeats", "rounds"))
    require_positive_items(args, ("tokens",))
    args.device = str(resolve_device(args.device))
    if "fp16" in args.dtypes and args.device == "cpu":
        raise ValueError("--dtypes fp16 needs a GPU (--device cuda); use bf16 on the CPU")


def run(args: argparse.Namespace) -> int:
    resolve(args)
    start = time.time()
    results = run_cases(args)
    rows = ratios(summarise(results), args.baseline)
    verdict = judge(rows)
    md = table(rows, args.layers, args.dim, args.batch, args.baseline)
    md += "\n\n" + "\n".join(verdict_lines(verdict, rows))
    print()
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "settings": options(
            args,
            (
                "tokens",
                "layers",
                "dim",
                "heads",
                "batch",
                "dtypes",
                "device",
                "warmup",
                "repeats",
                "rounds",
                "threads",
                "baseline",
            ),
        ),
        "machine": {**machine_info(args.threads), "loadavg_end": os.getloadavg()},
        "seconds": time.time() - start,
        "results": results,
        "ratios": rows,
        "targets": verdict,
    }
    write_json(out / "lm_bench.json", report, indent=2)
    write_text(out / "lm_bench.md", md)
    print(f"\nwrote {out / 'lm_bench.json'} and {out / 'lm_bench.md'}")
    return 0 if all(r["status"] == "ok" for r in results) else 1
