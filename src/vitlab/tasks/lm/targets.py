"""The targets of ``vitlab lm bench`` and the paper's figures they are read against.

AFT-local must need at most 0.6x the memory of the Transformer baseline of the same run at T = 3072 and
take less time per training step. The paper (Table 2, CIFAR-10, 8 x V100, batch 32) reports 12.8 / 30.4 GB
= 0.42x the memory and 1.67 / 1.36 it/s = 1.23x the speed for AFT-local, 9.5 / 30.4 GB and 2.15 / 1.36 it/s
for AFT-simple; the Image Transformer (local2d, L=12, d=512) 22.3 / 30.6 GB and 1.61 / 1.35 it/s against the
Transformer of its shape. The enwik8 baselines (Table 4, T = 1024, batch 128) are read against the L=12, d=512
Transformer's 29.4 GB and 1.42 it/s.
"""

from __future__ import annotations

from typing import Any

# the paper's ratios against its Transformer: memory, and speed (iterations per second)
PAPER = {
    "aft_local": {"mem": 12.8 / 30.4, "speed": 1.67 / 1.36},
    "aft_simple": {"mem": 9.5 / 30.4, "speed": 2.15 / 1.36},
    "local2d_attention": {"mem": 22.3 / 30.6, "speed": 1.61 / 1.35},
}
# the same at T = 1024 (enwik8, Table 4): each row against the paper's Transformer of its own shape (the
# baselines are L=12, d=512 rows; AFT-local-32 and AFT-simple the L=24, d=256 rows, against 28.3 GB and
# 1.57 it/s). Table 4 has no AFT-full row, so AFT-full's paper column stays empty.
PAPER_ENWIK8 = {
    "reformer": {"mem": 20.9 / 29.4, "speed": 1.05 / 1.42},
    "synthesizer": {"mem": 29.9 / 29.4, "speed": 1.49 / 1.42},
    "linear_transformer": {"mem": 10.6 / 29.4, "speed": 1.46 / 1.42},
    "performer": {"mem": 10.1 / 29.4, "speed": 1.44 / 1.42},
    "aft_local_32": {"mem": 11.2 / 28.3, "speed": 2.04 / 1.57},
    "aft_simple": {"mem": 9.6 / 28.3, "speed": 2.61 / 1.57},
}
TARGET_T, TARGET_MEM, TARGET_SPEED = 3072, 0.6, 1.0
TARGETS = (f"AFT-local at most {TARGET_MEM}x the Transformer's memory and faster per training step, fp32, "
           f"T = {TARGET_T}")  # fmt: skip


def paper_ratios(model: str, T: int) -> dict[str, float] | None:
    """The paper's memory and speed ratios for a benchmark row: Table 2's at T = 3072, Table 4's at T = 1024."""
    return PAPER.get(model) if T == TARGET_T else PAPER_ENWIK8.get(model) if T == 1024 else None


def judge(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The verdict for each AFT-local variant measured at T = 3072 in fp32 (against the SDPA Transformer)."""
    out = {}
    for r in rows:
        if r["model"].startswith("aft_local") and r["T"] == TARGET_T and r.get("dtype", "fp32") == "fp32":
            out[r["model"]] = {
                "mem_ratio": r["mem_ratio"],
                "mem_target": TARGET_MEM,
                "mem_met": r["mem_ratio"] <= TARGET_MEM,
                "speed_ratio": r["speed_ratio"],
                "speed_met": r["speed_ratio"] > TARGET_SPEED,
            }
    return out


def verdict_lines(verdict: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    if not verdict:
        return [f"Targets ({TARGETS}) not checked: this run has no fp32 AFT-local and Transformer pair at T = "
                f"{TARGET_T} (run with --tokens {TARGET_T})."]  # fmt: skip
    lines = []
    for model, v in verdict.items():
        lines.append(
            f"Target at T={TARGET_T}, {model}: memory {v['mem_ratio']:.2f}x the Transformer's (<= {TARGET_MEM}x: "
            f"{'met' if v['mem_met'] else 'NOT met'}), speed {v['speed_ratio']:.2f}x (> 1: "
            f"{'met' if v['speed_met'] else 'NOT met'})."
        )
    fp32 = [r for r in rows if r.get("dtype", "fp32") == "fp32"]
    flash = next((r for r in fp32 if r["model"] == "transformer_flash" and r["T"] == TARGET_T), None)
    if flash:
        for model in verdict:
            mine = next(r for r in fp32 if r["model"] == model and r["T"] == TARGET_T)
            lines.append(
                f"Against the Transformer without attention dropout (flash kernel, no maps): {model} memory "
                f"{mine['mem_mb'] / flash['mem_mb']:.2f}x, speed {flash['step_s'] / mine['step_s']:.2f}x."
            )
    p = PAPER["aft_local"]
    lines.append(f"Paper (8 x V100, batch 32): {p['mem']:.2f}x memory, {p['speed']:.2f}x speed.")
    return lines
