"""The VOC, ADE20K, ModelNet40 and ShapeNet-Part readers answer damaged and hostile folders with one line.

A tiny valid instance of each dataset in its official layout is copied and mutated, one mutation at a time,
from a seeded generator: images, masks, HDF5 parts and shape files truncated, overwritten with random bytes,
bytes flipped, replaced by text, by a named pipe, a folder, a symlink out of the dataset or nothing; split
lists given ``../`` and absolute ids, binary junk, duplicates; HDF5 parts rewritten with wrong dtypes and
shapes, NaN and infinite points, external and soft links, virtual datasets, external storage, unwritten
datasets, labels out of range or fractional. Each copy is opened and a few samples are read (the segmentation
readers decode lazily). Every outcome is either data that passes the readers' own promises (finite points,
labels in range) or ValueError / FileNotFoundError / NotADirectoryError / PermissionError with a one-line
message; nothing blocks on a pipe. Everything follows fixed seeds: no dependence on threads, CPU or order.
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from hangs import unblocked
from vitlab.tasks.points import open_points
from vitlab.tasks.points.synth import make_modelnet40, make_shapenet_part
from vitlab.tasks.segmentation import open_masks
from vitlab.tasks.segmentation.synth import make_mask_folder

try:
    import h5py
except ImportError:  # the ModelNet40 cases need it (vitlab[points])
    h5py = None

ONE_LINE_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError)
HAVE_FIFO = hasattr(os, "mkfifo")
CASES_PER_FILE = 6  # seeded mutations drawn for every file of an instance, beside the fixed ones


# --------------------------------------------------------------------------- running one case


FIFOS: list[Path] = []  # the pipes of the case being read (unblocked frees them)


def outcome(case: str, read: Callable[[], None]) -> str:
    """ "ok" or the name of the one-line error ``read`` raised; anything else fails the test naming ``case``."""
    try:
        unblocked(read, FIFOS)
    except ONE_LINE_ERRORS as e:
        message = str(e)
        assert message and "\n" not in message, f"{case}: {type(e).__name__} of more than one line: {message!r}"
        return type(e).__name__
    except Exception as e:
        pytest.fail(f"{case}: {type(e).__name__} escaped the reader: {e}")
    return "ok"


# --------------------------------------------------------------------------- mutations


def png_bomb_header() -> bytes:
    """A PNG whose header declares 60000 x 60000 grey pixels (valid CRC), with a tiny, short IDAT."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 60000, 60000, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def byte_mutations(rng: random.Random, data: bytes) -> list[tuple[str, bytes]]:
    """Seeded damages of a file's bytes: truncations, flipped bytes, random bytes."""
    out = []
    for i in range(CASES_PER_FILE):
        kind = rng.choice(("truncate", "flip", "random"))
        if kind == "truncate":
            out.append((f"truncate{i}", data[: rng.randrange(max(len(data), 1))]))
        elif kind == "flip":
            b = bytearray(data)
            for _ in range(rng.choice((1, 2, 8, 32))):
                b[rng.randrange(len(b))] = rng.randrange(256)
            out.append((f"flip{i}", bytes(b)))
        else:
            out.append((f"random{i}", rng.randbytes(rng.randrange(2048))))
    return out


def file_mutations(rng: random.Random, path: Path, outside: Path) -> list[tuple[str, Callable[[Path], None]]]:
    """(name, apply) of the mutations of one file of an instance (``apply`` takes the file in a fresh copy)."""
    data = path.read_bytes()

    def write(content: bytes):
        return lambda p: p.write_bytes(content)

    def fifo(p: Path) -> None:
        p.unlink()
        os.mkfifo(p)
        FIFOS.append(p)

    def folder(p: Path) -> None:
        p.unlink()
        p.mkdir()

    def symlink_out(p: Path) -> None:
        target = outside / f"copy-{p.name}"
        target.write_bytes(p.read_bytes())
        p.unlink()
        p.symlink_to(target)

    out = [(name, write(content)) for name, content in byte_mutations(rng, data)]
    out += [("empty", write(b"")), ("text", write(b"hello, not the data\n")), ("missing", Path.unlink)]
    out += [("folder", folder), ("symlink-out", symlink_out), ("png-bomb", write(png_bomb_header()))]
    if HAVE_FIFO:
        out.append(("fifo", fifo))
    return out


# --------------------------------------------------------------------------- the instances and their reads


