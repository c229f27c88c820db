"""Recipes as files: ``vitlab train --config deit_tiny`` (a shipped recipe) or ``--config path/to/file.yaml``.

A recipe is a YAML or TOML mapping of ``vitlab train`` options (the names of :class:`TrainConfig`'s fields,
``model_args`` a mapping of constructor overrides) plus a ``reference`` mapping saying what the paper reports
for it (``paper``, ``top1``, ``source``, ``notes``: documentation, not options), and an optional ``needs``
mapping of options the command line must give, each with what to give (a fine-tuning recipe's data set and its
starting checkpoint: without them the run would train from scratch on the default data). Options given on the command
line override the file's; ``--lr`` on the command line also drops the file's ``base_lr`` (an absolute learning
rate instead of one scaled by the batch). Every key and value is checked before any work: an unknown key, a
value of another type than its option's (:func:`check_type`, from the annotation of :class:`TrainConfig`'s
field) or outside its range, ``lr`` beside ``base_lr`` (one would be ignored), a key given twice (YAML would
keep the last silently; TOML refuses it too), more than ``MAX_ALIASES`` YAML aliases (a few nested aliases
expand into billions of values), and a distillation recipe run without ``--teacher`` are each one line.

The papers' recipes ship inside the package (``vitlab/recipes/<paper>/*.yaml``, package data read through
``importlib.resources``), so an installed wheel has them; a bare name is looked up in ``./recipes`` first (a
user's own), then among them.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from .config import OPTION_CHECKS, TrainConfig, check_type

SUFFIXES = (".yaml", ".yml", ".toml")
REFERENCE_KEYS = ("paper", "top1", "source", "notes")
NOT_IN_RECIPES = {"recipe", "resume", "force"}  # how a run starts is said on the command line
DISTILLATION_KEYS = ("distillation", "distill_alpha", "distill_tau", "dist_token")
MAX_ALIASES = 16  # YAML aliases per file: enough to share a few blocks; k aliases expand to at most ~3^(k/3) values


def shipped_recipes() -> dict[str, Path]:
    """The recipes shipped in the package (``recipes/<paper>/<name>.yaml``), by name (the file's stem)."""
    root = resources.files("vitlab") / "recipes"
    files = [f for paper in root.iterdir() if paper.is_dir() for f in paper.iterdir()]
    files = [f for f in files if f.is_file() and Path(f.name).suffix in SUFFIXES]
    return {Path(f.name).stem: Path(str(f)) for f in sorted(files, key=lambda f: f.name)}


def find_recipe(name: str) -> Path:
    """A recipe file from a path, or from the name of a recipe in ``./recipes`` or of a shipped one."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ValueError(f"--config {name} is a folder; give a recipe file (.yaml, .yml or .toml) or a recipe name")
    if path.suffix in SUFFIXES or "/" in name:
        raise FileNotFoundError(f"--config {name}: no such recipe file")
    local = next((Path("recipes") / f"{name}{s}" for s in SUFFIXES if (Path("recipes") / f"{name}{s}").is_file()), None)
    shipped = shipped_recipes()
    if local is not None or name in shipped:
        return local or shipped[name]
    known = ", ".join(list(shipped)[:8])
    raise FileNotFoundError(f"--config {name}: no recipe file or shipped recipe of that name (shipped: {known}, ...)")


def read_recipe(path: Path) -> dict[str, Any]:
    """The mapping in a YAML or TOML file (YAML read with ``safe_load``: no Python objects); ``vitlab train``'s
    and ``vitlab study``'s one reader."""
    if path.suffix.lower() not in SUFFIXES:
        raise ValueError(f"recipe {path}: use a .yaml, .yml or .toml file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"recipe {path}: not UTF-8 text; save it as a UTF-8 YAML or TOML file") from None
    except IsADirectoryError:
        raise ValueError(f"recipe {path} is a folder; give a .yaml, .yml or .toml file") from None
    toml = path.suffix.lower() == ".toml"
    if not toml:
        from ..common.extras import require

        yaml = require("yaml", "reading YAML recipes", "recipes")  # a missing PyYAML says so, not "not valid"
    try:
        data = tomllib.loads(text) if toml else yaml.load(text, Loader=_strict_loader(yaml))  # a SafeLoader
    except (tomllib.TOMLDecodeError, ValueError) as e:
        raise ValueError(
            f"recipe {path}: not valid {path.suffix[1:].upper()} ({' '.join(str(e).split())[:160]})"
        ) from None
    except Exception as e:  # yaml.YAMLError (yaml is optional: no name to catch before importing it)
        raise ValueError(f"recipe {path}: not valid YAML ({' '.join(str(e).split())[:160]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"recipe {path}: must be a mapping of option names to values")
    return data


def _strict_loader(yaml):
    """PyYAML's safe loader that refuses a mapping key given twice and more than ``MAX_ALIASES`` aliases."""

    class StrictLoader(yaml.SafeLoader):
        aliases = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_ALIASES:
                    raise ValueError(f"more than {MAX_ALIASES} aliases (*name); write the values out")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen: set = set()
            for k, _ in node.value:
                if isinstance(k, yaml.ScalarNode) and k.value != "<<":
                    if k.value in seen:
                        raise ValueError(
                            f"key {k.value!r} is given twice (again on line {k.start_mark.line + 1}); keep one"
                        )
                    seen.add(k.value)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def check_value(path: Path, key: str, value: Any) -> None:
    """A recipe value of the option's type (its annotation in :class:`TrainConfig`), then of its range (one line
    naming the key)."""
    why = check_type(key, value)
    if why:
        raise ValueError(f"recipe {path}: {why}")
    if key in OPTION_CHECKS and value is not None:
        try:
            OPTION_CHECKS[key].check(value, key)
        except ValueError as e:
            raise ValueError(f"recipe {path}: {e}") from None


def load_recipe(name: str) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """(the file, its options, its ``reference``), every key and value checked; the options the recipe ``needs``
    from the command line are under ``reference["needs"]``."""
    path = find_recipe(name)
    data = read_recipe(path)
    reference = data.pop("reference", None) or {}
    if not isinstance(reference, dict) or set(reference) - set(REFERENCE_KEYS):
        raise ValueError(f"recipe {path}: reference must be a mapping of {', '.join(REFERENCE_KEYS)}")
    names = {f.name for f in dataclasses.fields(TrainConfig)} - NOT_IN_RECIPES
    needs = data.pop("needs", None) or {}
    if not isinstance(needs, dict) or not all(k in names and isinstance(v, str) for k, v in needs.items()):
        raise ValueError(f"recipe {path}: needs must map options of vitlab train to what to pass for them")
    reference = {**reference, "needs": needs}
    for key, value in data.items():
        if key not in names:
            raise ValueError(f"recipe {path}: unknown key {key!r} (not an option of vitlab train)")
        check_value(path, key, value)
    if data.get("lr") is not None and data.get("base_lr") is not None:
        raise ValueError(
            f"recipe {path}: lr and base_lr both set the learning rate (base_lr x global batch / 512 wins); keep one"
        )
    return path, data, reference


def apply_recipe(args: argparse.Namespace) -> dict[str, Any]:
    """Fill ``args`` from the recipe ``args.config`` wherever the command line did not give the option; returns
    the recipe's ``reference`` (what the paper reports for it)."""
    path, values, reference = load_recipe(args.config)
    given = getattr(args, "given", set())
    for key, value in values.items():
        if key == "model_args":
            args.model_args = [*value.items(), *args.model_args]  # the command line's come last and win
        elif key not in given:
            setattr(args, key, value)
    if "lr" in given and "base_lr" not in given:
        args.base_lr = None
    if "out" not in given and "out" not in values:
        args.out = f"runs/train/{path.stem}"
    for key, what in reference["needs"].items():
        if key not in given:
            raise ValueError(f"recipe {path} needs --{key.replace('_', '-')}: {what}")
    if any(k in values for k in DISTILLATION_KEYS) and not getattr(args, "teacher", None):
        raise ValueError(
            f"recipe {path} distils from a teacher ({', '.join(k for k in DISTILLATION_KEYS if k in values)}) but "
            "none is given; pass --teacher FILE (a vitlab checkpoint, a .pt2 or a TorchScript file)"
        )
    args.recipe = str(path)
    return reference


def paper_line(reference: dict[str, Any], summary: dict[str, Any] | None = None) -> str | None:
    """The paper's figure for a recipe, beside the run's own held-out top-1 when ``summary`` is given (None when
    the recipe records no figure)."""
    top1 = reference.get("top1")
    if top1 is None:
        return None
    paper = f"the paper reports {top1} % top-1 ({reference.get('source', 'no source given')})"
    if summary is None:
        return f"recipe: {paper}"
    final, best = summary.get("final", {}).get("val_top1"), summary.get("best", {}).get("val_top1")
    if final is None:
        return f"recipe: {paper}"
    return f"this run: held-out top-1 {final:.2f} % (best {best:.2f} %); {paper}"
