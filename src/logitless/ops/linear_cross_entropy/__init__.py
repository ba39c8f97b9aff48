"""Fused linear cross-entropy: api (public), reference (float64), one file per backend."""

from .api import LinearCrossEntropyLoss, linear_cross_entropy

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss"]
