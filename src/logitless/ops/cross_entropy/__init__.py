"""Cross-entropy on logits the caller holds: api (public), reference, one file per backend."""

from .api import CrossEntropyLoss, cross_entropy

__all__ = ["cross_entropy", "CrossEntropyLoss"]
