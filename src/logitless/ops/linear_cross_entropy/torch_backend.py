"""Pure-PyTorch backend of linear_cross_entropy: the same math in bounded tiles.

Runs on any device (it is the CPU path). Logits are computed tile by tile,
token_chunk x vocab_chunk at a time (``planning.plans.torch_plan``), in fp32 (fp64 for fp64
inputs), so no tensor of tokens x vocab elements is ever allocated.

forward:  for each token chunk, for each vocab chunk: z = x_c W_v^T (+ b_v), soft-cap,
          the running argmax, the target logit, sum_c w_c z_c, then in place
          exp(z - m) for the online sum. One tile at a time.
backward: for each vocab chunk v, for each token chunk: dz recomputed in place from the
          saved lse (one more tile with a soft-cap); dW_v += dz^T x_c and
          dx_c += dz W_v as in-place matmuls (addmm_) into the outputs (fp32/fp64
          inputs) or into fp32 accumulators cast once (16-bit inputs).

Memory: temporaries stay within ``memory_budget`` (what ``torch_plan`` counts: the
tiles, the upcast chunks of x and W for 16-bit inputs, dW_v's accumulator) plus
O(tokens + vocab) vectors and, for 16-bit inputs, the fp32 dx accumulator
(tokens x hidden x 4 bytes). tests/test_precision.py measures it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import apply_softcap, compute_dtype, reduce
from logitless.formulas.cross_entropy import TokenStats, dlogits_, token_loss, upstream_per_token
from logitless.formulas.cross_entropy import grad_coefficients as grad_coefficients_of
from logitless.ops.common.contract import TorchKind
from logitless.ops.common.torch_tiles import chunked_backward, linear_torch_plan
from logitless.options import CrossEntropyOptions
from logitless.planning.plans import TorchPlan

from .contract import LceForward, TorchConfig


def _logits_tile(x_c: Tensor, w_v: Tensor, b_v: Optional[Tensor], softcap):
    """Soft-capped z = x_c w_v^T (+ b_v), all three already in the compute dtype."""
    z = x_c @ w_v.T
    if b_v is not None:
        z += b_v
    return apply_softcap(z, softcap, inplace=True)


def _forward_stats(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                   class_weight: Optional[Tensor], softcap: Optional[float], *, need_smooth: bool,
                   need_argmax: bool, plan: TorchPlan) -> TokenStats:
    """The statistics of every token, in ``plan``'s tiles."""
    n, h = x.shape
    v = weight.shape[0]
    cd = compute_dtype(x.dtype)
    lse = torch.empty(n, dtype=cd, device=x.device)
    tgt = torch.empty(n, dtype=cd, device=x.device)
    smooth = torch.empty(n, dtype=cd, device=x.device) if need_smooth else None
    amax = torch.empty(n, dtype=torch.int64, device=x.device) if need_argmax else None
    cw = class_weight.to(cd) if class_weight is not None else None
    for n0 in range(0, n, plan.token_chunk):
        n1 = min(n, n0 + plan.token_chunk)
        x_c, t_c = x[n0:n1].to(cd), target[n0:n1]
        m = torch.full((n1 - n0,), float("-inf"), dtype=cd, device=x.device)
        s = torch.zeros_like(m)
        z_t = torch.zeros_like(m)
        sm = torch.zeros_like(m)
        best = torch.full_like(m, float("-inf"))
        best_i = torch.zeros(n1 - n0, dtype=torch.int64, device=x.device)
        for v0 in range(0, v, plan.vocab_chunk):
            v1 = min(v, v0 + plan.vocab_chunk)
            z = _logits_tile(x_c, weight[v0:v1].to(cd), bias[v0:v1].to(cd) if bias is not None else None, softcap)
            tile_max, tile_arg = z.max(dim=1)  # first maximum on ties
            if need_argmax:
                better = tile_max > best
                best_i = torch.where(better, tile_arg + v0, best_i)
                best = torch.where(better, tile_max, best)
            local = t_c - v0
            inside = (local >= 0) & (local < v1 - v0)
            picked = z.gather(1, local.clamp(0, v1 - v0 - 1)[:, None])[:, 0]
            z_t = z_t + torch.where(inside, picked, torch.zeros_like(picked))
            if need_smooth:
                sm = sm + (z @ cw[v0:v1] if cw is not None else z.sum(dim=1))
            m_new = torch.maximum(m, tile_max)
            # Rows whose logits so far are all -inf (a -inf bias masks classes) stay 0.
            m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            s = s * torch.exp(m - m_safe) + z.sub_(m_safe[:, None]).exp_().sum(dim=1)  # z is spent
            m = m_new
            del z
        # NaN anywhere in a row gives a NaN lse (max() may skip NaN; the sum does not).
        lse[n0:n1] = m + torch.log(s)
        tgt[n0:n1] = z_t
        if smooth is not None:
            smooth[n0:n1] = sm
        if amax is not None:
            amax[n0:n1] = best_i
    return TokenStats(lse=lse, target_logit=tgt, smooth_sum=smooth, argmax=amax)


