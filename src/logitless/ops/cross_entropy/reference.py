"""Reference of cross_entropy: the plain definition through torch's own F.cross_entropy.

Independent of ``_loss_math`` on purpose, so that tests compare every backend against
torch's semantics, not against our formulas. In float64 it is the reference; in the
logits' own dtype it is what a user of plain torch would get. Test sizes only.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def cross_entropy_reference(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    z_loss: float = 0.0,
    dtype: torch.dtype = torch.float64,
):
    """Returns (loss, lse, correct) computed in ``dtype`` (lse and correct per token, in
    the shape of target). Differentiable with respect to logits."""
    z = logits.to(dtype)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    num_classes = z.shape[-1]
    flat = z.reshape(-1, num_classes)
    t = target.reshape(-1).long()
    cw = class_weight.to(dtype) if class_weight is not None else None
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
