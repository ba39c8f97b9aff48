"""Token log-probs and entropy from hidden states and the LM head: api (public),
reference (float64), one file per backend."""

from .api import LinearLogProbs, linear_log_probs

__all__ = ["linear_log_probs", "LinearLogProbs"]
