"""Models: the generic VisionTransformer, TNT, T2T-ViT (EAMLP) and the registry of named configs."""

from .registry import ModelConfig, create_model, get_config, list_models, register
from .vit import VisionTransformer

__all__ = ["ModelConfig", "VisionTransformer", "create_model", "get_config", "list_models", "register"]