def check_masks(spec: str) -> Callable[[], None]:
    def read() -> None:
        for split in ("train", "val"):
            ds = open_masks(spec, split)
            for i in range(min(3, len(ds))):
                image, mask = ds.load(i)
                assert image.dtype == torch.uint8 and image.shape[0] == 3 and mask.shape == image.shape[1:]
                assert bool(((mask >= 0) & (mask < ds.num_classes) | (mask == 255)).all())

    return read


def check_points(spec: str) -> Callable[[], None]:
    def read() -> None:
        for split in ("train", "test"):
            ps = open_points(spec, split)
            assert len(ps) > 0 and bool(torch.isfinite(ps.points).all())
            assert int(ps.labels.min()) >= 0 and int(ps.labels.max()) < ps.num_classes
            if ps.parts is not None:
                assert int(ps.parts.min()) >= 0 and int(ps.parts.max()) < 50
            x, y = ps.get_batch(torch.arange(min(3, len(ps))))
            assert len(x) == len(y) == min(3, len(ps))

    return read


def line_mutations(name: str) -> list[tuple[str, bytes]]:
    """Hostile split lists / file lists of text lines (``name``: a valid line)."""
    return [
        ("dotdot", f"../../outside/{name}\n{name}\n".encode()),
        ("absolute", f"/etc/{name}\n".encode()),
        ("nul", f"{name}\0x\n".encode()),
        ("binary", bytes(range(256)) * 4),
        ("not-utf8", b"\xff\xfe\xfa\n"),
        ("long", b"a" * 100_000 + b"\n"),
        ("blank", b"\n \n\t\n"),
        ("unknown", b"no_such_file\n"),
        ("duplicate", f"{name}\n{name}\n".encode()),
    ]


def run_cases(
    base: Path, work: Path, spec_of: Callable[[Path], str], check: Callable[[str], Callable[[], None]], cases: list
) -> collections.Counter:
    """Apply each (label, relative path, apply) case to a fresh copy of ``base`` and read it."""
    tally: collections.Counter = collections.Counter()
    for n, (label, rel, apply) in enumerate(cases):
        copy = work / f"case{n}"
        shutil.copytree(base, copy, symlinks=True)
        FIFOS.clear()
        apply(copy / rel)
        tally[outcome(f"{label} on {rel}", check(spec_of(copy)))] += 1
        shutil.rmtree(copy)
    FIFOS.clear()
    return tally


def cases_for_files(rng: random.Random, base: Path, files: list[str], outside: Path) -> list:
    return [(label, rel, apply) for rel in files for label, apply in file_mutations(rng, base / rel, outside)]


def text_cases(rel: str, contents: list[tuple[str, bytes]]) -> list:
    def write(content: bytes):
        return lambda p: p.write_bytes(content)

    return [(label, rel, write(content)) for label, content in contents]


# --------------------------------------------------------------------------- the test


@pytest.mark.parametrize("layout", ["voc", "ade20k"])
def test_segmentation_readers_answer_every_mutation_in_one_line(tmp_path, layout):
    rng = random.Random(f"seg-{layout}")
    outside = tmp_path / "outside"
    outside.mkdir()
    base = make_mask_folder(tmp_path / "base", layout, train=2, val=1, size=(12, 14), classes=3, seed=1)
    if layout == "voc":
        files = ["JPEGImages/train_00000.jpg", "SegmentationClass/train_00001.png", "SegmentationClass/val_00000.png"]
        cases = cases_for_files(rng, base, files, outside)
        cases += text_cases("ImageSets/Segmentation/train.txt", line_mutations("train_00000"))
    else:
        files = ["images/training/train_00000.jpg", "annotations/training/train_00001.png",
                 "annotations/validation/val_00000.png"]  # fmt: skip
        cases = cases_for_files(rng, base, files, outside)
        header = "Idx,Ratio,Train,Val,Name\n"
        cases += text_cases("objectInfo150.csv", [
            ("names", (header + "".join(f"{k},0,0,0,n{k};x\n" for k in range(1, 151))).encode()),
            ("names-short", (header + "1,0,0,0,wall\n").encode()),
            ("names-junk", bytes(range(256))),
            ("names-escape", (header + "".join(f"{k},0,0,0,\x1b[31mred\n" for k in range(1, 151))).encode()),
        ])  # fmt: skip
        if HAVE_FIFO:
            cases.append(("names-fifo", "objectInfo150.csv", lambda p: (os.mkfifo(p), FIFOS.append(p))))
        cases.append(("newline-name", "images/training/a\nb.jpg", lambda p: p.write_bytes(b"x")))
    tally = run_cases(base, tmp_path, lambda p: f"{layout}:{p}", check_masks, cases)
    assert tally["ok"] and sum(tally.values()) - tally["ok"] > len(cases) // 2, tally


