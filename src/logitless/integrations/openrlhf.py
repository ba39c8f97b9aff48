"""OpenRLHF (0.11): the actor's log-probs and entropy through ``logitless.linear_log_probs``,
without the (tokens x vocab) logits (docs/rl.md#openrlhf).

OpenRLHF's ``openrlhf.models.Actor.forward`` runs the HF model to its full logits, casts them to
fp32, divides them by the rollout temperature and takes ``log_probs_from_logits`` (and
``compute_entropy``) of them: at 8k-32k tokens and a 150k vocabulary the largest tensors of the
PPO/GRPO step. Here the same forward runs the model's decoder to its last hidden states and
``linear_log_probs(hidden, lm_head.weight, next tokens, temperature=actor.temperature,
entropy=return_entropy)`` gives the same per-token values (fp32, exact), with gradients to the
whole model. What the actor returns is OpenRLHF's: ``action_log_probs`` (B, A) times the action
mask, or all log-probs (B, S - 1) with ``return_logprobs``; with ``return_output`` an output
whose ``entropy`` is (B, S - 1) and whose ``logits`` is None. OpenRLHF's PPO / GRPO losses, KL
and advantages are untouched.

- ``patch_actor(actor)``: this ``Actor`` (one call, after it is built; a DeepSpeed engine
  around it calls its forward).
- ``patch()``: every ``Actor`` of this process (``openrlhf.models.Actor.forward``). OpenRLHF's
  PPO runs its actors in Ray workers: start Ray with the hook before OpenRLHF does (its
  ``train()`` starts Ray only when it is not running)::

      ray.init(runtime_env={"worker_process_setup_hook": "logitless.integrations.openrlhf.patch"})

Supported as OpenRLHF's forward does them: padded and packed samples (``packing_samples``, ring
attention: log-probs are per token, computed where the token is), LoRA (a ``PeftModel``),
Gemma 2's soft-capped logits, ZeRO stages 0-2. A call that asks for the logits themselves (no
``action_mask`` and no ``return_logprobs``) runs OpenRLHF's own forward. Refused with a
``ValueError`` that says why: vision-language actors (their forward takes image inputs),
DeepSpeed ZeRO-3 (the head's weight is partitioned outside its forward: use OpenRLHF's own
forward there), heads that scale their logits otherwise; ``output.aux_loss`` (a MoE router's
load-balancing loss, used when ``aux_loss_coef > 0``) raises AttributeError naming it.
``patch``/``patch_actor`` log once per process, at INFO, that logitless is active.
"""

from __future__ import annotations

import types
from typing import Any, Optional

import torch
from torch import Tensor

from logitless.ops.linear_log_probs import linear_log_probs
from logitless.transformers.patch import run_backbone

from . import hf as _hf
from ._announce import announce

__all__ = ["patch", "patch_actor", "ActorOutput"]

#: OpenRLHF's ``Actor.forward`` as found before ``patch()`` replaced it (None until then).
_openrlhf_forward = None


class ActorOutput(dict):
    """The ``output`` of a patched actor's forward: ``entropy`` (B, S - 1) when asked and
    ``logits`` None (attribute and key access, as the HF output OpenRLHF reads)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            what = ("the MoE router's aux_loss is not computed by logitless' actor forward: set "
                    "--actor.aux_loss_coef 0 or leave the actor unpatched" if name == "aux_loss" else
                    "logitless' actor forward returns entropy (when asked) and logits=None")
            raise AttributeError(f"{name!r}: {what}") from None


def _check_actor(actor) -> None:
    if not isinstance(getattr(actor, "model", None), torch.nn.Module) or not hasattr(actor, "temperature"):
        raise TypeError(f"logitless.integrations.openrlhf: expected an openrlhf.models.Actor (with .model and "
                        f".temperature), got {type(actor).__name__}")
    if getattr(actor, "is_vlm", False):
        raise ValueError("logitless.integrations.openrlhf: vision-language actors are not supported (their "
                         "forward takes image inputs); leave this actor unpatched")
    _hf.head_options(actor.model)   # ValueError for a head that scales its logits otherwise
    _hf.lm_head(actor.model)


def patch_actor(actor):
    """Route this OpenRLHF ``Actor``'s log-probs and entropy through logitless; returns it."""
    _check_actor(actor)
    actor.forward = types.MethodType(forward, actor)
    announce("openrlhf", "the actor's log-probs and entropy from linear_log_probs, no logits")
    return actor


