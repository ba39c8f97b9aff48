"""logitless: cross-entropy and distillation losses of language models without materialising the logits."""

from ._loss_math import LossStats
from ._plans import DEFAULT_MEMORY_BUDGET
from .cross_entropy import CrossEntropyLoss, cross_entropy
from .linear_cross_entropy import LinearCrossEntropyLoss, linear_cross_entropy
from .jsd import JSDLoss, jsd
from .linear_jsd import LinearJSDLoss, linear_jsd

__version__ = "0.1.0"

__all__ = [
    "linear_cross_entropy",
    "LinearCrossEntropyLoss",
    "cross_entropy",
    "CrossEntropyLoss",
    "linear_jsd",
    "LinearJSDLoss",
    "jsd",
    "JSDLoss",
    "LossStats",
    "DEFAULT_MEMORY_BUDGET",
]
