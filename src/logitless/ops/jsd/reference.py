"""Float64 reference of jsd: the plain definition with torch's own functions.

Independent of ``_jsd_math`` on purpose (``F.log_softmax``, ``F.kl_div``,
``F.cross_entropy``), so that tests compare every backend against the definition, not
against our formulas. With ``dtype`` set to the inputs' dtype it is "plain torch in the
same dtype", the tests' yardstick. Use only at test sizes.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def _cap(z: Tensor, cap: Optional[float]) -> Tensor:
    return z if cap is None else cap * torch.tanh(z / cap)


def jsd_reference(
    student_logits: Tensor,
    teacher_logits: Tensor,
    target: Optional[Tensor] = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    student_softcap: Optional[float] = None,
    teacher_softcap: Optional[float] = None,
    hard_label_weight: float = 0.0,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """The loss in ``dtype`` (per token in target's shape for "none"); differentiable
    with respect to both logits."""
    zs = _cap(student_logits.to(dtype), student_softcap)
    zt = _cap(teacher_logits.to(dtype), teacher_softcap)
    lp = F.log_softmax(zs / temperature, dim=-1)
    lq = F.log_softmax(zt / temperature, dim=-1)
    if beta == 0.0:  # forward KL(q || p): kl_div(input, target) = KL(target || input)
        per = F.kl_div(lp, lq, reduction="none", log_target=True).sum(-1)
    elif beta == 1.0:  # reverse KL(p || q)
        per = F.kl_div(lq, lp, reduction="none", log_target=True).sum(-1)
    else:
        lm = torch.logsumexp(torch.stack([lp + math.log(1 - beta), lq + math.log(beta)]), dim=0)
        per = (beta * F.kl_div(lm, lq, reduction="none", log_target=True).sum(-1)
               + (1 - beta) * F.kl_div(lm, lp, reduction="none", log_target=True).sum(-1))
    if target is None:
        valid = torch.ones(per.shape, dtype=torch.bool, device=per.device)
    else:
        valid = target != ignore_index
        if hard_label_weight != 0.0:
            ce = F.cross_entropy(zs.reshape(-1, zs.shape[-1]), target.reshape(-1).long(),
                                 ignore_index=ignore_index, reduction="none")
            per = per + hard_label_weight * ce.reshape(per.shape)
    per = torch.where(valid, per, torch.zeros_like(per))
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    return per.sum() / valid.sum()
