"""Validated option values: argparse types that check a flag's range while the command line is parsed.

Every vitlab command reads its numbers, devices, image sizes and ``KEY=VALUE`` pairs through these types,
so a bad value is one line naming the flag, the value and what is allowed, before any work starts::

    vitlab train: error: argument --train-limit: must be an integer >= 1, got '-5'

A :class:`Check` is used as ``parser.add_argument("--epochs", type=positive_int)``; the same object checks a
value given in code (:meth:`Check.check`), so a config dataclass and its command line share one table of
ranges. Ranges that depend on another option (``--jobs`` at most ``--threads``) or on the data stay with the
command that knows both. Foundation module: imports nothing from vitlab.
"""

from __future__ import annotations

import argparse
import ast
import math
import re
from collections.abc import Callable
from typing import Any

_BAD = object()


class Check:
    """An argparse type: ``parse`` reads the text, ``accepts`` checks the value, ``what`` says what is allowed
    (it completes "must be ...")."""

    what = "a valid value"

    def parse(self, text: str) -> Any:
        return text

    def accepts(self, value: Any) -> bool:
        return True

    def __call__(self, text: str) -> Any:
        try:
            value = self.parse(text.strip())
        except (ValueError, TypeError, OverflowError, SyntaxError):
            value = _BAD
        if value is _BAD or not self.accepts(value):
            raise argparse.ArgumentTypeError(f"must be {self.what}, got {text!r}")
        return value

    def check(self, value: Any, name: str) -> Any:
        """``value`` (given in code, not text) when allowed; else ValueError "NAME must be ..., got VALUE"."""
        if not self.accepts(value):
            raise ValueError(f"{name} must be {self.what}, got {value!r}")
        return value

    def __repr__(self) -> str:  # argparse names the type in a few messages
        return self.what


class Int(Check):
    """A whole number in ``[low, high]`` (either end open when None); booleans are not numbers here."""

    def __init__(self, low: int | None = None, high: int | None = None, note: str = "") -> None:
        self.low, self.high = low, high
        if low is not None and high is not None:
            self.what = f"an integer in {low}..{high}"
        elif low is not None:
            self.what = f"an integer >= {low}"
        else:
            self.what = "an integer" if high is None else f"an integer <= {high}"
        self.what += note

    def parse(self, text: str) -> int:
        return int(text, 10)

    def accepts(self, value: Any) -> bool:
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and (self.low is None or value >= self.low)
            and (self.high is None or value <= self.high)
        )


class Float(Check):
    """A finite number between ``low`` and ``high`` (None: unbounded), each end closed unless said open."""

    def __init__(
        self, low: float | None = None, high: float | None = None, low_open: bool = False, high_open: bool = False
    ) -> None:
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open
        if low is not None and high is not None:
            self.what = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            self.what = f"a number {'>' if low_open else '>='} {low:g}"
        elif high is not None:
            self.what = f"a number {'<' if high_open else '<='} {high:g}"
        else:
            self.what = "a finite number"

    def parse(self, text: str) -> float:
        return float(text)

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        low_ok = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return low_ok and (self.high is None or (value < self.high if self.high_open else value <= self.high))


class Choice(Check):
    """One of a few ``values``; the text is read as the values' type (``Choice(1, 3)``: the numbers 1 or 3)."""

    def __init__(self, *values: Any) -> None:
        self.values = values
        self.what = "one of " + ", ".join(map(str, values))

    def parse(self, text: str) -> Any:
        return type(self.values[0])(text)

    def accepts(self, value: Any) -> bool:
        return not isinstance(value, bool) and value in self.values


class Device(Check):
    """A torch device spec: ``auto`` (a GPU when there is one), ``cpu``, ``mps``, ``cuda`` or ``cuda:N``.
    Whether that device exists is the command's question; this is only the spelling."""

    what = "auto, cpu, mps, cuda or cuda:N"
    _SPEC = re.compile(r"auto|cpu|mps|cuda(:\d{1,3})?")

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str) and self._SPEC.fullmatch(value) is not None


