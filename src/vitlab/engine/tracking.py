"""What a training run reports while it runs: per-step metrics on disk, and its progress.

:class:`StepLog` appends one JSON line per optimisation step to ``OUT/steps.jsonl`` (loss, learning rate,
gradient norm, throughput, memory), and with ``tensorboard`` writes the same scalars to ``OUT/tb`` for
TensorBoard. The step's values stay on the device until a flush every ``every`` steps, so logging costs
one synchronisation per flush, not one per step; throughput is measured over the flushed interval. A
resumed run first drops the lines of steps after its checkpoint (the file is rewritten atomically), so the
file always describes the one run that produced the weights.

:class:`Progress` shows where a run is: a progress bar with the epoch's ETA on a terminal, and, when the
output is not one (a scheduler's log file), a plain line every ``every_s`` seconds with the epoch's and
the run's ETA.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor

from ..common.io import open_append, write_text_atomic

STEPS_FILE = "steps.jsonl"
TENSORBOARD_DIR = "tb"
MIB = 2**20


def tensorboard_writer_class() -> type:
    """TensorBoard's ``SummaryWriter``; one line naming the extra to install when it is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(
            "--tensorboard needs the tensorboard package: pip install 'vitlab[tensorboard]' (or tensorboard)"
        ) from None
    return SummaryWriter


def memory_probe(device: torch.device) -> Callable[[], float]:
    """MiB of memory: on a GPU the allocator's peak so far (``max_memory_allocated``), on the CPU the
    process's resident set size now."""
    if device.type == "cuda":
        return lambda: torch.cuda.max_memory_allocated(device) / MIB
    from ..measure.process import current_rss_bytes

    return lambda: (current_rss_bytes() or 0) / MIB


