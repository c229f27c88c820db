"""Causal sequence models (AFT paper §4.1-4.2): byte-level text and CIFAR-10 sub-pixel sequences.

``vitlab lm train | eval | sample | bench``; see :mod:`vitlab.tasks.lm.model` for the models and named configs.
"""

from .model import LM_CONFIGS, CausalLM, bits_per_dim, create_lm, list_lms, lm_config, shift_right

__all__ = ["LM_CONFIGS", "CausalLM", "bits_per_dim", "create_lm", "list_lms", "lm_config", "shift_right"]
