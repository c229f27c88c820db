"""COCO's instances format, read and checked before anything trusts it: :func:`read_instances` (the annotation file,
bounded, every entry checked), :func:`check_segmentation` and :func:`decode_mask` (polygons, compressed and
uncompressed RLE: checked here, decoded by pycocotools, whose C code trusts what it is given).

Each refusal is one :class:`~vitlab.data.safe_files.DataFileError` line naming the entry and what to do.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ...common.extras import require
from ...data.safe_files import MAX_UNPACKED_BYTES, DataFileError, read_regular

FIX = "correct the annotation file, or re-extract it from COCO's annotations_trainval2017.zip"
ANNOTATION_LIMIT = 2 << 30  # instances_train2017.json is ~450 MB
POLYGON_REACH = 1.0  # polygon points may lie this many image sizes outside the image (COCO's lie on it)


def bad(where: str, what: str, fix: str = FIX) -> DataFileError:
    return DataFileError(f"{where}: {what}; {fix}")


def is_int(v: Any) -> bool:
    # bounded: pycocotools keeps ids in numpy arrays, and math.isfinite overflows on a 400-digit integer
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1 << 53


def is_number(v: Any) -> bool:
    return is_int(v) or (isinstance(v, float) and math.isfinite(v))


def read_instances(path: str | Path) -> dict[str, Any]:
    """The checked content of a COCO instances file (module docstring): ``images``, ``annotations`` and
    ``categories`` lists, ``iscrowd`` defaulted to 0 and ``area`` to the box's where absent."""
    path = Path(path)
    data = read_regular(path, "COCO annotation file", FIX, ANNOTATION_LIMIT)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        detail = " ".join(str(e).split())[:120]
        raise DataFileError(f"COCO annotation file {path} is not JSON ({detail}); {FIX}") from None
    where = f"COCO annotation file {path}"
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), list) for k in ("images", "categories")):
        raise bad(where, "expected an object with images, annotations and categories lists")
    if not isinstance(doc.get("annotations"), list):
        raise bad(where, "it has no annotations list (an image-info file, not an instances file)")
    images: set[int] = set()
    for k, im in enumerate(doc["images"]):
        ok = isinstance(im, dict) and is_int(im.get("id")) and isinstance(im.get("file_name"), str)
        ok = ok and all(is_int(im.get(s)) and im[s] > 0 for s in ("height", "width"))
        if not ok:
            raise bad(where, f"image {k} needs an integer id, a file_name and positive integer height and width")
        if not im["file_name"].isprintable():  # a line break in a name would split every message naming it
            raise bad(where, f"image {k} has a control character in its file_name {im['file_name']!r:.80}")
        if im["height"] * im["width"] * 3 > MAX_UNPACKED_BYTES:
            raise bad(where, f"image {k} declares {im['width']} x {im['height']} pixels, more than any photograph")
        if im["id"] in images:
            raise bad(where, f"image id {im['id']} appears twice")
        images.add(im["id"])
    cats: set[int] = set()
    for k, c in enumerate(doc["categories"]):
        if not (isinstance(c, dict) and is_int(c.get("id")) and isinstance(c.get("name"), str)):
            raise bad(where, f"category {k} needs an integer id and a name")
        if c["id"] in cats:
            raise bad(where, f"category id {c['id']} appears twice")
        cats.add(c["id"])
    if not cats:
        raise bad(where, "it lists no categories")
    ann_ids: set[int] = set()
    for k, a in enumerate(doc["annotations"]):
        if not isinstance(a, dict) or not is_int(a.get("id")):
            raise bad(where, f"annotation {k} needs an integer id")
        at = f"annotation {k} (id {a['id']})"
        if a["id"] in ann_ids:
            raise bad(where, f"annotation id {a['id']} appears twice")
        ann_ids.add(a["id"])
        if not is_int(a.get("image_id")) or a["image_id"] not in images:
            raise bad(where, f"{at} names image id {a.get('image_id')!r:.40}, which is not among its images")
        if not is_int(a.get("category_id")) or a["category_id"] not in cats:
            raise bad(where, f"{at} names category id {a.get('category_id')!r:.40}, which is not among its categories")
        box = a.get("bbox")
        if not (isinstance(box, list) and len(box) == 4 and all(map(is_number, box))):
            raise bad(where, f"{at}: bbox must be four finite numbers x, y, width, height, got {box!r:.80}")
        if box[2] < 0 or box[3] < 0:
            raise bad(where, f"{at}: bbox {box} has a negative width or height")
        a.setdefault("iscrowd", 0)
        if a["iscrowd"] not in (0, 1) or isinstance(a["iscrowd"], bool):
            raise bad(where, f"{at}: iscrowd must be 0 or 1, got {a['iscrowd']!r:.40}")
        a.setdefault("area", box[2] * box[3])
        if not is_number(a["area"]) or a["area"] < 0:
            raise bad(where, f"{at}: area must be a finite number >= 0, got {a['area']!r:.40}")
        seg = a.get("segmentation")
        if seg is not None and not isinstance(seg, list | dict):
            raise bad(where, f"{at}: segmentation must be a list of polygons or an RLE object")
    return doc


