"""Training and evaluation of the causal models (paper §4.1: AdamW, warmup, lr 3e-3, wd 0.1 on linear weights).

:func:`train` runs a number of optimisation steps on random training windows/images, evaluates bits per
symbol on the training and held-out data every ``eval_every`` steps, and writes ``last.pt`` (atomic,
resumable: weights, optimizer, schedule, RNG), ``metrics.json`` and ``steps.jsonl`` (one row per step:
loss, learning rate, gradient norm, symbols/s, memory) into ``out``, which the run owns
(:func:`vitlab.common.rundir.own_folder`): a folder holding a run is refused unless resumed or started over
(``force``).

At paper scale (AFT Table 2: CIFAR-10 at T = 3072; Table 4: enwik8) it runs on a GPU (``device``), under
autocast (``amp``: bf16, or fp16 with a gradient scaler), on several GPUs or machines under ``torchrun``
(DDP, or FSDP2 with ``fsdp``: sharded checkpoints that resume on any number of processes), with
``accum_steps`` micro-batches per optimisation step. ``batch_size`` is the global batch of one step:
every process draws the same batch from the seeded data stream and takes its own slice, so the run sees the
same sequences whatever the number of processes and micro-batches.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...checkpoint import is_lm_checkpoint, load_checkpoint, load_state_checked
from ...common.device import AMP_CHOICES, amp_dtype, autocast, resolve_device, set_tf32
from ...common.distributed import World, all_reduce_sum, barrier, gradient_sync, init_distributed, parallelize
from ...common.io import write_json_atomic
from ...common.rundir import check_free_space, checkpoint_bytes, own_folder
from ...data import derive_seed
from ...engine.checkpointing import (
    gather_rng_states,
    optimization_state,
    prune_shards,
    restore_optimization,
    restore_rng_streams,
    write_run_checkpoint,
)
from ...engine.optim import Optimization, build_optimization
from ...engine.tracking import StepLog, fmt_eta, memory_probe
from .data import ByteData, ImageSequences, open_data
from .model import LN2, CausalLM, lm_config, shift_right

Data = ByteData | ImageSequences
# what a run writes into its folder (samples.png: `vitlab lm sample` of its checkpoint)
RUN_FILES = ("last.pt", "metrics.json", "samples.png", "steps.jsonl", "tb", "shards")


@dataclass
class LMTrainConfig:
    """Options of :func:`train` (the ``vitlab lm train`` flags)."""

    model: str = "tiny_aft_local"
    data: str = ""
    out: str | None = None
    seq_len: int | None = None  # text: window length (default: the config's max_len); images: H*W*3
    batch_size: int = 16  # global batch of one optimisation step (split over processes and micro-batches)
    steps: int = 1000
    lr: float = 3e-3
    min_lr: float = 0.0
    warmup_steps: int = 100
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    eval_every: int = 200
    eval_symbols: int = 100_000  # per split and evaluation (0: the whole split)
    eval_batch_size: int = 16
    log_every: int = 50
    holdout: float = 0.05  # text: held-out tail (fraction or bytes)
    valid: float = 0.0  # text: a validation part just before the held-out tail (fraction or bytes; 0: none)
    img_size: int | None = None  # images: average-pool to this side first (quick runs)
    augment: bool = True
    seed: int = 0
    threads: int = 0
    device: str = "auto"
    amp: str = "auto"  # auto: fp16 + scaler on a GPU, none on the CPU; bf16 anywhere
    accum_steps: int = 1  # micro-batches per optimisation step (gradient accumulation)
    fsdp: bool = False  # under torchrun: shard the model with FSDP2, one unit per block
    tf32: bool = False
    grad_checkpointing: bool = False  # recompute each block's activations in the backward pass
    tensorboard: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)  # CausalLM options: dim, depth, dropout, window...
    resume: bool = False
    force: bool = False  # start over in an ``out`` that holds a run (its files are moved aside)


def build_data(cfg: LMTrainConfig, max_len: int) -> Data:
    return open_data(cfg.data, cfg.seq_len or max_len, cfg.holdout, cfg.img_size, cfg.augment, cfg.valid)


def data_info(data: Data) -> dict[str, Any]:
    info: dict[str, Any] = {"kind": data.kind, "seq_len": data.seq_len}
    if isinstance(data, ImageSequences):
        info.update(size=list(data.size), channels=data.channels)
    return info


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: Data,
    split: str,
    batch_size: int = 16,
    max_symbols: int | None = None,
    dtype: torch.dtype | None = None,
) -> float:
    """Bits per symbol (bits/dim for images, bits/char for bytes) of ``model`` on a split: the summed NLL of
    every scored symbol / their number / ln 2 (on the model's device, under autocast to ``dtype`` if given)."""
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = torch.zeros((), device=device, dtype=torch.float64), 0
    try:
        for seqs in data.eval_batches(split, batch_size, max_symbols or None):
            seqs = seqs.long().to(device)
            with autocast(device, dtype):
                logits = model(shift_right(seqs, model.vocab_size))
            total += F.cross_entropy(logits.flatten(0, 1).float(), seqs.flatten(), reduction="sum").double()
            count += seqs.numel()
    finally:
        model.train(was)
    return total.item() / count / LN2


def load_lm(path: str | Path) -> tuple[CausalLM, dict[str, Any]]:
    """A trained model and its checkpoint (read with ``weights_only=True``; sharded weights gathered)."""
    ckpt = load_checkpoint(path)
    if not is_lm_checkpoint(ckpt):
        raise ValueError(
            f"{ckpt['path']} is not a `vitlab lm train` checkpoint (it holds the image model "
            f"{ckpt.get('model_name')!r}); use `vitlab eval` with it"
        )
    model = CausalLM(**ckpt["model_kwargs"])
    load_state_checked(model, ckpt["model"], f"checkpoint {ckpt['path']}")
    return model.eval(), ckpt


@dataclass
class LMRun:
    """Everything one sequence-model training run holds between its steps."""

    cfg: LMTrainConfig
    log: Callable[[str], None]  # rank 0's lines (the other ranks' are dropped)
    out: Path | None
    world: World
    device: torch.device
    dtype: torch.dtype | None
    data: Data
    raw: CausalLM  # the model itself
    model: nn.Module  # what a step calls: the model, its DDP wrapper, or the sharded model
    opt: Optimization  # optimizer, schedule, gradient scaler (as in `vitlab train`)
    gen: torch.Generator  # the data sampler's stream (the same on every rank)
    steps_log: StepLog
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def per_rank(self) -> int:
        return self.cfg.batch_size // self.world.size


def train(cfg: LMTrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.data``; returns ``{"history": [...], "final": {...}, "out": ...}``
    (rank 0; the other ranks return the same keys without writing)."""
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        set_tf32(cfg.tf32)
    world = init_distributed(device)
    with own_folder(cfg.out, "vitlab lm train", RUN_FILES, cfg.resume, cfg.force, log, world) as start_over:
        run = setup(cfg, log if world.main else (lambda line: None), world, device)
        if run.out is not None and world.main:  # before the first write: room for a checkpoint, old run aside
            check_free_space(run.out, checkpoint_bytes(run.raw.state_dict(), 3))
            start_over()
        run.model.train()
        try:
            loop(run)
        finally:
            run.steps_log.close()
        return finish(run)


def loop(run: LMRun) -> None:
    """Steps until ``cfg.steps``: a line every ``log_every`` steps (with the ETA), an evaluation and a
    checkpoint every ``eval_every`` steps and at the end."""
    cfg = run.cfg
    t0, first, running = time.perf_counter(), run.step, []
    while run.step < cfg.steps:
        bits = train_step(run)
        running.append(bits)
        if run.step % cfg.log_every == 0 or run.step == cfg.steps:
            per_step = (time.perf_counter() - t0) / (run.step - first)
            run.log(
                f"step {run.step}/{cfg.steps}  loss {sum(running) / len(running):.4f} bits  "
                f"lr {run.opt.sched.current_lr:.2e}  {1 / per_step:.2f} steps/s  ETA {fmt_eta(per_step * (cfg.steps - run.step))}"
            )
            running = []
        if run.step % cfg.eval_every == 0 or run.step == cfg.steps:
            record(run, bits)
            if run.out is not None:
                save(run)
            run.steps_log.restart_clock()


def check_config(cfg: LMTrainConfig, world: World) -> None:
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.eval_every < 1 or cfg.accum_steps < 1:
        raise ValueError(
            f"need steps, batch_size, eval_every and accum_steps >= 1, got {cfg.steps}, {cfg.batch_size}, "
            f"{cfg.eval_every}, {cfg.accum_steps}"
        )
    if cfg.amp not in AMP_CHOICES:
        raise ValueError(f"--amp must be one of {', '.join(AMP_CHOICES)}, got {cfg.amp!r}")
    parts = world.size * cfg.accum_steps
    if cfg.batch_size % parts:
        raise ValueError(
            f"the global batch {cfg.batch_size} must split evenly over {world.size} process(es) x "
            f"{cfg.accum_steps} micro-batch(es); use a multiple of {parts}"
        )


def setup(cfg: LMTrainConfig, log: Callable[[str], None], world: World, device: torch.device) -> LMRun:
    """Checks, the checkpoint to resume, data, model (seeded, spread over the processes), optimizer,
    schedule, scaler and the data stream."""
    check_config(cfg, world)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out) if cfg.out else None
    resume = None
    if cfg.resume:
        if out is None or not (out / "last.pt").is_file():
            raise FileNotFoundError(f"--resume: no checkpoint {out / 'last.pt' if out else '(no --out)'} to continue")
        resume = load_checkpoint(out / "last.pt", weights=False)
    base = lm_config(cfg.model)
    data = build_data(cfg, cfg.overrides.get("max_len", base["max_len"]))
    overrides = {"max_len": data.seq_len, **cfg.overrides}  # the position table fits the data's sequences
    torch.manual_seed(cfg.seed)
    raw = CausalLM(**lm_config(cfg.model, **overrides))
    if data.seq_len > raw.max_len:
        raise ValueError(f"sequences of {data.seq_len} symbols do not fit max_len = {raw.max_len}")
    dtype = amp_dtype(cfg.amp, device)
    raw.set_grad_checkpointing(cfg.grad_checkpointing)
    model = parallelize(raw.to(device), device, world, cfg.fsdp)
    opt = build_optimization(raw, cfg.lr, cfg.weight_decay, cfg.steps, min(cfg.warmup_steps, cfg.steps), cfg.min_lr,
                             device, dtype)  # fmt: skip
    steps_log = StepLog(out if world.main else None, cfg.log_every, cfg.tensorboard, memory_probe(device), "sym_s")
    gen = torch.Generator().manual_seed(cfg.seed)
    run = LMRun(cfg, log, out, world, device, dtype, data, raw, model, opt, gen, steps_log)
    if world.size > 1:  # one dropout stream per rank (alone: the stream goes on from the initialisation)
        torch.manual_seed(derive_seed(cfg.seed, world.rank))
    if resume is not None:
        restore(run, resume)
    params = sum(p.numel() for p in raw.parameters())
    how = f" on {world.size} processes ({'FSDP' if cfg.fsdp else 'DDP'})" if world.size > 1 else ""
    accum = f" ({cfg.accum_steps} micro-batches)" if cfg.accum_steps > 1 else ""
    log(
        f"{cfg.model}: {params / 1e6:.2f}M parameters, {data}, {cfg.steps} steps of batch {cfg.batch_size}{accum}"
        f"{how}, {device}{f', autocast {dtype}' if dtype else ''}"
    )
    return run


def restore(run: LMRun, ckpt: dict[str, Any]) -> None:
    """Continue from a checkpoint: weights and optimizer (sharded or whole), schedule, scaler, the data
    stream, every rank's dropout stream (when the number of processes is unchanged), the history."""
    restore_optimization(ckpt, run.raw, run.opt)
    run.gen.set_state(ckpt["rng"]["data"])
    streams = ckpt["rng"]["torch"]
    if not restore_rng_streams(streams, run.world, run.device):
        n = 1 if isinstance(streams, torch.Tensor) else len(streams)
        run.log(f"note: the checkpoint was written by {n} processes, now {run.world.size}: fresh dropout streams")
    run.step = int(ckpt["step"])
    run.history = list(ckpt["metrics"].get("history", []))
    if dropped := run.steps_log.trim(run.step):
        run.log(f"note: dropped {dropped} rows of steps after the checkpoint from {run.steps_log.path}")
    run.log(f"resumed from {ckpt['path']} at step {run.step}")


def train_step(run: LMRun) -> float:
    """One optimisation step on a fresh random batch (this rank's slice, in ``accum_steps`` micro-batches);
    returns the batch's loss in bits per symbol (over all ranks)."""
    cfg, world = run.cfg, run.world
    seqs = run.data.sample(cfg.batch_size, run.gen).long()  # the same global batch on every rank
    mine = seqs[world.rank * run.per_rank : (world.rank + 1) * run.per_rank].to(run.device)
    micro = mine.chunk(cfg.accum_steps)
    total = torch.zeros((), device=run.device)
    optimizer, scaler = run.opt.optimizer, run.opt.scaler
    optimizer.zero_grad(set_to_none=True)
    for i, part in enumerate(micro):
        with gradient_sync(run.model, i == len(micro) - 1):
            with autocast(run.device, run.dtype):
                logits = run.model(shift_right(part, run.raw.vocab_size))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), part.flatten()) / len(micro)
            scaler.scale(loss).backward()
        total += loss.detach()
    if not math.isfinite(total.item()):
        raise ValueError(f"the training loss became {total.item()} at step {run.step + 1}; lower --lr")
    scaler.unscale_(optimizer)
    params = [p for p in run.raw.parameters() if p.grad is not None]
    clip = cfg.clip_grad if cfg.clip_grad > 0 else float("inf")
    norm = nn.utils.clip_grad_norm_(params, clip)
    scaler.step(optimizer)
    scaler.update()
    lr = optimizer.param_groups[0]["lr"]
    run.opt.sched.step()
    run.step += 1
    total = all_reduce_sum(total, world) / world.size
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    scalars = {"_names": ("loss_bits", "grad_norm"), "lr": lr}
    run.steps_log.add(run.step, seqs.numel(), scalars, torch.stack([total / LN2, norm.float()]))
    return total.item() / LN2