def grad_coefficients(grad_loss: Tensor, grad_lse: Optional[Tensor], lse: Tensor, w_t: Tensor, target: Tensor,
                      class_weight: Optional[Tensor], opts: CrossEntropyOptions, num_classes: int) -> Tensor:
    """The backward's (3, N) A, B, C from the formulas."""
    g = upstream_per_token(grad_loss, w_t, opts.reduction)
    coef = grad_coefficients_of(lse, target, g, num_classes, class_weight, opts)
    if grad_lse is not None:  # d lse / d z_c = p_c: the A term, at every token
        coef[0] += grad_lse.to(coef.dtype)
    return coef


def _backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, class_weight: Optional[Tensor],
              softcap: Optional[float], lse: Tensor, coef: Tensor, *, need_dx: bool, need_dw: bool, need_db: bool,
              plan: TorchPlan, dx_acc: bool = False):
    """dx, dW, db in ``plan``'s tiles; ``dx_acc``: dx as the accumulator in the compute
    dtype (fp32, fp64 for fp64), not cast to x's dtype (a partial sum that the caller
    reduces first)."""
    cd = compute_dtype(x.dtype)
    lse = lse.to(cd)
    coef = coef.to(cd)
    cw = class_weight.to(cd) if class_weight is not None else None

    def dz_of(x_c, w_v, b_v, n0, n1, v0):  # dz in place of the recomputed tile
        z = _logits_tile(x_c, w_v, b_v, softcap)
        return dlogits_(z, lse[n0:n1], coef[:, n0:n1], target[n0:n1], v0, cw, softcap)

    return chunked_backward(x, weight, bias, plan, dz_of, need_dx=need_dx, need_dw=need_dw, need_db=need_db,
                            dx_acc=dx_acc)


class TorchBackend(TorchKind):
    """backend="torch" (``contract.LceBackend``): any device, fp64 too; keeps nothing for the
    backward; its Config (``TorchConfig``) holds the forward's and the backward's tiles."""


    def plan(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], class_weight: Optional[Tensor],
             opts: CrossEntropyOptions, *, budget: int, need_grad: bool, need_argmax: bool,
             grad_in_forward: bool = False, need_dw: bool = True, cute: bool = True,
             kept_owned: bool = True) -> TorchConfig:
        v = weight.shape[0]
        exact = x.dtype == compute_dtype(x.dtype)
        return TorchConfig(
            forward=linear_torch_plan(x, v, budget, tiles=1, accumulators=0),
            backward=linear_torch_plan(x, v, budget, tiles=1 + (opts.softcap is not None),
                                       accumulators=0 if exact else int(need_dw)),
        )

    def kept_shapes(self, config: TorchConfig, n: int) -> None:
        return None

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                class_weight: Optional[Tensor], opts: CrossEntropyOptions, config: TorchConfig, *,
                need_argmax: bool, loss: bool = True, need_dx: bool = False, need_dw: bool = False,
                need_db: bool = False) -> LceForward:
        stats = _forward_stats(x, weight, bias, target, class_weight, opts.softcap, need_smooth=opts.needs_smooth_sum,
                               need_argmax=need_argmax, plan=config.forward)
        if not loss:
            return LceForward(stats)
        loss_tok, w_t = token_loss(stats, target, weight.shape[0], class_weight, opts)
        return LceForward(stats, reduce(loss_tok, w_t, opts.reduction), w_t)

    grad_coefficients = staticmethod(grad_coefficients)

    def backward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                 class_weight: Optional[Tensor], softcap: Optional[float], lse: Tensor, coef: Tensor,
                 config: TorchConfig, *, kept=None, need_dx: bool, need_dw: bool, need_db: bool,
                 dx_acc: bool = False):
        return _backward(x, weight, bias, target, class_weight, softcap, lse, coef, need_dx=need_dx,
                         need_dw=need_dw, need_db=need_db, plan=config.backward, dx_acc=dx_acc)
