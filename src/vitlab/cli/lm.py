"""``vitlab lm train | eval | sample | bench | list``: causal sequence models on bytes and CIFAR-10 sub-pixels."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..common import options as opt
from ..common.device import AMP_CHOICES, add_device_argument
from ..common.io import check_writable_file, write_json_atomic

FULL_BIAS = "full"  # --bias-dim full: a full T x T position bias (AFT Table 3)


class BiasDim(opt.Check):
    """``--bias-dim``: d' of the factorised bias (a positive integer), or ``full`` (also ``none``) for the
    non-factorised ``T x T`` bias of the AFT paper's Table 3."""

    what = "a positive integer or 'full' (a T x T bias)"

    def parse(self, text: str) -> int | str:
        return FULL_BIAS if text.lower() in (FULL_BIAS, "none") else int(text, 10)

    def accepts(self, value: object) -> bool:
        return value == FULL_BIAS or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


bias_dim = BiasDim()


# CausalLM options settable from the command line (None: the named config's value)
MODEL_FLAGS = {
    "dim": (opt.positive_int, "model width d"),
    "depth": (opt.Int(1, 1024), "number of blocks L"),
    "heads": (opt.positive_int, "attention heads (Transformer and the multi-head baselines)"),
    "dropout": (opt.rate, "dropout (paper 0.1)"),
    "window": (opt.positive_int, "AFT-local window s, or the local_attention baseline's window"),
    "bias_dim": (bias_dim, "d' of the factorised AFT position bias, or 'full' for a T x T bias (Table 3)"),
    "max_len": (opt.positive_int, "position-table length (default: the data's sequence length)"),
    "channels": (opt.Choice(1, 3), "1: embedding/head shared across RGB (paper); 3: one per channel"),
}


def _train_args(p: argparse.ArgumentParser) -> None:
    from ..tasks.lm.train import LMTrainConfig

    d = LMTrainConfig()
    p.add_argument(
        "--model",
        default=d.model,
        help="named LM config (see `vitlab lm list`): AFT, the Transformer, or a baseline (performer_enwik8, ...)",
    )
    p.add_argument("--data", required=True, help="a text/byte file, or a CIFAR-10 batches folder (cifar10:<folder>)")
    p.add_argument("--out", default=None, help="output folder: last.pt, metrics.json (default runs/lm/<model>)")
    p.add_argument(
        "--seq-len", type=opt.positive_int, default=None, help="text window length (default: the config's max_len)"
    )
    for name, kind, text in (
        ("batch_size", opt.positive_int, "batch size"),
        ("steps", opt.positive_int, "optimisation steps"),
        ("lr", opt.positive_float, "peak learning rate (paper 3e-3)"),
        ("min_lr", opt.non_negative_float, "final learning rate"),
        ("warmup_steps", opt.non_negative_int, "linear warmup steps"),
        ("weight_decay", opt.non_negative_float, "AdamW decay of the linear weights (paper 0.1, enwik8 0.5)"),
        ("clip_grad", opt.non_negative_float, "gradient-norm clip (0: off)"),
        ("eval_every", opt.positive_int, "evaluate and checkpoint every N steps"),
        ("eval_symbols", opt.non_negative_int, "symbols scored per split and evaluation (0: whole split)"),
        ("eval_batch_size", opt.positive_int, "evaluation batch size"),
        ("log_every", opt.positive_int, "progress line every N steps"),
        ("holdout", opt.positive_float, "text: held-out tail, fraction or bytes"),
        (
            "valid",
            opt.non_negative_float,
            "text: validation part before the held-out tail, fraction or bytes "
            "(enwik8: --holdout 5000000 --valid 5000000)",
        ),
        ("img_size", opt.image_size, "images: average-pool to this side first (quick runs)"),
        ("seed", opt.seed, "seed of the weights and the data order"),
        ("threads", opt.threads, "torch threads (0: torch's default)"),
        ("accum_steps", opt.positive_int, "micro-batches per optimisation step (gradient accumulation)"),
    ):
        default = getattr(d, name)
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=f"{text} (default {default})")
    p.add_argument("--no-augment", dest="augment", action="store_false", help="images: no flip/shift augmentation")
    add_device_argument(p)
    p.add_argument(
        "--amp",
        choices=AMP_CHOICES,
        default=d.amp,
        help="autocast: auto = fp16 with a gradient scaler on a GPU, none on the CPU; bf16 on CPU or GPU "
        f"(default {d.amp})",
    )
    p.add_argument("--fsdp", action="store_true", help="under torchrun: shard the model over the processes (FSDP2)")
    p.add_argument("--tf32", action="store_true", help="GPU: TF32 tensor cores for fp32 matrix products")
    p.add_argument(
        "--grad-checkpointing", action="store_true", help="recompute each block's activations in the backward pass"
    )
    p.add_argument("--tensorboard", action="store_true", help="also write the metrics to OUT/tb (tensorboard extra)")
    start = p.add_mutually_exclusive_group()  # continue the run in --out, or start over: not both
    start.add_argument("--resume", action="store_true", help="continue the run in --out from its last.pt")
    start.add_argument("--force", action="store_true", help="start over even if --out holds a run (moved aside)")
    g = p.add_argument_group("model options (override the named config)")
    for name, (kind, text) in MODEL_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=text)
    g.add_argument("--tie-head", action="store_true", default=None, help="the head reuses the token embedding")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="lm_command", metavar="ACTION")
    _train_args(sub.add_parser("train", help="train a causal model; bits/dim (bits/char) on train and held-out data"))

    e = sub.add_parser("eval", help="bits/dim (bits/char) of a checkpoint on train and held-out data")
    e.add_argument("checkpoint", help="last.pt written by `vitlab lm train`")
    e.add_argument("--data", default=None, help="data to score (default: the data it was trained on)")
    e.add_argument(
        "--split",
        nargs="+",
        choices=("train", "valid", "test"),
        default=["train", "test"],
        help="the parts to score (valid: where the run set --valid)",
    )
    e.add_argument("--eval-symbols", type=opt.non_negative_int, default=0, help="symbols per split (0: whole split)")
    e.add_argument("--batch-size", type=opt.positive_int, default=16)
    e.add_argument("--json", default=None, help="write the figures to this JSON file")
    e.add_argument("--threads", type=opt.threads, default=0)
    add_device_argument(e)
    e.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none", help="autocast dtype (fp16: GPU)")

    s = sub.add_parser("sample", help="generate text, or images as a PNG grid, by incremental decoding")
    s.add_argument("checkpoint")
    s.add_argument("--num", type=opt.positive_int, default=4, help="number of samples")
    s.add_argument(
        "--length", type=opt.positive_int, default=None, help="symbols to generate (default: text 200, images all)"
    )
    s.add_argument("--prompt", default=None, help="text models: start every sample with this text")
    s.add_argument(
        "--prompt-rows",
        type=opt.non_negative_int,
        default=0,
        help="image models: complete held-out images from their top rows",
    )
    s.add_argument("--data", default=None, help="image prompts come from this data (default: the training data)")
    s.add_argument("--temperature", type=opt.non_negative_float, default=1.0, help="0: greedy")
    s.add_argument("--top-k", type=opt.positive_int, default=None, help="sample from the k likeliest symbols")
    s.add_argument("--seed", type=opt.seed, default=0)
    s.add_argument(
        "--out",
        default=None,
        help="write to this file (.txt, or .png for images; default: print text, "
        "images to samples.png next to the checkpoint)",
    )
    s.add_argument("--threads", type=opt.threads, default=0)
    add_device_argument(s)

    from ..tasks.lm.bench import add_arguments as bench_args

    bench_args(
        sub.add_parser(
            "bench",
            help="training step time and peak memory: AFT-local, AFT-simple, Transformer (--baselines: and the "
            "efficient-attention baselines)",
        )
    )
    sub.add_parser("list", help="the named LM configurations")


