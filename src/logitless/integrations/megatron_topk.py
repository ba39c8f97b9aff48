"""Megatron Core: top-k distillation from the hidden states and the vocabulary-parallel
output layer (``logitless.linear_topk_kl``), as an ``output_processor`` (the seam of
``integrations.megatron``: ``GPTModel.forward(..., output_processor=...,
output_processor_context=...)``), so that slime-style Megatron losses (OpenClaw-RL's
TP-aware top-K distillation: reverse KL over the teacher's top-K plus a tail bin) need no
logits.

``topk_kl_processor`` reads from ``output_processor_context`` (a dict):

    teacher_ids, teacher_log_probs   (b, s, K): the teacher's top-K at each position (global ids)
    direction, tail, temperature, hard_label_weight, ignore_index   linear_topk_kl's (defaults
                                     as there); hard labels are the model's ``labels`` (b, s)

and returns ``{"loss": (b, s) fp32}``, the per-token loss (0 where ``labels`` is
``ignore_index``), with gradients to the hidden states and the head. The head's layouts are
``integrations.megatron``'s (its ``_head``): this rank's rows of a tensor-parallel output
layer over its TP group, sequence parallel gathered along the sequence, tied embeddings,
MuP's output multiplier folded into the hidden states. Megatron is imported only inside.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from logitless.integrations._announce import announce
from logitless.integrations.megatron import _head, _logit_scale
from logitless.ops.linear_topk_kl import linear_topk_kl

__all__ = ["topk_kl_processor"]

_OPTIONS = ("direction", "tail", "temperature", "hard_label_weight", "ignore_index")


def topk_kl_processor(*, hidden_states: Tensor, output_layer, output_weight: Optional[Tensor] = None,
                      labels: Optional[Tensor] = None, context: Optional[dict] = None, config=None,
                      **_unused: Any) -> dict:
    """An ``output_processor``: the per-token top-k distillation loss (module docstring).
    hidden_states (s, b, h) as ``GPTModel._postprocess`` passes them; ``context`` must hold
    ``teacher_ids`` and ``teacher_log_probs`` (b, s, K)."""
    context = dict(context or {})
    if "teacher_ids" not in context or "teacher_log_probs" not in context:
        raise ValueError("topk_kl_processor needs output_processor_context={'teacher_ids': (b, s, K), "
                         "'teacher_log_probs': (b, s, K), ...}")
    unknown = set(context) - {"teacher_ids", "teacher_log_probs", *_OPTIONS}
    if unknown:
        raise ValueError(f"topk_kl_processor: unknown context keys {sorted(unknown)}; known: "
                         f"teacher_ids, teacher_log_probs, {', '.join(_OPTIONS)}")
    x, weight, bias, group, partial = _head(output_layer, output_weight, hidden_states)
    if partial:  # sequence parallel: _head's all-gather reduce-scatters dx; the op must not reduce it
        raise ValueError("topk_kl_processor does not take sequence parallelism yet (linear_topk_kl has no "
                         "partial_dx): run the output layer without sequence_parallel")
    scale = _logit_scale(config)
    if scale != 1.0:
        x = x * scale
        bias = None if bias is None else bias * scale
    opts = {k: context[k] for k in _OPTIONS if k in context}
    ids = context["teacher_ids"].transpose(0, 1)  # (b, s, K) -> (s, b, K), like x's leading dims
    lp = context["teacher_log_probs"].transpose(0, 1)
    target = labels.transpose(0, 1) if labels is not None else None
    loss = linear_topk_kl(x, weight, ids, lp, target, bias=bias, reduction="none", process_group=group, **opts)
    announce("megatron_topk", "topk_kl_processor computes the top-k distillation loss from the output layer's weight, "
                              "no logits")
    return {"loss": loss.transpose(0, 1).contiguous()}
