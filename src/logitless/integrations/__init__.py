"""Integrations with third-party trainers (PyTorch side). None of them imports the
trainer it serves: each works with that trainer installed or not.

- ``logitless.integrations.verl.linear_cross_entropy``: drop-in for verl's fused
  ``verl.utils.kernel.linear_cross_entropy`` (log-probs and entropy for PPO/GRPO).
- ``logitless.integrations.trl.patch_grpo``: TRL's ``GRPOTrainer`` gets its per-token
  log-probs and entropy from logitless (no logits).
- ``logitless.integrations.hf_log_probs``: per-token log-probs (and entropy) of the
  given tokens under an HF causal LM, from its last hidden states, without logits.
"""

from .hf import hf_log_probs

__all__ = ["hf_log_probs"]
