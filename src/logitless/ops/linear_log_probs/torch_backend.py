"""Pure-PyTorch backend of linear_log_probs: the same math in bounded tiles (any device;
the CPU path).

forward:  for each token chunk, for each vocab chunk: z = x_c W_v^T (+ b_v), soft-cap,
          a = z / T in the compute dtype (fp32; fp64 for fp64 inputs), the token's a,
          then the online (m, s, u) update (``formulas.log_probs.online_update``).
backward: for each vocab chunk, for each token chunk: a recomputed, turned into dz in
          place (``formulas.log_probs.dlogits_``); dW_v += dz^T x_c, dx_c += dz W_v into
          the outputs (fp32/fp64 inputs) or fp32 accumulators cast once (16-bit inputs).

Memory: the tiles ``planning.plans.torch_plan`` sizes within ``memory_budget``, O(N + V)
vectors and, for 16-bit inputs, the fp32 dx accumulator (N x H x 4 bytes).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import apply_softcap, compute_dtype
from logitless.formulas.log_probs import LogProbStats, dlogits_, finish, online_update, scaled_logits_, token_outputs
from logitless.formulas.log_probs import grad_coefficients as grad_coefficients_of
from logitless.ops.common.torch_tiles import chunked_backward, linear_torch_plan
from logitless.options import LogProbOptions


def scaled_tile(x_c: Tensor, w_v: Tensor, b_v: Optional[Tensor], opts: LogProbOptions) -> Tensor:
    """a = softcap(x_c @ w_v^T + b_v) / T of a tile, in the operands' dtype (the callers'
    compute dtype), in place after the GEMM; also the tile of ``truncation`` and
    ``integrations.trl_fields``."""
    z = x_c @ w_v.T
    if b_v is not None:
        z += b_v
    return scaled_logits_(apply_softcap(z, opts.softcap, inplace=True), opts)


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions, *,
            budget: int, plan=None, outputs: bool = False, tau: Optional[Tensor] = None):
    """(LogProbStats, None): this backend keeps nothing for the backward. ``outputs``:
    ((logp, entropy or None, lse), None) instead (``formulas.log_probs.token_outputs``).
    ``tau`` (N,): a per-token threshold, columns with a < tau left out (truncated
    sampling, ``formulas.truncation``; a token left out gets a = -inf)."""
    n, h = x.shape
    v = weight.shape[0]
    cd = compute_dtype(x.dtype)
    plan = linear_torch_plan(x, v, budget, tiles=2 + opts.entropy, accumulators=0)
    lse = torch.empty(n, dtype=cd, device=x.device)
    tgt = torch.empty(n, dtype=cd, device=x.device)
    ent = torch.empty(n, dtype=cd, device=x.device) if opts.entropy else None
    for n0 in range(0, n, plan.token_chunk):
        n1 = min(n, n0 + plan.token_chunk)
        x_c, t_c = x[n0:n1].to(cd), tokens[n0:n1]
        m = torch.full((n1 - n0,), float("-inf"), dtype=cd, device=x.device)
        s = torch.zeros_like(m)
        u = torch.zeros_like(m) if opts.entropy else None
        a_t = torch.zeros_like(m)
        for v0 in range(0, v, plan.vocab_chunk):
            v1 = min(v, v0 + plan.vocab_chunk)
            a = scaled_tile(x_c, weight[v0:v1].to(cd), bias[v0:v1].to(cd) if bias is not None else None, opts)
            if tau is not None:
                a.masked_fill_(a < tau[n0:n1, None].to(cd), float("-inf"))
            local = t_c - v0
            inside = (local >= 0) & (local < v1 - v0)
            picked = a.gather(1, local.clamp(0, v1 - v0 - 1)[:, None])[:, 0]
            a_t = a_t + torch.where(inside, picked, torch.zeros_like(picked))
            m, s, u = online_update(a, m, s, u)  # a is spent
            del a
        lse_c, ent_c = finish(m, s, u)
        lse[n0:n1] = lse_c
        tgt[n0:n1] = a_t
        if opts.entropy:
            ent[n0:n1] = ent_c
    stats = LogProbStats(lse=lse, target=tgt, entropy=ent)
    if outputs:
        logp, ent = token_outputs(stats, tokens, v, opts)
        return (logp, ent, stats.lse), None
    return stats, None


def plan(*_, **__) -> None:
    """No plan crosses to the backward: this backend sizes its tiles from the budget in
    the forward and in the backward (``ops.common.torch_tiles``) and keeps nothing."""
    return None


def kept_shapes(plan, n: int) -> None:
    """This backend keeps nothing for the backward."""
    return None


def grad_coefficients(entropy: Optional[Tensor], tokens: Tensor, g_lp: Optional[Tensor], g_h: Optional[Tensor],
                      num_classes: int, opts: LogProbOptions, lse: Tensor) -> Tensor:
    """The backward's (3, N) A, B, C from the formulas."""
    return grad_coefficients_of(entropy, tokens, g_lp, g_h, num_classes, opts, lse)


def backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
             lse: Tensor, coef: Tensor, *, need_dx: bool, need_dw: bool, need_db: bool, budget: int,
             kept=None, plan=None, dx_acc: bool = False, tau: Optional[Tensor] = None):
    """dx, dW, db; ``dx_acc``: dx as the accumulator in the compute dtype (fp32, fp64
    for fp64), not cast to x's dtype (a partial sum the caller reduces first: vocab
    parallelism). ``tau``: the forward's per-token threshold (dz = 0 where a < tau; lse
    and coef those of the truncated rows)."""
    v = weight.shape[0]
    cd = compute_dtype(x.dtype)
    exact = x.dtype == cd
    tiles = 1 + (opts.softcap is not None) + opts.entropy
    plan = linear_torch_plan(x, v, budget, tiles=tiles, accumulators=0 if exact else int(need_dw))
    lse = lse.to(cd)
    coef = coef.to(cd)

    def dz_of(x_c, w_v, b_v, n0, n1, v0):  # dz in place of the recomputed tile
        a = scaled_tile(x_c, w_v, b_v, opts)
        out = a < tau[n0:n1, None].to(cd) if tau is not None else None
        dz = dlogits_(a, lse[n0:n1], coef[:, n0:n1], tokens[n0:n1], v0, opts)
        return dz.masked_fill_(out, 0.0) if out is not None else dz

    return chunked_backward(x, weight, bias, plan, dz_of, need_dx=need_dx, need_dw=need_dw, need_db=need_db,
                            dx_acc=dx_acc)