def rewrite_h5(**datasets) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        path.unlink()
        with h5py.File(path, "w") as h5:
            for name, value in datasets.items():
                if callable(value):
                    value(h5, name, path)
                else:
                    h5.create_dataset(name, data=value)

    return apply


POINTS = np.random.default_rng(0).normal(size=(4, 8, 3)).astype(np.float32)
LABELS = np.array([[0], [1], [2], [0]], np.uint8)


def h5_variants() -> list[tuple[str, Callable[[Path], None]]]:
    def external_link(h5, name, path):
        h5[name] = h5py.ExternalLink("ply_data_test0.h5", f"/{name}")

    def soft_link(h5, name, path):
        h5.create_dataset("hidden", data=POINTS if name == "data" else LABELS)
        h5[name] = h5py.SoftLink("/hidden")

    def virtual(source):
        def make(h5, name, path):
            shape, dtype = (POINTS.shape, np.float32) if name == "data" else (LABELS.shape, np.uint8)
            layout = h5py.VirtualLayout(shape, dtype)
            layout[:] = h5py.VirtualSource(source, name, shape=shape)
            h5.create_virtual_dataset(name, layout, fillvalue=0)

        return make

    def external_storage(h5, name, path):
        (path.parent / "raw.bin").write_bytes(POINTS.tobytes())
        h5.create_dataset(name, shape=POINTS.shape, dtype="f4", external=[("raw.bin", 0, POINTS.nbytes)])

    def unwritten(h5, name, path):
        h5.create_dataset(name, shape=POINTS.shape, dtype="f4", chunks=(1, 8, 3), compression="gzip")

    def bomb(h5, name, path):
        h5.create_dataset(name, shape=(400_000, 2048, 3), dtype="f4", chunks=(4, 2048, 3), compression="gzip")

    def group(h5, name, path):
        h5.create_group(name)

    def empty(h5, name, path):
        h5.create_dataset(name, data=h5py.Empty("f4"))

    compound = np.zeros((4, 8, 3), dtype=[("a", "f4"), ("b", "i4")])
    return [
        ("external-link", rewrite_h5(data=external_link, label=LABELS)),
        ("soft-link", rewrite_h5(data=soft_link, label=LABELS)),
        ("label-external-link", rewrite_h5(data=POINTS, label=external_link)),
        ("virtual-missing", rewrite_h5(data=virtual("missing.h5"), label=LABELS)),
        ("virtual-present", rewrite_h5(data=virtual("ply_data_test0.h5"), label=LABELS)),
        ("label-virtual", rewrite_h5(data=POINTS, label=virtual("ply_data_test0.h5"))),
        ("external-storage", rewrite_h5(data=external_storage, label=LABELS)),
        ("unwritten", rewrite_h5(data=unwritten, label=LABELS)),
        ("bomb", rewrite_h5(data=bomb, label=np.zeros((400_000, 1), np.uint8))),
        ("group", rewrite_h5(data=group, label=LABELS)),
        ("null", rewrite_h5(data=empty, label=LABELS)),
        ("strings", rewrite_h5(data=np.array([[[b"a", b"b", b"c"]]] * 4), label=LABELS)),
        ("vlen-strings", rewrite_h5(data=POINTS, label=np.array(["a", "b", "c", "d"], dtype=h5py.string_dtype()))),
        ("compound", rewrite_h5(data=compound, label=LABELS)),
        ("bool", rewrite_h5(data=POINTS > 0, label=LABELS)),
        ("2d", rewrite_h5(data=POINTS[:, :, 0], label=LABELS)),
        ("4-channels", rewrite_h5(data=np.concatenate([POINTS, POINTS[..., :1]], -1), label=LABELS)),
        ("no-shapes", rewrite_h5(data=POINTS[:0], label=LABELS[:0])),
        ("no-points", rewrite_h5(data=POINTS[:, :0], label=LABELS)),
        ("nan", rewrite_h5(data=np.where(POINTS > 1, np.nan, POINTS), label=LABELS)),
        ("inf", rewrite_h5(data=np.where(POINTS > 1, np.inf, POINTS), label=LABELS)),
        ("float64-overflow", rewrite_h5(data=POINTS.astype(np.float64) * 1e300, label=LABELS)),
        ("int-points", rewrite_h5(data=(POINTS * 10).astype(np.int16), label=LABELS)),
        ("label-half", rewrite_h5(data=POINTS, label=LABELS + 0.5)),
        ("label-40", rewrite_h5(data=POINTS, label=LABELS + 40)),
        ("label-negative", rewrite_h5(data=POINTS, label=LABELS.astype(np.int8) - 1)),
        ("label-nan", rewrite_h5(data=POINTS, label=np.full((4, 1), np.nan))),
        ("label-count", rewrite_h5(data=POINTS, label=LABELS[:3])),
        ("label-3d", rewrite_h5(data=POINTS, label=np.zeros((4, 1, 1), np.uint8))),
        ("no-label", rewrite_h5(data=POINTS)),
        ("other-points-per-shape", rewrite_h5(data=np.zeros((4, 5, 3), np.float32), label=LABELS)),
    ]


