"""placeholder: being written."""
from .base import TokenMixer

class ExternalAttention(TokenMixer):
    pass

class MultiHeadExternalAttention(TokenMixer):
    pass
