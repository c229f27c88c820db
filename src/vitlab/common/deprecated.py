"""The deprecated import paths of the release before the package's folders were rearranged (``vitlab.train``,
``vitlab.seg``, ``vitlab.points``, ``vitlab.lm``, ``vitlab.convert``, ``vitlab.integrations``,
``vitlab.pretrained`` and their modules): for one release each still imports, as a stand-in that hands out the
names of the modules that replaced it, with one :class:`DeprecationWarning` naming the new path.

The table below names the new modules without the package prefix: they are imported only when a user imports
an old path, never by vitlab itself (so the layering has no edge for them).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

# old path (without "vitlab.") -> the module(s) that replaced it, searched in order for each name
OLD_PATHS: dict[str, tuple[str, ...]] = {
    "train": ("engine",),
    "train.engine": ("engine.loop",),
    "train.config": ("engine.config",),
    "train.setup": ("engine.setup",),
    "train.data": ("engine.data",),
    "train.losses": ("engine.losses",),
    "train.ema": ("engine.ema",),
    "train.checkpointing": ("engine.checkpointing",),
    "train.tasks": ("engine.tasks",),
    "train.recipes": ("engine.recipes",),
    "train.cli": ("engine.arguments", "cli.train"),
    "train.evaluate": ("engine.evaluate", "cli.eval"),
    "train.distill": ("distill.teacher", "distill.loss"),
    "train.teacher_safety": ("distill.safety",),
    "train.relabel": ("distill.relabel", "cli.relabel"),
    "train.segmentation": ("tasks.segmentation.task", "engine.dense"),
    "train.points": ("tasks.points.task",),
    "train.seg_cli": ("cli.seg",),
    "train.points_cli": ("cli.points",),
    "train.compare": ("experiments.runner", "cli.compare"),
    "train.study": ("experiments.reproduce", "cli.study"),
    "train.study_rows": ("experiments.study",),
    "train.study_launch": ("experiments.launch",),
    "train.resolution": ("experiments.resolution",),
    "train.studies": ("experiments.papers",),
    "seg": ("tasks.segmentation",),
    "seg.data": ("tasks.segmentation.data",),
    "seg.infer": ("tasks.segmentation.infer",),
    "seg.metrics": ("tasks.segmentation.metrics",),
    "seg.models": ("tasks.segmentation.models",),
    "seg.synth": ("tasks.segmentation.synth",),
    "points": ("tasks.points",),
    "points.data": ("tasks.points.data",),
    "points.metrics": ("tasks.points.metrics",),
    "points.models": ("tasks.points.models",),
    "points.synth": ("tasks.points.synth",),
    "lm": ("tasks.lm",),
    "lm.model": ("tasks.lm.model",),
    "lm.data": ("tasks.lm.data",),
    "lm.decode": ("tasks.lm.decode",),
    "lm.train": ("tasks.lm.train",),
    "lm.bench": ("tasks.lm.bench",),
    "lm.targets": ("tasks.lm.targets",),
    "lm.baseline_configs": ("tasks.lm.baselines",),
    "lm.cli": ("cli.lm",),
    "convert": ("interop",),
    "convert.keymaps": ("interop.keymaps",),
    "convert.load": ("interop.convert",),
    "convert.transfer": ("interop.transfer",),
    "integrations": ("interop",),
    "integrations.timm": ("interop.timm",),
    "integrations.hf": ("interop.hf",),
    "pretrained": ("interop.pretrained",),
}


class OldPath(types.ModuleType):
    """An old import path: each name is looked up in the new modules, in order."""

    def __init__(self, name: str, targets: tuple[str, ...]) -> None:
        super().__init__(name, f"Deprecated: use {' / '.join(targets)}.")
        self.__path__: list[str] = []  # a package, so that its old submodules import too
        self._targets = targets

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        for target in self._targets:
            module = importlib.import_module(target)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r} (moved to {self._targets[0]})")

    def __dir__(self) -> list[str]:
        return sorted({n for t in self._targets for n in dir(importlib.import_module(t))})


class OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`OLD_PATHS` (and nothing else) for the import system."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname.startswith("vitlab.") and fullname[len("vitlab.") :] in OLD_PATHS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> OldPath:
        targets = tuple(f"vitlab.{t}" for t in OLD_PATHS[spec.name[len("vitlab.") :]])
        warnings.warn(
            f"{spec.name} is deprecated and will be removed in the next release; import {' / '.join(targets)}",
            DeprecationWarning,
            stacklevel=2,
        )
        return OldPath(spec.name, targets)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Put the finder first on the import path (once)."""
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, OldPathFinder())
