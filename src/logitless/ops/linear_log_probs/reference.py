"""Float64 reference of linear_log_probs: logits materialised, then torch's own
``F.log_softmax`` (independent of ``formulas.log_probs``). Test sizes only."""

from __future__ import annotations

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
