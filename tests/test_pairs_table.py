"""benchmarks/pairs_table.py: the docs' side-by-side tables come from the kept JSON, figure for figure."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/pairs_table.py", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_a_pair_row_gives_the_median_and_range_of_its_rounds(tmp_path):
    rounds = [{"infer_speed_ratio": r, "train_speed_ratio": r / 2} for r in (0.9, 1.1, 1.0)]
    pair = {"peer": "timm:deit_tiny", "vitlab": "vitlab:deit_tiny@B=8", "rounds": rounds}
    pair.update(infer_speed_ratio_median=1.0, infer_speed_ratio_min=0.9, infer_speed_ratio_max=1.1)
    pair.update(train_speed_ratio_median=0.5, train_speed_ratio_min=0.45, train_speed_ratio_max=0.55)
    pair.update(infer_peak_incr_ratio_median=0.914, train_peak_incr_ratio_median=None)
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"pairs": [pair]}))
    out = _run(str(path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == (
        "| timm:deit_tiny | vitlab:deit_tiny | 3 | 1.00 (0.90-1.10) | 0.50 (0.45-0.55) | 0.91 / - |"
    )


def test_a_gpu_runs_memory_column_is_the_tensor_peak(tmp_path):
    """On a GPU the host's resident memory says little of what a batch needs: the column is the allocator's."""
    pair = {"peer": "timm:deit_small", "vitlab": "vitlab:deit_small", "rounds": [{}]}
    pair.update(infer_peak_incr_ratio_median=1.64, train_peak_incr_ratio_median=1.93)
    pair.update(infer_tensor_incr_ratio_median=0.47, train_tensor_incr_ratio_median=0.79)
    path = tmp_path / "run.json"
    for device, memory in (("cuda", "0.47 / 0.79"), ("cpu", "1.64 / 1.93")):
        path.write_text(json.dumps({"meta": {"device": {"type": device}}, "pairs": [pair]}))
        out = _run(str(path)).stdout.splitlines()
        assert out[-1].endswith(f"| {memory} |") and ("GPU tensor-peak" in out[0]) == (device == "cuda")


def test_every_kept_result_renders():
    for path in sorted((ROOT / "benchmarks" / "results").glob("peer_*.json")):
        out = _run(str(path))
        pairs = len(json.loads(path.read_text())["pairs"])
        assert out.returncode == 0 and out.stdout.count("\n| ") == pairs >= 1, (path, out.stderr)  # a row per pair


def test_an_unreadable_file_is_one_line(tmp_path):
    (tmp_path / "bad.json").write_text("{")
    out = _run(str(tmp_path / "bad.json"))
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1


def test_the_resident_table_gives_each_sides_median_sizes(tmp_path):
    def case(cid: str, after: float, infer: float, train: float | None) -> dict:
        phases = {"infer": {"status": "ok", "peak_rss_mb": infer}}
        phases["train"] = {"status": "ok", "peak_rss_mb": train} if train else {"status": "error: out of memory"}
        return {"id": cid, "mem_after_import": {"rss_mb": after}, "phases": phases}

    mine, theirs = "vitlab:deit_tiny@B=8", "timm:deit_tiny"
    cases = [case(mine, 316, 380, 530), case(theirs, 354, 430, 570), case(mine, 318, 390, 540)]
    cases += [case(theirs, 352, 420, None), case(mine, 317, 400, 520)]
    doc = {"pairs": [{"peer": theirs, "vitlab": mine, "rounds": []}], "cases": cases}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    out = _run("--resident", str(path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "| timm:deit_tiny | vitlab:deit_tiny | 317 / 353 | 390 / 425 | 530 / 570 |"


def test_the_docs_pair_rows_are_rows_of_kept_results():
    """Every side-by-side row in docs/performance.md is a row benchmarks/pairs_table.py renders from a JSON kept in
    benchmarks/results, figure for figure: a typed or stale figure fails here."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import pairs_table
    finally:
        sys.path.pop(0)
    rendered = set()
    for path in sorted((ROOT / "benchmarks" / "results").glob("peer_*.json")):
        rendered.update(line.strip() for line in pairs_table.table(json.loads(path.read_text())).splitlines())
    pair_row = re.compile(r"^\|[^|]+\|[^|]+\| \d+ \|")  # peer | vitlab | rounds | ...
    doc = (ROOT / "docs" / "performance.md").read_text().splitlines()
    rows = [(n, line.strip()) for n, line in enumerate(doc, 1) if pair_row.match(line.strip())]
    assert len(rows) > 100
    assert [(n, row) for n, row in rows if row not in rendered] == []


def _three_figures(x: float) -> str:
    """A figure as the docs' GPU section writes it: three significant digits (1,310; 46.0; 0.31)."""
    text = f"{x:#.3g}".rstrip(".")
    return f"{float(text):,.0f}" if "e" in text or float(text) >= 1000 else text


def test_the_docs_gpu_figures_are_the_kept_results():
    """The GPU section's training-step, AFT and ImageNet figures are those of the JSON kept beside it: a typed or
    stale figure fails here (the pairs are checked above)."""
    docs = (ROOT / "docs" / "performance.md").read_text()
    results = ROOT / "benchmarks" / "results"

    def cases(name: str) -> list[dict]:
        return json.loads((results / f"gpu_h200_2026-11-29_{name}.json").read_text())["cases"]

    for case in cases("fp32_bench") + cases("bf16_bench"):  # DeiT-S training
        row = (
            f"| {_three_figures(case['throughput'])} | {_three_figures(case['latency_ms'])} ms | "
            f"{100 * case['util']:.0f} % of {_three_figures(case['gemm_run_flops_per_s'] / 1e12)} TFLOP/s |"
        )
        assert row in docs, row
    for name in ("aft_cifar_bf16_lm_bench", "aft_enwik8_bf16_lm_bench"):
        for r in json.loads((results / f"gpu_h200_2026-11-29_{name}.json").read_text())["ratios"]:
            row = f"| {r['step_s']:.2f} s | {r['mem_mb']:,.0f} MB | {r['speed_ratio']:.2f}x | {r['mem_ratio']:.2f}x |"
            assert row in docs, row
    speed = {c["model"]: c["throughput"] for c in cases("aft_imagenet_bf16_bench")}
    deit = speed.pop("deit_tiny_patch16_224")
    assert f"DeiT-Ti {_three_figures(deit)}" in docs
    for model, label in (("aft_full_tiny", "AFT-full-tiny"), ("aft_conv_tiny_32_11", "AFT-conv-tiny")):
        assert f"{label} {_three_figures(speed[model])} " in docs, model
    assert (
        f"{speed['aft_full_tiny'] / deit:.2f}x and {speed['aft_conv_tiny_32_11'] / deit:.2f}x DeiT-Ti's speed" in docs
    )
