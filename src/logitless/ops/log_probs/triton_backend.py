"""Triton backend of log_probs (CUDA tensors; CPU under TRITON_INTERPRET=1).

forward:  ``lp_forward_kernel``, one program per ``block_n`` rows, reads the logits once
          (through their strides: no copy) and writes lse, a at the token, entropy.
backward: ``lp_backward_kernel`` over (row blocks x vocab blocks) reads the logits once
          and writes d(logits) once. No atomics (bitwise repeatable), no host syncs.
Tiles: ``planning.plans.ce_triton_plan`` (the same bandwidth-bound streaming shape as
cross_entropy).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from logitless.formulas.log_probs import LogProbStats
from logitless.options import LogProbOptions
from logitless.planning.plans import ce_triton_plan
from logitless.triton_lib import log_probs_logits_kernels as K
from logitless.triton_lib.fast_launch import public_launch


def forward(logits: Tensor, tokens: Tensor, opts: LogProbOptions, *, budget: int) -> LogProbStats:
    n, v = logits.shape
    plan = ce_triton_plan(n, v, logits.element_size(), logits.device)
    f32 = dict(dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, **f32)
    tgt = torch.empty(n, **f32)
    ent = torch.empty(n, **f32) if opts.entropy else None
    public_launch(K.lp_forward_kernel, (triton.cdiv(n, plan.block_n),),
        logits, tokens.contiguous(), lse, tgt, ent if ent is not None else lse,
        n, v, logits.stride(0), logits.stride(1), float(opts.softcap or 1.0), 1.0 / opts.temperature,
        HAS_SOFTCAP=opts.softcap is not None, ENTROPY=opts.entropy,
        BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, num_warps=plan.num_warps,
    )
    return LogProbStats(lse=lse, target=tgt, entropy=ent)


def backward(logits: Tensor, tokens: Tensor, opts: LogProbOptions, lse: Tensor, coef: Tensor, out: Tensor, *,
             budget: int) -> None:
    """Writes d / d logits into ``out`` (N, V)."""
    n, v = logits.shape
    plan = ce_triton_plan(n, v, logits.element_size(), logits.device)
    grid = (triton.cdiv(n, plan.block_n), triton.cdiv(v, plan.block_v))
    public_launch(K.lp_backward_kernel, grid,
        logits, out, tokens.contiguous(), lse.contiguous(), coef.contiguous(),
        n, v, logits.stride(0), logits.stride(1), out.stride(0), out.stride(1),
        float(opts.softcap or 1.0), 1.0 / opts.temperature,
        HAS_SOFTCAP=opts.softcap is not None, ENTROPY=opts.entropy,
        BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, num_warps=plan.num_warps,
    )
