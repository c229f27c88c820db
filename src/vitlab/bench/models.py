"""The model benchmark (``vitlab bench``): throughput, latency, peak memory, MACs/FLOPs and utilisation of named models.

A case is ``(model, batch, image size, dtype, mode, compiled, gradient checkpointing)``, run on the
``--device`` (the CPU, or a GPU):

* ``mode="infer"``: eval mode, ``torch.inference_mode()``, one forward pass per call;
  bf16 (fp16: GPU only) converts the model and the input;
* ``mode="train"``: train mode, forward + cross-entropy + backward + AdamW step
  per call; bf16 / fp16 are mixed precision (autocast, fp32 master weights; fp16 with a gradient
  scaler; fused AdamW on a GPU); ``--grad-checkpointing`` recomputes every block's activations in the
  backward pass.

On a GPU every call is timed with CUDA events and a synchronisation, the GEMM yardstick runs on that GPU,
and the memory pass reports the GPU allocator's peak (``max_memory_allocated`` after a reset) beside the
host's peak RSS.

Each case runs in fresh processes (:mod:`vitlab.measure.process`): one measures the
peak resident memory of one call (peak - baseline after setup, allocator made
tight), another times the calls. Utilisation is measured the way the project's side-by-side comparisons with
other implementations measure it, so the two give one answer for the same code:

    utilisation = model FLOPs / median call time / GEMM rate,  model FLOPs = 2 x MACs
    (x 3 for a training step: the backward pass costs twice the forward)

* the GEMM rate (:mod:`vitlab.measure.gemm`): a square 2048 x 2048 x 2048 ``torch.mm`` in the case's dtype
  with the case's threads, three untimed calls, then the MEDIAN rate of single calls over at least 2 s;
  measured in every timing process before the model is built, and the run divides by the best of these
  medians (``util``; ``util_case`` uses the case's own measurement);
* the model: the setup's warm call and ``--warmup`` more (default 1: two untimed calls, as the heap and the
  BLAS reach their steady state), then the median of the timed calls, with nothing run between them;
* the FLOPs: matrix products, convolutions and attention products only (torch's own flop counter counts the
  same for inference; for a training step it counts the backward actually run, which skips the input
  gradient of the first layer: a fraction of a percent for these models).

Throughput and latency come from the same median call. On a machine shared with
other jobs the figures move with the load: it is reported with every case; compare
figures taken at the same load.

MACs are counted on the meta device (:mod:`vitlab.measure.flops`: matmuls and
convolutions, the papers' convention); FLOPs = 2 x MACs + the mixers' elementwise
work, reported apart.

OpenMP threads that wait at the end of a parallel region spin by default
(libgomp's ACTIVE policy). On a machine shared with other jobs a spinning
thread burns the time slice its partner needs, so every one of the hundreds of
parallel operators of a forward pass can cost a scheduler quantum: a model
with many small operators looks several times slower than its GEMMs while a
single long GEMM does not. ``--omp-wait-policy`` (default ``inherit``: the
environment's, as the comparisons run) fixes the policy for the case processes,
the GEMM yardstick included, and is recorded with the results.

The timed calls run under the allocator policy of every ``vitlab`` command
(:func:`vitlab.common.runtime.keep_freed_memory`: freed activations are reused, not
returned to the OS and page-faulted back); ``--allocator default`` times glibc's
own policy for comparison. The memory pass always uses a tight allocator.

vitlab's performance goals are ratios to other implementations measured side by side (docs/performance.md),
not utilisation thresholds: utilisation says how much of the machine a model uses, not whether another
implementation does better.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..common.device import resolve_device, time_call
from ..common.io import write_csv_atomic
from ..common.report import aligned, figure_grid, log_axes, print_written, save_figure
from ..measure.process import MB, PRELOAD, CaseRunner, CaseSpec, Prepared, Timing, device_figures, warm_process
from ..measure.sweep import (
    Plan,
    fmt_mem,
    fmt_time,
    require_at_least,
    require_positive_items,
    run_sweep,
    with_wall_time,
    write_json,
    write_text,
)

DTYPES = ("fp32", "bf16", "fp16")
# the low-precision dtypes: inference converts the model to them, training autocasts to them
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("infer", "train")
# what a case is (with the options of the passes: prepare_case's arguments)
CASE_KEYS = ("model", "batch", "img_size", "dtype", "mode", "compile", "grad_checkpointing")
# the options a report records
CONFIG = ("models", "batch", "img_size", "dtypes", "modes", "compile", "grad_checkpointing", "device", "threads")
CONFIG += ("repeats", "warmup")
CONFIG += ("omp_wait_policy", "allocator", "max_time", "gemm_rounds")
DEFINITIONS = {
    "macs": "multiply-accumulates of matmuls and convolutions, one forward pass of the batch (meta device)",
    "model_flops": "2 x macs",
    "flops": "2 x macs + extra_flops (the mixers' elementwise work, analytic; see vitlab.measure.flops)",
    "util": "model_flops (x3 for a training step) / median call time / the best GEMM rate measured in the run",
    "util_case": "model_flops (x3 for a training step) / median call time / this case's GEMM rate",
    "gemm_flops_per_s": "this case's GEMM rate: median rate of single torch.mm calls over >= 2 s, 2048^3 on the "
    "CPU, 8192^3 on a GPU",
    "mem": "memory pass: peak RSS of one call and peak - baseline (RSS after setup), bytes; on a GPU the GPU "
    "allocator's peak over the call and peak - allocated after setup (the host's RSS figures under mem.host); on "
    "the CPU mem.tensors: the call's peak of tensor memory over what tensors held before it (profiler record)",
}


# --------------------------------------------------------------------------- one case (runs in the child process)


def build(name: str, img_size: int | None) -> Any:
    """The named model at ``img_size`` (its own default when None); position tables are built for that size."""
    from ..models import build_model, get_config

    overrides: dict[str, Any] = {}
    if img_size is not None and img_size != get_config(name).input_size[-1]:
        overrides["img_size"] = img_size
    return build_model(name, **overrides)


def prepare_case(
    model: str,
    batch: int,
    img_size: int | None,
    dtype: str,
    mode: str,
    compile: bool = False,
    gemm: bool = True,
    gemm_rounds: int = 5,
    profile: bool = False,
    seed: int = 0,
    device: str = "cpu",
    grad_checkpointing: bool = False,
) -> Prepared:
    """Build the model and its input on ``device``, run one warm call; return the call to measure.

    With ``gemm`` the device's GEMM rate (same dtype and threads) is measured first (``info["gemm"]``);
    ``info["calls"]`` lists the seconds of every call (the first is the setup's warm call; on a GPU timed with
    CUDA events). ``info["compile_s"]`` is the first call's time when ``compile``. ``profile``: one more call
    under the profiler after the warm call, grouped into ``info["profile"]``
    (:func:`vitlab.measure.profile.profile_call`). ``grad_checkpointing``: training recomputes each block's
    activations in the backward pass (``model.set_grad_checkpointing``).
    """
    from ..measure.gemm import measure_gemm

    dev = torch.device(device)
    torch.manual_seed(seed)
    warm_process()
    info: dict[str, Any] = {"threads": torch.get_num_threads(), "device": str(dev)}
    if gemm:
        info["gemm"] = measure_gemm(dtype, min_calls=gemm_rounds, device=dev).as_dict()
    net = build(model, img_size).to(dev)
    if grad_checkpointing:
        if not hasattr(net, "set_grad_checkpointing"):
            raise NotImplementedError(f"{model} has no set_grad_checkpointing()")
        net.set_grad_checkpointing(True)
    x = torch.randn(batch, *tuple(net.meta["input_size"]), device=dev)
    step, reset = (inference_step if mode == "infer" else training_step)(net, x, dtype, compile)
    calls: list[float] = []

    def timed_step() -> None:
        calls.append(time_call(step, dev))

    timed_step()  # warm call: lazy initialisation, optimizer state, compilation
    info["first_call_s"] = calls[0]
    if profile:
        from ..measure.profile import profile_call

        for _ in range(2):  # the allocator's heap reaches its steady state (no first-touch page faults)
            step()
        info["profile"] = profile_call(step, dev)
    if compile:
        info["compile_s"] = calls[0]
    info["loadavg"] = os.getloadavg()
    info["calls"] = calls  # filled in as the calls run (info is written out after the timed calls)
    return Prepared(timed_step, info, reset, device=str(dev))


def inference_step(net: Any, x: Any, dtype: str, compile: bool) -> tuple[Callable[[], None], None]:
    """One forward pass in eval mode under ``torch.inference_mode()``; bf16/fp16 convert the model and the
    input."""
    net.eval()
    if dtype != "fp32":
        low = LOW_PRECISION[dtype]
        net, x = net.to(low), x.to(low)
    fwd = torch.compile(net) if compile else net

    def step() -> None:
        with torch.inference_mode():
            fwd(x)

    return step, None


def training_step(net: Any, x: Any, dtype: str, compile: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """Forward, cross-entropy, backward and an AdamW step in train mode (bf16/fp16: autocast, fp32 weights;
    fp16 with a gradient scaler; fused AdamW on a GPU), and the reset that frees the gradients a step leaves."""
    import torch.nn.functional as F

    from ..common.device import autocast, grad_scaler
    from ..engine.optim import fused_available

    net.train()
    fwd = torch.compile(net) if compile else net
    labels = torch.randint(0, getattr(net, "num_classes", 1000) or 1, (x.shape[0],), device=x.device)
    fused = fused_available(x.device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=None if fused else True, fused=fused or None)
    low = LOW_PRECISION.get(dtype)
    scaler = grad_scaler(x.device, low)

    def step() -> None:
        opt.zero_grad(set_to_none=True)  # every step allocates its gradients, as training does
        with autocast(x.device, low):
            out = fwd(x)
            loss = F.cross_entropy(out if isinstance(out, torch.Tensor) else out[0], labels)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def reset() -> None:
        opt.zero_grad(set_to_none=True)

    return step, reset


# --------------------------------------------------------------------------- static facts (parent process)


def model_facts(name: str, img_size: int | None, batch: int) -> dict[str, Any]:
    """Parameters, token count and the MAC/FLOP counts of one forward pass at ``batch`` (meta device)."""
    import torch

    from ..measure.flops import count_flops

    with torch.device("meta"):
        net = build(name, img_size)
    size = tuple(net.meta["input_size"])
    grid = getattr(net, "grid", None)
    tokens = getattr(net, "num_prefix", 0) + grid[0] * grid[1] if grid is not None else None
    counts = count_flops(net.eval(), size, batch)
    return {
        "img_size": size[-1],
        "input_size": list(size),
        "tokens": tokens,
        "params": sum(p.numel() for p in net.parameters()),
        "count": counts.as_dict(),
    }


# --------------------------------------------------------------------------- the plan


def plan_cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every model over every chosen setting."""
    plan = Plan(CASE_KEYS)
    compiles, ckpts = SWITCH[args.compile], SWITCH[args.grad_checkpointing]
    for name in args.models:
        for mode in args.modes:
            for dtype in args.dtypes:
                for comp, ckpt in ((c, g) for c in compiles for g in (ckpts if mode == "train" else [False])):
                    for size in args.img_size or [None]:
                        for b in args.batch:
                            case = dict(dtype=dtype, mode=mode, compile=comp, grad_checkpointing=ckpt)
                            plan.add("sweep", model=name, batch=b, img_size=size, **case)
    return plan.cases


