"""Token log-probs and entropy on logits the caller holds: api (public), reference
(float64), one file per backend."""

from .api import LogProbs, log_probs

__all__ = ["log_probs", "LogProbs"]
