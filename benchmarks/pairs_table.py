"""Render the pairs of a side-by-side comparison's JSON (``peer_bench.py --out``) as the Markdown table that
docs/performance.md shows: vitlab ÷ peer, median of the rounds (min-max) for inference and training speed, and the
medians of the peak-memory increments.

    python benchmarks/pairs_table.py benchmarks/results/peer_models_avx512_2026-11-28.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _speed(pair: dict, phase: str) -> str:
    key = f"{phase}_speed_ratio"
    if pair.get(f"{key}_median") is None:
        return "-"
    return f"{pair[f'{key}_median']:.2f} ({pair[f'{key}_min']:.2f}-{pair[f'{key}_max']:.2f})"


def _memory(pair: dict, phase: str) -> str:
    value = pair.get(f"{phase}_peak_incr_ratio_median")
    return "-" if value is None else f"{value:.2f}"


def table(doc: dict) -> str:
    """The Markdown table of ``doc["pairs"]``."""
    rows = ["| peer | vitlab | rounds | inference | training | peak-memory increment, inference / training |"]
    rows.append("|---|---|---|---|---|---|")
    for pair in doc["pairs"]:
        memory = f"{_memory(pair, 'infer')} / {_memory(pair, 'train')}"
        vitlab = pair["vitlab"].split("@")[0]
        rows.append(
            f"| {pair['peer']} | {vitlab} | {len(pair['rounds'])} | {_speed(pair, 'infer')} | "
            f"{_speed(pair, 'train')} | {memory} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/pairs_table.py RESULT.json", file=sys.stderr)
        return 2
    try:
        doc = json.loads(Path(argv[0]).read_text())
        print(table(doc))
    except (OSError, ValueError, KeyError) as err:
        print(f"pairs_table: cannot read {argv[0]}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
