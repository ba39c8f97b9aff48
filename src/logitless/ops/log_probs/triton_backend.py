"""Triton backend of log_probs (CUDA tensors; CPU under TRITON_INTERPRET=1).

forward:  ``lp_forward_kernel``, one program per ``block_n`` rows, reads the logits once
          (through their strides: no copy) and writes lse, a at the token, entropy.
backward: ``lp_backward_kernel`` over (row blocks x vocab blocks) reads the logits once
          and writes d(logits) once. No atomics (bitwise repeatable), no host syncs.
Tiles: ``plan``, ``planning.logits.ce_triton_plan`` (the same bandwidth-bound streaming
shape as cross_entropy). Truncated or batch-invariant calls run ``truncation.py``
(``contract.Blocks``: plain torch ops).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from torch import Tensor

from logitless.formulas.log_probs import LogProbStats, grad_coefficients, token_outputs
from logitless.formulas.truncation import Truncation
from logitless.ops.common.contract import TritonKind
from logitless.options import LogProbOptions
from logitless.planning.logits import ce_triton_plan
from logitless.triton_lib import log_probs_logits_kernels as K
from logitless.triton_lib.fast_launch import public_launch

from . import truncation as blocked
from .contract import Blocks, LpForward, TritonConfig


class TritonBackend(TritonKind):
    """backend="triton" (``contract.LpBackend``): its Config (``contract.TritonConfig``)
    holds the tiles or the truncated path's blocks."""

    strided_logits = True  # (the kernels read the logits through their strides: no copy)

    def plan(self, logits: Tensor, opts: LogProbOptions, *, budget: int, truncated: bool,
             batch_invariant: bool) -> TritonConfig:
        if truncated or batch_invariant:
            return TritonConfig(blocks=Blocks(blocked.ROWS, batch_invariant))
        n, v = logits.shape
        return TritonConfig(tiles=ce_triton_plan(n, v, logits.element_size(), logits.device))

    def forward(self, logits: Tensor, tokens: Tensor, truncation: Optional[Truncation], opts: LogProbOptions,
                config: TritonConfig) -> LpForward:
        if config.blocks is not None:
            return blocked.forward(logits, tokens, truncation, opts, config.blocks)
        n, v = logits.shape
        plan = config.tiles
        assert plan is not None  # (a Config without blocks has tiles: ``plan``)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        tgt = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty(n, dtype=torch.float32, device=logits.device) if opts.entropy else None
        public_launch(K.lp_forward_kernel, (triton.cdiv(n, plan.block_n),),
            logits, tokens.contiguous(), lse, tgt, ent if ent is not None else lse,
            n, v, logits.stride(0), logits.stride(1), float(opts.softcap or 1.0), 1.0 / opts.temperature,
            HAS_SOFTCAP=opts.softcap is not None, ENTROPY=opts.entropy,
            BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, num_warps=plan.num_warps,
        )
        logp, entropy = token_outputs(LogProbStats(lse=lse, target=tgt, entropy=ent), tokens, v, opts)
        return LpForward(logp, entropy, lse)

    def backward(self, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], logits: Tensor, tokens: Tensor,
                 logp: Optional[Tensor], entropy: Optional[Tensor], lse: Tensor, tau: Optional[Tensor],
                 opts: LogProbOptions, config: TritonConfig) -> Tensor:
        if config.blocks is not None:
            assert logp is not None and tau is not None  # (the blocked forward's outputs: ``custom_op.save``)
            return blocked.backward(grad_logp, grad_entropy, logits, tokens, logp, entropy, lse, tau, opts,
                                    config.blocks)
        n, v = logits.shape
        plan = config.tiles
        assert plan is not None  # (a Config without blocks has tiles: ``plan``)
        out = torch.empty_like(logits)
        coef = grad_coefficients(entropy if opts.entropy else None, tokens, grad_logp,
                                 grad_entropy if opts.entropy else None, v, opts, lse)
        grid = (triton.cdiv(n, plan.block_n), triton.cdiv(v, plan.block_v))
        public_launch(K.lp_backward_kernel, grid,
            logits, out, tokens.contiguous(), lse.contiguous(), coef.contiguous(),
            n, v, logits.stride(0), logits.stride(1), out.stride(0), out.stride(1),
            float(opts.softcap or 1.0), 1.0 / opts.temperature,
            HAS_SOFTCAP=opts.softcap is not None, ENTROPY=opts.entropy,
            BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, num_warps=plan.num_warps,
        )
        return out
