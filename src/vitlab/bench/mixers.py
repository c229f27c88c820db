"""The token-mixer benchmark (``vitlab bench-mixers``): time and peak memory of every mixer as the token count T grows.

A case is ``(mixer, T, dtype, mode)`` with ``mode`` = ``forward`` (no grad, eval)
or ``train`` (forward + backward, train mode, grads of input and parameters).
Each case is measured in fresh processes (:mod:`vitlab.measure.process`) that
build the mixer and its input: a memory pass records the resident memory after
setup (the baseline) and the peak resident memory of one call under a tight
allocator -- the memory a case needs is ``peak - baseline`` -- and a time pass
reports the median and IQR of repeated calls after a warmup.

Besides every registered mixer (``vitlab.mixers.MIXERS``) two reference forms
are measured:

* ``aft_full_naive``: AFT-full computed directly from the paper's Eq. 2,
  materialising ``exp(K_t' + w[t, t'])`` as a (B, T, T, d) tensor, with the
  parameters of an :class:`~vitlab.mixers.AFTFull` (same output);
* ``attention_explicit``: ``softmax(Q Kᵀ / sqrt(d_h)) V`` with the map
  materialised (the ``attention`` mixer with ``fused=False``).

Cases whose memory, estimated from their shapes, exceeds the budget are
skipped and say how much they would need. The "targets" section checks the
project's performance claims on the measured figures (:mod:`vitlab.bench.targets`).
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..common.device import resolve_device
from ..common.report import (
    figure_grid,
    legend_entries,
    log_axes,
    print_written,
    pyplot,
    save_figure,
)
from ..measure.machine import mem_available, usable_cores
from ..measure.process import GB, MB, PRELOAD, CaseRunner, CaseSkipped, CaseSpec, Prepared, device_figures, warm_process
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
from ..mixers import MIXERS, AFTFull, Attention, TokenLayout, TokenMixer
from .targets import (
    AFT_TARGET_T,
    ATTN_TOKENS,
    LINEAR_MODES,
    LINEAR_TOKENS,
    TARGET_BATCH,
    TARGET_DIM,
    mixer_targets_text,
)

REFERENCES = ("aft_full_naive", "attention_explicit")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("forward", "train")
# what tells cases apart, and the options of prepare_case
CASE_KEY = ("mixer", "T", "dtype", "mode", "batch", "dim")
CASE_PARAMS = ("mixer", "T", "dtype", "mode", "batch", "dim", "heads", "window", "kernel")
# the options a report records
CONFIG = ("mixers", "tokens", "dim", "batch", "dtypes", "modes", "heads", "window", "kernel")
CONFIG += ("repeats", "warmup", "max_time", "threads", "timeout", "device")

DEFAULT_TOKENS = (64, 256, 1024)
# the default run's sweep, on top of the targets' cases: (dtypes, modes, tokens); a few minutes here
DEFAULT_SWEEPS = ((("fp32",), MODES, DEFAULT_TOKENS), (("bf16",), ("forward",), (256, 1024)))
QUICK = {"mixers": ["attention", "attention_explicit", "aft_simple"], "tokens": [16, 64], "dim": 32, "batch": 2}


# --------------------------------------------------------------------------- reference forms


def aft_full_direct(q: Tensor, k: Tensor, v: Tensor, w: Tensor) -> Tensor:
    """Paper Eq. 2 as written: ``sigmoid(Q_t) ⊙ Σ_t' e^{K_t'+w_tt'} ⊙ V_t' / Σ_t' e^{K_t'+w_tt'}``.

    ``q, k, v`` (B, T, d), ``w`` (T, T). Materialises ``exp(K[None] + w[:, :, None])`` as (B, T, T, d):
    O(T² d) memory, the cost the factorised form avoids. No max-subtraction (the direct form).
    """
    e = torch.exp(k[:, None] + w[None, :, :, None])  # (B, T, T', d)
    return torch.sigmoid(q) * (e * v[:, None]).sum(2) / e.sum(2)


class AFTFullNaive(TokenMixer):
    """AFT-full with the parameters of ``aft`` but the direct (B, T, T, d) computation (benchmark reference)."""

    def __init__(self, aft: AFTFull) -> None:
        super().__init__(aft.dim)
        self.aft = aft

    def mix(self, x: Tensor, layout: TokenLayout, attn_prev: Tensor | None, return_aux: bool):
        q, k, v = self.aft.qkv(x).chunk(3, -1)
        w = self.aft.position_bias(x.shape[1], layout)
        if w is None:
            raise ValueError("AFTFullNaive needs an AFTFull with a position bias")
        return self.aft.proj(aft_full_direct(q, k, v, w.to(q.dtype))), {}


def mixer_kwargs(kind: str, dim: int, tokens: int, heads: int, window: int, kernel: int) -> dict[str, Any]:
    """Constructor options of ``kind`` for the benchmark: heads of width dim/heads, AFT tables for T tokens."""
    base = {"aft_full_naive": "aft_full", "attention_explicit": "attention"}.get(kind, kind)
    wanted: dict[str, Any] = {
        "attention": {"num_heads": heads},
        "refiner": {"num_heads": heads},
        "reattention": {"num_heads": heads},
        "external": {},  # single head: paper Algorithm 1
        "external_mh": {"num_heads": heads},
        "aft_full": {"max_len": tokens},
        "aft_local": {"max_len": tokens, "window": window},
        "aft_simple": {},
        "aft_conv": {"num_heads": heads, "kernel_size": kernel},
    }.get(base, {"num_heads": heads, "max_len": tokens})  # a kind added later: the usual options
    accepted = inspect.signature(MIXERS[base].__init__).parameters
    kw = {k: v for k, v in wanted.items() if k in accepted}
    if kind == "attention_explicit":
        kw["fused"] = False
    return kw


def layout_for(tokens: int) -> TokenLayout:
    """A square patch grid when T = g² (or 1 + g²: a class token then g×g patches), else a plain sequence."""
    for prefix in (0, 1):
        g = math.isqrt(tokens - prefix)
        if g * g == tokens - prefix and g > 0:
            return TokenLayout(grid=(g, g), num_prefix=prefix)
    return TokenLayout.sequence()


def build_mixer(kind: str, dim: int, tokens: int, heads: int, window: int, kernel: int) -> TokenMixer:
    kw = mixer_kwargs(kind, dim, tokens, heads, window, kernel)
    if kind == "aft_full_naive":
        return AFTFullNaive(AFTFull(dim, **kw))
    if kind == "attention_explicit":
        return Attention(dim, **kw)
    return MIXERS[kind](dim, **kw)


# --------------------------------------------------------------------------- one case (runs in the child process)


def prepare_case(
    mixer: str,
    T: int,
    dtype: str,
    mode: str,
    batch: int,
    dim: int,
    heads: int,
    window: int,
    kernel: int,
    seed: int = 0,
    device: str = "cpu",
) -> Prepared:
    """Build the mixer and its input on ``device``; return the call to measure (forward, or forward + backward)."""
    torch.manual_seed(seed)
    warm_process()
    layout = layout_for(T)
    module = build_mixer(mixer, dim, T, heads, window, kernel)
    if module.needs_grid and layout.grid is None:
        raise CaseSkipped(f"needs a grid: T = {T} is neither g² nor 1 + g²")
    dt = DTYPES[dtype]
    module.to(device, dt).train(mode == "train")
    x = torch.randn(batch, T, dim, dtype=dt, device=device)
    info = {
        "params": sum(p.numel() for p in module.parameters()),
        "kwargs": mixer_kwargs(mixer, dim, T, heads, window, kernel),
        "layout": {"grid": layout.grid, "num_prefix": layout.num_prefix},
    }
    if mode == "forward":

        def fn() -> None:
            with torch.no_grad():
                module(x, layout)

        return Prepared(fn, info, device=device)
    x.requires_grad_(True)
    grad = torch.randn_like(x)
    params = [p for p in module.parameters() if p.requires_grad]

    def reset() -> None:
        for t in (x, *params):
            t.grad = None

    def fn() -> None:
        reset()  # every step allocates its gradients, as a training step does
        module(x, layout).backward(grad)

    return Prepared(fn, info, reset, device=device)


# --------------------------------------------------------------------------- memory estimate (before running)


def estimate_bytes(c: dict[str, Any]) -> int:
    """A generous estimate of a case's working memory from its shapes (to skip what cannot fit).

    Counts activations of width d (``act``), attention maps (B, H, T, T) in fp32 (``maps``: the softmax of
    half-precision logits is fp32) and, for the direct AFT form, the (B, T, T, d) tensors.
    """
    b, t, d, h = c["batch"], c["T"], c["dim"], c["heads"]
    s = DTYPES[c["dtype"]].itemsize
    train = c["mode"] == "train"
    act = b * t * d * max(s, 4)  # AFT cores compute in fp32 whatever the input dtype
    maps = b * h * t * t * 4
    n_maps = {
        "attention": 0,
        "external": 0,
        "external_mh": 0,
        "aft_simple": 0,
        "aft_conv": 0,
        "aft_full": 0,
        "aft_local": 0,
        "attention_explicit": 3,
        "reattention": 5,
        "refiner": 15,  # expansion 3: several (B, 3H, T, T) maps
        "aft_full_naive": 0,
    }.get(c["mixer"], 3)
    total = (40 if train else 16) * act + n_maps * maps * (2 if train else 1)
    if c["mixer"] in ("aft_full", "aft_local", "aft_full_naive"):
        total += 8 * t * t * 4  # w = u vᵀ, exp(w), masks
    if c["mixer"] == "aft_full_naive":
        total += (5 if train else 2) * b * t * t * d * s
    return int(total)


# --------------------------------------------------------------------------- the plan


def default_heads(dim: int) -> int:
    """Heads of width 64 where the width allows, else one head."""
    return max(1, dim // 64) if dim % 64 == 0 else 1


def plan_cases(args: argparse.Namespace, budget: int) -> Plan:
    """The targets' cases first (pairs that are compared run back to back), then the sweep."""
    plan = Plan(CASE_KEY)
    common = {"window": args.window, "kernel": args.kernel}
    if args.targets:
        plan_targets(plan, budget, common)
    heads = args.heads or default_heads(args.dim)
    for dtypes, modes, tokens in args.sweeps:
        for mode in modes:
            for dtype in dtypes:
                for mixer in args.mixers:
                    for t in tokens:
                        plan.add(
                            "sweep",
                            mixer=mixer,
                            T=t,
                            dtype=dtype,
                            mode=mode,
                            batch=args.batch,
                            dim=args.dim,
                            heads=heads,
                            **common,
                        )
    return plan


