"""The former name of :mod:`vitlab.layers.recompute` (activation recomputation), kept for the modules and
users that still import it; new code imports :mod:`vitlab.layers.recompute`."""

from .recompute import recompute_active as checkpoint_active
from .recompute import recomputed as checkpointed

__all__ = ["checkpoint_active", "checkpointed"]
