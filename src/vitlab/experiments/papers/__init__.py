"""The papers' ablation tables as studies: the catalogue of ``vitlab study``, one file per paper.

Each :class:`Study` is one table of a paper (or one question its text answers with numbers). A row names a small
registered model (``*_mini``, for the embedded data on a CPU) and the paper-size model it stands for (a
registered name plus the switch as constructor overrides), and carries the paper's own figures. ``vitlab study
NAME`` trains the rows (:mod:`vitlab.experiments.reproduce`); docs/studies.md lists them with the reading of each table.

The tables live in their paper's file: :mod:`.refiner`, :mod:`.tnt`, :mod:`.cpvt`, :mod:`.deepvit`,
:mod:`.external` (External Attention, EAMLP and its segmentation head) and :mod:`.aft`; the three papers'
detection tables share :mod:`.detection`; a table on baselines only lives with the paper whose table it is. This module only assembles them.

The papers' numbers are ImageNet top-1 (%) unless a study says otherwise; ``None`` marks a row whose number the
sources vitlab was built from do not give (the table exists in the paper, its values were not available).
"""

from __future__ import annotations

from typing import Any

from ...common.registry import Registry
from ..study import Row, Study
from . import aft, cpvt, deepvit, detection, external, refiner, tnt

__all__ = ["RESOLUTION_TABLES", "STUDIES", "STUDY_LIST", "Row", "Study"]

STUDY_LIST: list[Study] = [
    *refiner.TABLES,
    *tnt.TABLES,
    *cpvt.TABLES,
    *deepvit.TABLES,
    *external.TABLES,
    *aft.TABLES,
    *detection.TABLES,
]
# the resolution tables (one checkpoint evaluated at other sizes), in the order `vitlab study --list` prints them;
# vitlab.experiments.resolution builds its studies from these fields
RESOLUTION_TABLES: list[dict[str, Any]] = [cpvt.RESOLUTION_TABLE, aft.RESOLUTION_TABLE]

_names = [s.name for s in STUDY_LIST]
if len(set(_names)) != len(_names):  # the registry is keyed by name: a second table of one name would hide the first
    raise ValueError(f"studies named twice: {sorted({n for n in _names if _names.count(n) > 1})}")

STUDIES: Registry[Study] = Registry(
    "study",
    lambda s: (lambda: s, {}),
    rows={s.name: s for s in STUDY_LIST},
    listed_by="vitlab study --list",
)
