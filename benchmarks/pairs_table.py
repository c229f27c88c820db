"""Render the pairs of a side-by-side comparison's JSON (``peer_bench.py --out``) as the Markdown table that
docs/performance.md shows: vitlab ÷ peer, median of the rounds (min-max) for inference and training speed, and the
medians of the peak-memory increments. With ``--resident``, the resident sizes behind those increments instead:
each side's resident memory after its imports and its peak resident memory in each phase, in MB, medians over its
runs (an increment is the phase's peak minus the size just before the phase, so a side whose imports leave less
freed heap behind starts lower and grows more for the same tensors).

    python benchmarks/pairs_table.py benchmarks/results/peer_models_avx512_2026-11-28.json
    python benchmarks/pairs_table.py --resident benchmarks/results/peer_models_avx512_2026-11-28.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _speed(pair: dict, phase: str) -> str:
    key = f"{phase}_speed_ratio"
    if pair.get(f"{key}_median") is None:
        return "-"
    return f"{pair[f'{key}_median']:.2f} ({pair[f'{key}_min']:.2f}-{pair[f'{key}_max']:.2f})"


def _memory(pair: dict, phase: str, kind: str) -> str:
    value = pair.get(f"{phase}_{kind}_incr_ratio_median")
    return "-" if value is None else f"{value:.2f}"


def table(doc: dict) -> str:
    """The Markdown table of ``doc["pairs"]``: on a GPU the memory column is the allocator's tensor peak (the
    device memory a batch needs), on the CPU the process's peak resident memory."""
    device = doc.get("meta", {}).get("device")  # a CPU run's is its name, a GPU run's the device's description
    gpu = isinstance(device, dict) and device.get("type") == "cuda"
    kind, what = ("tensor", "GPU tensor-peak increment") if gpu else ("peak", "peak-memory increment")
    rows = [f"| peer | vitlab | rounds | inference | training | {what}, inference / training |"]
    rows.append("|---|---|---|---|---|---|")
    for pair in doc["pairs"]:
        memory = f"{_memory(pair, 'infer', kind)} / {_memory(pair, 'train', kind)}"
        vitlab = pair["vitlab"].split("@")[0]
        rows.append(
            f"| {pair['peer']} | {vitlab} | {len(pair['rounds'])} | {_speed(pair, 'infer')} | "
            f"{_speed(pair, 'train')} | {memory} |"
        )
    return "\n".join(rows)


def _resident(cases: list[dict], phase: str | None) -> float | None:
    """The median over ``cases`` of the resident MB after the imports (``phase`` None) or at the phase's peak."""
    if phase is None:
        values = [c["mem_after_import"]["rss_mb"] for c in cases if c.get("mem_after_import")]
    else:
        phases = [c.get("phases", {}).get(phase, {}) for c in cases]
        values = [p["peak_rss_mb"] for p in phases if p.get("status") == "ok" and p.get("peak_rss_mb") is not None]
    return statistics.median(values) if values else None


def resident_table(doc: dict) -> str:
    """The Markdown table of both sides' resident sizes for each pair of ``doc["pairs"]`` (from ``doc["cases"]``)."""
    runs: dict[str, list[dict]] = {}
    for case in doc.get("cases", []):
        runs.setdefault(case["id"], []).append(case)
    rows = ["| peer | vitlab | after imports, MB | inference peak, MB | training peak, MB |", "|---|---|---|---|---|"]
    for pair in doc["pairs"]:
        sides = [runs.get(pair["vitlab"], []), runs.get(pair["peer"], [])]
        cells = []
        for phase in (None, "infer", "train"):
            mine, theirs = (_resident(cases, phase) for cases in sides)
            cells.append("-" if mine is None or theirs is None else f"{mine:.0f} / {theirs:.0f}")
        rows.append(f"| {pair['peer']} | {pair['vitlab'].split('@')[0]} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    resident = "--resident" in argv
    argv = [a for a in argv if a != "--resident"]
    if len(argv) != 1:
        print("usage: python benchmarks/pairs_table.py [--resident] RESULT.json", file=sys.stderr)
        return 2
    try:
        doc = json.loads(Path(argv[0]).read_text())
        print(resident_table(doc) if resident else table(doc))
    except (OSError, ValueError, KeyError) as err:
        print(f"pairs_table: cannot read {argv[0]}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
