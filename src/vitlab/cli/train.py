"""``vitlab train``: train a registered model (``torchrun --nproc_per_node=N -m vitlab.cli train ...`` for DDP,
``--fsdp`` to shard it; ``--nnodes/--node-rank/--rdzv-endpoint`` across machines)."""

from __future__ import annotations

import argparse

from ..engine import arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    arguments.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    return arguments.train_from_args(args)
