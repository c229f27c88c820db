"""vitlab: Vision Transformer improvements as drop-in PyTorch components."""

from . import mixers

__version__ = "0.1.0"

__all__ = ["__version__", "mixers"]
