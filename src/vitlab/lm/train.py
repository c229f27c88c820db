"""Training and evaluation of the causal models (paper §4.1: AdamW, warmup, lr 3e-3, wd 0.1 on linear weights).

:func:`train` runs a number of optimisation steps on random training windows/images, evaluates bits per
symbol on the training and held-out data every ``eval_every`` steps, and writes ``last.pt`` (atomic,
resumable: weights, optimizer, schedule, RNG) and ``metrics.json`` into ``out``, which the run owns
(:class:`vitlab.rundir.RunLock`): a folder holding a run is refused unless resumed or started over (``force``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..checkpoint import is_lm_checkpoint, load_checkpoint, load_state_checked, save_checkpoint
from ..io import write_json_atomic
from ..optim import WarmupCosine, create_optimizer
from ..rundir import RunLock, check_free_space, checkpoint_bytes
from .data import ByteData, ImageSequences, open_data
from .model import LN2, CausalLM, lm_config, shift_right

Data = ByteData | ImageSequences
# what a run writes into its folder (samples.png: `vitlab lm sample` of its checkpoint)
RUN_FILES = ("last.pt", "metrics.json", "samples.png")


@dataclass
class LMTrainConfig:
    """Options of :func:`train` (the ``vitlab lm train`` flags)."""

    model: str = "tiny_aft_local"
    data: str = ""
    out: str | None = None
    seq_len: int | None = None  # text: window length (default: the config's max_len); images: H*W*3
    batch_size: int = 16
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
    img_size: int | None = None  # images: average-pool to this side first (quick runs)
    augment: bool = True
    seed: int = 0
    threads: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)  # CausalLM options: dim, depth, dropout, window...
    resume: bool = False
    force: bool = False  # start over in an ``out`` that holds a run (its files are moved aside)


def build_data(cfg: LMTrainConfig, max_len: int) -> Data:
    return open_data(cfg.data, cfg.seq_len or max_len, cfg.holdout, cfg.img_size, cfg.augment)


def data_info(data: Data) -> dict[str, Any]:
    info: dict[str, Any] = {"kind": data.kind, "seq_len": data.seq_len}
    if isinstance(data, ImageSequences):
        info.update(size=list(data.size), channels=data.channels)
    return info


@torch.no_grad()
def evaluate(model: CausalLM, data: Data, split: str, batch_size: int = 16, max_symbols: int | None = None) -> float:
    """Bits per symbol (bits/dim for images, bits/char for bytes) of ``model`` on a split: the summed NLL of
    every scored symbol / their number / ln 2."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for seqs in data.eval_batches(split, batch_size, max_symbols or None):
            seqs = seqs.long()
            logits = model(shift_right(seqs, model.vocab_size))
            total += F.cross_entropy(logits.flatten(0, 1).float(), seqs.flatten(), reduction="sum").item()
            count += seqs.numel()
    finally:
        model.train(was)
    return total / count / LN2


def _save(run: LMRun) -> None:
    save_checkpoint(
        {
            "model_name": run.cfg.model,
            "model_kwargs": run.model.config,
            "model": run.model.state_dict(),
            "optimizer": run.opt.state_dict(),
            "scheduler": run.sched.state_dict(),
            "step": run.step,
            "config": dataclasses.asdict(run.cfg),
            "data": data_info(run.data),
            "metrics": {"history": run.history},
            "rng": {"data": run.gen.get_state(), "torch": torch.get_rng_state()},
        },
        run.out / "last.pt",
    )


def load_lm(path: str | Path) -> tuple[CausalLM, dict[str, Any]]:
    """A trained model and its checkpoint (read with ``weights_only=True``)."""
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
    log: Callable[[str], None]
    out: Path | None
    data: Data
    model: CausalLM
    opt: torch.optim.Optimizer
    sched: WarmupCosine
    gen: torch.Generator  # the data sampler's stream
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


