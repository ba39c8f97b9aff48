"""Pure-PyTorch backend of jsd: ``formulas.jsd`` on chunks of rows (any device).

forward:  per chunk of rows, upcast both logits (fp32, fp64 for fp64), soft-cap, the
          row statistics of ``formulas.jsd.row_stats``.
backward: per chunk of rows, d loss / d student logits from the saved statistics.
Chunks are sized by the memory budget in ``plan`` (``planning.logits.jsd_torch_rows``):
never a full tokens x vocab temporary beyond the chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor

from logitless.formulas.common import apply_softcap, compute_dtype
from logitless.formulas.jsd import dlogits, row_stats
from logitless.ops.common.contract import TorchKind
from logitless.options import JSDOptions
from logitless.planning.logits import jsd_torch_rows

from .contract import TorchConfig


class TorchBackend(TorchKind):
    """backend="torch" (``contract.JsdBackend``): any device, fp64 too; its Config
    (``TorchConfig``) holds the rows per chunk."""


    def plan(self, zs: Tensor, zt: Tensor, *, budget: int) -> TorchConfig:
        n, v = zs.shape
        cd = compute_dtype(zs.dtype, zt.dtype)
        return TorchConfig(rows=jsd_torch_rows(n, v, torch.finfo(cd).bits // 8, budget))

    def forward(self, zs: Tensor, zt: Tensor, target: Tensor, opts: JSDOptions, config: TorchConfig) -> Tensor:
        n, v = zs.shape
        cd = compute_dtype(zs.dtype, zt.dtype)
        rows = config.rows
        out = torch.empty(6, n, dtype=cd, device=zs.device)
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            a = apply_softcap(zs[n0:n1].to(cd), opts.student_softcap)
            b = apply_softcap(zt[n0:n1].to(cd), opts.teacher_softcap)
            out[:, n0:n1] = row_stats(a, b, target[n0:n1], opts)
        return out

    def backward(self, g: Tensor, zs: Tensor, zt: Tensor, target: Tensor, stats: Tensor, opts: JSDOptions,
                 config: TorchConfig) -> Tensor:
        n, v = zs.shape
        cd = compute_dtype(zs.dtype, zt.dtype)
        rows = config.rows
        dz = torch.empty_like(zs)
        g = g.to(cd)
        stats = stats.to(cd)
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            a = apply_softcap(zs[n0:n1].to(cd), opts.student_softcap)
            b = apply_softcap(zt[n0:n1].to(cd), opts.teacher_softcap)
            dz[n0:n1] = dlogits(a, b, stats[:, n0:n1], g[n0:n1], target[n0:n1], 0, opts)
        return dz
