"""TRL: SFTTrainer, GRPOTrainer (and RLOO) with per-token log-probs from logitless.

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

SFT uses the same protocol (TRL's ``SFTTrainer.compute_loss`` reduces ``log_probs`` to
its loss and reads ``entropy`` and ``is_top1`` for its metrics): :func:`patch_sft`
installs a head whose log-probs and ``is_top1`` come from one
``logitless.linear_cross_entropy(..., reduction="none", return_stats=True)`` call::

    trainer = SFTTrainer(model=..., args=SFTConfig(...), train_dataset=...)
    logitless.integrations.trl.patch_sft(trainer)
    trainer.train()
"""

from __future__ import annotations

import contextlib
import types
import warnings
from typing import Any, Optional

import torch

from logitless.ops.linear_cross_entropy import api as _lce_api
from logitless.transformers.patch import run_backbone as _run_backbone

from . import hf as _hf


def _output_class():
    try:
        from trl.trainer.utils import FusedCausalLMOutput
        return FusedCausalLMOutput
    except Exception:  # trl not installed, or a version without it: a plain namespace
        return types.SimpleNamespace


def add_logitless_lm_head(model, temperature: float = 1.0, entropy: bool = True, is_top1: bool = False,
                          cast_lm_head_to_fp32: bool = False) -> None:
    """Make ``model(..., labels=labels, fused_lm_head=True)`` return per-token log-probs
    (and entropy) from logitless: TRL's fused-head protocol (``add_fused_lm_head``).

    With ``is_top1=False`` the log-probs (and entropy) come from one
    ``logitless.linear_log_probs`` pass. With ``is_top1=True`` (SFT's token accuracy;
    temperature must be 1) they come from ``logitless.linear_cross_entropy(...,
    reduction="none", return_stats=True)``: log_probs = -per-token loss, is_top1 =
    (argmax == label), both from the same pass; ``entropy=True`` then costs one more
    forward-only pass over the vocabulary (``linear_log_probs`` under no_grad, one GEMM),
    and ``entropy=False`` returns NaN entropies (a metric that reads them logs NaN).
    ``cast_lm_head_to_fp32`` (GRPOConfig's, with ``is_top1=False``): the hidden states and
    the head in fp32, outside autocast, as TRL's head does then.
    """
    _hf.head_options(model)  # refuse unsupported logit scalings now, not mid-training
    if getattr(_hf.text_config(model), "output_router_logits", False):
        raise ValueError("MoE router aux losses are not supported by the logitless TRL head")
    if is_top1 and float(temperature) != 1.0:
        raise ValueError(f"is_top1=True needs temperature=1.0, got temperature={temperature!r}")
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
        out = _run_backbone(self, _hf.backbone(self), *args, **kwargs)  # (not a bypass of patch(model))
        hidden = out.last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = _hf.lm_head(self)
        hidden, labels = hidden.to(head.weight.device), labels.to(head.weight.device)
        opts = _hf.head_options(self)
        mask = labels != -100
        top1 = None
        if is_top1:
            nll, stats = _lce_api.linear_cross_entropy(hidden, head.weight, labels, head.bias, ignore_index=-100,
                                                       reduction="none", return_stats=True, **opts)
            log_probs, top1 = -nll, stats.correct
            if entropy:
                with torch.no_grad():
                    ent = _hf.linear_log_probs(hidden.detach(), head.weight.detach(), labels,
                                               None if head.bias is None else head.bias.detach(), entropy=True,
                                               ignore_index=-100, **opts)[1]
            else:
                _warn_no_entropy()
                ent = torch.full(labels.shape, float("nan"), device=labels.device)
        else:
            x, w, b = hidden, head.weight, head.bias
            ctx = contextlib.nullcontext()
            if cast_lm_head_to_fp32:
                x, w, b = x.float(), w.float(), None if b is None else b.float()
                ctx = torch.autocast(x.device.type, enabled=False)
            with ctx:
                res = _hf.linear_log_probs(x, w, labels, b, temperature=temperature, entropy=entropy,
                                           ignore_index=-100, **opts)
            log_probs, ent = res if entropy else (res, None)
        denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return _output_class()(loss=-log_probs.sum() / denom, log_probs=log_probs, entropy=ent,
                               log_sum_sq_probs=None, mean_logits=None, is_top1=top1, label_mask=mask, aux_loss=None)

    model.forward = types.MethodType(forward, model)


_warned = False


def _warn_no_entropy() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("logitless SFT head: entropy not computed (patch_sft(trainer, entropy=False)); the logged "
                      "'entropy' metric is NaN", stacklevel=3)


def _unwrapped(model):
    get_base = getattr(model, "get_base_model", None)
    if get_base is not None and hasattr(model, "peft_config"):
        return get_base()
    return model


def patch_sft(trainer, entropy: bool = True) -> None:
    """Route a TRL ``SFTTrainer``'s training loss and its ``mean_token_accuracy`` metric
    through ``logitless.linear_cross_entropy`` (no logits). Call after constructing the
    trainer, before ``train()``.

    Same loss as TRL's own fused head for ``loss_type`` "nll" and "dft", with
    completion-only / assistant-only masks, padding-free packing and
    ``num_items_in_batch`` (TRL's ``compute_loss`` reduces the per-token log-probs this
    head returns). ``entropy=True`` (default) also computes TRL's logged ``entropy``
    metric with one extra forward-only pass over the vocabulary (no gradient);
    ``entropy=False`` skips it and the metric logs NaN (warned once). Paths of TRL that
    need the full logits (``label_smoothing_factor > 0``, ``compute_loss_func``) keep
    calling the model's unpatched forward for their loss.
    """
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError("MoE router aux losses are not supported by patch_sft: "
                         "set output_router_logits=False or use TRL's own head")
    add_logitless_lm_head(_unwrapped(trainer.model), 1.0, entropy=entropy, is_top1=True)


def patch_grpo(trainer) -> None:
    """Route a TRL ``GRPOTrainer``'s (or ``RLOOTrainer``'s) per-token log-probs and
    entropy, for the policy and the reference model, through logitless. Call after
    constructing the trainer, before ``train()``."""
    temperature = float(getattr(trainer, "temperature", getattr(trainer.args, "temperature", 1.0)))
    fp32 = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
    add_logitless_lm_head(_unwrapped(trainer.model), temperature, cast_lm_head_to_fp32=fp32)
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        add_logitless_lm_head(ref, temperature, entropy=False, cast_lm_head_to_fp32=fp32)
