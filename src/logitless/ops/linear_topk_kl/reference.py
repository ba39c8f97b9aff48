"""Float64 reference of linear_topk_kl: the plain definition (``formulas.topk_kl``'s module
docstring), the student's logits materialised.

log q = log_softmax(softcap(x @ W.T + b) / T) over the full vocabulary, gathered at the
teacher's ids; 1 - Q as the sum of q over the columns outside the ids (a masked
log-sum-exp, as the definition reads), 1 - P as 1 - sum exp(lp). Independent of
``formulas.topk_kl`` on purpose. With ``dtype`` the inputs' own dtype it is "plain torch in
the same dtype", the tests' yardstick. Test sizes only (it allocates the full logits).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def _terms(w: Tensor, d: Tensor) -> Tensor:
    return torch.where(w > 0, w * d, torch.zeros_like(d))


def linear_topk_kl_reference(x: Tensor, weight: Tensor, teacher_ids: Tensor, teacher_log_probs: Tensor,
                             target: Optional[Tensor] = None, bias: Optional[Tensor] = None, *,
                             direction: str = "forward", tail: str = "bucket", temperature: float = 1.0,
                             ignore_index: int = -100, reduction: str = "mean", hard_label_weight: float = 0.0,
                             softcap: Optional[float] = None, shift: bool = False,
                             dtype: torch.dtype = torch.float64) -> Tensor:
    """The loss in ``dtype``, differentiable with respect to x, weight and bias."""
    z = x.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    ids, lp = teacher_ids.long(), teacher_log_probs.to(dtype)
    if target is None:
        target = torch.zeros(ids.shape[:-1], dtype=torch.long, device=ids.device)
    if shift:
        z, ids, lp, target = z[..., :-1, :], ids[..., :-1, :], lp[..., :-1, :], target[..., 1:]
    logq = F.log_softmax(z / temperature, dim=-1)
    lq = logq.gather(-1, ids)
    outside = torch.ones_like(logq, dtype=torch.bool).scatter(-1, ids, False)
    log_tail_q = torch.logsumexp(logq.masked_fill(~outside, float("-inf")), dim=-1)  # log(1 - Q)
    p, q = lp.exp(), lq.exp()
    big_p = p.sum(-1)
    if tail == "renormalize":
        lp = lp - torch.log(big_p)[..., None]
        lq = lq - torch.logsumexp(lq, dim=-1, keepdim=True)
        p, q = lp.exp(), lq.exp()
    if direction == "forward":
        loss = _terms(p, lp - lq).sum(-1)
    else:
        loss = _terms(q, lq - lp).sum(-1)
    if tail == "bucket":
        tail_p = torch.clamp(1.0 - big_p, min=0.0)
        log_tail_p = torch.log(tail_p)
        if direction == "forward":
            loss = loss + _terms(tail_p, log_tail_p - log_tail_q)
        else:
            loss = loss + _terms(log_tail_q.exp(), log_tail_q - log_tail_p)
    valid = target != ignore_index
    if hard_label_weight:
        ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), target.reshape(-1), ignore_index=ignore_index,
                             reduction="none").reshape(target.shape)
        loss = loss + hard_label_weight * ce
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()
