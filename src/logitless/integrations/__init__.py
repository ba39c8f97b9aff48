"""Integrations with third-party trainers (PyTorch side). None of them but ``torchtitan`` and
``nemo_automodel`` imports the trainer it serves at import: each works with that trainer installed
or not, and those two (subclasses of the trainer's loss classes) are imported only by their user,
never by ``import logitless``.

- ``logitless.integrations.verl.linear_cross_entropy``: drop-in for verl's fused
  ``verl.utils.kernel.linear_cross_entropy`` (log-probs and entropy for PPO/GRPO).
- ``logitless.integrations.trl.patch_grpo``: TRL's ``GRPOTrainer`` gets its per-token
  log-probs and entropy from logitless (no logits).
- ``logitless.integrations.hf_log_probs``: per-token log-probs (and entropy) of the
  given tokens under an HF causal LM, from its last hidden states, without logits.
- ``logitless.integrations.torch_api`` (``logitless.patch_torch``): torch's own
  ``F.linear_cross_entropy`` / ``nn.LinearCrossEntropyLoss`` (torch >= 2.13) on logitless.
- ``logitless.integrations.torchtitan.LogitlessLoss``: torchtitan's cross-entropy loss
  without logits, selected with ``--override.imports
  logitless.integrations.torchtitan.logitless_loss`` (docs/torchtitan.md).
- ``logitless.integrations.axolotl.LogitlessPlugin``: the axolotl plugin (one line in the
  YAML's ``plugins:``; axolotl is imported only when axolotl looks the plugin up).
- ``logitless.integrations.liger`` and ``logitless.integrations.cce``: Liger's and
  cut-cross-entropy's loss functions and modules, with their signatures and rules
  (docs/peers.md).
- ``logitless.integrations.megatron``: megatron-core's ``GPTModel`` loss, MTP losses and
  RL log-probs through its ``output_processor`` hook (``install(model)``; docs/megatron.md).
- ``logitless.integrations.nemo_automodel.LogitlessLinearCrossEntropy``: NeMo Automodel's
  linear cross-entropy, one ``loss_fn: _target_:`` line in a recipe YAML (imports nemo_automodel).
- ``logitless.integrations.openrlhf``: OpenRLHF's actor log-probs and entropy
  (``patch_actor(actor)`` or ``patch()``; docs/rl.md).
- ``logitless.integrations.llamafactory``: LLaMA-Factory's SFT and DPO
  (``python -m logitless.integrations.llamafactory config.yaml``; docs/transformers.md).

Each logs one INFO line per process, ``logitless is active (...)``, when it takes over a loss
(``logitless.integrations._announce``).
"""

__all__ = ["hf_log_probs"]


def __getattr__(name):
    # hf_log_probs on first use: its module imports logitless.transformers (which imports
    # torch._dynamo), and ``import logitless`` imports this package for patch_torch.
    if name == "hf_log_probs":
        from .hf import hf_log_probs

        return hf_log_probs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
