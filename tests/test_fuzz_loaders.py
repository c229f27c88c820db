"""Every loader answers junk with one line: mutated checkpoints, safetensors files and CIFAR batches.

A few hundred damaged files (every first byte of a real vitlab checkpoint, random byte corruptions and
truncations, seeded) go through ``load_checkpoint``, ``read_checkpoint``, ``load_model`` and the CIFAR
reader. Each either loads (a damaged vitlab checkpoint only when nothing it holds changed: the checksum
catches flipped tensor bytes) or raises ValueError / FileNotFoundError with one line; no other exception
escapes. Malicious pickles (``os.system`` via ``__reduce__``) never run and are refused as asking to run code.
"""

from __future__ import annotations

import collections
import os
import pickle
import random
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import vitlab
from vitlab.checkpoint import load_checkpoint, save_checkpoint
from vitlab.data.readers import read_cifar_batch
from vitlab.interop import read_checkpoint, save_weights
from vitlab.interop.pretrained import load_model

KWARGS = dict(img_size=8, in_chans=1, num_classes=3, patch_size=4, embed_dim=8, depth=1, num_heads=2)
PROJECT_ERRORS = (ValueError, FileNotFoundError)
OUTCOMES: collections.Counter = collections.Counter()  # printed at the end (pytest -s)