def plan_targets(plan: Plan, budget: int, common: dict[str, Any]) -> None:
    """The cases the three targets need, at the issue's setting (d = 256, batch 8, fp32)."""
    tgt = {"dtype": "fp32", "dim": TARGET_DIM, "heads": default_heads(TARGET_DIM), **common}
    plan.add("target:aft_full", mixer="aft_full", T=AFT_TARGET_T, mode="forward", batch=TARGET_BATCH, **tgt)
    for b in naive_batches(budget, tgt):
        plan.add("target:aft_full", mixer="aft_full_naive", T=AFT_TARGET_T, mode="forward", batch=b, **tgt)
    for mixer in ("aft_simple", "aft_conv"):
        for mode in LINEAR_MODES:
            for t in LINEAR_TOKENS:
                plan.add("target:linear", mixer=mixer, T=t, mode=mode, batch=TARGET_BATCH, **tgt)
    for t in ATTN_TOKENS:  # each pair back to back: the machine's load changes over minutes
        for mixer in ("attention", "attention_explicit"):
            plan.add("target:attention", mixer=mixer, T=t, mode="forward", batch=TARGET_BATCH, **tgt)


def naive_batches(budget: int, tgt: dict[str, Any]) -> list[int]:
    """Batches at which the direct AFT form runs for the target: the target batch if it fits the budget,
    else the largest fitting power of two and its half (to extrapolate linearly in the batch)."""
    fits = [
        b
        for b in (TARGET_BATCH, 4, 2, 1)
        if b <= TARGET_BATCH
        and estimate_bytes({"mixer": "aft_full_naive", "T": AFT_TARGET_T, "mode": "forward", "batch": b, **tgt})
        <= budget
    ]
    if not fits or fits[0] == TARGET_BATCH:
        return [TARGET_BATCH]  # runs as is, or is reported as skipped with what it needs
    return fits[:2]