def patch() -> None:
    """Replace ``openrlhf.models.Actor.forward`` for every actor of this process (idempotent)."""
    global _openrlhf_forward
    from openrlhf.models.actor import Actor

    if Actor.forward is not forward:
        _openrlhf_forward = Actor.forward
        Actor.forward = forward
    announce("openrlhf", "every Actor's log-probs and entropy from linear_log_probs, no logits")


def forward(self, sequences: Tensor, action_mask: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
            return_output: bool = False, allgather_logits: bool = False, return_logprobs: bool = False,
            ring_attn_group=None, packed_seq_lens: Optional[list] = None, return_entropy: bool = False,
            **mm_inputs: Any):
    """OpenRLHF 0.11's ``Actor.forward`` with the log-probs and entropy from logitless."""
    if action_mask is None and not return_logprobs:   # the caller wants the logits themselves
        original = _openrlhf_forward or _class_forward(self)
        return original(self, sequences, action_mask, attention_mask, return_output, allgather_logits,
                        return_logprobs, ring_attn_group, packed_seq_lens, return_entropy, **mm_inputs)
    if getattr(self, "is_vlm", False) or mm_inputs:
        raise ValueError("logitless.integrations.openrlhf: vision-language inputs are not supported "
                         f"({sorted(mm_inputs) or 'is_vlm'}); leave this actor unpatched")
    if return_entropy and not return_output:
        raise ValueError("return_entropy needs return_output=True (as OpenRLHF's Actor.forward)")
    batch, seqlen = sequences.size()
    if getattr(self, "packing_samples", False):
        from openrlhf.models.ring_attn_utils import gather_and_pad_tensor, unpad_and_slice_tensor

        sequences, position_ids, rolled, pad_len, indices = unpad_and_slice_tensor(
            sequences, attention_mask, ring_attn_group)
        model_mask = None
    else:
        rolled = torch.roll(sequences, shifts=-1, dims=1)
        model_mask = attention_mask
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)

    model = self.model
    head = _hf.lm_head(model)
    if hasattr(head.weight, "ds_id"):
        raise ValueError("logitless.integrations.openrlhf: the LM-head weight is a DeepSpeed ZeRO-3 parameter "
                         "(partitioned outside the head's forward); use ZeRO stage 0-2 (--ds.zero_stage 2) or "
                         "leave the actor unpatched")
    out = run_backbone(model, _hf.backbone(model), sequences, attention_mask=model_mask, position_ids=position_ids,
                       use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    result = linear_log_probs(hidden, head.weight, rolled.to(head.weight.device), head.bias,
                              temperature=float(self.temperature), entropy=return_entropy,
                              **_hf.head_options(model))
    log_probs, entropy = result if return_entropy else (result, None)
    if getattr(self, "packing_samples", False):
        log_probs = gather_and_pad_tensor(log_probs, ring_attn_group, pad_len, indices, batch, seqlen)
        if entropy is not None:
            entropy = gather_and_pad_tensor(entropy, ring_attn_group, pad_len, indices, batch, seqlen)
    output = ActorOutput(logits=None)
    if entropy is not None:
        output["entropy"] = entropy[:, :-1]
    log_probs = log_probs[:, :-1]
    if action_mask is None:
        return (log_probs, output) if return_output else log_probs
    action_log_probs = log_probs[:, -action_mask.shape[1]:] * action_mask.float()
    return (action_log_probs, output) if return_output else action_log_probs


def _class_forward(actor):
    """OpenRLHF's own forward of an actor patched by ``patch_actor`` (its class's)."""
    return type(actor).forward
