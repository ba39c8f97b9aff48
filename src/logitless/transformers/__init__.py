"""Hugging Face ``transformers`` models trained with logitless' loss, no logits stored.

    import logitless.transformers as lt
    model = AutoModelForCausalLM.from_pretrained(...)
    lt.patch(model)                          # this instance; returns the model
    lt.patch(AutoModelForCausalLM)           # or: every supported model loaded from now on
    ...train as usual (Trainer, torch.compile, your own loop; TRL: see below)...
    lt.unpatch(model)

In training mode with ``labels`` the patched forward returns transformers' own output
with ``loss`` set and ``logits=None``: the loss is transformers' (shifted labels,
``ignore_index``, ``num_items_in_batch``, the family's soft-cap or logit scale, the MoE
router auxiliary loss), computed by ``logitless.linear_cross_entropy`` from the last
hidden state and the head weight. Without labels, or in eval mode, nothing changes.

Supported: ``SUPPORTED`` (dense causal LMs, mixture-of-experts and vision-language
models); each class's forward source is checked at patch time (``source_check``) and
anything unexpected is refused with the reason. ``patch.py`` describes the mechanism,
``head.py`` the heads (nn.Linear, PEFT LoRA, modules_to_save), ``loss.py`` the loss.
``causal_lm_loss`` gives the same loss from hidden states for trainers that run the
backbone themselves. TRL's trainers run their own fused head, which bypasses the
patch: a patched model warns once (``PatchBypassedWarning``) and names
``logitless.integrations.trl.patch_sft`` / ``patch_grpo`` / ``patch_gkd``.
"""

from __future__ import annotations

from .bypass import PatchBypassedWarning
from .patch import causal_lm_loss, is_patched, patch, unpatch
from .registry import SUPPORTED

__all__ = ["patch", "unpatch", "is_patched", "causal_lm_loss", "SUPPORTED", "PatchBypassedWarning"]
