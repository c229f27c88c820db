"""Optional dependencies: a missing one is one clear line naming the extra that installs it.

>>> onnx = require("onnx", purpose="ONNX export", extra="export")

Foundation module: imports nothing from vitlab.
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says which extra installs it."""


def require(module: str, purpose: str, extra: str | None = None) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtra`: "<purpose> needs <package> (not installed): pip
    install 'vitlab[<extra>]'" (without an extra: the package itself)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = (e.name or module).split(".")[0]
        how = f"'vitlab[{extra}]'" if extra else missing
        raise MissingExtra(f"{purpose} needs {missing} (not installed): pip install {how}") from None
