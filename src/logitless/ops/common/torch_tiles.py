"""The PyTorch backends' tiling of a fused linear op (x W^T + b, then a loss), shared by
linear_cross_entropy and linear_log_probs.

    linear_torch_plan   ``torch_plan`` with the bytes one step holds besides its tiles
    chunked_backward    dx, dW, db from dz recomputed tile by tile (the op gives dz)

Tiles are token_chunk x vocab_chunk, in the compute dtype (fp32; fp64 for fp64
inputs), so no (tokens x vocab) tensor is allocated. Memory of the backward: one vocab
chunk of W (and of dW's accumulator for 16-bit inputs) in the compute dtype, the op's
tiles, O(V) vectors and the dx accumulator (N x H in the compute dtype; dx itself for
fp32/fp64 inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.planning.plans import TorchPlan, torch_plan


def linear_torch_plan(x: Tensor, v: int, budget: int, *, tiles: int, accumulators: int) -> TorchPlan:
    """torch_plan for x (N, H) and V classes with ``tiles`` tile-sized temporaries per
    step, the upcast chunks of x and W for 16-bit inputs and ``accumulators`` (H-wide
    per class: dW's) besides them."""
    n, h = x.shape
    cd = compute_dtype(x.dtype)
    cs = torch.finfo(cd).bits // 8
    upcast = x.dtype != cd  # 16-bit inputs: chunks of x and W are copied to fp32
    return torch_plan(n, v, h, cs, budget, tiles=tiles, row_bytes=h * cs * upcast,
                      col_bytes=h * cs * (upcast + accumulators) + 2 * cs)


def chunked_backward(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    plan: TorchPlan,
    dz_of: Callable[[Tensor, Tensor, Optional[Tensor], int, int, int], Tensor],
    *,
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
    dx_acc: bool = False,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """dx, dW, db (None where not needed): for each vocab chunk [v0, v1), for each token
    chunk [n0, n1): dz = ``dz_of(x_c, w_v, b_v, n0, n1, v0)`` (x_c, w_v, b_v that
    chunk of x, W, b in the compute dtype; dz (n1 - n0, v1 - v0) in it), then
    dx[n0:n1] += dz w_v, dW_v += dz^T x_c (in-place addmm_) and db_v += column sums of
    dz, into the outputs (fp32/fp64 inputs) or compute-dtype accumulators cast once.
    ``dx_acc``: dx as the accumulator, not cast to x's dtype (a partial sum that the
    caller reduces first)."""
    n, h = x.shape
    v = weight.shape[0]
    cd = compute_dtype(x.dtype)
    exact = x.dtype == cd  # fp32/fp64: accumulate straight into the outputs
    dx_sum = torch.zeros(n, h, dtype=cd, device=x.device) if need_dx else None  # dx itself when exact
    dw = torch.empty_like(weight) if need_dw else None
    db = torch.empty_like(bias) if need_db and bias is not None else None
    for v0 in range(0, v, plan.vocab_chunk):
        v1 = min(v, v0 + plan.vocab_chunk)
        w_v = weight[v0:v1].to(cd)
        b_v = bias[v0:v1].to(cd) if bias is not None else None
        dw_acc = None
        if dw is not None:
            dw_acc = dw[v0:v1].zero_() if exact else torch.zeros(v1 - v0, h, dtype=cd, device=x.device)
        db_acc = torch.zeros(v1 - v0, dtype=cd, device=x.device) if db is not None else None
        for n0 in range(0, n, plan.token_chunk):
            n1 = min(n, n0 + plan.token_chunk)
            x_c = x[n0:n1].to(cd)
            dz = dz_of(x_c, w_v, b_v, n0, n1, v0)
            if dx_sum is not None:
                dx_sum[n0:n1].addmm_(dz, w_v)
            if dw_acc is not None:
                dw_acc.addmm_(dz.T, x_c)
            if db_acc is not None:
                db_acc += dz.sum(dim=0)
            del dz, x_c
        if dw is not None and dw_acc is not None and not exact:
            dw[v0:v1] = dw_acc
        if db is not None and db_acc is not None:
            db[v0:v1] = db_acc
        del w_v, b_v, dw_acc
    dx = dx_sum if dx_sum is None or dx_acc else dx_sum.to(x.dtype)
    return dx, dw, db