def rle_counts(text: str) -> list[int]:
    """The run lengths of COCO's compressed RLE string (6-bit groups from ``'0'``, the sign in the last group's
    fifth bit, counts after the second as differences from the count two before); ValueError if malformed."""
    counts: list[int] = []
    p, n = 0, len(text)
    while p < n:
        x, shift, more = 0, 0, True
        while more:
            if p >= n:
                raise ValueError("the RLE string ends inside a count")
            c = ord(text[p]) - 48
            if not 0 <= c < 64:
                raise ValueError(f"the RLE string holds the character {text[p]!r}")
            x |= (c & 0x1F) << shift
            more = bool(c & 0x20)
            p, shift = p + 1, shift + 5
            if not more and c & 0x10:
                x -= 1 << shift  # sign-extend
        counts.append(x + counts[-2] if len(counts) > 2 else x)
    return counts


def check_segmentation(seg: Any, h: int, w: int, where: str, fix: str = FIX) -> list | dict:
    """``seg`` (polygons or RLE) when pycocotools can rasterise it safely for an ``h x w`` image: polygons of
    finite points near the image (those of fewer than three points dropped: they have no area, and pycocotools
    would read four numbers as a box), an RLE of size ``[h, w]`` whose runs cover its pixels exactly. A
    segmentation with no polygon left is an empty mask."""
    if isinstance(seg, list):
        polys = []
        for poly in seg:
            if not isinstance(poly, list) or len(poly) % 2 or not all(map(is_number, poly)):
                raise bad(where, "a polygon must be an even-length list of finite numbers x0, y0, x1, y1, ...", fix)
            xy = np.asarray(poly, dtype=np.float64).reshape(-1, 2)
            if len(xy) and (np.abs(xy - [w / 2, h / 2]) > (0.5 + POLYGON_REACH) * np.array([w, h])).any():
                raise bad(where, f"a polygon point lies far outside the {w} x {h} image", fix)
            if len(xy) >= 3:
                polys.append(poly)
        return polys if polys else {"size": [h, w], "counts": [h * w]}
    if not isinstance(seg, dict) or seg.get("size") != [h, w]:
        raise bad(where, f"an RLE segmentation must be an object with size [{h}, {w}] (the image's) and counts", fix)
    counts = seg.get("counts")
    if isinstance(counts, str | list) and len(counts) > 8 * (h * w + 1):  # more runs than pixels: not a mask
        raise bad(where, f"the RLE holds {len(counts)} runs or characters for {h * w} pixels", fix)
    if isinstance(counts, str):
        try:
            runs = rle_counts(counts)
        except ValueError as e:
            raise bad(where, str(e), fix) from None
    elif isinstance(counts, list) and all(map(is_int, counts)):
        runs = counts
    else:
        raise bad(where, "RLE counts must be a string (compressed) or a list of integers", fix)
    if any(r < 0 for r in runs) or sum(runs) != h * w:
        raise bad(where, f"the RLE runs do not cover the {h * w} pixels of the image exactly", fix)
    return seg


def decode_mask(seg: list | dict, h: int, w: int) -> np.ndarray:
    """``uint8 (h, w)`` mask of a checked segmentation (:func:`check_segmentation`), by pycocotools."""
    mask = require("pycocotools.mask", "decoding COCO masks", extra="detection")
    if isinstance(seg, list):
        rle = mask.merge(mask.frPyObjects(seg, h, w))
    elif isinstance(seg["counts"], list):
        rle = mask.frPyObjects(seg, h, w)
    else:
        rle = {"size": seg["size"], "counts": seg["counts"].encode("ascii")}
    return mask.decode(rle)
