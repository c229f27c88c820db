"""placeholder: being written."""
from .base import TokenMixer

class AFTFull(TokenMixer):
    pass

class AFTLocal(TokenMixer):
    pass

class AFTSimple(TokenMixer):
    pass

class AFTConv(TokenMixer):
    pass
