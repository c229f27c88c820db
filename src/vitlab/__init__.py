"""vitlab: Vision Transformer improvements as drop-in PyTorch components.

The public front: ``create_model`` (timm's: ``pretrained=``, ``checkpoint_path=``, ``features_only=``),
``from_pretrained`` (a model folder written by ``model.save_pretrained``), ``list_models``, ``get_config``,
and the building blocks ``layers`` and ``mixers``.
"""

import importlib

from . import layers, mixers
from .common import deprecated
from .interop.pretrained import create_model, from_pretrained, weights_dir
from .models import get_config, list_models

__version__ = "0.1.0"

deprecated.install()  # the deprecated import paths (vitlab.train, vitlab.seg, ...), for one release


def __getattr__(name: str):
    """``vitlab.train`` and the other deprecated packages as attributes, as they were (each warns once)."""
    if name in deprecated.OLD_PATHS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "__version__",
    "create_model",
    "from_pretrained",
    "get_config",
    "layers",
    "list_models",
    "mixers",
    "weights_dir",
]
