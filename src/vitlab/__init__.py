"""vitlab: Vision Transformer improvements as drop-in PyTorch components.

The public front: ``create_model`` (timm's: ``pretrained=``, ``checkpoint_path=``, ``features_only=``),
``from_pretrained`` (a model folder written by ``model.save_pretrained``), ``list_models``, ``get_config``,
and the building blocks ``layers`` and ``mixers``.
"""

from . import layers, mixers
from .interop.pretrained import create_model, from_pretrained, weights_dir
from .models import get_config, list_models

__version__ = "0.1.0"

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
