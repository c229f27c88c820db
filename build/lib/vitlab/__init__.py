"""vitlab: Vision Transformer improvements as drop-in PyTorch components."""

from . import layers, mixers
from .models import create_model, get_config, list_models

__version__ = "0.1.0"

__all__ = ["__version__", "create_model", "get_config", "layers", "list_models", "mixers"]
