"""Training and evaluation of the causal models (paper §4.1: AdamW, warmup, lr 3e-3, wd 0.1 on linear weights).

:func:`train` runs a number of optimisation steps on random training windows/images, evaluates bits per
symbol on the training and held-out data every ``eval_every`` steps, and writes ``last.pt`` (atomic,
resumable: weights, optimizer, schedule, RNG) and ``metrics.json`` into ``out``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .data import ByteData, ImageSequences, open_data
from .model import LN2, CausalLM, lm_config, shift_right

Data = ByteData | ImageSequences


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


def _save(
    path: Path,
    model: CausalLM,
    opt,
    sched,
    step: int,
    cfg: LMTrainConfig,
    data: Data,
    metrics: dict,
    gen: torch.Generator,
) -> None:
    from ..checkpoint import save_checkpoint

    save_checkpoint(
        {
            "model_name": cfg.model,
            "model_kwargs": model.config,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "step": step,
            "config": dataclasses.asdict(cfg),
            "data": data_info(data),
            "metrics": metrics,
            "rng": {"data": gen.get_state(), "torch": torch.get_rng_state()},
        },
        path,
    )


def load_lm(path: str | Path) -> tuple[CausalLM, dict[str, Any]]:
    """A trained model and its checkpoint (read with ``weights_only=True``)."""
    from ..checkpoint import load_checkpoint, load_state_checked

    ckpt = load_checkpoint(path)
    if "data" not in ckpt or not isinstance(ckpt.get("model_kwargs"), dict) or "vocab_size" not in ckpt["model_kwargs"]:
        raise ValueError(f"{ckpt['path']} is not a `vitlab lm train` checkpoint")
    model = CausalLM(**ckpt["model_kwargs"])
    load_state_checked(model, ckpt["model"], f"checkpoint {ckpt['path']}")
    return model.eval(), ckpt


def train(cfg: LMTrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``cfg.model`` on ``cfg.data``; returns ``{"history": [...], "final": {...}, "out": ...}``."""
    from ..optim import WarmupCosine, create_optimizer

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
        from ..checkpoint import load_checkpoint

        resume = load_checkpoint(out / "last.pt")
    base = lm_config(cfg.model)
    data = build_data(cfg, cfg.overrides.get("max_len", base["max_len"]))
    overrides = {"max_len": data.seq_len, **cfg.overrides}  # the position table fits the data's sequences
    torch.manual_seed(cfg.seed)
    model = CausalLM(**lm_config(cfg.model, **overrides))
    if data.seq_len > model.max_len:
        raise ValueError(f"sequences of {data.seq_len} symbols do not fit max_len = {model.max_len}")
    opt = create_optimizer(model, cfg.lr, cfg.weight_decay)
    warmup = min(cfg.warmup_steps, cfg.steps)
    sched = WarmupCosine(opt, cfg.lr, cfg.steps, warmup, cfg.min_lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[dict[str, Any]] = []
    step = 0
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["optimizer"])
        sched.load_state_dict(resume["scheduler"])
        gen.set_state(resume["rng"]["data"])
        torch.set_rng_state(resume["rng"]["torch"])
        step = int(resume["step"])
        history = list(resume["metrics"].get("history", []))
        log(f"resumed from {out / 'last.pt'} at step {step}")
    params = sum(p.numel() for p in model.parameters())
    log(f"{cfg.model}: {params / 1e6:.2f}M parameters, {data}, {cfg.steps} steps of batch {cfg.batch_size}")

    def record(step: int, train_bits: float | None) -> dict[str, Any]:
        row = {
            "step": step,
            "train_loss_bits": train_bits,
            "train_bits": evaluate(model, data, "train", cfg.eval_batch_size, cfg.eval_symbols),
            "test_bits": evaluate(model, data, "test", cfg.eval_batch_size, cfg.eval_symbols),
        }
        history.append(row)
        log(
            f"step {step}: bits/{'dim' if data.kind == 'images' else 'char'} train {row['train_bits']:.4f} "
            f"held-out {row['test_bits']:.4f}"
        )
        return row

    model.train()
    t0, seen, running = time.perf_counter(), 0, []
    while step < cfg.steps:
        seqs = data.sample(cfg.batch_size, gen).long()
        loss = model.loss(seqs)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}; lower --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        opt.step()
        sched.step()
        step += 1
        seen += 1
        running.append(loss.item() / LN2)
        if step % cfg.log_every == 0 or step == cfg.steps:
            rate = seen / (time.perf_counter() - t0)
            log(
                f"step {step}/{cfg.steps}  loss {sum(running) / len(running):.4f} bits  lr {sched.current_lr:.2e}  "
                f"{rate:.2f} steps/s"
            )
            running = []
        if step % cfg.eval_every == 0 or step == cfg.steps:
            record(step, loss.item() / LN2)
            if out is not None:
                _save(out / "last.pt", model, opt, sched, step, cfg, data, {"history": history}, gen)
    final = history[-1] if history else record(step, None)
    result = {
        "model": cfg.model,
        "data": str(cfg.data),
        **data_info(data),
        "params": params,
        "steps": step,
        "history": history,
        "final": final,
        "out": str(out) if out else None,
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(result, indent=2))
    return result
