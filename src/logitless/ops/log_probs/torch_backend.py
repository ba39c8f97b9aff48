"""Pure-PyTorch backend of log_probs: rows in chunks (``planning.plans.ce_torch_plan``
sizes them within the budget), each upcast to the compute dtype once. Forward: one
pass of ``formulas.log_probs.online_update`` over the chunk's full rows. Backward:
``formulas.log_probs.dlogits_`` on the recomputed chunk, written into ``out``."""

from __future__ import annotations

import torch
from torch import Tensor

from logitless.formulas.common import apply_softcap, compute_dtype
from logitless.formulas.log_probs import LogProbStats, dlogits_, finish, online_update, scaled_logits_
from logitless.options import LogProbOptions
from logitless.planning.plans import ce_torch_plan


def _rows(logits: Tensor, budget: int) -> int:
    cd = compute_dtype(logits.dtype)
    n, v = logits.shape
    return ce_torch_plan(n, v, torch.finfo(cd).bits // 8, budget)


def _scaled(chunk: Tensor, opts: LogProbOptions) -> Tensor:
    a = chunk.to(compute_dtype(chunk.dtype), copy=True)
    return scaled_logits_(apply_softcap(a, opts.softcap, inplace=True), opts)


def forward(logits: Tensor, tokens: Tensor, opts: LogProbOptions, *, budget: int) -> LogProbStats:
    n, v = logits.shape
    cd = compute_dtype(logits.dtype)
    lse = torch.empty(n, dtype=cd, device=logits.device)
    tgt = torch.empty(n, dtype=cd, device=logits.device)
    ent = torch.empty(n, dtype=cd, device=logits.device) if opts.entropy else None
    rows = _rows(logits, budget)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        a = _scaled(logits[n0:n1], opts)
        t = tokens[n0:n1]
        tgt[n0:n1] = a.gather(1, t.clamp(0, v - 1)[:, None])[:, 0]
        m = torch.full((n1 - n0,), float("-inf"), dtype=cd, device=logits.device)
        zero = torch.zeros_like(m)
        m, s, u = online_update(a, m, zero, zero.clone() if opts.entropy else None)
        lse[n0:n1], e = finish(m, s, u)
        if opts.entropy:
            ent[n0:n1] = e
    return LogProbStats(lse=lse, target=tgt, entropy=ent)


def backward(logits: Tensor, tokens: Tensor, opts: LogProbOptions, lse: Tensor, coef: Tensor, out: Tensor, *,
             budget: int) -> None:
    n, _ = logits.shape
    cd = compute_dtype(logits.dtype)
    lse, coef = lse.to(cd), coef.to(cd)
    rows = _rows(logits, budget)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        out[n0:n1] = dlogits_(_scaled(logits[n0:n1], opts), lse[n0:n1], coef[:, n0:n1], tokens[n0:n1], 0, opts)
