"""The data-path benchmark (``vitlab bench-data``): images/s of decode + training transform through DataLoader workers, beside a plain
reference pipeline, the training step time it has to feed, and the loader's memory as the dataset grows.

Pipelines, each per worker count (0 = in the main process, one torch thread like a worker):

- ``reference``: what torchvision's RandomResizedCrop does on PIL images -- full decode
  (``Image.open().convert("RGB")``), box sampled by torchvision's rule with Python's ``random``,
  ``crop().resize(size, BICUBIC)``, flip, ``to_tensor``, normalise; default collation;
- ``vitlab``: the same transform by :func:`vitlab.data.create_loader` -- box from the header, JPEG decoded at
  the smallest DCT scale that covers it, antialiased uint8 resize, normalisation on the batch;
- ``vitlab+recipe``: DeiT's full transform (adds RandAugment rand-m9-mstd0.5-inc1 and random erasing 0.25).

Rounds interleave the pipelines (A B, then B A) so that load from other processes hits both alike.

``--device cuda``: the vitlab pipelines run their batch stage (RandAugment, normalisation, random erasing) on the
GPU, as a GPU training run does (the workers decode and crop, and send uint8); the training step is timed on the
GPU (CUDA events), beside its share of the GPU's GEMM rate in the same dtype; the report says which side is the
bottleneck: the loader at the most workers measured, or the step. Where torchvision's nvJPEG decoder is importable,
one more pipeline, ``gpu-decode+recipe``, has the workers only read the files and their headers and decodes, cuts
and augments on the GPU (:mod:`vitlab.data.device_decode`).
Memory: a fresh process builds the loader (2 workers) over 2,000 and over 20,000 files (hard links of the
generated images: the loader's memory depends on the file count, not on the pixels), runs a few batches and
reports the resident (RSS) and proportional (PSS) memory of itself plus its workers.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..common.device import time_call

PIPELINES = ("reference", "vitlab", "vitlab+recipe")
GPU_DECODE = "gpu-decode+recipe"  # on a GPU with nvJPEG: decode, crop and the recipe's batch stage on the device
RECIPE_PIPELINES = ("vitlab+recipe", GPU_DECODE)
STEP_MODELS = ("deit_tiny_patch16_224", "deit_small_patch16_224")


# --------------------------------------------------------------------------- the reference pipeline


def torchvision_box(w: int, h: int, rnd: random.Random, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's ``RandomResizedCrop.get_params`` with Python's ``random``: (top, left, height, width)."""
    area = h * w
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rnd.uniform(*scale)
        aspect = math.exp(rnd.uniform(*log_ratio))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            return rnd.randint(0, h - ch), rnd.randint(0, w - cw), ch, cw
    in_ratio = w / h
    if in_ratio < ratio[0]:
        cw, ch = w, round(w / ratio[0])
    elif in_ratio > ratio[1]:
        cw, ch = round(h * ratio[1]), h
    else:
        cw, ch = w, h
    return (h - ch) // 2, (w - cw) // 2, ch, cw


class ReferenceDataset(torch.utils.data.Dataset):
    """Full decode, crop, bicubic resize, flip, to_tensor, normalise: torchvision's training pipeline."""

    def __init__(self, source, size: int, mean, std) -> None:
        self.source, self.size = source, size
        self.mean, self.std = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        for k in range(16):  # an unreadable file is replaced by the next one, as vitlab's training loader does
            try:
                return self._sample((i + k) % len(self))
            except OSError:  # Pillow's truncated or unidentified image
                continue
        raise ValueError(f"16 files in a row from {self.source.path(i)} on cannot be decoded; repair or remove them")

    def _sample(self, i: int):
        import numpy as np
        from PIL import Image

        rnd = random.Random(i * 7919 + int(torch.initial_seed() % 2**31))
        path, label = self.source.read(i)
        with Image.open(path) as im:
            img = im.convert("RGB")
        top, left, h, w = torchvision_box(img.size[0], img.size[1], rnd)
        img = img.crop((left, top, left + w, top + h)).resize((self.size, self.size), Image.BICUBIC)
        if rnd.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.array(img)).permute(2, 0, 1).float().div_(255)
        return (x - self.mean) / self.std, label


def pipelines(device: str) -> tuple[str, ...]:
    """The pipelines measured: :data:`PIPELINES`, and :data:`GPU_DECODE` on a GPU where nvJPEG is importable."""
    from ..data.device_decode import device_decode_available

    return PIPELINES + ((GPU_DECODE,) if device_decode_available(device) else ())


# --------------------------------------------------------------------------- measuring


