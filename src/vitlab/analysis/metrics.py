"""The measures of the analyses, kept in :mod:`vitlab.measure.maps` (a service, so that ``vitlab study`` shares
them); the same functions under this module's name."""

from ..measure.maps import *  # noqa: F403
from ..measure.maps import __all__  # noqa: F401