def run(args: argparse.Namespace) -> int:
    action = getattr(args, "lm_command", None)
    if action is None:
        print("usage: vitlab lm {train,eval,sample,bench,list} ... (see vitlab lm --help)")
        return 0
    import torch

    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    return {"train": _train, "eval": _eval, "sample": _sample, "bench": _bench, "list": _list}[action](args)


def _train(args: argparse.Namespace) -> int:
    from ..common.distributed import close_distributed, current_world
    from ..tasks.lm.train import LMTrainConfig, train

    overrides = {k: getattr(args, k) for k in [*MODEL_FLAGS, "tie_head"] if getattr(args, k) is not None}
    if overrides.get("bias_dim") == FULL_BIAS:
        overrides["bias_dim"] = None  # the mixers' spelling of a full T x T bias
    fields = set(LMTrainConfig.__dataclass_fields__) - {"overrides", "out"}
    cfg = LMTrainConfig(
        **{k: getattr(args, k) for k in fields}, out=args.out or f"runs/lm/{args.model}", overrides=overrides
    )
    try:
        result = train(cfg, log=lambda s: print(s, flush=True))
    finally:
        close_distributed()
    if not current_world().main:
        return 0
    print(f"wrote {Path(cfg.out) / 'metrics.json'} and {Path(cfg.out) / 'last.pt'}")
    return 0 if result["final"] else 1


def _bench(args: argparse.Namespace) -> int:
    from ..tasks.lm.bench import run as bench_run

    return bench_run(args)


def _list(args: argparse.Namespace) -> int:
    from ..tasks.lm.model import LM_CONFIGS

    for name, (cfg, note) in LM_CONFIGS.items():
        mixer = cfg["mixer"] if isinstance(cfg["mixer"], str) else f"{cfg['mixer'][0]} {cfg['mixer'][1]}"
        print(f"{name:26s} L={cfg.get('depth')} d={cfg.get('dim')} T={cfg['max_len']} {mixer}  -- {note}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from ..tasks.lm.train import evaluate_checkpoint

    if args.json:
        check_writable_file(args.json, "--json")
    res = evaluate_checkpoint(
        args.checkpoint, args.split, args.batch_size, args.eval_symbols or None, args.device, args.amp, args.data
    )
    for split in args.split:
        print(f"{split}: {res[f'{split}_bits']:.4f} {res['unit']}")
    if args.json:
        write_json_atomic(args.json, res, indent=2)
    return 0


def _sample(args: argparse.Namespace) -> int:
    from ..tasks.lm.sample import sample

    if args.out:
        check_writable_file(args.out)
    lines = sample(
        args.checkpoint,
        num=args.num,
        length=args.length,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        prompt=args.prompt,
        prompt_rows=args.prompt_rows,
        data=args.data,
        out=args.out,
        device=args.device,
    )
    print("\n".join(lines))
    return 0
