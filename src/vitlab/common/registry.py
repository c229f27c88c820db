"""Named configurations: one :class:`Registry` per namespace (vision models, causal LMs) and the errors for
names and options that do not exist.

A registry holds rows (any record: a ``ModelConfig``, a ``(kwargs, note)`` pair) under unique names, lists
them by shell-style pattern, looks one up (an unknown name gets the closest known ones) and builds one with
keyword overrides checked against the constructor before anything is built.

Foundation module: imports nothing from vitlab.
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Generic, TypeVar

Row = TypeVar("Row")
#: a row -> (the callable that builds it, that callable's keyword arguments)
Recipe = Callable[[Row], tuple[Callable[..., Any], dict[str, Any]]]


def unknown_name_error(kind: str, name: str, known: Iterable[str], listed_by: str | None = None) -> ValueError:
    """The error for a ``kind`` (``"model"``, ``"mixer kind"``, ...) called ``name`` that does not exist: it
    names the closest known names and where to see them all (``listed_by``, else every known name inline)."""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f"; did you mean one of the closest: {', '.join(close)}?" if close else ""
    every = f"{listed_by} lists all {len(known)}" if listed_by else f"known: {', '.join(known)}"
    return ValueError(f"unknown {kind} {name!r}{hint} ({every})")


class UnknownOptionError(ValueError, TypeError):
    """An option a constructor does not take: a ValueError (vitlab's one-line user error) and, as Python
    itself raises for an unexpected keyword argument, a TypeError (what timm's factory contract expects)."""


def check_options(what: str, options: Iterable[str], target: Callable[..., Any]) -> None:
    """Raise :class:`UnknownOptionError` naming the ``options`` that ``target``'s signature does not take
    (``what`` says whose)."""
    accepted = sorted(inspect.signature(target).parameters)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        name = getattr(target, "__name__", repr(target))
        raise UnknownOptionError(
            f"{what}: unknown option(s) {', '.join(unknown)}; {name} accepts: {', '.join(accepted)}"
        )


class Registry(Generic[Row]):
    """Named rows of one kind (one namespace): register, list by pattern, look up, build.

    Args:
        kind: what a row names, for messages (``"model"``, ``"LM config"``).
        recipe: row -> (constructor, its keyword arguments); :meth:`create` calls it.
        listed_by: where users see every name (e.g. ``"vitlab.list_models()"``); None: unknown-name errors
            list them all inline.
        rows: initial ``{name: row}``, registered in order.
    """

    def __init__(
        self, kind: str, recipe: Recipe, listed_by: str | None = None, rows: Mapping[str, Row] | None = None
    ) -> None:
        self.kind, self.recipe, self.listed_by = kind, recipe, listed_by
        self._rows: dict[str, Row] = {}
        #: read-only view of every row, in registration order
        self.rows: Mapping[str, Row] = MappingProxyType(self._rows)
        for name, row in (rows or {}).items():
            self.register(name, row)

    def register(self, name: str, row: Row) -> None:
        if name in self._rows:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._rows[name] = row

    def names(self, pattern: str | Sequence[str] = "*", exclude: str | Sequence[str] = ()) -> list[str]:
        """Registered names matching a shell-style ``pattern`` (or any of a list of them) and none of
        ``exclude``, sorted."""
        include = [pattern] if isinstance(pattern, str) else list(pattern)
        excluded = [exclude] if isinstance(exclude, str) else list(exclude)
        return sorted(
            n
            for n in self._rows
            if any(fnmatch.fnmatch(n, p) for p in include) and not any(fnmatch.fnmatch(n, x) for x in excluded)
        )

    def get(self, name: str) -> Row:
        if name not in self._rows:
            raise unknown_name_error(self.kind, name, self._rows, self.listed_by)
        return self._rows[name]

    def arguments(self, name: str, overrides: Mapping[str, Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
        """(constructor, keyword arguments) of the named row with ``overrides`` applied; ValueError for an
        unknown name or an override the constructor does not take."""
        factory, kwargs = self.recipe(self.get(name))
        check_options(name, overrides, factory)
        return factory, {**kwargs, **overrides}

    def create(self, name: str, **overrides: Any) -> Any:
        """Build the named row; ``overrides`` replace its arguments."""
        factory, kwargs = self.arguments(name, overrides)
        return factory(**kwargs)
