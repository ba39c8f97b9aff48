"""Pure-PyTorch backend of cross_entropy: the same math, a chunk of rows at a time.

Runs on any device (it is the CPU path). One chunk of rows at a time is copied to fp32
(fp64 for fp64 logits); ``plan`` sizes the chunks (``planning.logits.ce_torch_plan``) so
that their temporaries fit the memory budget (at least one row), so the logits are
upcast whole only when that fits the budget.

forward:  per chunk: soft-cap, max, lse = m + log sum exp(z - m), the target logit,
          sum_c w_c z_c and the first argmax.
backward: per chunk: dz recomputed from the saved lse (``formulas.cross_entropy.dlogits_``) and
          written into ``out``, which may be the logits themselves (inplace_backward:
          each chunk is read, upcast, then overwritten).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import apply_softcap, compute_dtype
from logitless.formulas.cross_entropy import TokenStats, dlogits_
from logitless.ops.common.contract import TorchKind
from logitless.options import CrossEntropyOptions
from logitless.planning.logits import ce_torch_plan

from .contract import TorchConfig


def _chunks(logits: Tensor, rows: int):
    n = logits.shape[0]
    cd = compute_dtype(logits.dtype)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        # copy=True: never a view of the caller's logits (the ops below are in place).
        yield r0, r1, logits[r0:r1].to(cd, copy=True)


class TorchBackend(TorchKind):
    """backend="torch" (``contract.CeBackend``): any device, fp64 too; its Config
    (``TorchConfig``) holds the rows per chunk."""


    def plan(self, logits: Tensor, *, budget: int) -> TorchConfig:
        n, v = logits.shape
        return TorchConfig(rows=ce_torch_plan(n, v, torch.finfo(compute_dtype(logits.dtype)).bits // 8, budget))

    def forward(self, logits: Tensor, target: Tensor, class_weight: Optional[Tensor], opts: CrossEntropyOptions,
                config: TorchConfig, *, need_argmax: bool) -> TokenStats:
        n, v = logits.shape
        softcap, need_smooth = opts.softcap, opts.needs_smooth_sum
        cd = compute_dtype(logits.dtype)
        lse = torch.empty(n, dtype=cd, device=logits.device)
        tgt = torch.empty_like(lse)
        smooth = torch.empty_like(lse) if need_smooth else None
        amax = torch.empty(n, dtype=torch.int64, device=logits.device) if need_argmax else None
        cw = class_weight.to(cd) if class_weight is not None else None
        for r0, r1, z in _chunks(logits, config.rows):
            apply_softcap(z, softcap, inplace=True)
            m = z.max(dim=1).values  # NaN propagates
            # Rows of all -inf keep a shift of 0 (no inf - inf); their lse is -inf.
            m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
            lse[r0:r1] = m_safe + torch.sub(z, m_safe[:, None]).exp_().sum(dim=1).log_()
            tgt[r0:r1] = z.gather(1, target[r0:r1].clamp(0, v - 1)[:, None])[:, 0]
            if smooth is not None:
                smooth[r0:r1] = z @ cw if cw is not None else z.sum(dim=1)
            if amax is not None:
                amax[r0:r1] = z.argmax(dim=1)  # first maximum on ties
        return TokenStats(lse=lse, target_logit=tgt, smooth_sum=smooth, argmax=amax)

    def backward(self, logits: Tensor, target: Tensor, class_weight: Optional[Tensor], softcap: Optional[float],
                 lse: Tensor, coef: Tensor, out: Tensor, config: TorchConfig) -> None:
        cd = compute_dtype(logits.dtype)
        lse, coef = lse.to(cd), coef.to(cd)
        cw = class_weight.to(cd) if class_weight is not None else None
        for r0, r1, z in _chunks(logits, config.rows):
            apply_softcap(z, softcap, inplace=True)
            dlogits_(z, lse[r0:r1], coef[:, r0:r1], target[r0:r1], 0, cw, softcap)
            out[r0:r1] = z
