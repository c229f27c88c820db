"""placeholder: being written."""
from .base import TokenMixer

class ReAttention(TokenMixer):
    pass
