"""Triton backend of jsd (CUDA tensors; CPU under TRITON_INTERPRET=1).

forward:  ``jsd_rows.row_stats``: both logits read twice (lse sweep, divergence sweep;
          once for the KL limits), the (6, N) fp32 statistics written; one program per
          ``block_n`` rows, or each row split over several programs when the rows alone
          are too few to fill the device (``logits.jsd_stats_plan``).
backward: ``jsd_backward_kernel`` over (row blocks x vocab blocks): both logits read
          once, the student's gradient written once.
Both launches are planned in ``plan`` (``contract.TritonConfig``). Logits are read
through their strides (no copy). No atomics (bitwise repeatable), no host syncs.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from logitless.ops.common.contract import TritonKind
from logitless.options import JSDOptions
from logitless.planning.logits import ce_triton_plan, jsd_stats_plan
from logitless.triton_lib.fast_launch import public_launch
from logitless.triton_lib.jsd_rows import jsd_backward_kernel, row_stats, scalar_args

from .contract import TritonConfig


class TritonBackend(TritonKind):
    """backend="triton" (``contract.JsdBackend``): its Config (``TritonConfig``) holds the
    statistics' launch and the backward's tiles."""


    def plan(self, zs: Tensor, zt: Tensor, *, budget: int) -> TritonConfig:
        n, v = zs.shape
        itemsize = max(zs.element_size(), zt.element_size())
        return TritonConfig(stats=jsd_stats_plan(n, v, itemsize, zs.device),
                            backward=ce_triton_plan(n, v, itemsize, zs.device))

    def forward(self, zs: Tensor, zt: Tensor, target: Tensor, opts: JSDOptions, config: TritonConfig) -> Tensor:
        n = zs.shape[0]
        stats = torch.empty(6, n, dtype=torch.float32, device=zs.device)
        row_stats(zs, zt, target.contiguous(), stats, opts, config.stats)
        return stats

    def backward(self, g: Tensor, zs: Tensor, zt: Tensor, target: Tensor, stats: Tensor, opts: JSDOptions,
                 config: TritonConfig) -> Tensor:
        n, v = zs.shape
        plan = config.backward
        dz = torch.empty_like(zs)
        grid = (triton.cdiv(n, plan.block_n), triton.cdiv(v, plan.block_v))
        public_launch(jsd_backward_kernel, grid,
            zs, zt, dz, target.contiguous(), stats.float().contiguous(), g.float().contiguous(), n, v,
            zs.stride(0), zs.stride(1), zt.stride(0), zt.stride(1), dz.stride(0), dz.stride(1), n,
            wp=opts.weights[1], hlw=opts.hard_label_weight, **scalar_args(opts),
            BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, num_warps=plan.num_warps,
        )
        return dz
