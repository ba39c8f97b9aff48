"""transformers' causal-LM loss from the last hidden state and the head, no logits.

``hf_causal_lm_loss`` is transformers' ``ForCausalLMLoss(softcap(s * head(x)))`` computed
by ``logitless.linear_cross_entropy``: labels shifted inside (or the caller's
``shift_labels``), ``ignore_index``, mean over the non-ignored tokens, or sum /
``num_items_in_batch`` when given (a tensor stays on its device: no host sync).

The scale ``s`` (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``, a sampling
temperature ``1 / T``) is applied to the hidden state, ``(s * x) @ W.T == s * (x @ W.T)``:
a (tokens x H) product instead of a per-step copy of the (V x H) weight; exact when ``s``
is a power of two, otherwise one rounding of ``s * x`` (relative 2^-24 in fp32).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.ops.linear_cross_entropy import linear_cross_entropy

from .head import head_operands


def hf_causal_lm_loss(head, hidden: Tensor, labels: Optional[Tensor], shift_labels: Optional[Tensor],
                      num_items_in_batch, ignore_index: int, softcap: Optional[float], scale: float,
                      options: dict, reduction: Optional[str] = None) -> Tensor:
    """transformers' ForCausalLMLoss of ``softcap(scale * head(hidden))`` (module docstring).

    ``reduction`` None: transformers' (mean, or sum / num_items_in_batch); "none": the
    per-position losses, shaped like the positions (0 where ignored).
    """
    x, weight, bias = head_operands(head, hidden)
    if scale != 1.0:
        # (s * x) @ W.T == s * (x @ W.T); the bias is scaled too in transformers.
        x = x * scale
        bias = None if bias is None else bias * scale
    lead = x.shape[:-1]
    if shift_labels is None:
        if labels is None:
            raise ValueError("labels or shift_labels is required")
        target, shift = labels, True  # labels[..., 1:] padded with ignore_index, as transformers
    else:
        target, shift = shift_labels, False
    target = target.to(x.device)
    if target.numel() != lead.numel():
        raise ValueError(f"{'shift_labels' if shift_labels is not None else 'labels'} has shape "
                         f"{tuple(target.shape)} but the head receives {tuple(lead)} positions "
                         f"(with logits_to_keep, labels must match the kept positions)")
    target = target.reshape(lead)
    if reduction is None:
        reduction = "mean" if num_items_in_batch is None else "sum"
    elif num_items_in_batch is not None:
        raise ValueError("num_items_in_batch goes with the default reduction only")
    loss = linear_cross_entropy(x, weight, target, bias, ignore_index=ignore_index, reduction=reduction,
                                softcap=softcap, shift=shift, **options)
    if reduction == "none" and shift:
        loss = torch.nn.functional.pad(loss, (0, 1))  # the last position predicts nothing: 0, as transformers
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