def _loader(pipeline: str, source, args, workers: int):
    from ..data import create_loader, create_transform

    if pipeline == "reference":
        ds = ReferenceDataset(source, args.img_size, source.mean, source.std)
        return torch.utils.data.DataLoader(ds, args.batch_size, shuffle=True, num_workers=workers, drop_last=True,
                                           persistent_workers=workers > 0)  # fmt: skip
    recipe = pipeline in RECIPE_PIPELINES
    tf = create_transform(args.img_size, True, color_jitter=None, auto_augment="rand-m9-mstd0.5-inc1" if recipe else None,
                          re_prob=0.25 if recipe else 0.0)  # fmt: skip
    if pipeline == GPU_DECODE:
        from ..data.device_decode import DeviceDecodeLoader

        return DeviceDecodeLoader(source, tf, args.batch_size, workers, args.device)
    device = None if args.device == "cpu" else args.device  # the batch stage where the step runs (a GPU)
    return create_loader(source, tf, args.batch_size, is_training=True, workers=workers, decoder=args.decoder,
                         device=device)  # fmt: skip


def images_per_second(loader, batches: int) -> float:
    """Steady-state rate: the first batch (worker start, prefetch) is not timed."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(0)  # a StreamLoader would go on where the last measurement left it
    it = iter(loader)
    next(it)
    n, t0 = 0, time.perf_counter()
    for _ in range(batches):
        x = next(it)[0]
        n += len(x)
    if x.is_cuda:  # the batch stage's kernels, not their launch
        torch.cuda.synchronize(x.device)
    rate = n / (time.perf_counter() - t0)
    del it
    return rate


def throughput(source, args) -> list[dict[str, Any]]:
    """Interleaved rounds: per worker count, the pipelines in turn (order reversed every other round)."""
    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the main process as one worker (DataLoader workers run one thread)
    try:
        for workers in args.workers:
            names = pipelines(args.device)
            loaders = {p: _loader(p, source, args, workers) for p in names}
            rates: dict[str, list[float]] = {p: [] for p in names}
            for r in range(args.rounds):
                for p in names if r % 2 == 0 else names[::-1]:
                    rates[p].append(images_per_second(loaders[p], args.batches))
                    print(f"  workers={workers} round {r + 1} {p:<14} {rates[p][-1]:7.1f} img/s", flush=True)
            for p in names:
                rows.append({"pipeline": p, "workers": workers, "img_s": max(rates[p]), "rounds": rates[p]})
            del loaders
    finally:
        torch.set_num_threads(threads)
    return rows


def step_time(model_name: str, batch: int, img_size: int, dtype: str, steps: int = 3, device: str = "cpu") -> float:
    """Median seconds of one AdamW training step (forward, backward, update) at ``batch`` x ``img_size`` on
    ``device`` (CUDA events on a GPU)."""
    from ..models import build_model

    dev = torch.device(device)
    model = build_model(model_name, img_size=img_size).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, 3, img_size, img_size, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)

    def step() -> None:
        with torch.autocast(dev.type, torch.bfloat16, enabled=dtype == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = [time_call(step, dev) for _ in range(steps + 1)]
    return sorted(times[1:])[len(times[1:]) // 2]


def gemm_share(model_name: str, batch: int, img_size: int, seconds: float, dtype: str, device: str) -> float:
    """The step's share of the device's GEMM rate in ``dtype``: 3 x the forward pass's model FLOPs (forward and
    backward) / ``seconds`` / the measured rate (:mod:`vitlab.measure.gemm`)."""
    from ..measure.flops import count_flops
    from ..measure.gemm import measure_gemm
    from ..models import build_model

    flops = count_flops(build_model(model_name, img_size=img_size).train(), (3, img_size, img_size), batch)
    rate = measure_gemm(dtype, device=device, min_time=1.0).flops_per_s
    return 3 * 2 * flops.macs / seconds / rate


def bottleneck(doc: dict[str, Any]) -> list[str]:
    """Which side limits training: each loader of DeiT's recipe (CPU decode; GPU decode where measured) at the
    most workers measured against each step."""
    most = max(doc["options"]["workers"])
    loaders = {r["pipeline"]: r["img_s"] for r in doc["throughput"]
               if r["pipeline"] in RECIPE_PIPELINES and r["workers"] == most}  # fmt: skip
    lines = []
    for s in doc.get("steps", []):
        for name, loader in loaders.items():
            short = 1 - loader / s["img_s"]
            verdict = f"the loader, short by {100 * short:.0f} %" if short > 0 else "the step (the loader keeps up)"
            lines.append(f"bottleneck {s['model']} {s['dtype']}, {name}: {verdict}: loader {loader:.0f} img/s "
                         f"with {most} workers, step {s['img_s']:.0f} img/s")  # fmt: skip
    return lines


def _tree_memory(pid: int) -> dict[str, int]:
    """RSS and PSS in bytes of a process and all its descendants (Linux /proc)."""
    pids, out = [pid], {"rss": 0, "pss": 0, "processes": 0}
    while pids:
        p = pids.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                fields = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.split()[-1] == "kB"}
            with open(f"/proc/{p}/task/{p}/children") as f:
                pids += [int(c) for c in f.read().split()]
        except OSError:
            continue
        out["rss"] += fields.get("Rss", 0)
        out["pss"] += fields.get("Pss", 0)
        out["processes"] += 1
    return out


def memory_probe(root: str, batches: int = 30) -> dict[str, int]:
    """In a fresh process: a 2-worker loader over ``root``; the tree's memory sampled after each of the last
    ``batches // 2`` batches (how many batches are in flight, in shared memory, varies): the medians."""
    from ..data import create_loader, create_transform, open_source

    src = open_source(f"folder:{root}", "train")
    loader = create_loader(src, create_transform(224, True), 32, is_training=True, workers=2)
    it = iter(loader)
    samples = []
    for b in range(batches):
        next(it)
        if b >= batches // 2:
            samples.append(_tree_memory(os.getpid()))
    median = {k: sorted(s[k] for s in samples)[len(samples) // 2] for k in samples[0]}
    return {"files": len(src), **median, "rss_max": max(s["rss"] for s in samples)}


def replicate(src_root: Path, dst: Path, files: int) -> Path:
    """A train/ folder of ``files`` hard links cycling over the images of ``src_root/train``."""
    from ..data import open_source

    src = open_source(f"folder:{src_root}", "train")
    for k in range(files):
        i = k % len(src)
        path, label = src.read(i)
        target = dst / "train" / src.classes[label] / f"{k:07d}{path.suffix}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(path, target)
    return dst


def loader_memory(src_root: Path, work: Path) -> list[dict[str, int]]:
    """Fresh-process probes at 2,000 and 20,000 files in the order A B B A A B; per size the median of the
    three readings of each measure (one reading alone swung 2x with the batches that happened to be in flight)."""
    roots = {n: replicate(src_root, work / f"mem{n}", n) for n in (2000, 20000)}
    readings: dict[int, list[dict[str, int]]] = {n: [] for n in roots}
    for files in (2000, 20000, 20000, 2000, 2000, 20000):
        code = f"import json; from vitlab.bench.data import memory_probe; print(json.dumps(memory_probe({str(roots[files])!r})))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        readings[files].append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = readings[files][-1]
        print(f"  loader memory with {files} files: RSS {r['rss'] / 2**20:.0f} MiB, PSS {r['pss'] / 2**20:.0f} MiB "
              f"over {r['processes']} processes", flush=True)  # fmt: skip
    return [{k: statistics.median_low(r[k] for r in rs) for k in rs[0]} for rs in readings.values()]


# --------------------------------------------------------------------------- the run


def _dataset(args, work: Path) -> Path:
    if args.data:
        from ..data import DataSpec

        spec = DataSpec.parse(args.data)
        if spec.kind != "folder":
            raise ValueError(f"--data must be folder:ROOT (an ImageNet-layout folder), got {args.data!r}")
        return Path(spec.path).expanduser()
    from ..data.synth import synthesize

    per_class = max(1, args.images // 10)
    print(f"generating {per_class * 10} synthetic JPEGs (ImageNet sizes, quality 90) in {work}", flush=True)
    synthesize(work / "synth", num_classes=10, train_per_class=per_class, val_per_class=1)
    return work / "synth"


def report_text(doc: dict[str, Any]) -> str:
    names = list(dict.fromkeys(r["pipeline"] for r in doc["throughput"]))
    lines = [f"vitlab bench-data: decode + training transform at {doc['img_size']} px ({doc['images']} images, "
             f"load {doc['loadavg']})", "", f"{'workers':>7}  " + "  ".join(f"{p:>14}" for p in names)
             + "   vitlab/reference"]  # fmt: skip
    for w in doc["options"]["workers"]:
        rate = {r["pipeline"]: r["img_s"] for r in doc["throughput"] if r["workers"] == w}
        cells = "  ".join(f"{rate[p]:>10.1f} i/s" for p in names)
        lines.append(f"{w:>7}  {cells}   {rate['vitlab'] / rate['reference']:.2f}x")
    for s in doc.get("steps", []):
        share = f" ({100 * s['gemm_share']:.0f} % of the GEMM rate)" if "gemm_share" in s else ""
        lines.append(f"step {s['model']} {s['dtype']} batch {s['batch']} on {s.get('device', 'cpu')}: "
                     f"{s['seconds']:.3f} s = {s['img_s']:.1f} img/s{share} -> {s['workers_needed']:.2f} vitlab "
                     "workers")  # fmt: skip
    lines += bottleneck(doc)
    for m in doc.get("memory", []):
        lines.append(f"memory {m['files']} files: RSS {m['rss'] / 2**20:.0f} MiB, PSS {m['pss'] / 2**20:.0f} MiB")
    if len(doc.get("memory", [])) == 2:
        a, b = doc["memory"]
        lines.append(f"growth 2k -> 20k files: RSS {100 * (b['rss'] / a['rss'] - 1):+.1f} %, "
                     f"PSS {100 * (b['pss'] / a['pss'] - 1):+.1f} %")  # fmt: skip
    return "\n".join(lines)
