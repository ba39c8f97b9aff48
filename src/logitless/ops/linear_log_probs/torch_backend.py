"""Pure-PyTorch backend of linear_log_probs: the same math in bounded tiles (any device;
the CPU path).

forward:  for each token chunk, for each vocab chunk: z = x_c W_v^T (+ b_v), soft-cap,
          a = z / T in the compute dtype (fp32; fp64 for fp64 inputs), the token's a,
          then the online (m, s, u) update (``formulas.log_probs.online_update``).
backward: for each vocab chunk, for each token chunk: a recomputed, turned into dz in
          place (``formulas.log_probs.dlogits_``); dW_v += dz^T x_c, dx_c += dz W_v into
          the outputs (fp32/fp64 inputs) or fp32 accumulators cast once (16-bit inputs).

Memory: the tiles ``planning.plans.torch_plan`` sizes within ``memory_budget`` (in ``plan``:
the Config, ``contract.TorchConfig``), O(N + V) vectors and, for 16-bit inputs, the fp32 dx
accumulator (N x H x 4 bytes). Truncated / batch-invariant calls: ``truncation``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from logitless.formulas.common import apply_softcap, compute_dtype
from logitless.formulas.log_probs import LogProbStats, dlogits_, finish, online_update, scaled_logits_, token_outputs
from logitless.formulas.log_probs import grad_coefficients as grad_coefficients_of
from logitless.ops.common.contract import TorchKind
from logitless.ops.common.torch_tiles import chunked_backward, linear_torch_plan
from logitless.options import LogProbOptions

from .contract import TorchConfig, decide


def scaled_tile(x_c: Tensor, w_v: Tensor, b_v: Optional[Tensor], opts: LogProbOptions) -> Tensor:
    """a = softcap(x_c @ w_v^T + b_v) / T of a tile, in the operands' dtype (the callers'
    compute dtype), in place after the GEMM; also the tile of ``truncation`` and
    ``integrations.trl_fields``."""
    z = x_c @ w_v.T
    if b_v is not None:
        z += b_v
    return scaled_logits_(apply_softcap(z, opts.softcap, inplace=True), opts)


def _rows_like(x: Tensor, rows: int) -> Tensor:
    """A tensor of x's dtype with ``rows`` rows (what a planner reads: shape and dtype)."""
    return x if rows == x.shape[0] else x[:1].expand(rows, x.shape[1])


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
            plan, *, tau: Optional[Tensor] = None):
    """LogProbStats of x's rows over every column, in tiles of ``plan`` (a TorchPlan).
    ``tau`` (N,): a per-token threshold, columns with a < tau left out (truncated
    sampling, ``formulas.truncation``; a token left out gets a = -inf)."""
    n, h = x.shape
    v = weight.shape[0]
    cd = compute_dtype(x.dtype)
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
        if ent is not None and ent_c is not None:  # (opts.entropy)
            ent[n0:n1] = ent_c
    return LogProbStats(lse=lse, target=tgt, entropy=ent)


def backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
             lse: Tensor, coef: Tensor, plan, *, need_dx: bool, need_dw: bool, need_db: bool,
             dx_acc: bool = False, tau: Optional[Tensor] = None):
    """dx, dW, db in tiles of ``plan`` (a TorchPlan); ``dx_acc``: dx as the accumulator in
    the compute dtype (fp32, fp64 for fp64), not cast to x's dtype (a partial sum the caller
    reduces first: vocab parallelism). ``tau``: the forward's per-token threshold (dz = 0
    where a < tau; lse and coef those of the truncated rows)."""
    cd = compute_dtype(x.dtype)
    lse = lse.to(cd)
    coef = coef.to(cd)

    def dz_of(x_c, w_v, b_v, n0, n1, v0):  # dz in place of the recomputed tile
        a = scaled_tile(x_c, w_v, b_v, opts)
        out = a < tau[n0:n1, None].to(cd) if tau is not None else None
        dz = dlogits_(a, lse[n0:n1], coef[:, n0:n1], tokens[n0:n1], v0, opts)
        return dz.masked_fill_(out, 0.0) if out is not None else dz

    return chunked_backward(x, weight, bias, plan, dz_of, need_dx=need_dx, need_dw=need_dw, need_db=need_db,
                            dx_acc=dx_acc)


class TorchBackend(TorchKind):
    """backend="torch" (``contract.LlpBackend``): its Config is the call's tiles
    (``contract.TorchConfig``); it keeps nothing for the backward."""

    truncates = True
    threshold_search = False  # (the chunked threshold pass)

    def plan(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], opts: LogProbOptions, *, budget: int,
             need_grad: bool, need_dw: bool = True, truncated: bool = False, k_max: int = -1, block: int = 0,
             parallel: bool = False, plan_rows: Optional[int] = None, cute: bool = True,
             kept_owned: bool = True) -> TorchConfig:
        n, v = x.shape[0], weight.shape[0]
        exact = x.dtype == compute_dtype(x.dtype)
        rows = _rows_like(x, block or n)
        forward = backward = None
        if v:
            forward = linear_torch_plan(rows, v, budget, tiles=2 + opts.entropy, accumulators=0)
            backward = linear_torch_plan(x, v, budget, tiles=1 + (opts.softcap is not None) + opts.entropy,
                                         accumulators=0 if exact else int(need_dw))
        if not truncated and not block:
            return TorchConfig(forward, backward)
        decided, _ = decide(self, v, truncated, k_max, block, need_grad, parallel)  # (keeps nothing)
        steps = linear_torch_plan(rows, plan_rows or v, budget, tiles=3, accumulators=0) if truncated else None
        return TorchConfig(forward, backward, steps, decided)

    def kept_shapes(self, config: Any, n: int) -> None:
        return None

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
                config: TorchConfig, *, outputs: bool = True, tau: Optional[Tensor] = None, keep: bool = True):
        stats = forward(x, weight, bias, tokens, opts, config.forward, tau=tau)
        if outputs:
            logp, ent = token_outputs(stats, tokens, weight.shape[0], opts)
            return (logp, ent, stats.lse), None
        return stats, None

    @staticmethod
    def grad_coefficients(entropy: Optional[Tensor], tokens: Tensor, g_lp: Optional[Tensor],
                          g_h: Optional[Tensor], num_classes: int, opts: LogProbOptions, lse: Tensor) -> Tensor:
        """The backward's (3, N) A, B, C from the formulas."""
        return grad_coefficients_of(entropy, tokens, g_lp, g_h, num_classes, opts, lse)

    def backward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
                 lse: Tensor, coef: Tensor, config: TorchConfig, *, kept=None, need_dx: bool, need_dw: bool,
                 need_db: bool, dx_acc: bool = False, tau: Optional[Tensor] = None):
        return backward(x, weight, bias, tokens, opts, lse, coef, config.backward, need_dx=need_dx,
                        need_dw=need_dw, need_db=need_db, dx_acc=dx_acc, tau=tau)
