"""placeholder: being written."""
from .base import TokenMixer

class DistributedLocalAttention(TokenMixer):
    pass

class RefinerAttention(TokenMixer):
    pass
