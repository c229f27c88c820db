"""The mixer benchmark: measuring helpers, the direct AFT reference, targets and a tiny end-to-end run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from vitlab.bench import mixers as bench
from vitlab.bench import targets
from vitlab.cli import bench_mixers as bench_mixers_cli
from vitlab.cli import main as cli_main
from vitlab.measure import process as measure
from vitlab.measure.process import MB, CaseSpec, Timing, run_case, time_callable
from vitlab.mixers import AFTFull

# --------------------------------------------------------------------------- measuring helpers


def test_timing_summary_median_and_iqr():
    t = Timing([5.0, 1.0, 3.0, 2.0, 4.0])
    s = t.summary()
    assert (s["median"], s["q1"], s["q3"], s["iqr"], s["min"], s["n"]) == (3.0, 2.0, 4.0, 2.0, 1.0, 5)
    assert Timing([0.5]).iqr == 0.0


def test_time_callable_counts_calls_and_respects_max_time():
    calls = []
    t = time_callable(lambda: calls.append(1), warmup=2, repeats=4)
    assert len(calls) == 6 and len(t.times) == 4 and t.warmup == 2
    slow = time_callable(lambda: __import__("time").sleep(0.02), warmup=1, repeats=50, max_time=0.01)
    assert len(slow.times) == 1  # slower than max_time per call: timed once, not 50 times
    some = time_callable(lambda: __import__("time").sleep(0.02), warmup=1, repeats=50, max_time=0.1)
    assert 3 <= len(some.times) <= 5
    with pytest.raises(ValueError, match="repeats"):
        time_callable(lambda: None, repeats=0)


@pytest.fixture(scope="module")
def runner():
    with measure.CaseRunner() as r:
        yield r


def _alloc(mb: float, tensor: bool = False, **kw) -> CaseSpec:
    return CaseSpec("vitlab.measure.process:allocation_case", {"mb": mb, "tensor": tensor}, repeats=1, **kw)


@pytest.mark.parametrize("isolation", ["forkserver", "subprocess"])
def test_peak_memory_sees_a_known_allocation(isolation, runner):
    if isolation == "forkserver":
        res = runner.run(_alloc(200, passes=("memory",)))
    else:
        res = run_case(_alloc(200, passes=("memory",)), isolation="subprocess")
    assert res["status"] == "ok", res
    m = res["mem"]
    assert m["peak_reset"] and m["allocator"].startswith("glibc")
    assert 190 * MB <= m["delta"] <= 240 * MB, m  # the allocation, not the interpreter or torch
    assert m["peak"] == m["baseline"] + m["delta"]


def test_memory_pass_reports_the_tensor_peak_on_the_cpu(runner):
    res = runner.run(_alloc(64, tensor=True, passes=("memory",)))
    assert res["status"] == "ok", res
    assert res["mem"]["tensors"] == 64 * MB  # exact: the profiler's record of the one tensor
    assert runner.run(_alloc(64, passes=("memory",)))["mem"]["tensors"] == 0  # a bytearray is no tensor


def test_tensor_peak_is_exact_and_sees_frees_of_blocks_made_before():
    state = {"kept": torch.empty(4 * MB, dtype=torch.uint8)}

    def work():
        state["kept"] = None  # a block made before the call is freed ...
        a, b = torch.empty(10 * MB, dtype=torch.uint8), torch.empty(5 * MB, dtype=torch.uint8)
        del a
        c = torch.empty(8 * MB, dtype=torch.uint8)
        state["kept"] = torch.empty(4 * MB, dtype=torch.uint8)  # ... and made again
        del b, c

    # -4, +10, +5 (peak 11), -10, +8, +4 (peak 13) over the start of the call
    assert measure.tensor_peak_bytes(work) == 13 * MB


def test_both_passes_merge(runner):
    res = runner.run(_alloc(50))
    assert res["status"] == "ok" and res["time_s"]["n"] == 1
    assert min(res["mem"]["delta"], res["mem"]["timed"]["delta"]) >= 45 * MB


def test_run_case_reports_failures_instead_of_raising(runner):
    missing = runner.run(CaseSpec("vitlab.measure.process:no_such_case"))
    died = runner.run(CaseSpec("os:_exit", {"status": 3}))
    after = runner.run(_alloc(1, passes=("memory",)))
    assert missing["status"] == "error" and "no_such_case" in missing["reason"] and missing["pass"] == "memory"
    assert died["status"] == "error" and "code 3" in died["reason"]
    assert after["status"] == "ok"  # the runner survives a crashed case
    with pytest.raises(ValueError, match="passes"):
        runner.run(_alloc(1, passes=("speed",)))


# --------------------------------------------------------------------------- the direct AFT-full reference


def test_aft_full_direct_is_paper_eq2():
    """The reference against Eq. 2 written entry by entry, float64."""
    torch.manual_seed(0)
    b, t, d = 2, 5, 3
    q, k, v = (torch.randn(b, t, d, dtype=torch.float64) for _ in range(3))
    w = torch.randn(t, t, dtype=torch.float64)
    want = torch.empty(b, t, d, dtype=torch.float64)
    for bi in range(b):
        for ti in range(t):
            e = torch.stack([torch.exp(k[bi, s] + w[ti, s]) for s in range(t)])  # (T', d)
            want[bi, ti] = torch.sigmoid(q[bi, ti]) * (e * v[bi]).sum(0) / e.sum(0)
    torch.testing.assert_close(bench.aft_full_direct(q, k, v, w), want, rtol=1e-12, atol=1e-12)


def test_naive_aft_full_equals_the_mixer():
    torch.manual_seed(0)
    aft = AFTFull(16, max_len=12)
    with torch.no_grad():  # a bias large enough to matter
        aft.u.normal_(0, 0.7)
        aft.v.normal_(0, 0.7)
    x = torch.randn(3, 12, 16)
    torch.testing.assert_close(bench.AFTFullNaive(aft)(x), aft(x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- planning and targets


def test_layout_for_square_grids_and_class_token():
    assert bench.layout_for(64).grid == (8, 8) and bench.layout_for(64).num_prefix == 0
    assert bench.layout_for(197).grid == (14, 14) and bench.layout_for(197).num_prefix == 1
    assert bench.layout_for(100 + 7).grid is None


def test_estimate_grows_with_the_materialised_forms():
    c = {"T": 1024, "dtype": "fp32", "mode": "forward", "batch": 8, "dim": 256, "heads": 4}
    naive = bench.estimate_bytes({**c, "mixer": "aft_full_naive"})
    assert naive >= 2 * 8 * 1024 * 1024 * 256 * 4  # at least two (B, T, T, d) fp32 tensors
    assert bench.estimate_bytes({**c, "mixer": "aft_full"}) < naive / 20


def _args(*flags: str, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_mixers_cli.add_arguments(p)
    argv = [f"--{f.replace('_', '-')}" for f in flags]
    argv += [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    args = p.parse_args(argv)
    bench.resolve(args)
    return args


def test_run_plan_skips_over_budget_without_running():
    args = _args(mixers="attention", tokens="16", dim=32, batch=2, dtypes="fp32", modes="forward")
    plan = bench.plan_cases(args, budget=10**9)
    (result,) = bench.run_plan(plan, args, budget=1)  # nothing fits in one byte
    assert result["status"] == "skipped" and "needs ~" in result["reason"]


def test_default_run_includes_the_target_cases():
    args = _args()
    assert args.targets and len(args.sweeps) == 2
    plan = bench.plan_cases(args, budget=12 * bench.GB)
    keys = {(c["mixer"], c["T"], c["mode"], c["batch"]) for c in plan.cases}
    assert ("aft_full", 1024, "forward", 8) in keys
    assert any(k[0] == "aft_full_naive" and k[1] == 1024 for k in keys)
    assert ("attention_explicit", 197, "forward", 8) in keys
    assert ("aft_conv", 4096, "train", 8) in keys
    assert _args("targets_only").sweeps == []
    assert not _args("quick").targets


def _ok(mixer, T, median, delta, mode="forward", batch=8):
    return {
        "mixer": mixer,
        "T": T,
        "dtype": "fp32",
        "mode": mode,
        "batch": batch,
        "dim": 256,
        "status": "ok",
        "time_s": {"median": median},
        "mem": {"delta": delta},
    }


def test_aft_full_target_extrapolates_the_direct_form_in_batch():
    fast = _ok("aft_full", 1024, 0.1, 50 * MB)
    naive = [_ok("aft_full_naive", 1024, 2.0, 4000 * MB, batch=4), _ok("aft_full_naive", 1024, 1.0, 2000 * MB, batch=2)]
    t = targets.target_aft_full([fast, *naive])
    assert t["status"] == "PASS"
    assert t["measured"]["speedup"] == pytest.approx(40.0) and t["measured"]["memory_ratio"] == pytest.approx(160.0)
    assert "extrapolated linearly to 8" in t["detail"]
    slow = targets.target_aft_full([_ok("aft_full", 1024, 1.0, 50 * MB), *naive])
    assert slow["status"] == "FAIL"  # 4x faster only
    assert targets.target_aft_full([fast])["status"] == "N/A"


def test_linear_target_slope():
    lin = [_ok("aft_simple", t, 0.0, 1000 * t) for t in (64, 256, 1024, 4096)]
    quad = [_ok("aft_conv", t, 0.0, 10 * t * t) for t in (256, 1024, 4096)]
    assert targets.target_linear(lin, "aft_simple")["measured"]["slopes"]["forward"] == pytest.approx(1.0)
    assert targets.target_linear(lin, "aft_simple")["status"] == "PASS"
    assert targets.target_linear(quad, "aft_conv")["status"] == "FAIL"


def test_attention_target_ratios():
    rs = [
        _ok("attention", 197, 1.0, 1),
        _ok("attention_explicit", 197, 1.0, 1),
        _ok("attention", 1024, 1.0, 1),
        _ok("attention_explicit", 1024, 1.5, 1),
    ]
    t = targets.target_attention(rs)
    assert t["status"] == "PASS" and t["measured"]["speedup"][1024] == pytest.approx(1.5)
    rs[3] = _ok("attention_explicit", 1024, 1.1, 1)
    assert targets.target_attention(rs)["status"] == "FAIL"


@pytest.mark.parametrize("mixer", ["aft_conv", "attention_explicit"])
def test_prepare_case_runs_forward_and_train(mixer):
    fwd = bench.prepare_case(mixer, 16, "bf16", "forward", 2, 32, 1, 4, 3)
    fwd.fn()
    assert fwd.info["layout"] == {"grid": (4, 4), "num_prefix": 0} and fwd.info["params"] > 0
    train = bench.prepare_case(mixer, 17, "fp32", "train", 2, 32, 1, 4, 3)  # 1 + 4x4: class token + grid
    train.fn()
    train.reset()


def test_grid_mixer_without_a_grid_is_skipped():
    with pytest.raises(measure.CaseSkipped, match="grid"):
        bench.prepare_case("aft_conv", 20, "fp32", "forward", 2, 32, 1, 4, 3)


# --------------------------------------------------------------------------- end to end


def test_quick_run_writes_json_table_and_png(tmp_path):
    cmd = [
        sys.executable,
        "benchmarks/mixers.py",
        "--quick",
        "--mixers",
        "attention,aft_simple",
        "--tokens",
        "16,64",
        "--modes",
        "train",
        "--out",
        str(tmp_path),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=bench_root())
    assert out.returncode == 0, out.stderr
    assert "[4/4]" in out.stdout and "median time" in out.stdout
    doc = json.loads((tmp_path / "mixers.json").read_text())
    assert doc["schema"] == "vitlab.bench-mixers/1"
    assert {"torch", "cpu", "threads"} <= set(doc["machine"]) and doc["machine"]["threads"] == 2
    assert doc["targets"] == [] and doc["config"]["quick"]
    assert {(c["mixer"], c["T"], c["mode"]) for c in doc["cases"]} == {
        (m, t, "train") for m in ("attention", "aft_simple") for t in (16, 64)
    }
    for c in doc["cases"]:
        assert c["status"] == "ok", c
        assert {"mixer", "T", "dtype", "mode", "batch", "dim", "est_bytes", "loadavg_1m"} <= set(c)
        assert c["time_s"]["median"] > 0 and c["time_s"]["n"] == 1
        assert c["mem"]["peak"] >= c["mem"]["baseline"] > 0 and c["mem"]["delta"] >= 0
        assert c["mem"]["timed"]["peak"] >= c["mem"]["timed"]["baseline"] > 0
    assert (tmp_path / "mixers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "attention" in (tmp_path / "mixers.txt").read_text()


def bench_root() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parents[1])


def test_bad_options_are_rejected(capsys):
    assert cli_main(["bench-mixers", "--mixers", "nope"]) == 2  # the parser's one line
    assert "argument --mixers: unknown nope" in capsys.readouterr().err
    assert cli_main(["bench-mixers", "--quick", "--heads", "3"]) == 2  # 3 does not divide dim 32
    assert "--heads must divide" in capsys.readouterr().err
