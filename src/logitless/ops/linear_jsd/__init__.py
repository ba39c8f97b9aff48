"""Fused linear distillation loss: generalized JSD of student and teacher heads, no logits."""

from .api import LinearJSDLoss, linear_jsd

__all__ = ["linear_jsd", "LinearJSDLoss"]
