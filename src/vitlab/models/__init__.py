"""Models: the generic VisionTransformer, TNT, T2T-ViT (EAMLP) and the registry of named configs."""

from . import configs  # noqa: F401  (registers the named models)
from .registry import ModelConfig, create_model, get_config, list_models, register
from .t2t import T2TViT
from .tnt import TNT
from .vit import VisionTransformer

__all__ = ["TNT", "ModelConfig", "T2TViT", "VisionTransformer", "create_model", "get_config", "list_models", "register"]
