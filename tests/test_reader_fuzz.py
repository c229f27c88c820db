"""The classification readers answer hostile files with one line: a seeded fuzz of every reader's inputs.

A small valid instance of each reader's input (Oxford-IIIT Pets, Flowers-102, CIFAR-100, WebDataset shards with
their ``shards.json``, a ``save_pretrained`` model folder) is damaged in seeded ways: truncated, replaced by
random bytes, bytes flipped, JSON values of the wrong type, a named pipe in place of a file, a file in place of a
folder, ``../`` and absolute names in the lists that name files. Every outcome is either a success or one
``ValueError`` / ``FileNotFoundError`` / ``NotADirectoryError`` / ``PermissionError`` of one line (what the CLI
prints as ``vitlab CMD: error: ...``); a warning is one line too. A reader that blocks (a pipe read as a file)
is stopped by an alarm and fails the test, as does any other exception.

The cases are drawn from fixed seeds, each reader's instance is restored after each case, and nothing depends
on the thread count, the CPU or the order of the tests. The whole module takes a few seconds.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pickle
import random
import shutil
import signal
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitlab
from hangs import Hang, deadline
from vitlab.data import create_loader, create_transform, open_source
from vitlab.data.wds import count_shard, iter_shard

ONE_LINE = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError)
OUTCOMES: collections.Counter = collections.Counter()  # printed at the end (pytest -s)
HANG_SECONDS = 15
pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo") or not hasattr(signal, "SIGALRM"), reason="POSIX only")


def attempt(what: str, case: str, read: Callable[[], object]) -> str:
    """Run one reader on one damaged input: "ok", or "refused" after a one-line project error."""
    with warnings.catch_warnings(record=True) as caught, deadline(HANG_SECONDS):
        warnings.simplefilter("always")
        try:
            read()
            outcome = "ok"
        except ONE_LINE as e:
            message = str(e)
            assert message and "\n" not in message, f"{what} / {case}: a message of several lines: {message!r}"
            outcome = "refused"
        except Hang:
            pytest.fail(f"{what} / {case}: the reader blocked for {HANG_SECONDS} s")
        except BaseException as e:  # the bug this test exists for
            pytest.fail(f"{what} / {case}: escaped with {type(e).__name__}: {e}")
    for w in caught:
        assert "\n" not in str(w.message), f"{what} / {case}: a warning of several lines: {w.message}"
    OUTCOMES[f"{what}: {outcome}"] += 1
    return outcome


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    print(f"\nreader fuzz: {sum(OUTCOMES.values())} damaged inputs")
    for key, value in sorted(OUTCOMES.items()):
        print(f"  {key}: {value}")


# ----------------------------------------------------------------------------------------------- mutations
JSON_VALUES = [None, "x", "", 1.5, -1, 0, 10**30, True, [], {}, [1, 2], "../x.tar", "/etc/passwd", {"a": 1}]


def byte_mutations(data: bytes, rng: random.Random, n: int) -> Iterator[tuple[str, bytes]]:
    """``n`` each of: truncations, random bytes, 1-8 flipped bytes."""
    for i in range(n):
        yield f"cut{i}", data[: rng.randrange(len(data))]
        yield f"random{i}", rng.randbytes(rng.choice([0, 1, 7, 100, 600, len(data)]))
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        yield f"flip{i}", bytes(b)


def json_paths(value, prefix=()) -> Iterator[tuple]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from json_paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):
            yield from json_paths(v, (*prefix, i))


def json_mutations(data: bytes, rng: random.Random, n: int) -> Iterator[tuple[str, bytes]]:
    """``n`` copies of a JSON document with one value (anywhere in it) replaced by a value of another type."""
    doc = json.loads(data)
    paths = [p for p in json_paths(doc) if p]
    for i in range(n):
        changed = json.loads(data)
        path = rng.choice(paths)
        parent = changed
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = rng.choice(JSON_VALUES)
        yield f"json{i}:{'.'.join(map(str, path))}", json.dumps(changed).encode()
    yield "json:list", json.dumps([doc]).encode()
    yield "json:deep", b"[" * 100_000  # deeper than the parser's recursion limit


@contextlib.contextmanager
def replaced(path: Path, content: bytes | str) -> Iterator[None]:
    """``path`` holding ``content`` (bytes), a named pipe ("fifo") or a folder ("dir") for the block."""
    backup = path.with_name(path.name + ".fuzz-orig")
    path.rename(backup)
    try:
        if content == "fifo":
            os.mkfifo(path)
        elif content == "dir":
            path.mkdir()
        else:
            path.write_bytes(content)
        yield
    finally:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        backup.rename(path)


def fuzz_file(what: str, path: Path, read: Callable[[], object], seed: int, n: int, as_json: bool = False) -> None:
    rng = random.Random(seed)
    data = path.read_bytes()
    cases = list(byte_mutations(data, rng, n))
    if as_json:
        cases += list(json_mutations(data, rng, 3 * n))
    cases += [("fifo", "fifo"), ("dir", "dir")]
    for case, content in cases:
        with replaced(path, content):
            attempt(what, f"{path.name} {case}", read)
    assert attempt(what, "restored", read) == "ok"


# ----------------------------------------------------------------------------------------------- instances
def jpeg(path: Path, colour: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (12, 10), (colour, 255 - colour, 128)).save(path, "JPEG")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reader-fuzz")


@pytest.fixture(scope="module")
def pets(root) -> Path:
    folder = root / "pets"
    (folder / "annotations").mkdir(parents=True)
    rows = []
    for cid, breed in enumerate(("Abyssinian", "beagle", "Bengal"), 1):
        for k in range(1, 3):
            jpeg(folder / "images" / f"{breed}_{k}.jpg", 60 * cid + k)
            rows.append(f"{breed}_{k} {cid} {1 + (cid == 2)} {cid}")
    (folder / "annotations" / "trainval.txt").write_text("#Image CLASS-ID SPECIES BREED ID\n" + "\n".join(rows) + "\n")
    (folder / "annotations" / "test.txt").write_text("\n".join(rows[::2]) + "\n")
    jpeg(root / "outside" / "secret.jpg", 7)  # what a ../ name would read
    return folder


def read_pets(folder: Path) -> Callable[[], object]:
    def read():
        source = open_source(f"pets:{folder}", "train")
        return [source.read(i) for i in range(len(source))]

    return read


def test_pets(pets, root):
    read = read_pets(pets)
    listing = pets / "annotations" / "trainval.txt"
    fuzz_file("pets split file", listing, read, seed=1, n=16)
    rng = random.Random(2)
    names = ["../../outside/secret", str(root / "outside" / "secret"), "../images/Bengal_1", "Bengal_1/../../x",
             "beagle_1\x00", "", "~", "beagle_1 ten", "beagle_1 2 2 2\nbeagle_1 3 1 3"]  # fmt: skip
    lines = listing.read_text().splitlines()
    for i, name in enumerate(names * 2):
        changed = list(lines)
        changed[rng.randrange(1, len(lines))] = (
            f"{name} {rng.randint(1, 37) if i < len(names) else rng.randint(0, 40)} 1 1"
        )
        with replaced(listing, ("\n".join(changed) + "\n").encode()):
            attempt("pets split file", f"name{i} {name!r}", read)
    for image in ("images/beagle_1.jpg", "images/Bengal_2.jpg"):
        with replaced(pets / image, "fifo"):
            attempt("pets image", f"{image} fifo", read)
    for folder in ("images", "annotations"):
        backup = pets / f"{folder}.orig"
        (pets / folder).rename(backup)
        (pets / folder).write_bytes(b"not a folder")
        try:
            attempt("pets layout", f"{folder} is a file", read)
        finally:
            (pets / folder).unlink()
            backup.rename(pets / folder)
    assert attempt("pets", "restored", read) == "ok"


@pytest.fixture(scope="module")
def flowers(root) -> Path:
    sio = pytest.importorskip("scipy.io")
    folder = root / "flowers"
    labels = np.array([[1, 2, 102, 1, 2, 102, 5, 5]], dtype=np.uint8)
    for i in range(1, 9):
        jpeg(folder / "jpg" / f"image_{i:05d}.jpg", 20 * i)
    sio.savemat(folder / "imagelabels.mat", {"labels": labels})
    ids = {"trnid": np.array([[1, 2]], np.uint16), "valid": np.array([[3, 7]], np.uint16)}
    sio.savemat(folder / "setid.mat", {**ids, "tstid": np.array([[4, 5, 6, 8]], np.uint16)})
    return folder


def test_flowers(flowers):
    sio = pytest.importorskip("scipy.io")

    def read():
        source = open_source(f"flowers102:{flowers}", "train")
        return [source.read(i) for i in range(len(source))]

    fuzz_file("flowers imagelabels.mat", flowers / "imagelabels.mat", read, seed=3, n=12)
    fuzz_file("flowers setid.mat", flowers / "setid.mat", read, seed=4, n=12)
    rng = random.Random(5)
    values = [1.5, -1, 0, 1e30, np.nan, 103, 2**40]
    shapes = [(8,), (1, 8), (8, 1), (2, 4), (2, 2, 2), (0,), (1, 1)]
    original = (flowers / "imagelabels.mat").read_bytes()
    for i in range(16):
        labels = np.array([1, 2, 102, 1, 2, 102, 5, 5], dtype=np.float64)
        labels[rng.randrange(8)] = rng.choice(values)
        shape = rng.choice(shapes)
        labels = labels[: int(np.prod(shape))].reshape(shape)
        try:
            sio.savemat(flowers / "imagelabels.mat", {"labels": labels})
            attempt("flowers labels", f"labels{i} {shape}", read)
        finally:
            (flowers / "imagelabels.mat").write_bytes(original)
    with replaced(flowers / "jpg" / "image_00003.jpg", "fifo"):
        attempt("flowers image", "fifo", read)
    assert attempt("flowers", "restored", read) == "ok"


@pytest.fixture(scope="module")
def cifar(root) -> Path:
    folder = root / "c100" / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in (("train", 5), ("test", 3)):
        fine = [int(x) for x in rng.integers(0, 100, n)]
        record = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"fine_labels": fine,
                  b"coarse_labels": [f // 5 for f in fine], b"filenames": [b"x.png"] * n}  # fmt: skip
        (folder / name).write_bytes(pickle.dumps(record, protocol=2))
    meta = {b"fine_label_names": [f"c{i}".encode() for i in range(100)], b"coarse_label_names": [b"c"] * 20}
    (folder / "meta").write_bytes(pickle.dumps(meta, protocol=2))
    return folder


def test_cifar100(cifar):
    def read():
        return open_source(f"cifar100:{cifar.parent}", "train")

    fuzz_file("cifar100 train", cifar / "train", read, seed=6, n=20)
    fuzz_file("cifar100 meta", cifar / "meta", read, seed=7, n=10)
    rng = random.Random(8)
    images = np.zeros((3, 3072), np.uint8)
    for i in range(12):
        labels = [1, 2, 3]
        labels[rng.randrange(3)] = rng.choice([10**30, -(10**30), 1.5, 100, -1, "7", None, [1], b"\x00", True])
        record = {b"data": images[: rng.choice([0, 3, 3, 2])], b"fine_labels": labels if rng.random() < 0.9 else []}
        with replaced(cifar / "train", pickle.dumps(record, protocol=2)):
            attempt("cifar100 labels", f"labels{i} {labels!r}", read)
    assert attempt("cifar100", "restored", read) == "ok"


@pytest.fixture(scope="module")
def shards(root) -> Path:
    from vitlab.data.shard_writer import write_shards

    src = root / "shard-src"
    for split, n in (("train", 3), ("val", 2)):
        for c in ("a", "b"):
            for k in range(n):
                jpeg(src / split / c / f"{k}.jpg", 40 * k + (c == "b") * 100)
    write_shards(src, root / "shards", shard_size=3)
    return root / "shards"


def test_webdataset_manifest_and_shards(shards):
    transform = create_transform(8, is_training=True)

    def read():
        source = open_source(f"wds:{shards}", "train")
        for shard in source.shards:
            count_shard(shard)
            list(iter_shard(shard))
        return list(create_loader(source, transform, 2, is_training=True, workers=0, shuffle_buffer=0))

    fuzz_file("wds shards.json", shards / "shards.json", read, seed=9, n=10, as_json=True)
    fuzz_file("wds shard", shards / "train-000000.tar", read, seed=10, n=16)

    def read_pattern():
        source = open_source(f"wds:{shards}/train-{{000000..000001}}.tar", "train")
        return [list(iter_shard(s)) for s in source.shards]

    fuzz_file("wds pattern shard", shards / "train-000001.tar", read_pattern, seed=11, n=6)


@pytest.fixture(scope="module")
def model_folder(root) -> Path:
    torch.manual_seed(0)
    vitlab.create_model("deit_mini", num_classes=3, depth=1).save_pretrained(root / "model")
    return root / "model"


def test_model_folder(model_folder):
    def read():
        return vitlab.from_pretrained(model_folder)

    fuzz_file("model config.json", model_folder / "config.json", read, seed=12, n=8, as_json=True)
    fuzz_file("model weights", model_folder / "model.safetensors", read, seed=13, n=12)
