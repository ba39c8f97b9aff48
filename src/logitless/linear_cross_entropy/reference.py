"""Float64 reference of linear_cross_entropy: the plain definition, logits materialised.

Independent of ``_loss_math`` on purpose: it calls torch's own ``F.cross_entropy`` so
that tests compare every backend against torch's semantics, not against our formulas.
Use only at test sizes (it allocates the full logits in float64).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def linear_cross_entropy_reference(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor] = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    z_loss: float = 0.0,
    shift: bool = False,
):
    """Returns (loss, lse, correct) in float64 (lse, correct per token, shape of the loss
    positions). Differentiable with respect to x, weight and bias."""
    logits = x.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if shift:
        logits = logits[..., :-1, :]
        target = target[..., 1:]
    num_classes = logits.shape[-1]
    flat = logits.reshape(-1, num_classes)
    t = target.reshape(-1).long()
    cw = class_weight.double() if class_weight is not None else None
    kw = dict(weight=cw, ignore_index=ignore_index, label_smoothing=label_smoothing)
    valid = t != ignore_index
    lse = torch.logsumexp(flat, dim=-1)
    z_term = torch.where(valid, z_loss * lse**2, torch.zeros_like(lse))
    if reduction == "none":
        loss = (F.cross_entropy(flat, t, reduction="none", **kw) + z_term).reshape(target.shape)
    elif reduction == "sum":
        loss = F.cross_entropy(flat, t, reduction="sum", **kw) + z_term.sum()
    else:
        w_t = cw[t.clamp(0, num_classes - 1)] if cw is not None else torch.ones_like(lse)
        denom = torch.where(valid, w_t, torch.zeros_like(w_t)).sum()
        loss = F.cross_entropy(flat, t, reduction="mean", **kw) + z_term.sum() / denom
    correct = (flat.argmax(dim=-1) == t) & valid
    return loss, lse.reshape(target.shape).detach(), correct.reshape(target.shape)
