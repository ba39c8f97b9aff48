"""Pure-PyTorch backend of linear_jsd: ``formulas.jsd`` on bounded tiles (any device).

forward:  per chunk of tokens (``planning.logits.jsd_torch_rows``), both heads' logits of the
          chunk (rows x V, fp32; fp64 for fp64), filled vocabulary slice by slice so
          that the upcast weight slice stays small, then ``formulas.jsd.row_stats``.
backward: for each vocabulary chunk, for each token chunk (``planning.plans.torch_plan``):
          recompute both tiles, dz from the saved statistics (``formulas.jsd.dlogits``),
          dW_s[v] += dz^T x_s, db_s[v] += column sums, dx_s (fp32) += dz W_s[v].
No tensor of tokens x vocab elements unless the budget holds it. ``column_sums``: the
second pass of vocabulary parallelism for 0 < beta < 1 (``vocab_parallel``). Every chunk
size comes from the call's ``contract.TorchConfig`` (``TorchBackend.plan``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import apply_softcap, compute_dtype
from logitless.formulas.jsd import dlogits, log_mixture, reduce, row_stats, token_loss
from logitless.formulas.jsd import upstream as _upstream
from logitless.ops.common.contract import TorchKind
from logitless.options import JSDOptions
from logitless.planning.logits import jsd_torch_rows
from logitless.planning.plans import torch_plan

from .contract import LjsdForward, TorchConfig


def _tile(x_c: Tensor, w: Tensor, b: Optional[Tensor], v0: int, v1: int, cap, cd) -> Tensor:
    z = x_c.to(cd) @ w[v0:v1].to(cd).T
    if b is not None:
        z += b[v0:v1].to(cd)
    return apply_softcap(z, cap)


def _vocab_step(v: int, h: int, itemsize: int, budget: int) -> int:
    """Columns per slice when filling full rows: the upcast weight slice <= budget / 4."""
    return max(1, min(v, budget // max(1, 4 * h * itemsize)))


def forward(xs, ws, bs, xt, wt, bt, target, opts: JSDOptions, config: TorchConfig) -> Tensor:
    """(6, N) statistics (``formulas.jsd``) in the compute dtype."""
    n = xs.shape[0]
    v = ws.shape[0]
    cd = compute_dtype(xs.dtype)
    rows, step = config.forward_rows, config.vocab_step
    out = torch.empty(6, n, dtype=cd, device=xs.device)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        zs = torch.empty(n1 - n0, v, dtype=cd, device=xs.device)
        zt = torch.empty_like(zs)
        for v0 in range(0, v, step):
            v1 = min(v, v0 + step)
            zs[:, v0:v1] = _tile(xs[n0:n1], ws, bs, v0, v1, opts.student_softcap, cd)
            zt[:, v0:v1] = _tile(xt[n0:n1], wt, bt, v0, v1, opts.teacher_softcap, cd)
        out[:, n0:n1] = row_stats(zs, zt, target[n0:n1], opts)
    return out


def backward(g, xs, ws, bs, xt, wt, bt, target, stats, opts: JSDOptions, config: TorchConfig, *,
             need_dx: bool, need_dw: bool, need_db: bool, dx_acc: bool = False, kept=None):
    """dx, dW, db of the student; ``dx_acc``: dx in the compute dtype, not cast; ``kept``:
    never given (this backend's Config keeps no columns)."""
    n, h = xs.shape
    v = ws.shape[0]
    cd = compute_dtype(xs.dtype)
    plan = config.backward
    g = g.to(cd)
    stats = stats.to(cd)
    dx_sum = torch.zeros(n, h, dtype=cd, device=xs.device) if need_dx else None
    dw = torch.empty_like(ws) if need_dw else None
    db = torch.empty_like(bs) if need_db and bs is not None else None
    for v0 in range(0, v, plan.vocab_chunk):
        v1 = min(v, v0 + plan.vocab_chunk)
        w_v = ws[v0:v1].to(cd)
        dw_acc = torch.zeros(v1 - v0, h, dtype=cd, device=xs.device) if dw is not None else None
        db_acc = torch.zeros(v1 - v0, dtype=cd, device=xs.device) if db is not None else None
        for n0 in range(0, n, plan.token_chunk):
            n1 = min(n, n0 + plan.token_chunk)
            xs_c = xs[n0:n1].to(cd)
            zs = _tile(xs_c, ws, bs, v0, v1, opts.student_softcap, cd)
            zt = _tile(xt[n0:n1], wt, bt, v0, v1, opts.teacher_softcap, cd)
            dz = dlogits(zs, zt, stats[:, n0:n1], g[n0:n1], target[n0:n1], v0, opts)
            if dx_sum is not None:
                dx_sum[n0:n1] += dz @ w_v
            if dw_acc is not None:
                dw_acc += dz.T @ xs_c
            if db_acc is not None:
                db_acc += dz.sum(dim=0)
        if dw is not None and dw_acc is not None:
            dw[v0:v1] = dw_acc
        if db is not None and db_acc is not None:
            db[v0:v1] = db_acc
    dx = dx_sum if dx_sum is None or dx_acc else dx_sum.to(xs.dtype)
    return dx, dw, db


def forward_loss(stats: Tensor, target: Tensor, num_classes: int, opts: JSDOptions, reduction: str) -> Tensor:
    """The loss (reduced, or per token for "none") from the (6, N) statistics: the
    formulas (``token_loss`` then ``reduce``). The Triton backend fuses them (``jsd_epilogue``)."""
    return reduce(token_loss(stats, target, num_classes, opts), target, reduction, opts.ignore_index)


def upstream(grad: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """The per-token upstream gradient of a gradient of the reduced loss (what autograd
    through ``reduce`` gives: grad; grad for each token of "sum"; grad / #non-ignored
    for "mean"), 0 at ignored tokens (``formulas.jsd.upstream``)."""
    if reduction == "none":
        g = grad.reshape(-1)
    elif reduction == "sum":
        g = grad.expand(target.shape)
    else:
        g = (grad / (target != ignore_index).to(grad.dtype).sum()).expand(target.shape)
    return _upstream(g, target, ignore_index)


def column_sums(xs, ws, bs, xt, wt, bt, target, lse_s, lse_t, opts: JSDOptions, config: TorchConfig) -> Tensor:
    """(3, N) in lse_s' dtype: S, K and the student's soft-capped logit at
    ``target`` (0 where the target is not among these columns), summed over these columns
    only, with GIVEN log-sum-exps of the full rows (vocabulary parallelism's second pass:
    the merged lse's of all ranks). Tiles of both heads in the statistics' dtype."""
    n, v = xs.shape[0], ws.shape[0]
    cd = lse_s.dtype
    out = torch.zeros(3, n, dtype=cd, device=xs.device)
    if v == 0 or n == 0:  # (no Config then)
        return out
    plan = config.column_sums
    assert plan is not None  # (planned with column_sums=True)
    t = opts.temperature
    for n0 in range(0, n, plan.token_chunk):
        n1 = min(n, n0 + plan.token_chunk)
        ls, lt, tg = lse_s[n0:n1, None], lse_t[n0:n1, None], target[n0:n1, None]
        for v0 in range(0, v, plan.vocab_chunk):
            v1 = min(v, v0 + plan.vocab_chunk)
            zs = _tile(xs[n0:n1], ws, bs, v0, v1, opts.student_softcap, cd)
            zt = _tile(xt[n0:n1], wt, bt, v0, v1, opts.teacher_softcap, cd)
            lp, lq = zs / t - ls, zt / t - lt
            lm = log_mixture(lp, lq, opts.beta)
            p, q = lp.exp(), lq.exp()
            out[0, n0:n1] += torch.where(p == 0, torch.zeros_like(p), p * (lp - lm)).sum(dim=1)
            out[1, n0:n1] += torch.where(q == 0, torch.zeros_like(q), q * (lq - lm)).sum(dim=1)
            cols = torch.arange(v0, v1, device=xs.device)[None, :]
            out[2, n0:n1] += torch.where(cols == tg, zs, torch.zeros_like(zs)).sum(dim=1)
    return out


class TorchBackend(TorchKind):
    """backend="torch" (``contract.LjsdBackend``): any device, fp64 too; its Config
    (``TorchConfig``) holds every chunk size of the call; no gradient-in-forward strategy."""

    grad_in_forward = None

    def plan(self, xs: Tensor, ws: Tensor, xt: Tensor, opts: JSDOptions, *, budget: int,
             grad_in_forward: bool = False, keep: bool = False, column_sums: bool = False) -> TorchConfig:
        n, v = xs.shape[0], ws.shape[0]
        h = max(xs.shape[1], xt.shape[1])
        isz = torch.finfo(compute_dtype(xs.dtype)).bits // 8
        return TorchConfig(
            forward_rows=jsd_torch_rows(n, v, isz, budget), vocab_step=_vocab_step(v, h, isz, budget),
            # About 12 tile-sized temporaries (two tiles, log-probs, mixture, dz, ...).
            backward=torch_plan(n, v, h, isz, max(1, budget // 4)),
            column_sums=torch_plan(n, v, h, isz, max(1, budget // 8)) if column_sums and v else None)

    def forward(self, xs, ws, bs, xt, wt, bt, target, opts: JSDOptions, config: TorchConfig, *,
                reduction: Optional[str] = None, need_dx: bool = False, need_dw: bool = False,
                need_db: bool = False) -> LjsdForward:
        stats = forward(xs, ws, bs, xt, wt, bt, target, opts, config)
        return LjsdForward(stats, forward_loss(stats, target, ws.shape[0], opts, reduction) if reduction else None)

    upstream = staticmethod(upstream)
    backward = staticmethod(backward)
    column_sums = staticmethod(column_sums)
