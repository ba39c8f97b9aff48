"""TRL: GRPOTrainer (and RLOO) with per-token log-probs and entropy from logitless.

TRL >= 1.x computes the policy's and reference model's per-token log-probs by calling
``model(input_ids=..., attention_mask=..., labels=labels, fused_lm_head=True)`` on a
forward that ``trl.trainer.utils.add_fused_lm_head`` installs at trainer set-up
(labels: -100 outside the completion). :func:`patch_grpo` installs, on top of it, a
forward whose ``fused_lm_head=True`` path runs the backbone to the last hidden states
and calls ``logitless.linear_log_probs`` (exact fp32 statistics, no logits); every other
call (generation, ``fused_lm_head=False``) goes to the previous forward unchanged::

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...)
    logitless.integrations.trl.patch_grpo(trainer)
    trainer.train()

Returns TRL's ``FusedCausalLMOutput`` fields: loss, log_probs, entropy (both 0 where the
label is -100), label_mask; the optional fields (log_sum_sq_probs, mean_logits,
is_top1, aux_loss) are None. MoE load-balancing losses and models that scale their
logits other than by ``final_logit_softcapping`` are refused (ValueError).
"""

from __future__ import annotations

import types
from typing import Any, Optional

from . import hf as _hf


def _output_class():
    try:
        from trl.trainer.utils import FusedCausalLMOutput
        return FusedCausalLMOutput
    except Exception:  # trl not installed, or a version without it: a plain namespace
        return types.SimpleNamespace


def add_logitless_lm_head(model, temperature: float = 1.0, entropy: bool = True) -> None:
    """Make ``model(..., labels=labels, fused_lm_head=True)`` return per-token log-probs
    (and entropy) from ``logitless.linear_log_probs``: TRL's fused-head protocol."""
    _hf.head_options(model)  # refuse unsupported logit scalings now, not mid-training
    if getattr(_hf.text_config(model), "output_router_logits", False):
        raise ValueError("MoE router aux losses are not supported by the logitless TRL head")
    previous = model.forward

    def forward(self, *args, fused_lm_head: bool = False, labels=None, shift_labels=None,
                num_items_in_batch: Optional[Any] = None, **kwargs):
        if not fused_lm_head:
            passed = (("labels", labels), ("shift_labels", shift_labels), ("num_items_in_batch", num_items_in_batch))
            for k, v in passed:
                if v is not None:
                    kwargs[k] = v
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        out = _hf.backbone(self)(*args, **kwargs)
        hidden = out.last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = _hf.lm_head(self)
        hidden, labels = hidden.to(head.weight.device), labels.to(head.weight.device)
        res = _hf.linear_log_probs(hidden, head.weight, labels, head.bias, temperature=temperature, entropy=entropy,
                                   ignore_index=-100, **_hf.head_options(self))
        log_probs, ent = res if entropy else (res, None)
        mask = labels != -100
        denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return _output_class()(loss=-log_probs.sum() / denom, log_probs=log_probs, entropy=ent,
                               log_sum_sq_probs=None, mean_logits=None, is_top1=None, label_mask=mask, aux_loss=None)

    model.forward = types.MethodType(forward, model)


def patch_grpo(trainer) -> None:
    """Route a TRL ``GRPOTrainer``'s (or ``RLOOTrainer``'s) per-token log-probs and
    entropy, for the policy and the reference model, through logitless. Call after
    constructing the trainer, before ``train()``."""
    temperature = float(getattr(trainer, "temperature", getattr(trainer.args, "temperature", 1.0)))
    model = trainer.model
    get_base = getattr(model, "get_base_model", None)
    if get_base is not None and hasattr(model, "peft_config"):
        model = get_base()
    add_logitless_lm_head(model, temperature)
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        add_logitless_lm_head(ref, temperature, entropy=False)
