"""Formulas shared by every op (PyTorch): compute dtype, soft-cap, reductions, and the
merge of statistics computed over separate parts of the vocabulary.

Merge of split statistics. A backend may reduce a row of logits in S parts (vocabulary
splits of one kernel, or the vocabulary shards of tensor-parallel ranks), each giving
its running max m_s and sum_s = sum over its columns of exp(z_c - m_s). Then

    M   = max_s m_s
    lse = M + log sum_s sum_s * exp(m_s - M)

(M = 0 when every part is empty or -inf, so that no inf - inf appears; NaN in any part
propagates). Sums that are plain sums over columns (the target logit, sum_c w_c z_c)
merge by addition.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Dtype of the statistics, the loss and the math: fp64 when an input is fp64 (the
    torch backend is then exact to fp64 rounding), else fp32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def apply_softcap(z: Tensor, cap: Optional[float], *, inplace: bool = False) -> Tensor:
    """z -> cap * tanh(z / cap) (identity for cap None); ``inplace`` for a temporary z."""
    if cap is None:
        return z
    if inplace:
        return z.div_(cap).tanh_().mul_(cap)
    return cap * torch.tanh(z / cap)


def sub_at_target_(tile: Tensor, target: Tensor, col0: int, b: Tensor) -> Tensor:
    """``tile[r, target[r] - col0] -= b[r]`` in place, for the rows whose target lies in
    this tile of columns col0.. (the - B [c == t] term of the kernels' epilogues): one
    element per row, the others untouched."""
    width = tile.shape[1]
    local = target - col0
    inside = (local >= 0) & (local < width)
    idx = local.clamp(0, width - 1)[:, None]
    hit = torch.where(inside, b, torch.zeros_like(b))[:, None]
    return tile.scatter_(1, idx, tile.gather(1, idx) - hit)


def reduce(loss: Tensor, weight: Tensor, reduction: str) -> Tensor:
    """"none": per token; "sum"; "mean": sum / sum of the per-token denominator weights
    (1 per counted token, or its class weight: torch's convention; 0/0 = NaN for none)."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / weight.sum()


def merge_splits(part_max: Tensor, part_sum: Tensor, dim: int = 0) -> Tensor:
    """lse of rows reduced in parts along ``dim`` (module docstring): max() propagates NaN."""
    big_m = part_max.max(dim=dim).values
    m_safe = torch.where(big_m == float("-inf"), torch.zeros_like(big_m), big_m)
    return m_safe + torch.log((part_sum * torch.exp(part_max - m_safe.unsqueeze(dim))).sum(dim=dim))
