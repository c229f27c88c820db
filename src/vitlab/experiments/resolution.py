"""``vitlab study cpvt-resolution`` / ``aft-resolution``: one checkpoint trained at 224, evaluated at larger
inputs without fine-tuning, beside the paper's figures (CPVT Table 2: 224 / 384 / 448 / 512; AFT §6.3.2: 384).

The evaluation is ``vitlab eval --img-size ...`` (:func:`vitlab.engine.evaluate.evaluate_checkpoint`): the
held-out images resized to each size, a learned position table resampled to the larger grid, PEGs and
AFT-conv kernels used as they are (both are convolutions over the grid). The paper's row is the one of the
checkpoint's model; a model the table does not have gets "not given".
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ..common.io import write_csv_atomic, write_json_atomic, write_text_atomic
from ..common.options import Int
from ..common.report import Column, render_markdown, render_text
from ..common.rundir import RunLock
from ..engine.evaluate import evaluate_checkpoint
from .papers import RESOLUTION_TABLES


@dataclass(frozen=True)
class ResolutionStudy:
    """A paper's resolution table: its input sizes and, per registered model, its top-1 at each."""

    name: str
    title: str
    source: str
    sizes: tuple[int, ...]
    paper: dict[str, dict[int, float]]


# the figures are kept with the rest of their paper's tables (papers/cpvt.py, papers/aft.py); what a resolution
# study is and how it runs are here
RESOLUTION_STUDIES = {t["name"]: ResolutionStudy(**t) for t in RESOLUTION_TABLES}

COLUMNS: list[Column] = [
    ("model", "model", "{}"),
    ("img_size", "size", "{}"),
    ("top1", "top-1 %", "{:.2f}"),
    ("top5", "top-5 %", "{:.2f}"),
    ("paper_top1", "paper top-1 %", "{}"),
    ("n", "images", "{}"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options only the resolution studies take (``vitlab study`` has the rest)."""
    p.add_argument("--checkpoint", default=None, help="resolution studies: the trained checkpoint to evaluate")
    p.add_argument(
        "--sizes",
        type=Int(16, 4096),
        nargs="+",
        default=None,
        help="resolution studies: input sizes (default: the paper's)",
    )


def run_resolution(args: argparse.Namespace) -> int:
    """Evaluate ``args.checkpoint`` at the study's sizes; ``table.json/csv/md`` in ``args.out``."""
    study = RESOLUTION_STUDIES[args.name]
    if not args.checkpoint:
        raise ValueError(f"{study.name} evaluates a trained checkpoint: pass --checkpoint (a vitlab train run)")
    out = Path(args.out if args.out != "runs/study/NAME" else f"runs/study/{study.name}")
    sizes = list(args.sizes or study.sizes)
    with RunLock(out, "vitlab study", print) as lock:
        old = lock.check_fresh(["table.json", "table.csv", "table.md"], resume=False, force=args.force)
        rows = evaluate_checkpoint(args.checkpoint, sizes, args.data, device=args.device or "auto")
        lock.move_aside(old)
        for row in rows:
            row["paper_top1"] = study.paper.get(row["model"], {}).get(row["img_size"], "not given")
        note = f"{study.title}. Checkpoint {args.checkpoint}; held-out data {args.data or 'as trained'}. " + (
            f"Paper: {study.source}; its rows: {', '.join(study.paper)}."
        )
        write_json_atomic(out / "table.json", {"study": study.name, "source": study.source, "rows": rows})
        write_csv_atomic(out / "table.csv", rows)
        write_text_atomic(out / "table.md", render_markdown(rows, note, COLUMNS))
    print(render_text(rows, COLUMNS))
    print(f"\nwrote {out / 'table.md'}, table.csv, table.json")
    return 0
