"""Float64 reference of linear_log_probs: logits materialised, then torch's own
``F.log_softmax`` (independent of ``formulas.log_probs``). Test sizes only."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def linear_log_probs_reference(x: Tensor, weight: Tensor, tokens: Tensor, bias: Optional[Tensor] = None, *,
                               temperature: float = 1.0, softcap: Optional[float] = None,
                               ignore_index: int = -100, dtype: torch.dtype = torch.float64):
    """(log p(token), entropy) of softmax(softcap(x W^T + b) / T) per token in ``dtype``,
    in tokens' shape, 0 at ignored tokens; differentiable. With ``dtype`` the inputs'
    dtype it is "plain torch in the same dtype" (the tests' yardstick)."""
    z = x.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        z = z + bias.to(dtype)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lp = F.log_softmax(z / temperature, dim=-1)
    valid = tokens != ignore_index
    picked = lp.gather(-1, torch.where(valid, tokens, 0).long().unsqueeze(-1)).squeeze(-1)
    ent = -(lp.exp() * lp).sum(-1)
    zero = torch.zeros((), dtype=dtype, device=lp.device)
    return torch.where(valid, picked, zero), torch.where(valid, ent, zero)


def truncated_keep_reference(a: Tensor, top_k=None, top_p=1.0, min_p=0.0) -> Tensor:
    """Kept mask (N, V) of scaled logits ``a`` (N, V) in float64, written plainly after
    vLLM's sampler: min-p (probs < min_p * max prob masked), then top-k (sorted
    ascending, values below the k-th largest masked), then top-p (softmax of what is
    left, ascending cumsum ``<= 1 - p`` masked, the largest kept). Parameters: per-row
    sequences (or numbers); top_k 0/None, top_p 1, min_p 0 off."""
    a = a.double()
    n, v = a.shape

    def per_row(val, i, off):
        if val is None:
            return off
        if isinstance(val, Tensor):
            return val.reshape(-1)[i].item()
        return val

    keep = torch.ones_like(a, dtype=torch.bool)
    for i in range(n):
        row = a[i].clone()
        mp, k, p = per_row(min_p, i, 0.0), int(per_row(top_k, i, 0)), per_row(top_p, i, 1.0)
        if mp > 0:
            probs = torch.softmax(row, 0)
            row = torch.where(probs < mp * probs.max(), torch.full_like(row, -math.inf), row)
        srt, order = row.sort(descending=False)
        if 0 < k < v:
            srt = torch.where(srt < srt[v - k], torch.full_like(srt, -math.inf), srt)
        if p < 1:
            drop = torch.softmax(srt, 0).cumsum(0) <= 1 - p
            drop[-1] = False
            srt = torch.where(drop, torch.full_like(srt, -math.inf), srt)
        out = torch.empty_like(row)
        out[order] = srt
        keep[i] = out > -math.inf
    return keep


def truncated_log_probs_reference(x: Tensor, weight: Tensor, tokens: Tensor, bias: Optional[Tensor] = None, *,
                                  temperature: float = 1.0, softcap: Optional[float] = None,
                                  ignore_index: int = -100, top_k=None, top_p=1.0, min_p=0.0,
                                  dtype: torch.dtype = torch.float64, logits: Optional[Tensor] = None):
    """(log p(token), entropy) of the truncated distribution (``truncated_keep_reference``'s
    set, renormalised) in ``dtype``, tokens' shape: -inf for a token outside the set, 0
    at ignored tokens; differentiable. ``logits``: given instead of x @ W^T + b."""
    z = logits.to(dtype) if logits is not None else x.to(dtype) @ weight.to(dtype).T
    if bias is not None and logits is None:
        z = z + bias.to(dtype)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    a = (z / temperature).reshape(-1, z.shape[-1])
    keep = truncated_keep_reference(a.detach(), top_k, top_p, min_p)
    lse = torch.logsumexp(a.masked_fill(~keep, -math.inf), dim=-1, keepdim=True)
    lp = torch.where(keep, a - lse, torch.zeros_like(a))  # (no -inf: no NaN gradients)
    flat = tokens.reshape(-1)
    valid = flat != ignore_index
    idx = torch.where(valid, flat, 0).long().unsqueeze(-1)
    picked = lp.gather(-1, idx).squeeze(-1)
    picked = torch.where(keep.gather(-1, idx).squeeze(-1), picked, torch.full_like(picked, -math.inf))
    ent = -(lp.exp() * keep * lp).sum(-1)
    zero = torch.zeros((), dtype=dtype, device=lp.device)
    return (torch.where(valid, picked, zero).reshape(tokens.shape),
            torch.where(valid, ent, zero).reshape(tokens.shape))
