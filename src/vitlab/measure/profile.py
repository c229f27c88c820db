"""Where a model's time goes: one call under ``torch.profiler``, grouped into kinds of work.

``vitlab bench --profile`` runs this once per case (after the warm calls, apart from the timed calls; the
fastest of three profiled calls) and writes ``profile_<case>.txt``. Every operator's self time is put in one group:

* ``gemm``: matrix products and convolutions (mm, addmm, bmm, baddbmm, convolutions), with their FLOPs
  (2 x MACs, from the recorded shapes) and achieved rate;
* ``attention``: fused attention kernels (SDPA flash / math) and softmax, with SDPA's FLOPs;
* ``norm``: layer / batch norm;
* ``copy``: copies, concatenations, layout changes (including the bias broadcast of ``addmm``);
* ``elementwise``: everything else (activations, residual adds, exponentials, reductions).

From these, ``gemm_util`` is the rate of the gemm group over the GEMM yardstick: the utilisation the model
would reach if everything outside its matrix products took no time (a ceiling set by the kernels at the
model's shapes, not by the model code).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mkldnn_convolution",
            "aten::convolution_overrideable", "aten::_convolution", "aten::thnn_conv2d", "aten::_slow_conv2d_forward",
            "aten::mkldnn_linear", "mkldnn::_linear_pointwise", "mkl::_mkl_linear"}  # fmt: skip
ATTENTION_OPS = ("aten::_scaled_dot_product", "aten::_softmax", "aten::_safe_softmax")
NORM_OPS = ("aten::native_layer_norm", "aten::native_batch_norm", "aten::_native_batch_norm_legit")
COPY_OPS = {"aten::copy_", "aten::cat", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::im2col",
            "aten::col2im", "aten::constant_pad_nd", "aten::index", "aten::repeat"}  # fmt: skip
GROUPS = ("gemm", "attention", "norm", "copy", "elementwise")


def group_of(name: str) -> str:
    if name in GEMM_OPS:
        return "gemm"
    if name.startswith(ATTENTION_OPS):
        return "attention"
    if name.startswith(NORM_OPS):
        return "norm"
    if name in COPY_OPS:
        return "copy"
    return "elementwise"


def op_flops(name: str, shapes: list[list[int]]) -> float:
    """FLOPs (2 x MACs) of one call of a matrix-product or SDPA operator from its input shapes; 0 otherwise
    (convolutions too: their output size is not among the recorded shapes)."""
    try:
        if name in ("aten::mm",):
            (m, k), (_, n) = shapes[0], shapes[1]
            return 2.0 * m * k * n
        if name == "aten::addmm":
            (m, k), (_, n) = shapes[1], shapes[2]
            return 2.0 * m * k * n
        if name in ("aten::bmm",):
            (b, m, k), (_, _, n) = shapes[0], shapes[1]
            return 2.0 * b * m * k * n
        if name == "aten::baddbmm":
            (b, m, k), (_, _, n) = shapes[1], shapes[2]
            return 2.0 * b * m * k * n
        if name.startswith("aten::_scaled_dot_product") and "backward" not in name:
            q, k = shapes[0], shapes[1]  # (..., L, E), (..., S, E); value width taken equal to E
            return 4.0 * math.prod(q[:-1]) * k[-2] * q[-1]
    except (IndexError, ValueError, TypeError):
        return 0.0
    return 0.0


def profile_call(fn: Callable[[], Any], device: Any = "cpu", top: int = 12, calls: int = 3) -> dict[str, Any]:
    """Profile ``calls`` separate calls of ``fn`` and keep the fastest (other processes only add time):
    per-group self time and FLOPs, and the ``top`` operators by time. On a GPU the times are the operators'
    GPU (kernel) self times."""
    runs = [_profile_once(fn, top, str(device).startswith("cuda")) for _ in range(max(1, calls))]
    return min(runs, key=lambda r: r["total_ms"])


def _profile_once(fn: Callable[[], Any], top: int, gpu: bool) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]
    with profile(activities=activities, record_shapes=True) as prof:
        fn()
        if gpu:
            torch.cuda.synchronize()
    groups = {g: {"ms": 0.0, "flops": 0.0, "flops_ms": 0.0, "calls": 0} for g in GROUPS}
    ops = []
    for e in prof.key_averages(group_by_input_shape=True):
        ms = (e.self_device_time_total if gpu else e.self_cpu_time_total) / 1e3
        if ms <= 0:
            continue
        shapes = [list(s) for s in (e.input_shapes or [])]
        flops = op_flops(e.key, shapes) * e.count
        g = group_of(e.key)
        groups[g]["ms"] += ms
        groups[g]["flops"] += flops
        groups[g]["flops_ms"] += ms if flops else 0.0
        groups[g]["calls"] += e.count
        ops.append(
            {
                "op": e.key,
                "group": g,
                "calls": e.count,
                "ms": ms,
                "flops": flops,
                "shapes": [s for s in shapes if s][:3],
            }
        )
    total = sum(v["ms"] for v in groups.values())
    for v in groups.values():
        v["share"] = v["ms"] / total if total else 0.0
        v["gflops_per_s"] = v["flops"] / v["flops_ms"] / 1e6 if v["flops"] else None  # ops with known FLOPs
    ops.sort(key=lambda o: -o["ms"])
    for o in ops:
        o["share"] = o["ms"] / total if total else 0.0
        o["gflops_per_s"] = o["flops"] / o["ms"] / 1e6 if o["flops"] else None
    return {"total_ms": total, "groups": groups, "top": ops[:top], "threads": torch.get_num_threads()}


def with_yardstick(prof: dict[str, Any], gemm_flops_per_s: float | None, model_flops: float | None) -> dict[str, Any]:
    """Add ``gemm_util``: the rate of the matrix products (with known FLOPs) / the GEMM yardstick, and
    ``ceiling_util``: the model's FLOPs over the time of its matrix products and attention kernels alone /
    the yardstick -- the utilisation if norms, copies and elementwise work took no time."""
    out = dict(prof)
    g, a = prof["groups"]["gemm"], prof["groups"]["attention"]
    if gemm_flops_per_s:
        out["gemm_util"] = g["gflops_per_s"] * 1e9 / gemm_flops_per_s if g["gflops_per_s"] else None
        busy = (g["ms"] + a["ms"]) / 1e3
        out["ceiling_util"] = model_flops / busy / gemm_flops_per_s if model_flops and busy else None
    return out


def profile_text(name: str, prof: dict[str, Any]) -> str:
    lines = [f"{name}: one call, {prof['total_ms']:.1f} ms of operator self time ({prof['threads']} threads)", ""]
    lines.append(f"{'group':<12} {'ms':>9} {'share':>7} {'calls':>6} {'GFLOP/s':>8}")
    for g, v in prof["groups"].items():
        rate = f"{v['gflops_per_s']:.0f}" if v["gflops_per_s"] else "-"
        lines.append(f"{g:<12} {v['ms']:9.1f} {v['share']:7.1%} {v['calls']:6d} {rate:>8}")
    if prof.get("gemm_util") is not None:
        lines.append("")
        lines.append(
            f"matrix products run at {prof['gemm_util']:.0%} of the GEMM yardstick"
            + (
                f"; if only they and the attention kernels took time, utilisation would be {prof['ceiling_util']:.0%}"
                if prof.get("ceiling_util")
                else ""
            )
        )
    lines += ["", f"{'operator':<44} {'group':<11} {'calls':>5} {'ms':>8} {'share':>6} {'GFLOP/s':>8}  shapes"]
    for o in prof["top"]:
        rate = f"{o['gflops_per_s']:.0f}" if o["gflops_per_s"] else "-"
        shapes = " ".join("x".join(map(str, s)) for s in o["shapes"])
        lines.append(
            f"{o['op'][:44]:<44} {o['group']:<11} {o['calls']:5d} {o['ms']:8.2f} {o['share']:6.1%} {rate:>8}  {shapes}"
        )
    return "\n".join(lines)
