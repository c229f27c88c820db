"""Rows of ``vitlab study`` (and variants of ``vitlab compare``) under ``torchrun``: ``--nproc-per-node N``.

Each row's training config goes to ``ROW/row_config.json`` (data only: read back with ``json``, nothing
executed), and ``python -m torch.distributed.run --standalone --nproc-per-node N -m vitlab.experiments.launch
ROW/row_config.json`` trains it with DDP (gloo on the CPU, NCCL on GPUs). Rank 0 writes ``ROW/result.json`` in
the form the table reads. A row stopped part way (a kill, a lost machine) resumes from its ``last.pt`` with
``--resume``; a finished row is reused. Rows trained on different machines merge by copying their folders into
one ``--out`` and running the study again with ``--resume``: every finished row is reused, the table is
written over all of them.
"""

from __future__ import annotations

import json
import re
import resource
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..common.io import open_append, write_json_atomic
from ..engine.config import TrainConfig

CONFIG_NAME = "row_config.json"
ERROR_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception): .*")  # "[rank0]: ValueError: ..." -> "ValueError: ..."


def launch_row(cfg: TrainConfig, nproc: int, resume_from_checkpoint: bool, tag: str) -> dict[str, Any]:
    """Train one row under ``torchrun`` with ``nproc`` processes; its result (``status`` ``ok`` or ``error``)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    config = {**asdict(cfg), "resume": "auto" if resume_from_checkpoint else None, "force": False}
    write_json_atomic(out / CONFIG_NAME, config)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "vitlab.experiments.launch", str(out / CONFIG_NAME)]  # fmt: skip
    t0 = time.perf_counter()
    tail: list[str] = []
    with (
        open_append(out / "train.log") as log,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
    ):
        for line in proc.stdout:
            log.write(line)
            log.flush()
            print(f"[{tag}] {line.rstrip()}", flush=True)
            if ERROR_LINE.search(line):  # the training's own error, not torchrun's report around it
                tail = [ERROR_LINE.search(line).group(0).strip()]
    result_file = out / "result.json"
    if proc.returncode == 0 and result_file.is_file():
        return json.loads(result_file.read_text())
    reason = f"torchrun exited with {proc.returncode} after {time.perf_counter() - t0:.0f} s" + "".join(
        f": {t}" for t in tail[-1:]
    )
    return {"status": "error", "reason": reason[-400:], "config": asdict(cfg)}


def main(argv: list[str] | None = None) -> int:
    """One process of a row's ``torchrun``: train the config in the JSON file; rank 0 writes the result."""
    from ..common.distributed import close_distributed, current_world
    from ..engine.loop import train
    from ..tasks import detection, points, segmentation  # noqa: F401  (a row of any task: its hooks registered)

    path = Path((argv or sys.argv[1:])[0])
    config = json.loads(path.read_text())
    cfg = TrainConfig.from_dict(config)
    t0 = time.perf_counter()
    try:
        summary = train(cfg, lambda line: print(line, flush=True))
    finally:
        close_distributed()
    if current_world().main:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # rank 0's peak resident memory
        row_config = {**asdict(cfg), "resume": None, "force": True}  # as the plan holds it (see _reusable)
        result = {
            "status": "ok",
            "info": {"summary": summary},
            "time_s": {"median": time.perf_counter() - t0},
            "mem": {"peak": peak, "delta": peak},
            "config": row_config,
            "world_size": current_world().size,
        }
        write_json_atomic(path.parent / "result.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
