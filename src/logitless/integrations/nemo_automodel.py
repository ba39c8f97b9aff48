"""NeMo Automodel (0.7): its recipes' LM loss computed by logitless, without the (tokens x
vocab) logits (docs/transformers.md#nemo-automodel). Importing this module imports
nemo_automodel (``import logitless`` never does).

One line in a recipe YAML selects it, through NeMo Automodel's loss builder (a ``_target_``
that is not one of its registered losses becomes its ``LossFromFactoryConfig``, the escape
hatch for external losses)::

    loss_fn:
      _target_: logitless.integrations.nemo_automodel.LogitlessLinearCrossEntropy
      # optional: memory_budget: 536870912, logit_softcapping: 30.0, backend: torch

:class:`LogitlessLinearCrossEntropy` is a NeMo Automodel ``LinearCrossEntropy`` (the base of its
``FusedLinearCrossEntropy``), so its recipes treat it as they treat that loss: the model runs with
``logits_to_keep=1`` and returns its final hidden states, the LM-head weight is gathered once per
step by ``prepare_lm_weight`` (an FSDP2 DTensor through the base class's
``materialize_lm_weight``: one all-gather, the gradient reduce-scattered into the shard), MTP
depths reuse it. The loss is ``FusedLinearCrossEntropy``'s contract (and ``MaskedCrossEntropy``'s
on fp32 logits): the cross-entropy of ``hidden_states @ lm_weight.T`` (soft-capped with
``logit_softcapping``) against already-shifted ``labels``, ``ignore_index`` ignored, reduced by
``reduction``; ``num_label_tokens`` divides a sum; ``loss_weights`` weights each token (sum only).
Its logits are fp32 and exact (``FusedLinearCrossEntropy`` with ``impl="torch_compile"`` rounds
them to bf16); memory is bounded by ``memory_budget``, not by a chunk size.

Bad options raise ``ValueError`` at construction (the recipe's config build); the first
construction in a process logs, at INFO, that logitless is active.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from nemo_automodel.components.loss.linear_ce_base import LinearCrossEntropy

from logitless.ops.linear_cross_entropy import linear_cross_entropy
from logitless.options import check_memory_budget

from ._announce import announce

__all__ = ["LogitlessLinearCrossEntropy"]

_REDUCTIONS = ("sum", "mean", "none")
_BACKENDS = ("auto", "triton", "torch")


class LogitlessLinearCrossEntropy(LinearCrossEntropy):
    """NeMo Automodel's linear cross-entropy on logitless (module docstring)."""

    def __init__(self, ignore_index: int = -100, logit_softcapping: float = 0.0, reduction: str = "sum",
                 memory_budget: Optional[int] = None, backend: str = "auto"):
        super().__init__()
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise ValueError(f"LogitlessLinearCrossEntropy: ignore_index must be an int, got {ignore_index!r}")
        if isinstance(logit_softcapping, bool) or not isinstance(logit_softcapping, (int, float)) \
                or not logit_softcapping >= 0:
            raise ValueError(f"LogitlessLinearCrossEntropy: logit_softcapping must be a number >= 0 (0: off), "
                             f"got {logit_softcapping!r}")
        if reduction is None:   # NeMo Automodel's YAML loader reads ``reduction: none`` as None
            reduction = "none"
        if reduction not in _REDUCTIONS:
            raise ValueError(f"LogitlessLinearCrossEntropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        if memory_budget is not None:
            try:
                check_memory_budget(memory_budget)
            except ValueError as e:
                raise ValueError(f"LogitlessLinearCrossEntropy: memory_budget: {e}") from None
        if backend not in _BACKENDS:
            raise ValueError(f"LogitlessLinearCrossEntropy: backend must be one of {_BACKENDS}, got {backend!r}")
        self.ignore_index = ignore_index
        self.logit_softcapping = float(logit_softcapping)
        self.reduction = reduction
        self.memory_budget = memory_budget
        self.backend = backend
        announce("nemo_automodel", "the recipe's loss_fn is LogitlessLinearCrossEntropy (no logits)")

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor, lm_weight: torch.Tensor,
                num_label_tokens: Optional[int] = None, grad_reduce_group: Optional[dist.ProcessGroup] = None,
                loss_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``FusedLinearCrossEntropy.forward``'s contract: hidden states (B, S, H), shifted labels
        (B, S), the head weight (V, H) (plain or an FSDP2 DTensor), optional normalisation and
        per-token weights; a scalar (or per-token with ``reduction="none"``) fp32 loss."""
        if loss_weights is not None:
            if self.reduction != "sum":
                raise ValueError("LogitlessLinearCrossEntropy: loss_weights needs reduction='sum'")
            if loss_weights.shape != labels.shape:
                raise ValueError(f"LogitlessLinearCrossEntropy: loss_weights.shape {tuple(loss_weights.shape)} "
                                 f"must match labels.shape {tuple(labels.shape)}")
        if num_label_tokens is not None and self.reduction != "sum":
            raise ValueError("LogitlessLinearCrossEntropy: num_label_tokens needs reduction='sum'")
        weight = self.materialize_lm_weight(lm_weight, grad_reduce_group=grad_reduce_group)
        loss = linear_cross_entropy(
            hidden_states, weight, labels.to(hidden_states.device), ignore_index=self.ignore_index,
            softcap=self.logit_softcapping or None,
            reduction="none" if loss_weights is not None else self.reduction,
            memory_budget=self.memory_budget, backend=self.backend)
        if loss_weights is not None:
            loss = (loss * loss_weights.to(device=loss.device, dtype=torch.float32)).sum()
        if num_label_tokens is not None:
            if num_label_tokens == 0:
                return loss * 0.0
            loss = loss / num_label_tokens
        return loss