class KeyValue(Check):
    """``KEY=VALUE`` -> ``(key, value)``: the key a Python name, the value a Python literal (``7``, ``0.5``,
    ``True``, ``(7, 4, 2)``, ``'x'``) or else the bare text."""

    what = "KEY=VALUE with KEY a Python name (e.g. depth=6)"

    def parse(self, text: str) -> tuple[str, Any]:
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier() or not value.strip():
            raise ValueError(text)
        try:
            return key, ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return key, value.strip()  # a bare string

    def accepts(self, value: Any) -> bool:
        return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str) and value[0].isidentifier()


class Validated(Check):
    """A check made from a function that returns the value or raises ValueError with its own one-line message
    (a registered name, a dataset spec): that message is the flag's error."""

    def __init__(self, function: Callable[[str], Any], what: str) -> None:
        self.function, self.what = function, what

    def __call__(self, text: str) -> Any:
        try:
            return self.function(text)
        except (ValueError, OSError) as e:  # argparse names the flag: a message's own "--flag" goes
            raise argparse.ArgumentTypeError(re.sub(r"^--[\w-]+:? ", "", str(e))) from None

    def check(self, value: Any, name: str) -> Any:
        try:
            return self.function(value)
        except (ValueError, OSError) as e:
            raise ValueError(f"{name}: {e}") from None


# the ranges the commands share
positive_int = Int(1)
non_negative_int = Int(0)
positive_float = Float(0, low_open=True)
non_negative_float = Float(0)
probability = Float(0, 1)
#: a rate below one: drop-path, label smoothing, EMA decay, dropout
rate = Float(0, 1, high_open=True)
seed = Int(0, 2**32 - 1)
#: torch threads; 0 keeps torch's default
threads = Int(0, 1024, note=" (0: torch's default)")
#: an image side in pixels
image_size = Int(1, 8192)
device = Device()
key_value = KeyValue()


# --------------------------------------------------------------------------- keyword values against a signature
_KINDS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "str": (str,),
    "tuple": (tuple, list),
    "list": (tuple, list),
    "Sequence": (tuple, list),
    "None": (type(None),),
}


def accepted_kinds(annotation: Any) -> tuple[type, ...] | None:
    """The Python types a parameter annotated ``annotation`` takes at its top level (``int | tuple[int, int]``
    -> int, tuple, list), or None when the annotation names anything else (then every value passes)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    while (inner := re.sub(r"\[[^\[\]]*\]", "", text)) != text:  # drop bracketed parts, innermost first
        text = inner
    names = re.findall(r"[A-Za-z_]\w*", text)
    if not names or any(n not in _KINDS for n in names):
        return None
    return tuple({t for n in names for t in _KINDS[n]})


def check_keyword_values(target: Callable[..., Any], values: dict[str, Any], flag: str) -> None:
    """ValueError naming ``flag`` when a value of ``values`` cannot be what ``target``'s parameter of that name
    takes: judged from the annotation (int, float, bool, str, sequences, None) and from the default, since a
    parameter whose default is a positive number (a size, a count, a ratio) takes a positive number.
    Parameters the signature does not have are left to the caller."""
    import inspect

    params = inspect.signature(target).parameters
    for key, value in values.items():
        if key not in params:
            continue
        param = params[key]
        kinds = None if param.annotation is inspect.Parameter.empty else accepted_kinds(param.annotation)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kinds is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            wanted = param.annotation if isinstance(param.annotation, str) else kinds
            raise ValueError(f"{flag} {key}={value!r}: {key} takes {wanted}, not {type(value).__name__}")
        default = param.default
        positive_default = isinstance(default, (int, float)) and not isinstance(default, bool) and default > 0
        if positive_default and number and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} {key}={value!r}: {key} must be positive (default {default})")