def tiny_checkpoint(path: Path) -> Path:
    """A real (tiny) training checkpoint: model, AdamW state after one step, counters, options, RNG state."""
    torch.manual_seed(0)
    model = vitlab.create_model("deit_mini", **KWARGS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    opt.step()
    state = {
        "model_name": "deit_mini",
        "model_kwargs": KWARGS,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 1,
        "step": 1,
        "config": {"lr": 1e-3, "data": "mnist", "betas": (0.9, 0.999)},
        "metrics": {"val_top1": 12.5, "val_loss": 1.09},
        "rng": [torch.get_rng_state()],
    }
    return save_checkpoint(state, path)


def cifar_batch(path: Path, n: int = 6) -> Path:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    payload = {b"batch_label": b"fuzz", b"labels": rng.integers(0, 10, n).tolist(), b"data": data}
    path.write_bytes(pickle.dumps(payload, protocol=2))
    return path


def same(a, b) -> bool:
    """Deep equality of loaded checkpoints (tensors bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def attempt(what: str, load, path: Path):
    """Run one loader on one file: the result, or None after a project error (checked to be one line)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # non-finite weights from flipped safetensors bytes warn; fine here
            result = load(path)
    except PROJECT_ERRORS as e:
        message = str(e)
        assert message and "\n" not in message, f"{what}: a message of several lines: {message!r}"
        assert "weights_only" not in message, f"{what}: repeats torch's unsafe advice: {message}"
        OUTCOMES[f"{what}: one-line error"] += 1
        return None
    except BaseException as e:  # the bug this test exists for
        OUTCOMES[f"{what}: TRACEBACK"] += 1
        pytest.fail(f"{what} on {path.name} escaped with {type(e).__name__}: {e}")
    OUTCOMES[f"{what}: loaded"] += 1
    return result


def mutations(data: bytes, rng: random.Random, flips: int, cuts: int, regions=None):
    """(name, bytes): ``flips`` files with 1-8 bytes replaced (inside ``regions`` when given), ``cuts`` truncations."""
    for i in range(flips):
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            lo, hi = rng.choice(regions) if regions else (0, len(b))
            b[rng.randrange(lo, hi)] = rng.randrange(256)
        yield f"flip{i}", bytes(b)
    for i in range(cuts):
        yield f"cut{i}", data[: rng.randrange(len(data))]


def tensor_regions(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of the tensor data records inside a torch zip (stored uncompressed)."""
    out = []
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            if "/data/" in info.filename and not info.filename.endswith("serialization_id") and info.file_size:
                f.seek(info.header_offset + 26)
                name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
                start = info.header_offset + 30 + name_len + extra_len
                out.append((start, start + info.file_size))
    return out


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    """After the module: how many damaged files each loader saw and what came of them (shown with pytest -s)."""
    yield
    tried = sum(v for k, v in OUTCOMES.items() if not k.startswith(("checksum", "malicious")))
    print(f"\nloader fuzz: {tried} loads of damaged files")
    for key, value in sorted(OUTCOMES.items()):
        print(f"  {key}: {value}")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    ckpt = tiny_checkpoint(d / "good.pt")
    model = vitlab.create_model("deit_mini", **KWARGS)
    st = save_weights(model, d / "good.safetensors")
    return d, ckpt, st, cifar_batch(d / "good_batch")


def check_checkpoint_file(path: Path, original: dict, reference: torch.nn.Module) -> bool:
    """All three checkpoint loaders on one file; True when they loaded it (and it equals the original)."""
    ckpt = attempt("load_checkpoint", load_checkpoint, path)
    if ckpt is not None:
        ckpt.pop("path")
        assert same(ckpt, original), f"{path.name}: a damaged checkpoint loaded with changed contents"
    state = attempt("read_checkpoint", read_checkpoint, path)
    if state is not None:
        assert same(state, original["model"]), f"{path.name}: read_checkpoint returned changed weights"
    model = attempt("load_model", load_model, path)
    if model is not None:
        assert same(model.state_dict(), reference.state_dict())
    return ckpt is not None


def test_every_first_byte_of_a_checkpoint(files):
    d, good, _, _ = files
    original, reference = load_checkpoint(good), load_model(good)
    original.pop("path")
    data = good.read_bytes()
    loaded = 0
    for value in range(256):
        path = d / f"first{value}.pt"
        path.write_bytes(bytes([value]) + data[1:])
        loaded += check_checkpoint_file(path, original, reference)
        path.unlink()
    assert loaded == 1  # only the original first byte, "P" of the zip magic


def test_corrupted_and_truncated_checkpoints(files):
    d, good, _, _ = files
    original, reference = load_checkpoint(good), load_model(good)
    original.pop("path")
    data = good.read_bytes()
    rng = random.Random(16)
    for name, content in mutations(data, rng, flips=120, cuts=40):
        path = d / f"ckpt_{name}.pt"
        path.write_bytes(content)
        check_checkpoint_file(path, original, reference)
        path.unlink()


def test_flipped_tensor_bytes_are_caught_by_the_checksum(files):
    d, good, _, _ = files
    data = good.read_bytes()
    rng = random.Random(7)
    for name, content in mutations(data, rng, flips=40, cuts=0, regions=tensor_regions(good)):
        path = d / f"data_{name}.pt"
        path.write_bytes(content)
        if content == data:
            continue
        for load in (load_checkpoint, read_checkpoint, load_model):
            with pytest.raises(ValueError, match=r"is corrupt: tensor \S+ differs from the checksum") as e:
                load(path)
            assert "\n" not in str(e.value)
            OUTCOMES["checksum: one-line error"] += 1
        path.unlink()


def test_corrupted_safetensors(files):
    d, _, good, _ = files
    data = good.read_bytes()
    rng = random.Random(3)
    header_end = 8 + int.from_bytes(data[:8], "little")
    items = [
        *mutations(data, rng, flips=40, cuts=30),
        *mutations(data, rng, flips=40, cuts=0, regions=[(0, header_end)]),
    ]
    items += [(f"first{v}", bytes([v]) + data[1:]) for v in rng.sample(range(256), 16)]
    for name, content in items:
        path = d / f"st_{name}.safetensors"
        path.write_bytes(content)
        attempt("read_checkpoint (safetensors)", read_checkpoint, path)
        attempt("load_model (safetensors)", lambda p: load_model("deit_mini", p, **KWARGS), path)
        path.unlink()


def test_corrupted_cifar_batches(files):
    d, _, _, good = files
    data = good.read_bytes()
    rng = random.Random(5)
    items = [*mutations(data, rng, flips=60, cuts=30), *mutations(data, rng, flips=40, cuts=0, regions=[(0, 200)])]
    items += [(f"random{i}", rng.randbytes(rng.choice([1, 9, 300, 40_000]))) for i in range(30)]
    for name, content in items:
        path = d / f"batch_{name}"
        path.write_bytes(content)
        attempt("read_cifar_batch", read_cifar_batch, path)
        path.unlink()


# ------------------------------------------------------------------------------------------ malicious pickles
class System:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def evil_files(d: Path, marker: Path) -> list[Path]:
    payload = {"format": "vitlab-checkpoint", "model_name": "deit_mini", "model": {"x": System(marker)}}
    out = []
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):  # bare pickles, every protocol
        out.append(d / f"bare{protocol}.pt")
        out[-1].write_bytes(pickle.dumps(payload, protocol=protocol))
    for protocol in (2, 4, 5):  # torch zip archives
        out.append(d / f"zip{protocol}.pt")
        torch.save(payload, out[-1], pickle_protocol=protocol)
    out.append(d / "legacy.pt")  # torch's legacy (pre-zip) format
    torch.save(payload, out[-1], _use_new_zipfile_serialization=False)
    out.append(d / "test_batch")  # a CIFAR batch carrying the command
    out[-1].write_bytes(pickle.dumps({b"data": System(marker), b"labels": [0]}, protocol=2))
    return out


def test_malicious_pickles_never_run(tmp_path):
    marker = tmp_path / "pwned"
    loaders = {
        "load_checkpoint": load_checkpoint,
        "read_checkpoint": read_checkpoint,
        "load_model": load_model,
        "load_model(name, file)": lambda p: load_model("deit_mini", p, **KWARGS),
        "read_cifar_batch": read_cifar_batch,
    }
    for path in evil_files(tmp_path, marker):
        for what, load in loaders.items():
            if what == "read_cifar_batch" and not path.name.startswith(("bare", "test_batch")):
                continue  # a torch zip is no CIFAR batch: a plain "corrupt" line
            with pytest.raises(ValueError) as e:
                load(path)
            message = str(e.value)
            assert "asks to run code" in message and "vitlab will not load it" in message, (what, path.name, message)
            assert "\n" not in message and "weights_only" not in message, message
            assert "system" in message, message  # names what it wanted to import
            OUTCOMES["malicious: refused"] += 1
            assert not marker.exists(), f"{what} ran code from {path.name}"
    pickle.loads((tmp_path / "bare2.pt").read_bytes())  # they really are exploits: plain pickle runs them
    assert marker.exists()
