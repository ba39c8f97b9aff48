"""Plain references on materialised logits, through torch's own functions
(``F.cross_entropy``, ``F.log_softmax``, ``F.kl_div``): the definitions the tests hold
every op and backend to. Independent of ``logitless.formulas`` on purpose, so that
tests compare against torch's semantics, not against our formulas. In float64 they are
the references; in the inputs' own dtype they are what a user of plain torch would get.
Each op's ``reference.py`` builds its reference from these. Test sizes only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from logitless.options import CrossEntropyOptions, JSDOptions


def cross_entropy_reference(logits: Tensor, target: Tensor, *, class_weight: Optional[Tensor] = None,
                            dtype: torch.dtype = torch.float64, **options):
    """Returns (loss, lse, correct) computed in ``dtype`` (lse and correct per token, in
    the shape of target). Differentiable with respect to logits. ``options``: the fields
    of ``logitless.options.CrossEntropyOptions`` (ignore_index, reduction,
    label_smoothing, softcap, z_loss), with its defaults."""
    o = CrossEntropyOptions(**options)
    ignore_index, reduction, label_smoothing, softcap, z_loss = o.args()
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


def _cap(z: Tensor, cap: Optional[float]) -> Tensor:
    return z if cap is None else cap * torch.tanh(z / cap)


def jsd_reference(student_logits: Tensor, teacher_logits: Tensor, target: Optional[Tensor] = None, *,
                  reduction: str = "mean", dtype: torch.dtype = torch.float64, **options) -> Tensor:
    """The loss in ``dtype`` (per token in target's shape for "none"); differentiable
    with respect to both logits. ``options``: the fields of
    ``logitless.options.JSDOptions`` (beta, temperature, ignore_index, the softcaps,
    hard_label_weight), with its defaults."""
    beta, temperature, ignore_index, student_softcap, teacher_softcap, hard_label_weight = \
        JSDOptions(**options).args()
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