# --------------------------------------------------------------------------- running


def run_plan(plan: Plan, args: argparse.Namespace, budget: int) -> list[dict[str, Any]]:
    """Every case of ``plan`` in fresh processes, one progress line each; over-budget cases are skipped."""
    width = max(len(c["mixer"]) for c in plan.cases)
    with CaseRunner(args.isolation, args.timeout, (*PRELOAD, __name__)) as runner:
        return run_sweep(
            plan.cases,
            lambda c: measure_case(runner, c, args, budget),
            lambda c: f"{c['mixer']:<{width}} T={c['T']:<5} {c['dtype']} {c['mode']:<7} B={c['batch']}",
            describe,
        )


def measure_case(runner: CaseRunner, c: dict[str, Any], args: argparse.Namespace, budget: int) -> dict[str, Any]:
    """One case's result row: the case, its memory estimate, the load, and what the runner measured."""
    est = estimate_bytes(c)
    r: dict[str, Any] = {**c, "est_bytes": est, "loadavg_1m": os.getloadavg()[0]}
    if est > budget:
        r.update(status="skipped", reason=f"needs ~{est / GB:.1f} GB > budget {budget / GB:.1f} GB")
        return r
    spec = CaseSpec(
        prepare_case,
        {**{k: c[k] for k in CASE_PARAMS}, "device": args.device},
        warmup=args.warmup,
        repeats=args.repeats,
        max_time=args.max_time,
        threads=args.threads,
    )
    r.update(with_wall_time(lambda: runner.run(spec)))
    if r["status"] == "ok":
        r["mem"] = device_figures(r["mem"])
    return r


