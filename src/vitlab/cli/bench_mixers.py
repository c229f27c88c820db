"""``vitlab bench-mixers``: time and peak memory of every token mixer as the token count grows."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..bench.mixers import (
    CONFIG,
    DEFAULT_SWEEPS,
    DEFAULT_TOKENS,
    DTYPES,
    MODES,
    REFERENCES,
    memory_budget,
    plan_cases,
    report_text,
    resolve,
    run_plan,
    write_report,
)
from ..bench.targets import (
    TARGET_BATCH,
    TARGET_DIM,
    mixer_targets,
)
from ..common.device import add_device_argument
from ..common.options import Int, non_negative_int, positive_float, positive_int
from ..common.report import (
    report_doc,
    timed_sweep,
)
from ..measure.machine import machine_info
from ..measure.process import GB
from ..measure.sweep import (
    csv_list,
    options,
)
from ..mixers import MIXERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "Without options: the cases the targets need, then every mixer over " + "; ".join(
        f"T = {','.join(map(str, t))} in {'/'.join(d)} {' and '.join(m)}" for d, m, t in DEFAULT_SWEEPS
    )
    add_selection_arguments(parser)
    opt = parser.add_argument_group("mixer options")
    opt.add_argument("--heads", type=positive_int, help="attention heads (default dim/64, head width 64)")
    opt.add_argument("--window", type=positive_int, default=32, help="AFT-local window s (default 32)")
    opt.add_argument("--kernel", type=positive_int, default=11, help="AFT-conv kernel size (default 11)")
    add_measuring_arguments(parser)


def add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    kinds = [*MIXERS, *REFERENCES]
    sel = parser.add_argument_group("what to run (any of these runs a sweep of just that, without the targets)")
    sel.add_argument("--mixers", type=csv_list(str, kinds), help=f"comma-separated subset of: {', '.join(kinds)}")
    sel.add_argument(
        "--tokens", type=csv_list(positive_int), help=f"token counts T (default {','.join(map(str, DEFAULT_TOKENS))})"
    )
    sel.add_argument("--dim", type=positive_int, help=f"token width (default {TARGET_DIM})")
    sel.add_argument("--batch", type=positive_int, help=f"batch size (default {TARGET_BATCH})")
    sel.add_argument("--dtypes", type=csv_list(str, DTYPES), help="fp32,bf16 (default both)")
    sel.add_argument("--modes", type=csv_list(str, MODES), help="forward,train (default both)")
    sel.add_argument("--quick", action="store_true", help="a tiny run (3 mixers, T=16,64, dim 32, batch 2, 1 repeat)")
    sel.add_argument("--targets-only", action="store_true", help="only the cases the targets need")
    sel.add_argument("--with-targets", action="store_true", help="add the targets' cases to a chosen sweep")


def add_measuring_arguments(parser: argparse.ArgumentParser) -> None:
    how = parser.add_argument_group("measuring")
    how.add_argument("--repeats", type=positive_int, help="timed calls per case (default 5; 1 with --quick)")
    how.add_argument("--warmup", type=non_negative_int, default=1, help="untimed calls first (default 1)")
    how.add_argument(
        "--max-time",
        type=positive_float,
        default=3.0,
        help="about this many seconds of timed calls per case: fewer repeats for slow cases, at least 1 (default 3)",
    )
    how.add_argument("--threads", type=Int(1, 1024), default=2, help="torch threads in each case (default 2)")
    add_device_argument(how, default="cpu")
    how.add_argument(
        "--mem-budget",
        type=positive_float,
        default=8.0,
        help="GB; skip cases estimated to need more (default 8: the machine is shared; capped at 60%% of the "
        "available memory, of the GPU's free memory on a GPU)",
    )
    how.add_argument(
        "--isolation",
        choices=("forkserver", "subprocess"),
        default="forkserver",
        help="fresh process per case: forked from a clean preloaded server (default) or a new interpreter",
    )
    how.add_argument(
        "--timeout", type=positive_float, default=600.0, help="seconds before a case is killed (default 600)"
    )
    how.add_argument(
        "--out", type=Path, default=Path("runs/bench-mixers"), help="output folder (default runs/bench-mixers)"
    )


def run(args: argparse.Namespace) -> int:
    resolve(args)
    budget = memory_budget(args.mem_budget, args.device)
    plan = plan_cases(args, budget)
    args.out.mkdir(parents=True, exist_ok=True)
    info = {**machine_info(args.threads), "isolation": args.isolation}
    print(
        f"vitlab bench-mixers: {len(plan.cases)} cases, each in a fresh process ({args.isolation}); "
        f"torch {info['torch']}, {args.threads} threads, {info['cpu']}, on {args.device}; "
        f"memory budget {budget / GB:.1f} GB"
    )
    results, elapsed = timed_sweep(lambda: run_plan(plan, args, budget), info)
    targets = mixer_targets(results) if args.targets else []
    text = report_text(results, targets, args.batch)
    print("\n" + text)
    config = options(args, CONFIG)
    config.update(mem_budget_bytes=budget, sweeps=args.sweeps, targets=args.targets, quick=args.quick)
    doc = report_doc("vitlab.bench-mixers/1", elapsed, info, config, cases=results, targets=targets)
    write_report(args, results, doc, text)
    return 0
