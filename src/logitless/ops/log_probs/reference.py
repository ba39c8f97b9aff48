"""Float64 reference of log_probs on logits: torch's own ``F.log_softmax`` (independent
of ``formulas.log_probs``). Test sizes only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def log_probs_reference(logits: Tensor, tokens: Tensor, *, temperature: float = 1.0, ignore_index: int = -100,
                        dtype: torch.dtype = torch.float64):
    """(log p(token), entropy) of softmax(logits / T) in ``dtype``, tokens' shape, 0 at
    ignored tokens; differentiable with respect to logits."""
    lp = F.log_softmax(logits.to(dtype) / temperature, dim=-1)
    valid = tokens != ignore_index
    picked = lp.gather(-1, torch.where(valid, tokens, 0).long().unsqueeze(-1)).squeeze(-1)
    ent = -(lp.exp() * lp).sum(-1)
    zero = torch.zeros((), dtype=dtype, device=lp.device)
    return torch.where(valid, picked, zero), torch.where(valid, ent, zero)
