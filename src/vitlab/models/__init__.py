"""Models: the generic VisionTransformer, TNT, T2T-ViT (EAMLP), Twins' PCPVT pyramid and the registry of named
configs."""

from . import ablation_configs, configs  # noqa: F401  (register the named models)
from .pyramid import PyramidCPVT
from .registry import ModelConfig, create_model, get_config, list_models, register
from .t2t import T2TViT
from .tnt import TNT
from .vit import VisionTransformer

__all__ = [
    "TNT",
    "ModelConfig",
    "PyramidCPVT",
    "T2TViT",
    "VisionTransformer",
    "create_model",
    "get_config",
    "list_models",
    "register",
]
