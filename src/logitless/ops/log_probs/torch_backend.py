"""Pure-PyTorch backend of log_probs: rows in chunks (``plan``: ``planning.logits.ce_torch_plan``
sizes them within the budget), each upcast to the compute dtype once. Forward: one
pass of ``formulas.log_probs.online_update`` over the chunk's full rows. Backward:
``formulas.log_probs.dlogits_`` on the recomputed chunk, written into a new tensor.
Truncated or batch-invariant calls run ``truncation.py`` (``contract.Blocks``)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import apply_softcap, compute_dtype
from logitless.formulas.log_probs import (
    LogProbStats,
    dlogits_,
    finish,
    grad_coefficients,
    online_update,
    scaled_logits_,
    token_outputs,
)
from logitless.formulas.truncation import Truncation
from logitless.ops.common.contract import TorchKind
from logitless.options import LogProbOptions
from logitless.planning.logits import ce_torch_plan

from . import truncation as blocked
from .contract import Blocks, LpForward, TorchConfig


def _scaled(chunk: Tensor, opts: LogProbOptions) -> Tensor:
    a = chunk.to(compute_dtype(chunk.dtype), copy=True)
    return scaled_logits_(apply_softcap(a, opts.softcap, inplace=True), opts)


class TorchBackend(TorchKind):
    """backend="torch" (``contract.LpBackend``): any device, fp64 too; its Config
    (``contract.TorchConfig``) holds the rows per chunk or the truncated path's blocks."""

    strided_logits = False  # (rows made contiguous first: ``api``)

    def plan(self, logits: Tensor, opts: LogProbOptions, *, budget: int, truncated: bool,
             batch_invariant: bool) -> TorchConfig:
        if truncated or batch_invariant:
            return TorchConfig(blocks=Blocks(blocked.ROWS, batch_invariant))
        n, v = logits.shape
        return TorchConfig(rows=ce_torch_plan(n, v, torch.finfo(compute_dtype(logits.dtype)).bits // 8, budget))

    def forward(self, logits: Tensor, tokens: Tensor, truncation: Optional[Truncation], opts: LogProbOptions,
                config: TorchConfig) -> LpForward:
        if config.blocks is not None:
            return blocked.forward(logits, tokens, truncation, opts, config.blocks)
        n, v = logits.shape
        cd = compute_dtype(logits.dtype)
        lse = torch.empty(n, dtype=cd, device=logits.device)
        tgt = torch.empty(n, dtype=cd, device=logits.device)
        ent = torch.empty(n, dtype=cd, device=logits.device) if opts.entropy else None
        rows = config.rows
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            a = _scaled(logits[n0:n1], opts)
            t = tokens[n0:n1]
            tgt[n0:n1] = a.gather(1, t.clamp(0, v - 1)[:, None])[:, 0]
            m = torch.full((n1 - n0,), float("-inf"), dtype=cd, device=logits.device)
            zero = torch.zeros_like(m)
            m, s, u = online_update(a, m, zero, zero.clone() if opts.entropy else None)
            lse[n0:n1], e = finish(m, s, u)
            if ent is not None and e is not None:  # (opts.entropy)
                ent[n0:n1] = e
        stats = LogProbStats(lse=lse, target=tgt, entropy=ent)
        logp, entropy = token_outputs(stats, tokens, v, opts)
        return LpForward(logp, entropy, lse)

    def backward(self, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], logits: Tensor, tokens: Tensor,
                 logp: Optional[Tensor], entropy: Optional[Tensor], lse: Tensor, tau: Optional[Tensor],
                 opts: LogProbOptions, config: TorchConfig) -> Tensor:
        if config.blocks is not None:
            assert logp is not None and tau is not None  # (the blocked forward's outputs: ``custom_op.save``)
            return blocked.backward(grad_logp, grad_entropy, logits, tokens, logp, entropy, lse, tau, opts,
                                    config.blocks)
        n, v = logits.shape
        out = torch.empty_like(logits)
        coef = grad_coefficients(entropy if opts.entropy else None, tokens, grad_logp,
                                 grad_entropy if opts.entropy else None, v, opts, lse)
        cd = compute_dtype(logits.dtype)
        lse, coef = lse.to(cd), coef.to(cd)
        rows = config.rows
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            out[n0:n1] = dlogits_(_scaled(logits[n0:n1], opts), lse[n0:n1], coef[:, n0:n1], tokens[n0:n1], 0, opts)
        return out
