"""logitless: cross-entropy losses of language models without materialising the logits."""

from ._loss_math import LossStats
from ._plans import DEFAULT_MEMORY_BUDGET
from .cross_entropy import CrossEntropyLoss, cross_entropy
from .linear_cross_entropy import LinearCrossEntropyLoss, linear_cross_entropy

__version__ = "0.1.0"

__all__ = [
    "linear_cross_entropy",
    "LinearCrossEntropyLoss",
    "cross_entropy",
    "CrossEntropyLoss",
    "LossStats",
    "DEFAULT_MEMORY_BUDGET",
]