class StepLog:
    """Per-step rows in ``folder/steps.jsonl`` (and TensorBoard scalars in ``folder/tb``), written every
    ``every`` steps. ``folder=None`` (the processes other than rank 0) logs nothing."""

    def __init__(
        self,
        folder: str | Path | None,
        every: int = 10,
        tensorboard: bool = False,
        memory: Callable[[], float] | None = None,
        unit: str = "img_s",
    ) -> None:
        self.folder = Path(folder) if folder is not None else None
        self.every, self.memory, self.unit = max(1, every), memory, unit
        self.writer_class = tensorboard_writer_class() if tensorboard and self.folder is not None else None
        self.pending: list[tuple[int, dict[str, Any], Tensor | None]] = []
        self.items = 0
        self.t_last = time.perf_counter()
        self._file: IO[str] | None = None
        self._writer: Any = None

    @property
    def path(self) -> Path | None:
        return None if self.folder is None else self.folder / STEPS_FILE

    def trim(self, last_step: int) -> int:
        """Keep only the rows of steps <= ``last_step`` (a resumed run continues after its checkpoint's step);
        returns how many rows were dropped."""
        if self.path is None or not self.path.exists():
            return 0
        lines = self.path.read_text().splitlines()
        kept = [line for line in lines if _step_of(line) <= last_step]
        dropped = len(lines) - len(kept)
        if dropped:
            write_text_atomic(self.path, "".join(line + "\n" for line in kept))
        return dropped

    def restart_clock(self) -> None:
        """Throughput counts from now (after an evaluation or a checkpoint, which are not training time)."""
        self.flush()
        self.t_last, self.items = time.perf_counter(), 0

    def add(self, step: int, items: int, values: dict[str, Any], device_values: Tensor | None = None) -> None:
        """Step ``step``'s row: plain ``values`` and, still on the device, ``device_values`` (a 1-D tensor of
        the scalars named in ``values['_names']``, e.g. loss and gradient norm); ``items`` images (or tokens)
        were processed. Written at the next flush."""
        self.items += items
        if self.folder is None:
            return
        self.pending.append((step, values, None if device_values is None else device_values.detach()))
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> list[dict[str, Any]]:
        """Write the pending rows (one synchronisation); returns them."""
        if not self.pending:
            return []
        now = time.perf_counter()
        rate = self.items / max(now - self.t_last, 1e-9)
        self.t_last, self.items = now, 0
        stacked = [d for _, _, d in self.pending if d is not None]
        numbers = torch.stack(stacked).float().cpu().tolist() if stacked else []
        mem = self.memory() if self.memory is not None else None
        rows, i = [], 0
        for step, values, dev in self.pending:
            row = {"step": step, **{k: v for k, v in values.items() if k != "_names"}}
            if dev is not None:
                row.update(zip(values["_names"], numbers[i]))
                i += 1
            row[self.unit] = rate
            if mem is not None:
                row["mem_mib"] = mem
            rows.append(row)
        self.pending = []
        self._write(rows)
        return rows

    def _write(self, rows: list[dict[str, Any]]) -> None:
        if self._file is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._file = open_append(self.path)
        self._file.write("".join(json.dumps(r) + "\n" for r in rows))
        self._file.flush()
        if self.writer_class is not None:
            if self._writer is None:
                self._writer = self.writer_class(log_dir=str(self.folder / TENSORBOARD_DIR))
            for r in rows:
                for key, value in r.items():
                    if key != "step" and isinstance(value, int | float):
                        self._writer.add_scalar(f"train/{key}", value, r["step"])
            self._writer.flush()

    def scalars(self, step: int, values: dict[str, float], prefix: str = "val") -> None:
        """Per-epoch (or per-evaluation) scalars for TensorBoard (the JSON logs hold them already)."""
        if self.writer_class is None:
            return
        if self._writer is None:
            self._writer = self.writer_class(log_dir=str(self.folder / TENSORBOARD_DIR))
        for key, value in values.items():
            if isinstance(value, int | float):
                self._writer.add_scalar(f"{prefix}/{key}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _step_of(line: str) -> float:
    """The step of a ``steps.jsonl`` line; infinity for a line a killed run left half-written."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, TypeError, KeyError):
        return float("inf")


def fmt_eta(seconds: float) -> str:
    """``1:02:03`` / ``2:03``: hours, minutes and seconds left."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Progress of a run of ``total`` steps (``done`` of them before this process started): a tqdm bar with
    ETA on a terminal, otherwise a line through ``log`` every ``every_s`` seconds with the ETA of the
    epoch and of the run. Disabled: nothing."""

    def __init__(
        self,
        total: int,
        done: int,
        log: Callable[[str], None],
        enabled: bool = True,
        every_s: float = 30.0,
        terminal: bool | None = None,
        unit: str = "img",
    ) -> None:
        self.total, self.done, self.log, self.enabled = total, done, log, enabled
        self.every_s, self.unit = every_s, unit
        self.terminal = sys.stdout.isatty() and sys.stderr.isatty() if terminal is None else terminal
        self.bar: Any = None
        self.steps = self.step = 0
        self.items = 0
        self.desc = ""
        self.t0 = self.t_line = time.perf_counter()

    def start(self, desc: str, steps: int) -> None:
        """A new stretch (an epoch) of ``steps`` steps."""
        self.desc, self.steps, self.step, self.items = desc, steps, 0, 0
        self.t0 = self.t_line = time.perf_counter()
        if self.enabled and self.terminal:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)

    def wants_status(self) -> bool:
        """Whether the next :meth:`update` shows its status (callers skip computing it otherwise)."""
        if not self.enabled:
            return False
        if self.terminal:
            return self.step % 10 == 0 or self.step == self.steps - 1
        return time.perf_counter() - self.t_line >= self.every_s

    def update(self, items: int, status: str | None = None) -> None:
        """One step of ``items`` images (tokens) done; ``status`` (e.g. the running loss) shown if given."""
        self.step += 1
        self.done += 1
        self.items += items
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            if status is not None:
                self.bar.set_postfix_str(f"{status} {self.rate():.0f} {self.unit}/s")
        elif status is not None:
            self.t_line = time.perf_counter()
            self.log(self.line(status))

    def rate(self) -> float:
        return self.items / max(time.perf_counter() - self.t0, 1e-9)

    def line(self, status: str) -> str:
        """The plain progress line: where the run is, its status, speed and the ETAs."""
        per_step = (time.perf_counter() - self.t0) / max(self.step, 1)
        left_here, left_all = self.steps - self.step, self.total - self.done
        return (
            f"{self.desc} step {self.step}/{self.steps}  {status}  {self.rate():.0f} {self.unit}/s  "
            f"ETA {fmt_eta(per_step * left_here)} (run {fmt_eta(per_step * left_all)})"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
