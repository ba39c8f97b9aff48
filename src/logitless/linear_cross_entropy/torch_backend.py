"""Pure-PyTorch backend of linear_cross_entropy: the same math in bounded tiles.

Runs on any device (it is the CPU path). Logits are computed tile by tile,
token_chunk x vocab_chunk at a time (``_plans.torch_plan``), in fp32 (fp64 for fp64
inputs), so no tensor of tokens x vocab elements is ever allocated.

forward:  for each token chunk, for each vocab chunk: z = x_c W_v^T (+ b_v), soft-cap,
          online max / sum-exp, the target logit, sum_c w_c z_c and the running argmax.
backward: for each vocab chunk v: dW_v (fp32) += dz^T x_c over token chunks, cast once;
          dx (fp32, tokens x hidden) += dz W_v; dz recomputed from the saved lse.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._loss_math import TokenStats, dlogits_, softcap_
from .._plans import torch_plan


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _logits_tile(x_c: Tensor, weight: Tensor, bias: Optional[Tensor], v0: int, v1: int, softcap):
    cd = _compute_dtype(x_c.dtype)
    z = x_c.to(cd) @ weight[v0:v1].to(cd).T
    if bias is not None:
        z += bias[v0:v1].to(cd)
    return softcap_(z, softcap)


def forward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    class_weight: Optional[Tensor],
    softcap: Optional[float],
    *,
    need_smooth: bool,
    need_argmax: bool,
    budget: int,
    need_grad: bool = False,
):
    """Returns (TokenStats, None): this backend keeps nothing for the backward."""
    n, h = x.shape
    v = weight.shape[0]
    cd = _compute_dtype(x.dtype)
    plan = torch_plan(n, v, h, torch.finfo(cd).bits // 8, budget)
    lse = torch.empty(n, dtype=cd, device=x.device)
    tgt = torch.empty(n, dtype=cd, device=x.device)
    smooth = torch.empty(n, dtype=cd, device=x.device) if need_smooth else None
    amax = torch.empty(n, dtype=torch.int64, device=x.device) if need_argmax else None
    cw = class_weight.to(cd) if class_weight is not None else None
    for n0 in range(0, n, plan.token_chunk):
        n1 = min(n, n0 + plan.token_chunk)
        x_c, t_c = x[n0:n1], target[n0:n1]
        m = torch.full((n1 - n0,), float("-inf"), dtype=cd, device=x.device)
        s = torch.zeros_like(m)
        z_t = torch.zeros_like(m)
        sm = torch.zeros_like(m)
        best = torch.full_like(m, float("-inf"))
        best_i = torch.zeros(n1 - n0, dtype=torch.int64, device=x.device)
        for v0 in range(0, v, plan.vocab_chunk):
            v1 = min(v, v0 + plan.vocab_chunk)
            z = _logits_tile(x_c, weight, bias, v0, v1, softcap)
            tile_max, tile_arg = z.max(dim=1)  # first maximum on ties
            if need_argmax:
                better = tile_max > best
                best_i = torch.where(better, tile_arg + v0, best_i)
                best = torch.where(better, tile_max, best)
            m_new = torch.maximum(m, tile_max)
            # Rows whose logits so far are all -inf (a -inf bias masks classes) stay 0.
            m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            s = s * torch.exp(m - m_safe) + torch.exp(z - m_safe[:, None]).sum(dim=1)
            m = m_new
            local = t_c - v0
            inside = (local >= 0) & (local < v1 - v0)
            picked = z.gather(1, local.clamp(0, v1 - v0 - 1)[:, None])[:, 0]
            z_t = z_t + torch.where(inside, picked, torch.zeros_like(picked))
            if need_smooth:
                sm = sm + (z @ cw[v0:v1] if cw is not None else z.sum(dim=1))
        # NaN anywhere in a row gives a NaN lse (max() may skip NaN; the sum does not).
        lse[n0:n1] = m + torch.log(s)
        tgt[n0:n1] = z_t
        if need_smooth:
            smooth[n0:n1] = sm
        if need_argmax:
            amax[n0:n1] = best_i
    return TokenStats(lse=lse, target_logit=tgt, smooth_sum=smooth, argmax=amax), None


def backward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    target: Tensor,
    class_weight: Optional[Tensor],
    softcap: Optional[float],
    lse: Tensor,
    coef: Tensor,
    *,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    budget: int,
    kept=None,
):
    n, h = x.shape
    v = weight.shape[0]
    cd = _compute_dtype(x.dtype)
    plan = torch_plan(n, v, h, torch.finfo(cd).bits // 8, budget)
    lse = lse.to(cd)
    coef = coef.to(cd)
    dx_acc = torch.zeros(n, h, dtype=cd, device=x.device) if need_dx else None
    dw = torch.empty_like(weight) if need_dw else None
    db = torch.empty_like(bias) if need_db else None
    for v0 in range(0, v, plan.vocab_chunk):
        v1 = min(v, v0 + plan.vocab_chunk)
        w_v = weight[v0:v1].to(cd)
        dw_acc = torch.zeros(v1 - v0, h, dtype=cd, device=x.device) if need_dw else None
        db_acc = torch.zeros(v1 - v0, dtype=cd, device=x.device) if need_db else None
        for n0 in range(0, n, plan.token_chunk):
            n1 = min(n, n0 + plan.token_chunk)
            x_c = x[n0:n1].to(cd)
            z = _logits_tile(x_c, weight, bias, v0, v1, softcap)
            dz = dlogits_(
                z, lse[n0:n1], coef[:, n0:n1], target[n0:n1], v0,
                class_weight.to(cd) if class_weight is not None else None, softcap,
            )
            if need_dx:
                dx_acc[n0:n1] += dz @ w_v
            if need_dw:
                dw_acc += dz.T @ x_c
            if need_db:
                db_acc += dz.sum(dim=0)
        if need_dw:
            dw[v0:v1] = dw_acc
        if need_db:
            db[v0:v1] = db_acc
    dx = dx_acc.to(x.dtype) if need_dx else None
    return dx, dw, db
