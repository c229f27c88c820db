"""Shared test helpers: golden reference vectors and thread settings."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

# the fast paths' decisions are cached per machine (vitlab.ops.probe): the suite keeps its own cache, never the user's
os.environ["VITLAB_CACHE_DIR"] = tempfile.mkdtemp(prefix="vitlab-test-cache-")


# the suite must pass with any thread count (reduction orders differ): VITLAB_TEST_THREADS picks it; by default
# the CPU's cores shared among pytest-xdist's workers (scripts/test.sh runs one per core), at most 2 each
def torch_threads(workers: int) -> int:
    return int(os.environ.get("VITLAB_TEST_THREADS") or max(1, min(2, (os.cpu_count() or 1) // max(1, workers))))


THREADS = torch_threads(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1))
torch.set_num_threads(THREADS)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("VITLAB_SHARED", REPO.parent / "shared"))
# the reference vectors ship with the tests (docs/testing.md says where they come from): a clone checks the
# README's central claim by itself, and a missing file is a failure, not a skip
GOLDEN = Path(__file__).resolve().parent / "golden"
DATA = SHARED / "data"


class Golden(dict):
    """One ``golden/*.npz`` file: ``g.param("qkv.weight")``, ``g.input("x")``, ``g.output("x")``."""

    def param(self, key: str) -> torch.Tensor:
        return self[f"param/{key}"]

    def buffer(self, key: str) -> torch.Tensor:
        return self[f"buffer/{key}"]

    def input(self, key: str) -> torch.Tensor:
        return self[f"input/{key}"]

    def output(self, key: str) -> torch.Tensor:
        return self[f"output/{key}"]

    def state(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Reference state_dict (params and buffers) under keys starting with ``prefix``, prefix stripped."""
        out = {}
        for k, v in self.items():
            kind, _, key = k.partition("/")
            if kind in ("param", "buffer") and key.startswith(prefix):
                out[key[len(prefix) :]] = v
        return out


def load_golden(name: str) -> Golden:
    path = GOLDEN / name
    if not path.exists():
        pytest.fail(f"golden vectors {path} are missing: restore tests/golden/ from the repository")
    with np.load(path) as z:
        return Golden({k: torch.from_numpy(np.array(z[k])) for k in z.files})


def assert_close_to_golden(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    """Within ``rtol`` of the reference output's largest magnitude (docs/testing.md, Tolerances)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = expected.abs().max().item()
    err = (actual.detach().float() - expected.float()).abs().max().item()
    assert err <= rtol * scale + 1e-7, f"max abs error {err:.3g} > {rtol} x {scale:.3g}"


def allocations_of(fn, nbytes: int) -> list[str]:
    """The aten operators that allocated a CPU block of exactly ``nbytes`` while ``fn`` ran (the profiler's record):
    how the tests count the map- or matrix-sized buffers a fast path claims to allocate."""
    with torch.profiler.profile(profile_memory=True) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("aten::") and e.self_cpu_memory_usage == nbytes]


@pytest.fixture
def data_dir() -> Path:
    if not DATA.exists():
        pytest.skip(f"shared data not found at {DATA}")
    return DATA


def pytest_terminal_summary(terminalreporter, config) -> None:
    """Name the test order and thread count, so that any failure can be replayed exactly."""
    seed = getattr(config.option, "randomly_seed", None)
    order = f"random order, --randomly-seed={seed}" if config.pluginmanager.hasplugin("randomly") else "file order"
    workers = getattr(config.option, "numprocesses", None) or 0  # the controller: its workers' count
    where = f"{workers} pytest-xdist workers of " if workers else ""
    terminalreporter.write_line(
        f"vitlab tests: {order}; {where}{torch_threads(workers)} torch thread(s) (VITLAB_TEST_THREADS)"
    )


@pytest.fixture
def onednn_linear(monkeypatch):
    """oneDNN's linear path taken wherever its primitive works on this CPU, whatever the probe's timing chose
    (a test of that path, not of the choice). Call the fixture's value with a dtype (and ``training=True``) to
    skip where the primitive does not run in it: the plain path, which those CPUs take, has tests of its own."""
    from dataclasses import replace

    from vitlab.ops import probe, switch

    monkeypatch.setattr(switch, "_enabled", True)  # a test of the path runs with VITLAB_FAST_PATHS=0 too

    def require(dtype: torch.dtype = torch.float32, training: bool = False) -> None:
        decision = probe.onednn_linear(dtype, training)
        if not decision.works:
            pytest.skip(f"oneDNN's {dtype} linear does not run on this CPU: {decision.reason}")
        monkeypatch.setitem(probe._DECISIONS, (dtype, training), replace(decision, taken=True))

    return require


@pytest.fixture
def fast_path(monkeypatch):
    """The fast paths on for a test of one of them (the suite also runs with ``VITLAB_FAST_PATHS=0``, where the
    other tests check the plain paths)."""
    from vitlab.ops import switch

    monkeypatch.setattr(switch, "_enabled", True)
