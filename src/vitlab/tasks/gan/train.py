"""A short GAN training loop (SAGAN's recipe: hinge loss, Adam β = (0, 0.9), two time-scale learning rates
1e-4 / 4e-4, one D step per G step) over an in-memory image set, with checkpoints (``last.pt``, resumable), a
sample grid and a loss log in the run folder; and the FID of a checkpoint (:func:`checkpoint_fid`).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...common.device import resolve_device
from ...common.io import atomic_path, open_append
from ...data.datasets import load_dataset
from .fid import fake_batches, frechet_distance, inception_features, real_batches
from .model import ATTENTIONS, GAN_SIZES, Generator, build_gan, check_size, d_hinge_loss, g_hinge_loss


@dataclass
class GANTrainConfig:
    """One run: the data (a :func:`vitlab.data.load_dataset` spec), the model (attention switch, size row, image
    side) and the recipe (SAGAN's unless set)."""

    data: str = "mnist"
    out: str = "runs/gan"
    attention: str = "ea"
    size: str = "mini"
    img_size: int = 32
    batch_size: int = 64
    steps: int = 1000
    lr_g: float = 1e-4
    lr_d: float = 4e-4
    beta1: float = 0.0
    beta2: float = 0.9
    d_steps: int = 1
    checkpoint_every: int = 200
    log_every: int = 50
    seed: int = 0
    device: str = "auto"
    threads: int = 0
    resume: bool = False

    def check(self) -> GANTrainConfig:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.size not in GAN_SIZES:
            raise ValueError(f"size must be one of {', '.join(GAN_SIZES)}, got {self.size!r}")
        check_size(self.img_size)
        for name in ("batch_size", "steps", "d_steps", "checkpoint_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        return self


def as_images(batch: Tensor, img_size: int) -> Tensor:
    """uint8 (B, C, H, W) → float in [-1, 1] at ``img_size`` (the generator's tanh range)."""
    x = batch.float() / 127.5 - 1
    if x.shape[-2:] != (img_size, img_size):
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False, antialias=True)
    return x


def save_checkpoint(path: Path, **state: Any) -> None:
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}; give the last.pt of a `vitlab gan train` run")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or "generator" not in ckpt or "config" not in ckpt:
        raise ValueError(f"{path} is not a `vitlab gan train` checkpoint (no generator or config in it)")
    return ckpt


def generator_of(ckpt: dict[str, Any]) -> Generator:
    """The checkpoint's generator, its weights loaded."""
    cfg = ckpt["config"]
    g, _ = build_gan(cfg["size"], cfg["img_size"], ckpt["chans"], cfg["attention"])
    g.load_state_dict(ckpt["generator"])
    return g


def train_gan(cfg: GANTrainConfig, print_fn=print) -> dict[str, Any]:
    """Train; returns the last step's losses. ``OUT/last.pt`` every ``checkpoint_every`` steps and at the end,
    ``OUT/samples.png`` (64 images from a fixed z), ``OUT/log.jsonl`` (one line per ``log_every`` steps)."""
    cfg.check()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    last = out / "last.pt"
    if last.exists() and not cfg.resume:
        raise ValueError(f"{out} holds a run (last.pt); give --resume to continue it or a new --out")
    device = resolve_device(cfg.device)
    data = load_dataset(cfg.data, "train", seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    g, d = build_gan(cfg.size, cfg.img_size, data.in_chans, cfg.attention)
    g, d = g.to(device), d.to(device)
    betas = (cfg.beta1, cfg.beta2)
    opt_g = torch.optim.Adam(g.parameters(), cfg.lr_g, betas=betas)
    opt_d = torch.optim.Adam(d.parameters(), cfg.lr_d, betas=betas)
    step, rng = 0, torch.Generator().manual_seed(cfg.seed)
    if cfg.resume and last.exists():
        ckpt = load_checkpoint(last)
        if ckpt["config"]["attention"] != cfg.attention or ckpt["config"]["size"] != cfg.size:
            raise ValueError(f"{last} is a {ckpt['config']['attention']} / {ckpt['config']['size']} run; resume it so")
        g.load_state_dict(ckpt["generator"])
        d.load_state_dict(ckpt["discriminator"])
        opt_g.load_state_dict(ckpt["opt_g"])
        opt_d.load_state_dict(ckpt["opt_d"])
        step = ckpt["step"]
        rng.set_state(ckpt["rng"])
    fixed_z = torch.randn(64, g.z_dim, generator=torch.Generator().manual_seed(cfg.seed + 1)).to(device)
    out.mkdir(parents=True, exist_ok=True)
    losses: dict[str, Any] = {}
    start = time.perf_counter()

    def checkpoint() -> None:
        save_checkpoint(
            last,
            config=asdict(cfg),
            chans=data.in_chans,
            step=step,
            generator=g.state_dict(),
            discriminator=d.state_dict(),
            opt_g=opt_g.state_dict(),
            opt_d=opt_d.state_dict(),
            rng=rng.get_state(),
        )
        from ..lm.sample import save_grid

        g.eval()
        with torch.no_grad():
            grid = ((g(fixed_z).clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
        g.train()
        save_grid(grid, out / "samples.png")

    while step < cfg.steps:
        g.train()
        d.train()
        for _ in range(cfg.d_steps):  # discriminator: hinge on a real batch and a generated one
            idx = torch.randint(len(data), (cfg.batch_size,), generator=rng)
            real = as_images(data.images[idx], cfg.img_size).to(device)
            with torch.no_grad():
                fake = g.sample(cfg.batch_size)
            loss_d = d_hinge_loss(d(real), d(fake))
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()
        loss_g = g_hinge_loss(d(g.sample(cfg.batch_size)))  # generator: D's gradients reach G only
        opt_g.zero_grad(set_to_none=True)
        loss_g.backward()
        opt_g.step()
        step += 1
        losses = {"step": step, "loss_d": loss_d.item(), "loss_g": loss_g.item()}
        if step % cfg.log_every == 0 or step == cfg.steps:
            losses["seconds"] = round(time.perf_counter() - start, 2)
            with open_append(out / "log.jsonl") as f:
                f.write(json.dumps(losses) + "\n")
            print_fn(f"step {step}/{cfg.steps}  loss_d {losses['loss_d']:.4f}  loss_g {losses['loss_g']:.4f}")
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            checkpoint()
    return losses


def checkpoint_fid(
    checkpoint: str | Path,
    data: str | None = None,
    inception: str | None = None,
    samples: int = 10_000,
    batch_size: int = 100,
    device: str = "auto",
    feature: torch.nn.Module | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """FID of a checkpoint's generator (``samples`` images) against the training images of ``data`` (default:
    the run's data; at most ``samples`` of them). ``feature``: another feature module than FID's Inception."""
    feature = feature if feature is not None else inception_features(inception)  # before any work: the file
    ckpt = load_checkpoint(checkpoint)
    dev = resolve_device(device)
    g = generator_of(ckpt).to(dev)
    spec = data or ckpt["config"]["data"]
    images = load_dataset(spec, "train").images[:samples]
    size = ckpt["config"]["img_size"]
    fid = frechet_distance(
        real_batches(images, size, batch_size), fake_batches(g, samples, batch_size, seed), feature.to(dev)
    )
    config = ckpt["config"]
    return dict(fid=fid, real=len(images), generated=samples, data=spec, step=ckpt["step"], **config_of(config))


def config_of(config: dict[str, Any]) -> dict[str, Any]:
    """What names a run's model: its attention switch, size row and image side."""
    return {k: config[k] for k in ("attention", "size", "img_size")}
