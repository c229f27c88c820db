"""The skeleton every benchmark sweep shares.

A sweep is a list of cases (dicts of parameters, :class:`Plan`) measured one after the other, each in
fresh processes (:class:`vitlab.measure.process.CaseRunner`), with one progress line per case; its report
is a JSON document with every measurement and a text summary, each written atomically. This module holds
those common steps -- comma-separated option lists and their checks, the case plan, the loop with its
progress lines, the formatting of times and memory for people, the report files -- and nothing about what
is measured.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..common.io import write_text_atomic
from .process import GB, MB

Case = TypeVar("Case")


# --------------------------------------------------------------------------- options


def csv_list(kind: type, choices: Iterable[str] | None = None) -> Callable[[str], list]:
    """An argparse type: a comma-separated list of ``kind``, each one of ``choices`` when given."""

    def parse(text: str) -> list:
        items = [kind(x) for x in text.split(",") if x.strip()]
        if choices is not None:
            bad = [x for x in items if x not in choices]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"unknown {', '.join(map(str, bad))}; choose from {', '.join(choices)}"
                )
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items

    return parse


def require_at_least(args: argparse.Namespace, names: Iterable[str], low: int = 1) -> None:
    """ValueError naming the option when one of the numeric options ``names`` is below ``low``."""
    for name in names:
        value = getattr(args, name)
        if value < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def require_positive_items(args: argparse.Namespace, names: Iterable[str]) -> None:
    """ValueError naming the option when a list option of ``names`` (None: not given) holds a value below 1."""
    for name in names:
        values = getattr(args, name)
        if values and any(v < 1 for v in values):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {values}")


# --------------------------------------------------------------------------- the cases


@dataclass
class Plan:
    """The cases of a sweep in order, each once: cases are equal when their ``key`` fields are, and a case
    asked for again (by another target, or the sweep) gains that ``role`` instead of running twice."""

    key: tuple[str, ...]
    cases: list[dict[str, Any]] = field(default_factory=list)
    _index: dict[tuple, dict[str, Any]] = field(default_factory=dict, repr=False)

    def add(self, role: str, **case: Any) -> dict[str, Any]:
        key = tuple(case[name] for name in self.key)
        if key not in self._index:
            self._index[key] = {**case, "roles": []}
            self.cases.append(self._index[key])
        found = self._index[key]
        if role not in found["roles"]:
            found["roles"].append(role)
        return found


# --------------------------------------------------------------------------- running


def run_sweep(
    cases: Sequence[Case],
    measure: Callable[[Case], dict[str, Any]],
    label: Callable[[Case], str],
    describe: Callable[[dict[str, Any]], str],
) -> list[dict[str, Any]]:
    """Measure every case in order; before each, a progress line ``[i/n] label : `` that ``describe`` of
    its result completes. Returns the results in the order of the cases."""
    results = []
    n = len(cases)
    for i, case in enumerate(cases, 1):
        print(f"[{i:>{len(str(n))}}/{n}] {label(case)} : ", end="", flush=True)
        result = measure(case)
        print(describe(result), flush=True)
        results.append(result)
    return results


def with_wall_time(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``'s result with ``wall_s``: the seconds it took, set-up and fresh processes included."""
    t0 = time.perf_counter()
    result = run()
    return {**result, "wall_s": time.perf_counter() - t0}


# --------------------------------------------------------------------------- formatting


def fmt_time(s: float) -> str:
    return f"{s:.3g} s" if s >= 0.9995 else f"{_three_digits(s * 1e3)} ms"


def fmt_mem(b: float) -> str:
    return f"{b / GB:.2f} GB" if b >= 999.5 * MB else f"{_three_digits(b / MB)} MB"


def _three_digits(x: float) -> str:
    """3 significant digits without exponent notation (x < 1000)."""
    return f"{x:.0f}" if x >= 99.95 else f"{x:.3g}"


# --------------------------------------------------------------------------- report files


def options(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The options ``names`` as the run used them (the report's configuration)."""
    return {name: getattr(args, name) for name in names}


def write_json(path: Path, doc: Any, indent: int = 1) -> Path:
    """``doc`` as JSON, written atomically; values JSON does not know (paths) are written as strings."""
    return write_text_atomic(path, json.dumps(doc, indent=indent, default=str))


def write_text(path: Path, text: str) -> Path:
    """``text`` ending in a newline, written atomically."""
    return write_text_atomic(path, text if text.endswith("\n") else text + "\n")
