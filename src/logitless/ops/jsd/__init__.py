"""Generalized Jensen-Shannon distillation loss on student and teacher logits held."""

from .api import JSDLoss, jsd

__all__ = ["jsd", "JSDLoss"]
