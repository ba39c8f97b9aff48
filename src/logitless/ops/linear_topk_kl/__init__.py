"""Top-k distillation without the student's logits: api (public), reference (float64), one file per backend."""

from .api import LinearTopKKLLoss, linear_topk_kl

__all__ = ["linear_topk_kl", "LinearTopKKLLoss"]
