"""Models: the generic VisionTransformer, TNT, T2T-ViT (EAMLP), Twins' PCPVT pyramid and the registry of named
configs."""

from . import zoo  # noqa: F401  (register the named models)
from .pyramid import PyramidCPVT
from .registry import ModelConfig, build_model, get_config, list_models, register, supports_dynamic_size
from .t2t import T2TViT
from .tnt import TNT
from .vit import VisionTransformer

__all__ = [
    "TNT",
    "ModelConfig",
    "PyramidCPVT",
    "T2TViT",
    "VisionTransformer",
    "build_model",
    "get_config",
    "list_models",
    "register",
    "supports_dynamic_size",
]
