"""The routing algorithm of Heinsen (2022), in pure PyTorch: no serving code depends on it here."""

from service.routing import credit
from service.routing.definable import DefinableVectorRouting
from service.routing.efficient import EfficientVectorRouting
from service.routing.generative import GenerativeMatrixRouting

__all__ = ["DefinableVectorRouting", "EfficientVectorRouting", "GenerativeMatrixRouting", "credit"]
