"""``vitlab bench``: throughput, latency, peak memory, MACs/FLOPs and GEMM utilisation of named models."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..bench.models import (
    CONFIG,
    DEFINITIONS,
    DTYPES,
    MODES,
    apply_wait_policy,
    plan_cases,
    report_text,
    resolve,
    run_plan,
    write_report,
)
from ..common import options as opt
from ..common.device import add_device_argument
from ..common.report import report_doc, timed_sweep
from ..measure.machine import machine_info
from ..measure.sweep import (
    csv_list,
    options,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "Example: vitlab bench deit_small_patch16_224 tnt_s_patch16_224 --batch 1,8 --img-size 224,384 "
        "--dtypes fp32,bf16 --modes infer,train"
    )
    p.add_argument("models", nargs="*", help="registered model names (vitlab models lists them)")
    p.add_argument("--batch", type=csv_list(opt.positive_int), default=[1, 8], help="batch sizes (default 1,8)")
    p.add_argument(
        "--img-size", type=csv_list(opt.image_size), default=None, help="input resolutions (default: the model's)"
    )
    p.add_argument(
        "--dtypes", type=csv_list(str, DTYPES), default=["fp32"], help="fp32,bf16,fp16 (fp16: GPU only; default fp32)"
    )
    p.add_argument("--modes", type=csv_list(str, MODES), default=["infer"], help="infer,train (default infer)")
    p.add_argument(
        "--compile",
        nargs="?",
        const="on",
        default="off",
        choices=("off", "on", "both"),
        help="torch.compile the model (--compile = on; 'both' also runs eager)",
    )
    p.add_argument(
        "--grad-checkpointing",
        nargs="?",
        const="on",
        default="off",
        choices=("off", "on", "both"),
        help="training cases recompute each block's activations in the backward pass (model.set_grad_checkpointing; "
        "--grad-checkpointing = on; 'both' also runs without)",
    )
    add_device_argument(p, default="cpu")
    p.add_argument("--threads", type=opt.Int(1, 1024), default=2, help="torch threads per case (default 2)")
    p.add_argument("--repeats", type=opt.positive_int, default=5, help="timed calls per case (default 5)")
    p.add_argument(
        "--warmup", type=opt.non_negative_int, default=1, help="untimed calls besides the setup's warm call (default 1)"
    )
    p.add_argument(
        "--max-time",
        type=opt.positive_float,
        default=30.0,
        help="seconds of timed calls per case; fewer repeats (>= 3) for slow cases (default 30)",
    )
    p.add_argument(
        "--gemm-rounds",
        type=opt.positive_int,
        default=5,
        help="at least this many timed calls of the GEMM yardstick, over at least 2 s (default 5)",
    )
    p.add_argument("--no-memory", action="store_true", help="skip the memory pass (faster)")
    add_run_arguments(p)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Profiling, the case processes' environment, and where the report goes."""
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one call per case: time per kind of work (matrix products, attention, norms, copies, "
        "elementwise) with their GFLOP/s, top operators; profile_*.txt",
    )
    p.add_argument(
        "--omp-wait-policy",
        choices=("passive", "active", "inherit"),
        default=None,
        help="OpenMP wait policy of the case processes (default: inherit, the environment's, as the side-by-side "
        "comparisons run)",
    )
    p.add_argument(
        "--allocator",
        choices=("keep", "default"),
        default="keep",
        help="allocator policy of the timed calls: keep freed memory for reuse (default, as every vitlab command) "
        "or glibc's default (returns large blocks to the OS: page faults on every new activation)",
    )
    p.add_argument(
        "--isolation",
        choices=("forkserver", "subprocess"),
        default="forkserver",
        help="fresh process per pass: forked from a clean server (default) or a new interpreter",
    )
    p.add_argument("--timeout", type=opt.positive_float, default=1200.0, help="seconds before a case pass is killed")
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="output folder (default runs/bench)")


def run(args: argparse.Namespace) -> int:
    resolve(args)
    cases = plan_cases(args)
    args.out.mkdir(parents=True, exist_ok=True)
    info = machine_info(args.threads)
    info["omp_wait_policy"] = policy = apply_wait_policy(args.omp_wait_policy)
    print(
        f"vitlab bench: {len(cases)} cases, fresh processes per case; torch {info['torch']}, {args.threads} threads, "
        f"{info['cpu']}; OMP_WAIT_POLICY={policy or 'unset (libgomp: active)'}; allocator {args.allocator}; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    results, elapsed = timed_sweep(lambda: run_plan(cases, args), info)
    text = report_text(results, {**info, "allocator": args.allocator})
    print("\n" + text)
    doc = report_doc(
        "vitlab.bench-models/1",
        elapsed,
        info,
        options(args, CONFIG),
        definitions=DEFINITIONS,
        cases=results,
    )
    write_report(args, results, doc, text)
    return 0