SWITCH = {"off": [False], "on": [True], "both": [False, True]}


# --------------------------------------------------------------------------- running


def run_plan(cases: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case in fresh processes, one progress line each; then the utilisation against the run's best GEMM."""
    facts = {key: model_facts(*key) for key in dict.fromkeys(map(facts_key, cases))}
    width = max(len(c["model"]) for c in cases)

    def label(c: dict[str, Any]) -> str:
        options = " compiled" * c["compile"] + " grad-ckpt" * c["grad_checkpointing"]
        return (
            f"{c['model']:<{width}} {c['mode']:<5} {c['dtype']} B={c['batch']:<3} "
            f"{facts[facts_key(c)]['img_size']}px{options}"
        )

    def measure(c: dict[str, Any]) -> dict[str, Any]:
        r: dict[str, Any] = {**c, **facts[facts_key(c)]}
        params = {**{k: c[k] for k in CASE_KEYS}, "img_size": r["img_size"], "device": args.device}
        r.update(with_wall_time(lambda: run_case(runner, params, args)))
        derive(r)
        return r

    with CaseRunner(args.isolation, args.timeout, (*PRELOAD, "vitlab.models", __name__)) as runner:
        results = run_sweep(cases, measure, label, describe)
    add_run_utilisation(results)
    return results


def facts_key(c: dict[str, Any]) -> tuple[str, int | None, int]:
    """What a case's static facts (:func:`model_facts`) depend on: the model, the input size, the batch."""
    return c["model"], c["img_size"], c["batch"]


def run_case(runner: CaseRunner, params: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The memory pass (no GEMM measurement) and the time pass (GEMM rate first), each in a fresh process."""
    common = dict(
        warmup=args.warmup, repeats=args.repeats, max_time=args.max_time, threads=args.threads, allocator=args.allocator
    )
    out: dict[str, Any] = {"status": "ok"}
    passes = [("memory", {**params, "gemm": False})] if not args.no_memory else []
    passes.append(("time", {**params, "gemm": True, "gemm_rounds": args.gemm_rounds, "profile": args.profile}))
    for name, p in passes:
        res = runner.run(CaseSpec(prepare_case, p, passes=(name,), **common))
        if res["status"] != "ok":
            return {**res, "pass": name}
        if name == "memory":
            out["mem"] = device_figures(res["mem"])
        else:
            out["mem_timed"] = res["mem"].get("timed")
            out["time_s"], out["info"] = res["time_s"], res["info"]
    return out


def derive(r: dict[str, Any]) -> None:
    """Throughput, latency, achieved FLOP/s and the case's own utilisation of an ok result (in place)."""
    if r["status"] != "ok":
        return
    calls = r["info"].get("calls") or []
    timed = calls[1:] if len(calls) > 1 else calls  # the first is the setup's warm call
    if timed:
        r["time_s"] = Timing(timed, len(calls) - len(timed)).summary()
    t = r["time_s"]["median"]
    passes = 3 if r["mode"] == "train" else 1  # backward = 2 x forward
    model_flops = passes * r["count"]["model_flops"]
    r["throughput"] = r["batch"] / t
    r["throughput_best"] = r["batch"] / r["time_s"]["min"]
    r["latency_ms"] = t * 1e3
    r["achieved_flops_per_s"] = model_flops / t
    gemm = r["info"].get("gemm")
    r["gemm_flops_per_s"] = gemm["flops_per_s"] if gemm else None
    r["util_case"] = r["util"] = model_flops / t / gemm["flops_per_s"] if gemm else None
    r["loadavg"] = r["info"].get("loadavg")


def add_run_utilisation(results: list[dict[str, Any]]) -> None:
    """``util``: achieved FLOP/s over the best GEMM rate the whole run measured (per dtype)."""
    best: dict[str, float] = {}
    for r in results:
        rate = ((r.get("info") or {}).get("gemm") or {}).get("flops_per_s")
        if r["status"] == "ok" and rate:
            best[r["dtype"]] = max(best.get(r["dtype"], 0.0), rate)
    for r in results:
        if r["status"] == "ok" and r["dtype"] in best:
            r["gemm_run_flops_per_s"] = best[r["dtype"]]
            r["util"] = r["achieved_flops_per_s"] / best[r["dtype"]]


def describe(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['status']} ({r.get('reason', '')})"
    util = f"{100 * r['util']:.0f} %" if r.get("util") is not None else "-"
    mem = f", +{fmt_mem(r['mem']['delta'])} peak{' (GPU)' * ('host' in r['mem'])}" if r.get("mem") else ""
    if r.get("mem", {}).get("tensors") is not None:
        mem += f" ({fmt_mem(r['mem']['tensors'])} of tensors)"
    return (
        f"{r['throughput']:.3g} img/s, {fmt_time(r['time_s']['median'])}/batch (IQR "
        f"{fmt_time(r['time_s']['iqr'])}, n={r['time_s']['n']}){mem}, util {util} of "
        f"{r['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s GEMM, load {r['loadavg'][0]:.1f}"
    )


# --------------------------------------------------------------------------- reporting

COLUMNS = (
    ("model", "model", "{}"),
    ("mode", "mode", "{}"),
    ("dtype", "dtype", "{}"),
    ("compile", "comp", "{}"),
    ("grad_checkpointing", "ckpt", "{}"),
    ("batch", "B", "{}"),
    ("img_size", "img", "{}"),
    ("tokens", "tokens", "{}"),
    ("params_m", "params M", "{:.2f}"),
    ("gmacs_per_img", "GMACs/img", "{:.3f}"),
    ("gflops_per_img", "GFLOPs/img", "{:.3f}"),
    ("throughput", "img/s", "{:.3g}"),
    ("latency_ms", "ms/batch", "{:.4g}"),
    ("iqr_ms", "IQR ms", "{:.3g}"),
    ("peak_mb", "peak MiB", "{:.0f}"),
    ("delta_mb", "+MiB", "{:.0f}"),
    ("tensors_mb", "tensors MiB", "{:.0f}"),
    ("achieved_gflops", "GFLOP/s", "{:.1f}"),
    ("gemm_gflops", "GEMM GF/s", "{:.1f}"),
    ("util_pct", "util %", "{:.1f}"),
    ("util_case_pct", "case util %", "{:.1f}"),
    ("load", "load", "{:.1f}"),
)


def flat_row(r: dict[str, Any]) -> dict[str, Any]:
    """One flat row per case (the CSV and the table)."""
    count = r.get("count", {})
    b = r["batch"]
    row: dict[str, Any] = {
        "model": r["model"],
        "mode": r["mode"],
        "dtype": r["dtype"],
        "compile": r["compile"],
        "grad_checkpointing": r.get("grad_checkpointing", False),
        "batch": b,
        "img_size": r.get("img_size"),
        "tokens": r.get("tokens"),
        "params_m": r["params"] / 1e6 if "params" in r else None,
        "gmacs_per_img": count["macs"] / b / 1e9 if count else None,
        "gflops_per_img": count["flops"] / b / 1e9 if count else None,
        "status": r["status"],
    }
    if r["status"] == "ok":
        mem = r.get("mem") or {}
        row.update(
            throughput=r["throughput"],
            latency_ms=r["latency_ms"],
            iqr_ms=r["time_s"]["iqr"] * 1e3,
            peak_mb=mem["peak"] / MB if mem else None,
            delta_mb=mem["delta"] / MB if mem else None,
            tensors_mb=mem["tensors"] / MB if mem.get("tensors") is not None else None,
            achieved_gflops=r["achieved_flops_per_s"] / 1e9,
            gemm_gflops=r["gemm_flops_per_s"] / 1e9 if r.get("gemm_flops_per_s") else None,
            util_pct=100 * r["util"] if r.get("util") is not None else None,
            util_case_pct=100 * r["util_case"] if r.get("util_case") is not None else None,
            load=r["loadavg"][0] if r.get("loadavg") else None,
        )
    else:
        row["reason"] = r.get("reason")
    return row


def table(results: list[dict[str, Any]]) -> str:
    rows = [flat_row(r) for r in results]
    cells = [[h for _, h, _ in COLUMNS]]
    for row in rows:
        line = []
        for key, _, fmt in COLUMNS:
            v = row.get(key)
            line.append("-" if v is None else fmt.format("y" if v is True else "n" if v is False else v))
        if row["status"] != "ok":
            line[[key for key, _, _ in COLUMNS].index("throughput")] = row["status"]
        cells.append(line)
    text = aligned(cells)
    notes = [
        f"  {r['model']} {r['mode']} {r['dtype']} B={r['batch']}: {r['status']} ({r.get('reason')})"
        for r in results
        if r["status"] != "ok"
    ]
    legend = (
        "MACs: matmul/conv multiply-accumulates (papers' convention); FLOPs: 2 x MACs + the mixers' elementwise work; "
        "util: 2 x MACs (x3 when training) / median call time / the best GEMM rate (median of 2048^3 calls on the "
        "CPU, 8192^3 on a GPU) of the run; case util: / the case's own GEMM rate; peak: peak RSS of one call (on a "
        "GPU the allocator's peak), +MiB: peak - baseline after setup; tensors MiB (CPU): the call's peak of tensor "
        "memory alone, from the profiler's allocation record (the RSS adds the allocator's heap and code paged in on "
        "first use)"
    )
    if any((row.get("util_pct") or 0) > 100 for row in rows):
        legend += (
            "\nutil above 100 %: the model's products run faster than the yardstick's torch.mm (fp32 on the CPU: "
            "vitlab's linear layers run in oneDNN, torch.mm in the BLAS, which lacks its fastest kernels on some "
            "CPUs; docs/performance.md)"
        )
    return "\n".join([*text, "", legend, *(["not measured:", *notes] if notes else [])])


def plot(results: list[dict[str, Any]], out: Path, title: str) -> list[Path]:
    """``throughput.png`` (img/s against input resolution) and ``memory.png`` (peak - baseline against tokens),
    a panel per (mode, dtype), a line per model and batch."""
    ok = [r for r in results if r["status"] == "ok"]
    groups = sorted({(r["mode"], r["dtype"]) for r in ok}, key=lambda g: (MODES.index(g[0]), DTYPES.index(g[1])))
    groups = groups or [("infer", "fp32")]
    return [
        plot_panels(ok, groups, out / "throughput.png", ("img_size", "input resolution (px)"), THROUGHPUT, title),
        plot_panels(ok, groups, out / "memory.png", ("tokens", "tokens per image"), MEMORY, title),
    ]


# what a figure plots of a result (None: not measured), and its axis label
THROUGHPUT = (lambda r: r["throughput"], "images / s")
MEMORY = (lambda r: max(r["mem"]["delta"], 1) / MB if r.get("mem") else None, "peak - baseline (MiB)")


def plot_panels(
    ok: list[dict[str, Any]],
    groups: list[tuple[str, str]],
    path: Path,
    x: tuple[str, str],
    y: tuple[Callable[[dict[str, Any]], float | None], str],
    title: str,
) -> Path:
    """One figure at ``path``: a panel per (mode, dtype) of ``groups``, ``y`` against the result field ``x``."""
    (xkey, xlabel), (value, ylabel) = x, y
    cols = min(2, len(groups))
    fig, axes = figure_grid(-(-len(groups) // cols), cols, 4.6)
    for ax in axes.flat[len(groups) :]:
        ax.set_visible(False)
    for ax, (mode, dtype) in zip(axes.flat, groups):
        lines: dict[str, list[tuple[float, float]]] = {}
        for r in ok:
            if (r["mode"], r["dtype"]) != (mode, dtype) or r.get(xkey) is None or value(r) is None:
                continue
            label = f"{r['model']} B={r['batch']}" + " compiled" * r["compile"] + " grad-ckpt" * r["grad_checkpointing"]
            lines.setdefault(label, []).append((r[xkey], value(r)))
        for label, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=4, label=label)
        ax.set_title(f"{mode}, {dtype}")
        log_axes(ax, xlabel, ylabel)
        if lines:
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)


def write_profiles(results: list[dict[str, Any]], out: Path) -> dict[str, Path]:
    """``profile_<case>.txt`` for every profiled case; prints each one's summary by kind of work."""
    from ..measure.profile import profile_text, with_yardstick

    paths = {}
    for r in results:
        prof = (r.get("info") or {}).get("profile") if r["status"] == "ok" else None
        if not prof:
            continue
        passes = 3 if r["mode"] == "train" else 1
        prof = r["info"]["profile"] = with_yardstick(
            prof, r.get("gemm_flops_per_s"), passes * r["count"]["model_flops"]
        )
        name = f"{r['model']}_{r['mode']}_{r['dtype']}_b{r['batch']}_{r['img_size']}px"
        name += "_compiled" * r["compile"] + "_gradckpt" * r["grad_checkpointing"]
        text = profile_text(name, prof)
        paths[f"profile {name}"] = write_text(out / f"profile_{name}.txt", text)
        print("\n" + "\n".join(text.splitlines()[:10]))
    return paths


def report_text(results: list[dict[str, Any]], info: dict[str, Any]) -> str:
    """The table and the load the figures were taken under."""
    text = table(results)
    policy, allocator = info["omp_wait_policy"], info["allocator"]
    return text + (
        f"\n\nload average {info['loadavg_start'][0]:.1f} at the start, {info['loadavg_end'][0]:.1f} at the end "
        f"({info['cpu_count']} CPUs), OMP_WAIT_POLICY={policy or 'unset'}, allocator {allocator}: on a shared "
        "machine, timings and utilisation move with the load"
    )


def write_report(args: argparse.Namespace, results: list[dict[str, Any]], doc: dict[str, Any], text: str) -> None:
    """bench.json, bench.csv, bench.txt, a profile_*.txt per profiled case, throughput.png and memory.png."""
    profiles = write_profiles(results, args.out)  # adds each profile's yardstick figures to the results
    paths = {"json": args.out / "bench.json", "csv": args.out / "bench.csv", "txt": args.out / "bench.txt", **profiles}
    write_json(paths["json"], doc)
    write_csv_atomic(paths["csv"], [flat_row(r) for r in results])
    write_text(paths["txt"], text)
    info = doc["machine"]
    pngs = plot(results, args.out, f"vitlab bench, torch {info['torch']}, {args.threads} threads, {info['cpu']}")
    print_written([*paths.values(), *pngs], doc["elapsed_s"])


# --------------------------------------------------------------------------- command line


def resolve(args: argparse.Namespace) -> None:
    from ..models import get_config

    if not args.models:
        raise ValueError("name at least one model (vitlab models lists them)")
    for name in args.models:
        get_config(name)  # ValueError naming the closest known names
    require_at_least(args, ("threads", "repeats", "gemm_rounds"))
    require_at_least(args, ("warmup",), 0)
    if any(b < 1 for b in args.batch):
        raise ValueError(f"--batch sizes must be >= 1, got {args.batch}")
    require_positive_items(args, ("img_size",))
    args.device = str(resolve_device(args.device))
    if "fp16" in args.dtypes and args.device == "cpu":
        raise ValueError("--dtypes fp16 needs a GPU (--device cuda); use bf16 on the CPU")


def apply_wait_policy(choice: str | None) -> str | None:
    """Set ``OMP_WAIT_POLICY`` for the case processes (started after this); returns the policy they run with."""
    if choice not in (None, "inherit"):
        os.environ["OMP_WAIT_POLICY"] = choice.upper()
    return os.environ.get("OMP_WAIT_POLICY")
