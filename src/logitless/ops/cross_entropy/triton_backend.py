"""Triton backend of cross_entropy (CUDA tensors; CPU under TRITON_INTERPRET=1).

forward:  ``ce_forward_kernel``, one program per ``block_n`` rows, reads the logits once
          and writes O(N) fp32 statistics (lse, target logit, smooth sum, argmax).
backward: ``ce_backward_kernel`` over (row blocks x vocab blocks) reads the logits once
          and writes dz once into ``out`` (a fresh tensor, or the logits themselves with
          inplace_backward).
Tiles: the Config, ``planning.logits.ce_triton_plan``'s ``CETritonPlan``.
Logits are read through their strides (no copy). No atomics: every output element is
written by exactly one program, so results are bitwise repeatable; no host syncs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
from torch import Tensor

from logitless.formulas.cross_entropy import TokenStats
from logitless.ops.common.contract import TritonKind
from logitless.options import CrossEntropyOptions
from logitless.planning.logits import CETritonPlan, ce_triton_plan
from logitless.triton_lib import ce_logits_kernels as K
from logitless.triton_lib.fast_launch import public_launch


def _cw(class_weight: Optional[Tensor], logits: Tensor) -> Tensor:
    return class_weight.contiguous() if class_weight is not None else logits  # dummy pointer


class TritonBackend(TritonKind):
    """backend="triton" (``contract.CeBackend``): its Config is the call's tiles
    (``planning.logits.CETritonPlan``)."""


    def plan(self, logits: Tensor, *, budget: int) -> CETritonPlan:
        n, v = logits.shape
        return ce_triton_plan(n, v, logits.element_size(), logits.device)

    def forward(self, logits: Tensor, target: Tensor, class_weight: Optional[Tensor], opts: CrossEntropyOptions,
                config: CETritonPlan, *, need_argmax: bool) -> TokenStats:
        n, v = logits.shape
        softcap, need_smooth = opts.softcap, opts.needs_smooth_sum
        target = target.contiguous()
        f32: dict[str, Any] = dict(dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, **f32)
        tgt = torch.empty(n, **f32)
        smooth = torch.empty(n, **f32) if need_smooth else None
        argmax = torch.empty(n, dtype=torch.int64, device=logits.device) if need_argmax else None
        public_launch(K.ce_forward_kernel, (triton.cdiv(n, config.block_n),),
            logits, target, _cw(class_weight, logits), lse, tgt,
            smooth if need_smooth else lse, argmax if need_argmax else lse,
            n, v, logits.stride(0), logits.stride(1), float(softcap or 1.0),
            HAS_SOFTCAP=softcap is not None, HAS_CW=class_weight is not None,
            NEED_SMOOTH=need_smooth, NEED_ARGMAX=need_argmax,
            BLOCK_N=config.block_n, BLOCK_V=config.block_v, num_warps=config.num_warps,
        )
        return TokenStats(lse=lse, target_logit=tgt, smooth_sum=smooth, argmax=argmax)

    def backward(self, logits: Tensor, target: Tensor, class_weight: Optional[Tensor], softcap: Optional[float],
                 lse: Tensor, coef: Tensor, out: Tensor, config: CETritonPlan) -> None:
        n, v = logits.shape
        grid = (triton.cdiv(n, config.block_n), triton.cdiv(v, config.block_v))
        public_launch(K.ce_backward_kernel, grid,
            logits, out, target.contiguous(), _cw(class_weight, logits), lse.contiguous(),
            coef.contiguous(),
            n, v, logits.stride(0), logits.stride(1), out.stride(0), out.stride(1),
            float(softcap or 1.0),
            HAS_SOFTCAP=softcap is not None, HAS_CW=class_weight is not None,
            BLOCK_N=config.block_n, BLOCK_V=config.block_v, num_warps=config.num_warps,
        )