def record(run: LMRun, loss_bits: float | None) -> dict[str, Any]:
    """Evaluate bits per symbol on both splits (rank 0, or every rank of a sharded model); the row joins the
    history."""
    cfg, data = run.cfg, run.data
    if not (run.world.main or cfg.fsdp):
        return {}
    model = run.model if cfg.fsdp else run.raw
    bits = {s: evaluate(model, data, s, cfg.eval_batch_size, cfg.eval_symbols, run.dtype) for s in data.parts}
    row = {"step": run.step, "train_loss_bits": loss_bits, **{f"{s}_bits": b for s, b in bits.items()}}
    run.history.append(row)
    run.steps_log.scalars(run.step, {k: v for k, v in row.items() if k != "step"}, prefix="eval")
    run.log(
        f"step {run.step}: bits/{'dim' if data.kind == 'images' else 'char'} train {row['train_bits']:.4f} "
        + (f"validation {row['valid_bits']:.4f} " if "valid_bits" in row else "")
        + f"held-out {row['test_bits']:.4f}"
    )
    return row


def save(run: LMRun) -> None:
    """``last.pt`` (collective: every rank its RNG stream, and its shards under FSDP; rank 0 the file)."""
    cfg = run.cfg
    streams = gather_rng_states(run.device, run.world)
    state = {
        "model_name": cfg.model,
        "model_kwargs": run.raw.config,
        **optimization_state(run.raw, run.opt, sharded=cfg.fsdp),
        "step": run.step,
        "world_size": run.world.size,
        "config": dataclasses.asdict(cfg),
        "data": data_info(run.data),
        "metrics": {"history": run.history},
        "rng": {"data": run.gen.get_state(), "torch": streams},
    }
    shards = f"step-{run.step:07d}" if cfg.fsdp else None
    if write_run_checkpoint(run.out / "last.pt", state, run.world, shards, run.raw, run.opt.optimizer) is not None:
        prune_shards(run.out)


