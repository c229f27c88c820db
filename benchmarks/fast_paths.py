#!/usr/bin/env python
"""Each fast path of vitlab.ops on and off, on the machine at hand: what the probes decided, then whole models'
inference and training steps with the fast paths as decided, with oneDNN's linear forced on (where it runs) and
with every fast path off, measured side by side in one process (alternating, best of --repeats).

Example: ``python benchmarks/fast_paths.py`` (DeiT-S, TNT-S, Refined-ViT-S, DeepViT-S, EAMLP-14, AFT-full-tiny and
AFT-conv-tiny at batch 8). Simulate an AVX2-only CPU on an AVX-512 one with ``ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2`` in the environment (oneDNN's and ATen's kernels then use AVX2 only).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import replace

import torch

import vitlab
from vitlab.ops import fast_paths, probe

MODELS = (
    "deit_small_patch16_224",
    "tnt_s_patch16_224",
    "refiner_vit_s",
    "deepvit_s",
    "eamlp_14",
    "aft_full_tiny",
    "aft_conv_tiny",
)


def cpu() -> str:
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}; torch {torch.__version__}, {torch.get_num_threads()} threads, ISA {torch.backends.cpu.get_cpu_capability()}"


def onednn_forced(on: bool) -> None:
    """oneDNN's linear path taken (where it works) or not, whatever the timing probe chose."""
    for key in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False)):
        decision = probe.onednn_linear(*key)
        probe._DECISIONS[key] = replace(decision, taken=on and decision.works)


def settings() -> dict[str, Callable[[], None]]:
    decided = dict(probe._DECISIONS)
    return {
        "decided": lambda: (probe._DECISIONS.update(decided), vitlab.ops.set_fast_paths(True)),
        "onednn_on": lambda: (onednn_forced(True), vitlab.ops.set_fast_paths(True)),
        "all_off": lambda: vitlab.ops.set_fast_paths(False),
    }


def step(model: torch.nn.Module, x: torch.Tensor, mode: str) -> None:
    if mode == "infer":
        model.eval()
        with torch.inference_mode():
            model(x)
    else:
        model.train()
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()


def measure(name: str, batch: int, repeats: int) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    model = vitlab.create_model(name)
    x = torch.randn(batch, *model.meta["input_size"])
    choices = settings()
    out: dict[str, dict[str, float]] = {}
    for mode in ("infer", "train"):
        times: dict[str, list[float]] = {k: [] for k in choices}
        for r in range(repeats + 1):  # the first round warms up
            for key, apply in choices.items():
                apply()
                start = time.perf_counter()
                step(model, x, mode)
                if r:
                    times[key].append(time.perf_counter() - start)
        out[mode] = {k: round(min(v) * 1e3, 1) for k, v in times.items()}
    choices["decided"]()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    with fast_paths(True):
        report = {"cpu": cpu(), "decisions": vitlab.ops.decisions(), "models": {}}
    print(report["cpu"])
    for key, d in report["decisions"].items():
        times = f"{d['fast_ms']} ms vs aten {d['plain_ms']} ms" if d["works"] else ""
        print(f"  {key:32s} {'taken' if d['taken'] else 'not taken':9s} {times:28s} {d['reason']}")
    print(f"\nms per step, batch {args.batch}, best of {args.repeats}; ratio = all_off / decided")
    print(f"{'model':26s} {'mode':5s} {'decided':>9s} {'onednn_on':>9s} {'all_off':>9s} {'ratio':>6s}")
    for name in args.models:
        figures = measure(name, args.batch, args.repeats)
        report["models"][name] = figures
        for mode, t in figures.items():
            ratio = t["all_off"] / t["decided"]
            print(f"{name:26s} {mode:5s} {t['decided']:9.1f} {t['onednn_on']:9.1f} {t['all_off']:9.1f} {ratio:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
