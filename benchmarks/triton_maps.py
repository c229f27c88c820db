#!/usr/bin/env python
"""The map chains on a GPU with the Triton kernels and without: forward + backward of each chain at the maps of
the released models, milliseconds (CUDA events, median) and the bytes the kernels must move per second.

Chains (bf16 by default, the models' shapes at batch 64 and 224 px):

- ``double_norm``: EAMLP-14's external attention, logits (64, 196, 32, 64) (tokens, heads x coef, slots);
- ``reattention``: DeepViT-S's ``BN(W A + b)`` on maps (64, 12, 197, 197);
- ``refiner_expand`` / ``refiner_reduce``: Refined-ViT-S's expansion 12 -> 36 + BN (channels-last out) and
  reduction 36 -> 12 + BN.

Example: ``python benchmarks/triton_maps.py --dtype bf16 --repeats 20``. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from vitlab.common.device import resolve_device, time_call
from vitlab.mixers.attention import HeadMix
from vitlab.ops import fast_paths
from vitlab.ops.double_norm import double_normalize
from vitlab.ops.head_mix_norm import can_fuse, head_mix_batchnorm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def chains(batch: int, dtype: torch.dtype, dev: torch.device) -> dict:
    """name -> (make the input, the chain, bytes the fused forward + backward must move at least)."""
    size = torch.finfo(dtype).bits // 8

    def maps(h: int, n: int = 197, channels_last: bool = False) -> torch.Tensor:
        a = torch.randn(batch, h, n, n, device=dev).mul(3).softmax(-1).to(dtype)
        return (a.contiguous(memory_format=torch.channels_last) if channels_last else a).requires_grad_()

    def mix_bn(h: int, g: int, heads_last: bool):
        mix, bn = HeadMix(h, g).to(dev), torch.nn.BatchNorm2d(g).to(dev)
        # as the mixers call it: the kernels where they run, else the modules (under autocast, as in the models)
        return lambda a: head_mix_batchnorm(a, mix, bn, heads_last=heads_last) if can_fuse(a, bn) else bn(mix(a))

    eamlp = (batch, 196, 32, 64)
    n_maps = batch * 197 * 197
    return {  # bytes: forward reads x twice and writes y; backward reads x, g twice and writes dx
        "double_norm": (
            lambda: torch.randn(eamlp, device=dev, dtype=dtype).requires_grad_(),
            lambda x: double_normalize(x, token_dim=1, memory_dim=-1),
            8 * size * torch.Size(eamlp).numel(),
        ),
        "reattention": (lambda: maps(12), mix_bn(12, 12, False), size * n_maps * (12 * 2 + 12 + 12 * 2 + 12 * 2 + 12)),
        "refiner_expand": (
            lambda: maps(12),
            mix_bn(12, 36, True),
            size * n_maps * (12 * 2 + 36 + 36 * 2 + 12 * 2 + 12),
        ),
        "refiner_reduce": (
            lambda: maps(36, channels_last=True),
            mix_bn(36, 12, False),
            size * n_maps * (36 * 2 + 12 + 12 * 2 + 36 * 2 + 36),
        ),
    }


def time_chain(make, chain, repeats: int, dtype: torch.dtype, dev: torch.device) -> float:
    """Median milliseconds of forward + backward under autocast in ``dtype`` (CUDA events on a GPU)."""
    x = make()

    def step(grad=None):
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            out = chain(x)
        return out if grad is None else out.backward(grad)

    grad = torch.randn_like(step())
    for _ in range(3):  # Triton's compile and the allocator's first allocations stay out
        step(grad)
    return 1e3 * statistics.median(time_call(lambda: step(grad), dev) for _ in range(repeats))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cuda (default; cpu runs the CPU paths, for a smoke test)")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args()
    try:
        dev, dtype = resolve_device(args.device), DTYPES[args.dtype]
    except ValueError as e:  # no GPU here: one line
        raise SystemExit(f"benchmarks/triton_maps.py: {e}") from None
    rows = []
    for name, (make, chain, nbytes) in chains(args.batch, dtype, dev).items():
        with fast_paths(True):
            fast = time_chain(make, chain, args.repeats, dtype, dev)
        with fast_paths(False):
            plain = time_chain(make, chain, args.repeats, dtype, dev)
        rows.append({"chain": name, "kernels_ms": fast, "plain_ms": plain, "speedup": plain / fast,
                     "kernels_gb_s": nbytes / fast / 1e6})  # fmt: skip
        print(f"{name:<15} kernels {fast:8.3f} ms ({nbytes / fast / 1e6:7.0f} GB/s of the least traffic)  "
              f"plain {plain:8.3f} ms  {plain / fast:5.2f}x", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
            json.dump({"dtype": args.dtype, "batch": args.batch, "device": device, "rows": rows}, f)


if __name__ == "__main__":
    main()