@pytest.mark.skipif(h5py is None, reason="h5py (vitlab[points]) is not installed")
def test_modelnet40_reader_answers_every_mutation_in_one_line(tmp_path):
    rng = random.Random("modelnet40")
    outside = tmp_path / "outside"
    outside.mkdir()
    base = make_modelnet40(tmp_path / "base", train=4, test=2, points=8, classes=3, seed=1)
    cases = cases_for_files(rng, base, ["ply_data_train0.h5", "shape_names.txt"], outside)
    cases += [(label, "ply_data_train0.h5", apply) for label, apply in h5_variants()]
    official = "data/modelnet40_ply_hdf5_2048/ply_data_train0.h5"
    cases += text_cases("train_files.txt", line_mutations("ply_data_train0.h5"))
    cases += text_cases("train_files.txt", [("official", f"{official}\n".encode()),
                                            ("official-dotdot", b"data/../../ply_data_train0.h5\n")])  # fmt: skip
    tally = run_cases(base, tmp_path, lambda p: f"modelnet40:{p}", check_points, cases)
    assert tally["ok"] and sum(tally.values()) - tally["ok"] > len(cases) // 2, tally


def test_shapenet_part_reader_answers_every_mutation_in_one_line(tmp_path):
    rng = random.Random("shapenetpart")
    outside = tmp_path / "outside"
    outside.mkdir()
    base = make_shapenet_part(tmp_path / "base", per_split=2, points=12, categories=2, seed=1)
    shape = "02691156/train0000.txt"
    cases = cases_for_files(rng, base, [shape, "synsetoffset2category.txt"], outside)
    rows = np.loadtxt(base / shape, ndmin=2)

    def rows_with(i: int, j: int, value: float) -> bytes:
        changed = rows.copy()
        changed[i, j] = value
        return "".join(" ".join(f"{v:.5f}" for v in row) + "\n" for row in changed).encode()

    cases += text_cases(shape, [
        ("nan", rows_with(2, 0, np.nan)), ("inf", rows_with(2, 1, np.inf)), ("huge", rows_with(2, 2, 1e300)), ("part-half", rows_with(2, -1, 2.5)),
        ("part-50", rows_with(2, -1, 50)), ("part-negative", rows_with(2, -1, -1)),
        ("one-column", b"1.0\n2.0\n"), ("ragged", b"1 2 3 4 5 6 0\n1 2 3\n"), ("words", b"a b c d e f g\n"),
    ])  # fmt: skip
    split = "train_test_split/shuffled_train_file_list.json"
    entries = [
        ("dotdot", ["shape_data/../train0000"]),
        ("dotdot-deep", ["shape_data/02691156/../../../etc/passwd"]),
        ("absolute", ["/etc/passwd"]),
        ("unlisted-synset", ["shape_data/99999999/x"]),
        ("not-strings", [1, 2]),
        ("nested", [["shape_data/02691156/train0000"]]),
        ("newline", ["shape_data/02691156/a\nb"]),
        ("nul", ["shape_data/02691156/a\0b"]),
    ]
    cases += text_cases(split, [(label, json.dumps(value).encode()) for label, value in entries])
    cases += text_cases(split, [("object", b"{}"), ("empty-list", b"[]"), ("not-json", b"[\"a\", "),
                                ("not-utf8", b"\xff\xfe")])  # fmt: skip
    cases += text_cases("synsetoffset2category.txt", [
        ("one-word", b"Airplane\n"), ("seventeen", "".join(f"C{i}\t{i:08d}\n" for i in range(17)).encode()),
        ("duplicate", b"Airplane\t02691156\nBag\t02691156\n"), ("dotdot", b"Airplane\t..\n"),
    ])  # fmt: skip
    tally = run_cases(base, tmp_path, lambda p: f"shapenetpart:{p}", check_points, cases)
    assert tally["ok"] and sum(tally.values()) - tally["ok"] > len(cases) // 2, tally
