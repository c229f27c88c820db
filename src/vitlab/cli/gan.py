"""``vitlab gan train | fid``: a SAGAN-style GAN with SAGAN's self-attention, external attention or none in it
(External Attention's image-generation row), and the FID of a checkpoint (docs/gan.md).

``vitlab gan train --data mnist --attention ea --steps 2000 --out runs/gan/ea`` trains (hinge loss, spectral
norm, SAGAN's learning rates) and writes ``last.pt``, ``samples.png`` and ``log.jsonl``;
``vitlab gan fid runs/gan/ea/last.pt --inception PATH`` prints the FID against the run's training images.
"""

from __future__ import annotations

import argparse
import json

from ..common import options as opt
from ..common.device import add_device_argument
from ..common.io import write_json_atomic
from ..tasks.gan.fid import ENV, WEIGHTS_FILE
from ..tasks.gan.model import ATTENTIONS, GAN_SIZES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..tasks.gan.train import GANTrainConfig

    d = GANTrainConfig()
    sub = parser.add_subparsers(dest="gan_command", metavar="ACTION", required=True)
    t = sub.add_parser("train", help="train a SAGAN-style GAN (attention: sa, ea or none); checkpoints, samples")
    t.add_argument("--data", default=d.data, help="images: mnist (embedded), cifar10:FOLDER, mnist-idx:FOLDER")
    t.add_argument("--out", default=None, help="run folder: last.pt, samples.png, log.jsonl (default runs/gan/ATTN)")
    t.add_argument("--attention", type=opt.Choice(*ATTENTIONS), default=d.attention, help="(default ea)")
    t.add_argument(
        "--size", type=opt.Choice(*GAN_SIZES), default=d.size, help="widths: paper (SAGAN's CIFAR) or mini (CPU)"
    )
    t.add_argument("--img-size", type=opt.Int(8, 256), default=d.img_size, help="image side, a power of two")
    for name, kind, text in (
        ("batch_size", opt.positive_int, "batch size"),
        ("steps", opt.positive_int, "generator steps"),
        ("lr_g", opt.positive_float, "generator learning rate (SAGAN 1e-4)"),
        ("lr_d", opt.positive_float, "discriminator learning rate (SAGAN 4e-4)"),
        ("beta1", opt.Float(0, 1, high_open=True), "Adam beta1 (SAGAN 0)"),
        ("beta2", opt.Float(0, 1, high_open=True), "Adam beta2 (SAGAN 0.9)"),
        ("d_steps", opt.positive_int, "discriminator steps per generator step"),
        ("checkpoint_every", opt.positive_int, "write last.pt and samples.png every N steps"),
        ("log_every", opt.positive_int, "log the losses every N steps"),
        ("seed", opt.seed, "seed of the weights, the batches and z"),
        ("threads", opt.threads, "torch threads"),
    ):
        default = getattr(d, name)
        t.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=f"{text} (default {default})")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last.pt")
    add_device_argument(t)

    f = sub.add_parser("fid", help="FID of a checkpoint's generator against real images (Inception weights file)")
    f.add_argument("checkpoint", help="last.pt of a `vitlab gan train` run")
    f.add_argument("--data", default=None, help="real images (default: the run's training data)")
    f.add_argument("--inception", default=None, help=f"the Inception weights file {WEIGHTS_FILE} (default: ${ENV})")
    f.add_argument("--samples", type=opt.Int(2), default=10_000, help="generated (and at most real) images")
    f.add_argument("--batch-size", type=opt.positive_int, default=100)
    f.add_argument("--seed", type=opt.seed, default=0, help="seed of z")
    f.add_argument("--json", default=None, help="also write the result to this JSON file")
    add_device_argument(f)


def run(args: argparse.Namespace) -> int:
    if args.gan_command == "train":
        from ..tasks.gan.train import GANTrainConfig, train_gan

        names = [k for k in vars(GANTrainConfig()) if k != "out"]
        cfg = GANTrainConfig(out=args.out or f"runs/gan/{args.attention}", **{k: getattr(args, k) for k in names})
        print(json.dumps(train_gan(cfg)))
        return 0
    from ..tasks.gan.train import checkpoint_fid

    result = checkpoint_fid(
        args.checkpoint, args.data, args.inception, args.samples, args.batch_size, args.device, seed=args.seed
    )
    if args.json:
        write_json_atomic(args.json, result)
    print(json.dumps(result))
    return 0
