"""Gradient-in-forward strategy of the Triton backend (``planning.cost_model``: "grad_in_forward").

For reductions "mean" and "sum" the upstream gradient of each token's loss is
grad_output times a factor known before the forward (1 for "sum", 1 / sum of w_t for
"mean": the targets and class weights decide it, not the logits). So the forward can
finish the gradient itself, token chunk by token chunk [n0, n1):

    forward_stats_kernel over the chunk, KEEP on every column -> lse, e = exp(z - m)
    coef = grad_coefficients(lse, target, g)  (g: the factor above; z-loss needs lse)
    kept_dlogits_kernel: e -> dz in place (no GEMM)
    dx[n0:n1]  = dz W                       (one GEMM, fp32 accumulation, one rounding)
    dW        += dz^T x[n0:n1]              (fp32 accumulator across chunks)
    db        += column sums of dz          (fp32)

3 GEMMs in all, no recomputation; temporary memory: the chunk's kept logits
(tokens_chunk x V in the input dtype) plus the fp32 dW accumulator (4 V H bytes)
when there is more than one chunk and the weight is not fp32 already. The backward
multiplies by grad_output: dx once rounded twice when grad_output != 1 (bf16 dx of the
forward, then scaled; dW and db are scaled in fp32 and rounded once).

No atomics; chunks run in a fixed order: bitwise repeatable.
"""

from __future__ import annotations

import torch
import triton

from logitless.formulas.cross_entropy import TokenStats, grad_coefficients, target_weight, upstream_per_token
from logitless.planning.plans import LinearPlan
from logitless.triton_lib import launch
from logitless.triton_lib import lce_kernels as K
from logitless.triton_lib.fast_launch import public_launch

from . import triton_backend


def forward_with_grad(x, weight, bias, target, class_weight, opts, *, plan: LinearPlan, need_smooth: bool,
                      need_argmax: bool, need_dx: bool, need_dw: bool, need_db: bool):
    """With ``plan.grad_in_forward`` tokens per chunk (``plan.chunk``/``plan.tail``: their
    launches): TokenStats of every token, and (dx, dw_acc, db_acc) for grad_output = 1:
    dx in x's dtype; dw_acc and db_acc fp32 (dw_acc in weight's dtype when one chunk
    covers every token); None where not needed. ``ops.common.grad_in_forward.scale_grads`` finishes them."""
    n, h = x.shape
    v = weight.shape[0]
    softcap = opts.softcap
    valid = target != opts.ignore_index
    w_t = target_weight(target, class_weight, valid)
    g = upstream_per_token(torch.ones((), device=x.device), w_t, opts.reduction)
    token_chunk = plan.grad_in_forward
    chunks = [(n0, min(n, n0 + token_chunk)) for n0 in range(0, n, token_chunk)]
    one = len(chunks) == 1
    dx = torch.empty_like(x) if need_dx else None
    dw = None
    if need_dw:
        dw = torch.empty_like(weight) if one else torch.zeros(v, h, dtype=torch.float32, device=x.device)
    db = torch.zeros(v, dtype=torch.float32, device=x.device) if need_db else None
    cw_arg = class_weight if class_weight is not None else x
    parts = []
    for n0, n1 in chunks:
        xc, tc = x[n0:n1], target[n0:n1]
        full = n1 - n0 == token_chunk or plan.tail is None
        tiles, cute = (plan.chunk, plan.chunk_cute) if full else (plan.tail, plan.tail_cute)
        assert tiles is not None  # (a plan with grad_in_forward has its chunk's tiles)
        stats, (keep_buf, tile_max) = triton_backend.forward_launches(
            xc, weight, bias, tc, class_weight, softcap, need_smooth=need_smooth, need_argmax=need_argmax,
            tiles=tiles, keep=True, cute=cute)
        parts.append(stats)
        coef = grad_coefficients(stats.lse, tc, g[n0:n1], v, class_weight, opts).contiguous()
        dz = keep_buf[:, :tiles.keep_cols]
        rows, warps = launch.kept_pass_shape(tiles, softcap is not None)
        grid = (triton.cdiv(n1 - n0, rows), triton.cdiv(v, tiles.block_v))
        public_launch(K.kept_dlogits_kernel, grid,
            dz, tile_max, dz, cw_arg, tc, stats.lse, coef, n1 - n0, v, 0, v, dz.stride(0), dz.stride(0),
            float(softcap or 1.0), HAS_SOFTCAP=softcap is not None, HAS_CW=class_weight is not None,
            IN_PLACE=True, BLOCK_N=rows, BLOCK_V=tiles.block_v, APPROX_LOG=launch.approx_log(x), num_warps=warps,
        )
        if dx is not None:
            torch.mm(dz, weight, out=dx[n0:n1])
        if dw is not None:
            if one:
                torch.mm(dz.T, xc, out=dw)
            elif dw.is_cuda and dz.dtype != torch.float32:
                torch.addmm(dw, dz.T, xc, out_dtype=torch.float32, out=dw)
            elif dw.is_cuda:
                torch.addmm(dw, dz.T, xc, out=dw)
            else:  # the interpreter on CPU
                dw += dz.T.float() @ xc.float()
        if db is not None:
            db += dz.sum(dim=0, dtype=torch.float32)
        del dz, tile_max, keep_buf
    stats = TokenStats(
        lse=torch.cat([p.lse for p in parts]),
        target_logit=torch.cat([p.target_logit for p in parts]),
        smooth_sum=torch.cat([p.smooth_sum for p in parts]) if need_smooth else None,
        argmax=torch.cat([p.argmax for p in parts]) if need_argmax else None,
    )
    return stats, (dx, dw, db)