def describe(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['status'].replace('_', ' ')} ({r.get('reason', '')})"
    t, m = r["time_s"], r["mem"]
    return (
        f"{fmt_time(t['median'])} (IQR {fmt_time(t['iqr'])}, n={t['n']}) | "
        f"peak {fmt_mem(m['peak'])}, +{fmt_mem(m['delta'])} over baseline"
        + (f" ({fmt_mem(m['tensors'])} of tensors)" if m.get("tensors") is not None else "")
    )


# --------------------------------------------------------------------------- reporting


def mixer_rank(kind: str) -> float:
    """Registry order, each reference form right after the mixer it is compared with."""
    kinds = list(MIXERS)
    partner = {"aft_full_naive": "aft_full", "attention_explicit": "attention"}
    if kind in partner:
        return kinds.index(partner[kind]) + 0.5
    return kinds.index(kind) if kind in kinds else len(kinds)


def table(results: list[dict[str, Any]], main_batch: int) -> str:
    """One block per (mode, dtype, dim): a row per mixer, a column per T; cells 'time / peak - baseline'."""
    groups = sorted(
        {(r["mode"], r["dtype"], r["dim"]) for r in results},
        key=lambda g: (MODES.index(g[0]), list(DTYPES).index(g[1]), g[2]),
    )
    lines = []
    for group in groups:
        lines += table_block([r for r in results if (r["mode"], r["dtype"], r["dim"]) == group], group, main_batch)
    reasons = sorted(
        {
            f"{r['mixer']} T={r['T']} {r['dtype']} {r['mode']} B={r['batch']}: {r['status']} ({r.get('reason')})"
            for r in results
            if r["status"] in ("skipped", "error")
        }
    )
    if reasons:
        lines += ["not measured:", *(f"  {x}" for x in reasons), ""]
    return "\n".join(lines)


def table_block(rs: list[dict[str, Any]], group: tuple[str, str, int], main_batch: int) -> list[str]:
    """The lines of one (mode, dtype, dim) block of :func:`table`, a blank line last."""
    abbrev = {"skipped": "skipped", "not_implemented": "n/i", "error": "ERROR"}
    mode, dtype, dim = group
    tokens = sorted({r["T"] for r in rs})
    rows: dict[str, dict[int, str]] = {}
    for r in sorted(rs, key=lambda r: (mixer_rank(r["mixer"]), -r["batch"])):
        row = r["mixer"] + ("" if r["batch"] == main_batch else f" (B={r['batch']})")
        if r["status"] == "ok":
            cell = f"{fmt_time(r['time_s']['median'])} / {fmt_mem(r['mem']['delta'])}"
        else:
            cell = abbrev.get(r["status"], r["status"])
        rows.setdefault(row, {})[r["T"]] = cell
    w0 = max(len(k) for k in rows) + 2
    w = max(19, *(len(c) + 2 for cells in rows.values() for c in cells.values()))
    return [
        f"{mode}, {dtype}, dim {dim}, batch {main_batch} unless said: median time / peak - baseline memory",
        "mixer".ljust(w0) + "".join(f"T={t}".rjust(w) for t in tokens),
        *(row.ljust(w0) + "".join(cells.get(t, "-").rjust(w) for t in tokens) for row, cells in rows.items()),
        "",
    ]


def busy_note(results: list[dict[str, Any]]) -> str:
    """A warning when the load average exceeded the cores during the run (else empty)."""
    load = [r["loadavg_1m"] for r in results]
    cores = usable_cores()
    if max(load) <= cores:
        return ""
    return (
        f"\nnote: the machine was busy (1-min load average {min(load):.1f} to {max(load):.1f} on {cores} cores "
        f"during the run): timings are inflated and noisy; memory figures are not affected.\n"
    )


