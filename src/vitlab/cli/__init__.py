"""``vitlab`` command line: the dispatcher of the commands, one file each in this folder.

Each command module (``vitlab/cli/<command>.py``) exposes ``add_arguments(parser)`` and ``run(args) -> int``;
they are imported only when their subcommand runs, so ``vitlab --help`` stays
fast. Errors a user can fix (bad path, unknown model, bad option) print one
line; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from typing import NoReturn

from ..common.extras import MissingExtra
from ..common.runtime import configure_from_env, is_out_of_memory

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "models": ("vitlab.cli.models", "list the registered models with parameters and MACs"),
    "bench-mixers": ("vitlab.cli.bench_mixers", "time and memory of every token mixer as the token count grows"),
    "bench": ("vitlab.cli.bench", "throughput, latency, memory, MACs/FLOPs and GEMM utilisation of named models"),
    "train": (
        "vitlab.cli.train",
        "train a model (AdamW, warmup-cosine, EMA, distillation, resumable, torchrun DDP)",
    ),
    "relabel": (
        "vitlab.cli.relabel",
        "dense token-label maps (top-k scores per patch) for an image folder from a teacher",
    ),
    "eval": ("vitlab.cli.eval", "top-1/top-5 and throughput of a checkpoint, also at other input sizes"),
    "compare": (
        "vitlab.cli.compare",
        "train and evaluate a set of variants; one table, CSV/JSON/Markdown, plots",
    ),
    "study": (
        "vitlab.cli.study",
        "run a paper's ablation table (mean ± std over seeds, the paper's numbers beside); --list shows them",
    ),
    "analyze": (
        "vitlab.cli.analyze",
        "attention maps, collapse, head similarity, feature evolution, AFT, EA of a model",
    ),
    "bench-data": (
        "vitlab.cli.bench_data",
        "images/s of decode + training transform through DataLoader workers vs a plain PIL pipeline; loader memory",
    ),
    "data": ("vitlab.cli.data", "make image data: a synthetic ImageNet-layout JPEG folder, WebDataset shards, info"),
    "convert": ("vitlab.cli.convert", "load an official / timm checkpoint into a vitlab model and write safetensors"),
    "export": ("vitlab.cli.export", "export a model to ONNX or TorchScript (dynamic input size where it can vary)"),
    "seg": (
        "vitlab.cli.seg",
        "semantic segmentation (EANet / plain head over any backbone): synth, train, eval (mIoU, sliding windows)",
    ),
    "det": (
        "vitlab.cli.det",
        "detection (DETR with sine / learned / PEG encodings, Faster / Mask R-CNN over any backbone): synth, train, "
        "eval (COCO box and mask AP)",
    ),
    "points": (
        "vitlab.cli.points",
        "point clouds: PCT-style classifier with external attention on ModelNet40 (HDF5): synth, train, eval",
    ),
    "gan": ("vitlab.cli.gan", "image generation: a SAGAN-style GAN with self- / external / no attention; train, fid"),
    "lm": (
        "vitlab.cli.lm",
        "causal AFT / Transformer models on bytes and CIFAR-10 sub-pixels: train, eval, sample, bench",
    ),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, without the usage block: ``vitlab train: error: argument
    --train-limit: must be an integer >= 1, got '-5'; see vitlab train --help`` (exit code 2). Sub-commands'
    parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}; see {self.prog} --help\n")

    def parse_known_args(self, args=None, namespace=None):
        """Also records the innermost (sub-)command's name, ``vitlab lm train``, for the messages of its run."""
        namespace, extras = super().parse_known_args(args, namespace)
        if getattr(namespace, "_prog", None) is None:  # a sub-parser, which finishes first, has set it already
            namespace._prog = self.prog
        return namespace, extras


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (for its arguments), so ``vitlab --help`` stays fast
    and one tool's import cost or failure never affects another."""
    parser = OneLineParser(prog="vitlab", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = build_parser(command).parse_args(argv)
    except SystemExit as e:  # --help, or a bad option (one line printed): the parser's exit code, returned
        return e.code if isinstance(e.code, int) else 2
    if not args.command:
        build_parser().print_help()
        return 0
    try:
        configure_from_env()  # reuse freed activations instead of page-faulting fresh ones (vitlab.common.runtime)
        warnings.formatwarning = one_line_warning
        return int(importlib.import_module(args._module).run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- silence the flush at exit
        return 0
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, MissingExtra) as e:
        if args.debug:
            raise
        print(f"{args._prog}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a write the atomic helpers do not wrap (a lock file, a stream): full disk, size limit
        from ..common.io import WRITE_ERRNOS

        if args.debug or e.errno not in WRITE_ERRNOS:
            raise
        where = f" {os.fsdecode(e.filename)}" if e.filename else ""
        print(f"{args._prog}: error: could not write{where}: {WRITE_ERRNOS[e.errno]}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:  # out of memory in any command: one line (others: a traceback)
        if args.debug or not is_out_of_memory(e):
            raise
        first = " ".join(str(e).split("\n")[0].split())[:160]
        print(
            f"{args._prog}: error: out of memory ({first or type(e).__name__}); use a smaller batch, "
            "input size or model, or free memory",
            file=sys.stderr,
        )
        return 2


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings a command raises for its user (non-finite weights, ...) as one line, not file and source."""
    return f"vitlab: warning: {message}\n"


def run_tool(command: str, argv: list[str] | None = None) -> int:
    """``vitlab COMMAND ARGV...``: the entry of the ``benchmarks/`` scripts (one parser, one error format, the
    same runtime settings as the command)."""
    return main([command, *(sys.argv[1:] if argv is None else argv)])