def finish(run: LMRun) -> dict[str, Any]:
    """The result (also ``OUT/metrics.json`` on rank 0): the final evaluation and the history."""
    cfg = run.cfg
    final = run.history[-1] if run.history else record(run, None)
    result = {
        "model": cfg.model,
        "data": str(cfg.data),
        **data_info(run.data),
        "params": sum(p.numel() for p in run.raw.parameters()),
        "steps": run.step,
        "world_size": run.world.size,
        "history": run.history,
        "final": final,
        "out": str(run.out) if run.out else None,
    }
    if run.out is not None and run.world.main:
        write_json_atomic(run.out / "metrics.json", result, indent=2)
    barrier(run.world)
    return result


def checkpoint_data(ckpt: dict[str, Any], spec: str | None = None, augment: bool = False) -> Data:
    """The data a checkpoint was trained on (or ``spec``, read with the same sequence length and splits)."""
    cfg = ckpt["config"]
    return open_data(
        spec or cfg["data"], ckpt["data"]["seq_len"], cfg["holdout"], cfg["img_size"], augment, cfg.get("valid", 0.0)
    )


def evaluate_checkpoint(
    path: str,
    splits: list[str],
    batch_size: int,
    symbols: int | None = None,
    device: str = "auto",
    amp: str = "none",
    data: str | None = None,
) -> dict[str, Any]:
    """``vitlab lm eval``: the bits per symbol (bits/char for text, bits/dim for images) of the causal model saved
    at ``path`` on each split of its data (or ``data``)."""
    model, ckpt = load_lm(path)
    dev = resolve_device(device)
    model.to(dev)
    sequences = checkpoint_data(ckpt, data)
    unit = "bits/dim" if sequences.kind == "images" else "bits/char"
    res = {"checkpoint": ckpt["path"], "data": str(data or ckpt["config"]["data"]), "step": ckpt["step"], "unit": unit}
    dtype = amp_dtype(amp, dev)
    for split in splits:
        res[f"{split}_bits"] = evaluate(model, sequences, split, batch_size, symbols, dtype)
    return res
