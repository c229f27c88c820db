"""Checkpoints: one package for the file format, safe loading and sharded (DCP) checkpoints.

A save goes down through the layers once, one way: a training run's checkpoint (collective; the engine's
:mod:`vitlab.engine.checkpointing`) -> :mod:`.sharded` (every rank's shards, FSDP) -> :mod:`.format` (the file: format tag, checksum, atomic
write). A read comes back through :mod:`.safeload` (the one loader that never runs code from a file) and
:mod:`.load` (the checkpoint dict, its shards gathered, the model it holds).

Nothing here imports :mod:`vitlab.interop`: converting other implementations' weights uses this package,
not the other way round. :func:`vitlab.interop.pretrained.load_model` builds a model from any weights file.

>>> save_checkpoint({"model_name": "deit_mini", "model_kwargs": {}, "model": model.state_dict()}, "m.pt")
>>> model = model_from_checkpoint(load_checkpoint("m.pt"))
"""

from .format import FORMAT, VERSION, save_checkpoint, state_checksum, verify_checksum
from .load import (
    check_image_classifier,
    check_model_name,
    describe_mismatch,
    is_lm_checkpoint,
    load_checkpoint,
    load_state_checked,
    model_from_checkpoint,
    shard_folder,
)
from .safeload import NonFiniteWeightsWarning, load_file
from .sharded import SHARDS, ShardError, load_sharded, read_sharded_weights, save_sharded

__all__ = [
    "FORMAT",
    "SHARDS",
    "VERSION",
    "NonFiniteWeightsWarning",
    "ShardError",
    "check_image_classifier",
    "check_model_name",
    "describe_mismatch",
    "is_lm_checkpoint",
    "load_checkpoint",
    "load_file",
    "load_sharded",
    "load_state_checked",
    "model_from_checkpoint",
    "read_sharded_weights",
    "save_checkpoint",
    "save_sharded",
    "shard_folder",
    "state_checksum",
    "verify_checksum",
]
