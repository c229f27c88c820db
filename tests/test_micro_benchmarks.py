"""The kernel layer's micro-benchmarks run and print one row per case (they share benchmarks/side_by_side.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_row_norm_benchmark_prints_a_row_per_channel_count():
    lines = run("row_norm.py", "--tokens", "12", "--channels", "3", "18", "--repeats", "1")
    assert lines[0].startswith("torch ") and [line.split()[0] for line in lines[-2:]] == ["3", "18"]
    assert all(line.endswith("x") for line in lines[-2:])


def test_soft_split_benchmark_prints_a_row_per_split():
    lines = run("soft_split.py", "--batch", "1", "--width", "8", "--repeats", "1")
    assert lines[0].startswith("torch ") and [line.split()[0] for line in lines[-3:]] == ["7/4/2", "3/2/1", "3/2/1"]
    assert all(line.endswith("x") for line in lines[-3:])