def plot(results: list[dict[str, Any]], path: Path, main_batch: int, title: str) -> None:
    """Median time (top) and peak - baseline memory (bottom) against T, a column per mode, log-log."""
    ok = [r for r in results if r["status"] == "ok" and r["batch"] == main_batch]
    modes = [m for m in MODES if any(r["mode"] == m for r in ok)] or list(MODES)
    mixers = sorted({r["mixer"] for r in ok}, key=mixer_rank)
    colors = pyplot().get_cmap("tab20" if len(mixers) > 10 else "tab10")
    fig, axes = figure_grid(2, len(modes), 4.5)
    for j, mode in enumerate(modes):
        for i, mixer in enumerate(mixers):
            for dtype, style in {"fp32": "-", "bf16": "--"}.items():
                rs = sorted(
                    (r for r in ok if (r["mixer"], r["mode"], r["dtype"]) == (mixer, mode, dtype)), key=lambda r: r["T"]
                )
                if not rs:
                    continue
                ts = [r["T"] for r in rs]
                kw = {
                    "color": colors(i),
                    "linestyle": style,
                    "marker": "o",
                    "markersize": 3,
                    "label": f"{mixer} {dtype}",
                }
                axes[0, j].plot(ts, [r["time_s"]["median"] * 1e3 for r in rs], **kw)
                axes[1, j].plot(ts, [max(r["mem"]["delta"], 1) / MB for r in rs], **kw)
        axes[0, j].set_title(f"{mode}: median time")
        axes[1, j].set_title(f"{mode}: peak - baseline memory")
        log_axes(axes[0, j], "tokens T", "ms", x_base=2)
        log_axes(axes[1, j], "tokens T", "MiB", x_base=2)
    fig.legend(*legend_entries(axes), loc="center right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.82, 0.96))
    save_figure(fig, path)


# --------------------------------------------------------------------------- command line


def resolve(args: argparse.Namespace) -> None:
    """Fill defaults: the selection options decide between the default run, a custom sweep and quick."""
    chosen = any(getattr(args, k) is not None for k in ("mixers", "tokens", "dim", "batch", "dtypes", "modes"))
    quick = QUICK if args.quick else {}
    defaults = {
        "mixers": quick.get("mixers", [*MIXERS, *REFERENCES]),
        "tokens": quick.get("tokens", list(DEFAULT_TOKENS)),
        "dim": quick.get("dim", TARGET_DIM),
        "batch": quick.get("batch", TARGET_BATCH),
        "dtypes": ["fp32"] if args.quick else list(DTYPES),
        "modes": list(MODES),
        "repeats": 1 if args.quick else 5,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.sweeps = [] if args.targets_only else [(args.dtypes, args.modes, args.tokens)]
    if not (chosen or args.quick or args.targets_only):
        args.sweeps = [tuple(map(list, sweep)) for sweep in DEFAULT_SWEEPS]
    args.targets = args.targets_only or args.with_targets or not (chosen or args.quick)
    require_at_least(args, ("dim", "batch", "repeats", "threads", "window", "kernel"))
    require_positive_items(args, ("tokens",))
    if args.heads is not None and (args.heads < 1 or args.dim % args.heads):
        raise ValueError(f"--heads must divide --dim={args.dim}, got {args.heads}")
    args.device = str(resolve_device(args.device))


def memory_budget(gb: float, device: str = "cpu") -> int:
    """``gb`` in bytes, at most 60 % of the memory available now (of the GPU's free memory on a GPU)."""
    avail = torch.cuda.mem_get_info(torch.device(device))[0] if device.startswith("cuda") else mem_available()
    budget = int(gb * GB)
    return budget if avail is None else min(budget, int(0.6 * avail))


def report_text(results: list[dict[str, Any]], targets: list[dict[str, Any]], main_batch: int) -> str:
    """The table, the targets' verdicts, and a note when the machine was busy."""
    text = table(results, main_batch)
    if targets:
        text += "\n" + mixer_targets_text(targets) + "\n"
    return text + busy_note(results)


def write_report(args: argparse.Namespace, results: list[dict[str, Any]], doc: dict[str, Any], text: str) -> None:
    """mixers.json, mixers.txt and mixers.png in ``args.out``."""
    json_path, png_path, txt_path = args.out / "mixers.json", args.out / "mixers.png", args.out / "mixers.txt"
    write_json(json_path, doc)
    write_text(txt_path, text)
    info = doc["machine"]
    title = (
        f"token mixers, dim {args.dim}, batch {args.batch}, torch {info['torch']}, {args.threads} threads, "
        f"{info['cpu']}"
    )
    plot(results, png_path, args.batch, title)
    print_written((json_path, png_path, txt_path), doc["elapsed_s"])