def train(cfg: LMTrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.data``; returns ``{"history": [...], "final": {...}, "out": ...}``."""
    with own_out(cfg, log) as start_over:
        run = setup(cfg, log)
        if run.out is not None:  # before the first write: room for a checkpoint, then the old run out of the way
            check_free_space(run.out, checkpoint_bytes(run.model.state_dict(), 3))
            start_over()
        run.model.train()
        t0, seen, running = time.perf_counter(), 0, []
        while run.step < cfg.steps:
            bits = train_step(run)
            running.append(bits)
            seen += 1
            if run.step % cfg.log_every == 0 or run.step == cfg.steps:
                rate = seen / (time.perf_counter() - t0)
                log(
                    f"step {run.step}/{cfg.steps}  loss {sum(running) / len(running):.4f} bits  "
                    f"lr {run.sched.current_lr:.2e}  {rate:.2f} steps/s"
                )
                running = []
            if run.step % cfg.eval_every == 0 or run.step == cfg.steps:
                record(run, bits)
                if run.out is not None:
                    _save(run)
        return finish(run)


@contextlib.contextmanager
def own_out(cfg: LMTrainConfig, log: Callable[[str], None]) -> Iterator[Callable[[], None]]:
    """The run owns ``cfg.out`` while it trains (none without an ``out``); yields ``start_over``, which moves
    an old run's files aside (``force``)."""
    if cfg.out is None:
        yield lambda: None
        return
    with RunLock(cfg.out, "vitlab lm train", log) as lock:
        old = lock.check_fresh(RUN_FILES, resume=cfg.resume, force=cfg.force)
        yield lambda: lock.move_aside(old)


def setup(cfg: LMTrainConfig, log: Callable[[str], None]) -> LMRun:
    """Checks, the checkpoint to resume, data, model (seeded), optimizer, schedule and the data stream."""
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.eval_every < 1:
        raise ValueError(
            f"need steps, batch_size and eval_every >= 1, got {cfg.steps}, {cfg.batch_size}, {cfg.eval_every}"
        )
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out) if cfg.out else None
    resume = None
    if cfg.resume:
        if out is None or not (out / "last.pt").is_file():
            raise FileNotFoundError(f"--resume: no checkpoint {out / 'last.pt' if out else '(no --out)'} to continue")
        resume = load_checkpoint(out / "last.pt")
    base = lm_config(cfg.model)
    data = build_data(cfg, cfg.overrides.get("max_len", base["max_len"]))
    overrides = {"max_len": data.seq_len, **cfg.overrides}  # the position table fits the data's sequences
    torch.manual_seed(cfg.seed)
    model = CausalLM(**lm_config(cfg.model, **overrides))
    if data.seq_len > model.max_len:
        raise ValueError(f"sequences of {data.seq_len} symbols do not fit max_len = {model.max_len}")
    opt = create_optimizer(model, cfg.lr, cfg.weight_decay)
    sched = WarmupCosine(opt, cfg.lr, cfg.steps, min(cfg.warmup_steps, cfg.steps), cfg.min_lr)
    run = LMRun(cfg, log, out, data, model, opt, sched, torch.Generator().manual_seed(cfg.seed))
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        sched.load_state_dict(resume["scheduler"])
        run.gen.set_state(resume["rng"]["data"])
        torch.set_rng_state(resume["rng"]["torch"])
        run.step = int(resume["step"])
        run.history = list(resume["metrics"].get("history", []))
        log(f"resumed from {out / 'last.pt'} at step {run.step}")
    params = sum(p.numel() for p in model.parameters())
    log(f"{cfg.model}: {params / 1e6:.2f}M parameters, {data}, {cfg.steps} steps of batch {cfg.batch_size}")
    return run


def train_step(run: LMRun) -> float:
    """One optimisation step on a fresh random batch; returns its loss in bits per symbol."""
    cfg = run.cfg
    seqs = run.data.sample(cfg.batch_size, run.gen).long()
    loss = run.model.loss(seqs)
    if not math.isfinite(loss.item()):
        raise ValueError(f"the training loss became {loss.item()} at step {run.step + 1}; lower --lr")
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.clip_grad > 0:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.clip_grad)
    run.opt.step()
    run.sched.step()
    run.step += 1
    return loss.item() / LN2


def record(run: LMRun, loss_bits: float | None) -> dict[str, Any]:
    """Evaluate bits per symbol on both splits; the row joins the history."""
    cfg, data = run.cfg, run.data
    row = {
        "step": run.step,
        "train_loss_bits": loss_bits,
        "train_bits": evaluate(run.model, data, "train", cfg.eval_batch_size, cfg.eval_symbols),
        "test_bits": evaluate(run.model, data, "test", cfg.eval_batch_size, cfg.eval_symbols),
    }
    run.history.append(row)
    run.log(
        f"step {run.step}: bits/{'dim' if data.kind == 'images' else 'char'} train {row['train_bits']:.4f} "
        f"held-out {row['test_bits']:.4f}"
    )
    return row


def finish(run: LMRun) -> dict[str, Any]:
    """The result (also ``OUT/metrics.json``): the final evaluation and the history."""
    cfg = run.cfg
    final = run.history[-1] if run.history else record(run, None)
    result = {
        "model": cfg.model,
        "data": str(cfg.data),
        **data_info(run.data),
        "params": sum(p.numel() for p in run.model.parameters()),
        "steps": run.step,
        "history": run.history,
        "final": final,
        "out": str(run.out) if run.out else None,
    }
    if run.out is not None:
        write_json_atomic(run.out / "metrics.json", result, indent=2)
    return result
