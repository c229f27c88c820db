"""The project's performance targets and the functions that judge measured results against them.

Each judge takes the result rows of a benchmark run (the ``cases`` of its JSON report) and returns one
verdict per target: ``status`` PASS, FAIL or N/A (the cases it needs did not run, or failed) and a
``detail`` line with the figures. Which cases a target needs is decided by the benchmark that runs it,
from the settings here.
"""

from __future__ import annotations

import math
from typing import Any

from ..measure.sweep import fmt_mem, fmt_time

Result = dict[str, Any]

# --------------------------------------------------------------------------- token mixers (vitlab bench-mixers)

# the setting of every mixer target: width, batch, fp32
TARGET_DIM, TARGET_BATCH = 256, 8
AFT_TARGET_T = 1024
LINEAR_TOKENS = (64, 256, 1024, 4096)
LINEAR_MODES = ("forward", "train")
LINEAR_FIT_MIN_T = 256  # below this, fixed per-call buffers dominate the few MB a case needs
ATTN_TOKENS = (197, 1024)  # the target also uses any larger T the sweep ran


def find(results: list[Result], **kw: Any) -> Result | None:
    """The ok result matching ``kw`` (None if absent or not ok)."""
    for r in results:
        if r["status"] == "ok" and all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def na(name: str, why: str) -> Result:
    return {"name": name, "status": "N/A", "detail": why}


