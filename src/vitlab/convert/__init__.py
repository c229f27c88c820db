"""Load checkpoints of the official code and timm into vitlab models."""

from .keymaps import KEY_RULES, rename_keys

__all__ = ["KEY_RULES", "rename_keys"]
