"""Cityscapes' fine annotations (Cordts et al. 2016) in the layout its two archives unpack to::

    ROOT/leftImg8bit/{train,val}/<city>/<city>_<seq>_<frame>_leftImg8bit.png       8-bit RGB images
    ROOT/gtFine/{train,val}/<city>/<city>_<seq>_<frame>_gtFine_labelIds.png        one-channel label ids

``leftImg8bit_trainvaltest.zip`` and ``gtFine_trainvaltest.zip`` both unpack into the folder they are opened in
(no dataset folder of their own, unlike VOC's ``VOCdevkit/VOC2012``), so ``ROOT`` is that folder.

The masks hold the 34 label ids of the annotation protocol (0..33); the benchmark scores 19 of them, renumbered
as *train ids* 0..18 (:data:`TRAIN_IDS`), and every other id (void, ego vehicle, parking, rail track, guard
rail, bridge, tunnel, pole group, caravan, trailer) becomes 255, ignored. A mask value that is no label id
(34..254) means the file is not a ``*_gtFine_labelIds.png``: it is refused. The ``*_labelTrainIds.png`` files
that the dataset's own scripts can generate are not needed; the mapping is made here, when a mask is read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ...data.safe_files import DataFileError, inside_root
from ...engine.dense import IGNORE_INDEX

IMAGE_SUFFIX, MASK_SUFFIX = "_leftImg8bit.png", "_gtFine_labelIds.png"

#: the 34 label ids of the annotation protocol, in id order: (name, train id or None when not scored)
LABELS: tuple[tuple[str, int | None], ...] = (
    ("unlabeled", None), ("ego vehicle", None), ("rectification border", None), ("out of roi", None),
    ("static", None), ("dynamic", None), ("ground", None), ("road", 0), ("sidewalk", 1), ("parking", None),
    ("rail track", None), ("building", 2), ("wall", 3), ("fence", 4), ("guard rail", None), ("bridge", None),
    ("tunnel", None), ("pole", 5), ("polegroup", None), ("traffic light", 6), ("traffic sign", 7),
    ("vegetation", 8), ("terrain", 9), ("sky", 10), ("person", 11), ("rider", 12), ("car", 13), ("truck", 14),
    ("bus", 15), ("caravan", None), ("trailer", None), ("train", 16), ("motorcycle", 17), ("bicycle", 18),
)  # fmt: skip
NUM_LABEL_IDS = len(LABELS)
#: label id -> train id (0..18), or 255 for the ids the benchmark does not score
TRAIN_IDS = {i: IGNORE_INDEX if t is None else t for i, (_, t) in enumerate(LABELS)}
#: the 19 scored classes, in train-id order
CLASSES = tuple(name for name, t in sorted((x for x in LABELS if x[1] is not None), key=lambda x: x[1]))
NUM_CLASSES = len(CLASSES)

EXPECTED = (
    "leftImg8bit/{train,val}/<city>/*_leftImg8bit.png and gtFine/{train,val}/<city>/*_gtFine_labelIds.png (the "
    "folder where leftImg8bit_trainvaltest.zip and gtFine_trainvaltest.zip unpack)"
)
FIX = "re-extract the file from leftImg8bit_trainvaltest.zip / gtFine_trainvaltest.zip, or remove the image"


def is_cityscapes(root: Path) -> bool:
    return (root / "leftImg8bit").is_dir() and (root / "gtFine").is_dir()


def _lookup() -> Tensor:
    """A 256-entry table: label id -> train id; 255 stays ignored; -1 marks a value that is no label id."""
    table = torch.full((256,), -1, dtype=torch.int64)
    for label_id, train_id in TRAIN_IDS.items():
        table[label_id] = train_id
    table[IGNORE_INDEX] = IGNORE_INDEX
    return table


_TABLE = _lookup()


def to_train_ids(mask: Tensor, path: Path) -> Tensor:
    """An ``int64`` mask of label ids -> train ids (0..18, 255 ignored); a value that is no label id is one line."""
    out = _TABLE[mask]  # the mask was decoded from 8 bits: 0..255
    bad = out < 0
    if bad.any():
        value = int(mask[bad][0])
        raise DataFileError(
            f"Cityscapes mask {path}: value {value} is not a Cityscapes label id (0..{NUM_LABEL_IDS - 1}): is it a "
            f"*{MASK_SUFFIX}? {FIX}"
        )
    return out


def pairs(root: Path, split: str) -> list[tuple[Path, Path]]:
    """(image, mask) paths of ``split`` ("train" / "val"): every ``*_leftImg8bit.png`` of every city folder, in
    name order, beside the ``*_gtFine_labelIds.png`` of the same city and frame; each inside its own folder."""
    image_dir, mask_dir = root / "leftImg8bit" / split, root / "gtFine" / split
    if not image_dir.is_dir():
        return []
    out = []
    for p in sorted(image_dir.glob(f"*/*{IMAGE_SUFFIX}")):
        city = p.parent.name
        if not (p.name.isprintable() and city.isprintable()):  # a line break would split every message naming it
            raise DataFileError(f"Cityscapes image {str(p)!r} has a control character in its name; rename or remove it")
        what = f"Cityscapes image {p}"
        fix = "the images and annotations must lie in the dataset folder itself"
        frame = p.name[: -len(IMAGE_SUFFIX)]
        # resolved against the split folders themselves: a city folder or file that is a symlink out is refused
        out.append((inside_root(image_dir, f"{city}/{p.name}", what, fix),
                    inside_root(mask_dir, f"{city}/{frame}{MASK_SUFFIX}", what, fix)))  # fmt: skip
    return out