def pass_fail(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def extrapolate(points: list[tuple[int, float]], to: int) -> tuple[float, str]:
    """Value at batch ``to`` from (batch, value) points: as measured, linear through two, or proportional."""
    points = sorted(points, reverse=True)
    (b1, y1) = points[0]
    if b1 == to:
        return y1, f"measured at batch {to}"
    if len(points) > 1:
        b2, y2 = points[1]
        return y1 + (to - b1) * (y1 - y2) / (b1 - b2), f"measured at batch {b1} and {b2}, extrapolated linearly to {to}"
    return y1 * to / b1, f"measured at batch {b1}, scaled x{to / b1:g}"


def target_aft_full(results: list[Result]) -> Result:
    """AFT-full (paper Eq. 2, factorised) >= 5x faster and >= 20x less memory than the direct (B, T, T, d) form."""
    name = f"AFT-full vs the direct (B, T, T, d) form, T={AFT_TARGET_T}, d={TARGET_DIM}, batch {TARGET_BATCH}, fp32 forward"
    sel = {"T": AFT_TARGET_T, "dtype": "fp32", "mode": "forward", "dim": TARGET_DIM}
    fast = find(results, mixer="aft_full", batch=TARGET_BATCH, **sel)
    naive = [
        r
        for r in results
        if r["mixer"] == "aft_full_naive" and r["status"] == "ok" and all(r[k] == v for k, v in sel.items())
    ]
    if fast is None or not naive:
        return na(name, "aft_full or aft_full_naive did not run at this setting")
    t_naive, how = extrapolate([(r["batch"], r["time_s"]["median"]) for r in naive], TARGET_BATCH)
    m_naive, _ = extrapolate([(r["batch"], r["mem"]["delta"]) for r in naive], TARGET_BATCH)
    speed, mem = t_naive / fast["time_s"]["median"], m_naive / max(fast["mem"]["delta"], 1)
    return {
        "name": name,
        "status": pass_fail(speed >= 5 and mem >= 20),
        "measured": {
            "speedup": speed,
            "memory_ratio": mem,
            "aft_full_s": fast["time_s"]["median"],
            "naive_s": t_naive,
            "aft_full_delta_bytes": fast["mem"]["delta"],
            "naive_delta_bytes": m_naive,
            "naive_batches": sorted(r["batch"] for r in naive),
        },
        "need": "speedup >= 5, memory (peak - baseline) ratio >= 20",
        "detail": f"{speed:.1f}x faster (need >= 5), {mem:.0f}x less peak memory (need >= 20); "
        f"aft_full {fmt_time(fast['time_s']['median'])} +{fmt_mem(fast['mem']['delta'])}, "
        f"direct form {fmt_time(t_naive)} +{fmt_mem(m_naive)} ({how})",
    }


def loglog_slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of log y against log x."""
    xs, ys = [math.log(x) for x, _ in points], [math.log(max(y, 1.0)) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _memory_by_tokens(results: list[Result], mixer: str, mode: str) -> list[tuple[int, int]]:
    """(T, peak - baseline) of ``mixer`` at the target setting, T >= LINEAR_FIT_MIN_T, ascending."""
    sel = {"mixer": mixer, "mode": mode, "dtype": "fp32", "batch": TARGET_BATCH, "dim": TARGET_DIM}
    return sorted(
        (r["T"], r["mem"]["delta"])
        for r in results
        if r["status"] == "ok" and all(r[k] == v for k, v in sel.items()) and r["T"] >= LINEAR_FIT_MIN_T
    )


def target_linear(results: list[Result], mixer: str, limit: float = 1.2) -> Result:
    """The memory of ``mixer`` grows linearly in T: log-log slope of (peak - baseline) against T <= ``limit``."""
    name = f"{mixer} memory linear in T (d={TARGET_DIM}, batch {TARGET_BATCH}, fp32)"
    slopes, top, parts = {}, {}, []
    for mode in LINEAR_MODES:
        pts = _memory_by_tokens(results, mixer, mode)
        if len(pts) < 2:
            continue
        slopes[mode] = loglog_slope(pts)
        top[mode] = loglog_slope(pts[-2:])  # a T² term shows first between the largest sizes
        parts.append(
            f"{mode} slope {slopes[mode]:.2f} over T={','.join(str(t) for t, _ in pts)} "
            f"({', '.join(fmt_mem(m) for _, m in pts)}; {top[mode]:.2f} between the last two)"
        )
    if not slopes:
        return na(name, f"fewer than two {mixer} sizes with T >= {LINEAR_FIT_MIN_T} ran")
    return {
        "name": name,
        "status": pass_fail(all(s <= limit for s in slopes.values())),
        "measured": {"slopes": slopes, "slopes_last_two": top},
        "need": f"log-log slope of (peak - baseline) vs T <= {limit} (1 = linear, 2 = quadratic)",
        "detail": "; ".join(parts) + f" (need <= {limit})",
    }


def target_attention(results: list[Result]) -> Result:
    """SDPA attention no slower than the explicit softmax(QKᵀ)V at T = 197 and >= 1.2x faster at T >= 1024."""
    name = f"attention (SDPA) vs explicit softmax(QK^T)V, d={TARGET_DIM}, batch {TARGET_BATCH}, fp32 forward"
    ratios, parts, ok = {}, [], True
    for t in sorted({r["T"] for r in results if r["T"] >= 1024} | set(ATTN_TOKENS)):
        sel = {"T": t, "dtype": "fp32", "mode": "forward", "batch": TARGET_BATCH, "dim": TARGET_DIM}
        fast, slow = find(results, mixer="attention", **sel), find(results, mixer="attention_explicit", **sel)
        if fast is None or slow is None:
            continue
        ratios[t] = slow["time_s"]["median"] / fast["time_s"]["median"]
        need = 0.95 if t < 1024 else 1.2
        ok &= ratios[t] >= need
        parts.append(f"T={t}: {ratios[t]:.2f}x (need >= {need})")
    if 197 not in ratios or not any(t >= 1024 for t in ratios):
        return na(name, "attention / attention_explicit did not run at T=197 and a T >= 1024")
    return {
        "name": name,
        "status": pass_fail(ok),
        "measured": {"speedup": ratios},
        "need": "no slower at T=197 (ratio >= 0.95, timing noise), clearly faster at T >= 1024 (ratio >= 1.2)",
        "detail": "explicit/SDPA time " + ", ".join(parts),
    }


def mixer_targets(results: list[Result]) -> list[Result]:
    """Every mixer target's verdict on a ``vitlab bench-mixers`` run."""
    return [
        target_aft_full(results),
        target_linear(results, "aft_simple"),
        target_linear(results, "aft_conv"),
        target_attention(results),
    ]


def mixer_targets_text(targets: list[Result]) -> str:
    return "\n".join(["targets:"] + [f"  [{t['status']}] {t['name']}\n         {t['detail']}" for t in targets])


# Models (vitlab bench) have no utilisation targets any more: their goals are ratios to other implementations
# measured side by side (docs/performance.md).
