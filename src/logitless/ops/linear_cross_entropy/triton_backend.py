"""Triton backend of linear_cross_entropy (CUDA tensors; CPU under TRITON_INTERPRET=1).

forward  (1 GEMM): ``forward_stats_kernel`` over (row blocks x vocab splits) writes
         O(N * splits) partial statistics, merged here with O(N * splits) torch ops.
         On Hopper with the optional CuTe DSL, ``planning.cute.forward_plan`` may pick
         the warp-specialised ``cute_lib.forward_stats`` kernel instead (same partials;
         bf16/fp16, no bias/soft-cap/argmax, nothing kept for the backward).
         When a backward will follow, it also keeps exp(z - m) for the first
         ``plan.keep_cols`` vocabulary columns that the budget holds (all of them when
         the budget is at least the logits' size in the input dtype).
backward (2 GEMMs + 1 per recomputed column): kept columns become dz (in place where
         the call owns them, ``ops.common.kept.Kept``; ``kept_dlogits_kernel``, no GEMM);
         the others, chunk by chunk [v0, v1), are recomputed by ``dlogits_kernel``. For each chunk, dW[v0:v1] = dz^T x
         (written once, fp32 accumulation inside the matmul), db[v0:v1] = column sums
         of dz in fp32, and dx += dz W[v0:v1] into an fp32 (N, H) accumulator (plain
         dx = dz W when one chunk covers V).
fp32 at matmul precision "high" (``launch.tf32_prerounded``): x is rounded to TF32 once
per call into a scratch buffer and W chunk by chunk (``plan.w_chunk`` rows per forward
launch, each recomputed chunk's rows in the backward), by ``launch.round_to_tf32`` (one
read and one write); the kernels then multiply TF32-exact operands with DOT_PRECISION
"tf32" (truncation is exact on them: the products of rounding in the kernel, bitwise,
with the operands loaded by TMA straight into the tensor cores).
No tensor of N x V elements unless the budget allows it: temporaries are the kept
columns and one dz chunk (and the rounded x and W chunk), sized by the memory budget
(``planning.plans.triton_plan``). One plan per call (``plan``: a
``planning.plans.LinearPlan``, made by the forward custom op; the forward, the
gradient-in-forward strategy and the backward follow it). No
atomics: every output element is written by one program or one matmul, so results
are bitwise repeatable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import reduce
from logitless.formulas.cross_entropy import TokenStats, token_loss
from logitless.ops.common.contract import TritonKind
from logitless.ops.common.kept import Kept
from logitless.options import CrossEntropyOptions
from logitless.planning import cute as cute_planning
from logitless.planning.memo import memoised
from logitless.planning.plans import LinearPlan, linear_plan
from logitless.planning.tiles import TritonPlan
from logitless.triton_lib import ce_epilogue, launch
from logitless.triton_lib import lce_kernels as K
from logitless.triton_lib.launch import cdiv

from .contract import LceForward


def _flags(bias, class_weight, softcap, dtype, prerounded=False):
    return dict(
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_CW=class_weight is not None,
        DOT_PRECISION="tf32" if prerounded else launch.dot_precision(dtype),
    )


def plan(x: Tensor, weight: Tensor, bias: Optional[Tensor], class_weight: Optional[Tensor],
         opts: CrossEntropyOptions, *, budget: int, need_grad: bool, need_argmax: bool,
         grad_in_forward: bool = False, need_dw: bool = True, cute: bool = True,
         kept_owned: bool = True) -> LinearPlan:
    """The plan of one call (``planning.plans.LinearPlan``), made once by the forward custom
    op and used by everything after it. ``grad_in_forward``: the caller allows that
    strategy (eager; the planner decides). ``kept_owned``: the backward may overwrite the
    kept columns (``planning.plans.triton_plan``). ``cute=False``: no CuTe choice (the fake
    implementation: it needs the tensors' memory). ``need_dw``: the contract's (unused here).
    Memoised (``_plan``) by what it reads of the tensors: shapes, dtypes, device, and for the
    CuTe choice their layout (what ``cute_planning.layout_fits`` reads)."""
    n, h = x.shape
    layout = (x.dtype == weight.dtype, x.stride(), weight.stride(), x.data_ptr() % 16,
              weight.data_ptr() % 16) if cute else None
    return _plan(n, weight.shape[0], h, x.dtype, weight.dtype == torch.float32, x.device, budget,
                 launch.tf32_prerounded(x.dtype), opts.softcap, opts.reduction != "none", opts.needs_smooth_sum,
                 bias is not None, class_weight is not None, need_grad, need_argmax, grad_in_forward, layout,
                 kept_owned)


@memoised
def _plan(n: int, v: int, h: int, dtype: torch.dtype, weight_fp32: bool, device, budget: int, prerounded: bool,
          softcap: Optional[float], reduces: bool, need_smooth: bool, has_bias: bool, weighted: bool,
          need_grad: bool, need_argmax: bool, grad_in_forward: bool, layout: Optional[tuple],
          kept_owned: bool = True) -> LinearPlan:
    """``plan`` from its tensors' facts (``layout``: None for no CuTe choice)."""
    keep = _keep_allowed(dtype, softcap, need_grad)
    p = linear_plan(n, v, h, dtype.itemsize, budget, device, keep_allowed=keep, prerounded=prerounded,
                    grad_in_forward=grad_in_forward and keep and reduces, weight_fp32=weight_fp32,
                    kept_owned=kept_owned)
    if layout is None:
        return p
    def cute_plan(rows: int, row0: int, keep_cols: int, keep_block: int):
        return cute_planning.forward_plan(device, dtype, rows, v, h, cute_planning.layout_fits(layout, h, dtype, row0),
                                          keep_cols=keep_cols, keep_block=keep_block, bias=has_bias,
                                          softcap=softcap is not None, need_argmax=need_argmax,
                                          weighted_smooth=need_smooth and weighted)

    if p.grad_in_forward:  # each chunk's forward (keeps every column)
        chunk_cute = cute_plan(min(n, p.grad_in_forward), 0, v, p.chunk.block_v)
        tail_cute = None
        if p.tail is not None:
            row0 = n - n % p.grad_in_forward
            tail_cute = cute_plan(n - row0, row0, v, p.tail.block_v)
        if chunk_cute is None and tail_cute is None:
            return p
        return replace(p, chunk_cute=chunk_cute, tail_cute=tail_cute)
    # Hopper + the CuTe DSL: the warp-specialised kernel computes the same partials (``planning.cute``).
    c = cute_plan(n, 0, p.forward.keep_cols if p.keeps else 0, p.forward.block_v)
    return p if c is None else replace(p, cute=c)


def kept_shapes(plan: Optional[LinearPlan], n: int):
    """Shapes of the tensors ``forward`` keeps for the backward under ``plan`` (the custom
    op's fake implementation uses them), or None when it keeps nothing."""
    if plan is None or not plan.keeps or plan.grad_in_forward:
        return None
    return launch.kept_shapes_of(plan.forward, n)


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, class_weight: Optional[Tensor],
            softcap: Optional[float], *, need_smooth: bool, need_argmax: bool, plan: LinearPlan,
            budget: Optional[int] = None, loss_opts: Optional[CrossEntropyOptions] = None):
    """Under the call's ``plan`` (``budget``: planned already), returns (TokenStats,
    kept): kept is None or (buffer, tile maxima) of the ``kept_shapes`` shapes, which
    ``backward`` turns into dz (so it can use them once). With ``loss_opts`` (N > 0):
    (TokenStats with lse and argmax only, kept, loss, w_t), the split merge, per-token loss and reduction in one launch
    (``ce_epilogue.forward_loss``)."""
    return forward_launches(x, weight, bias, target, class_weight, softcap, need_smooth=need_smooth,
                            need_argmax=need_argmax, tiles=plan.forward, keep=plan.keeps, cute=plan.cute,
                            loss_opts=loss_opts)


def forward_launches(x, weight, bias, target, class_weight, softcap, *, need_smooth: bool, need_argmax: bool,
                     tiles: TritonPlan, keep: bool, cute, loss_opts: Optional[CrossEntropyOptions] = None):
    """``forward`` on one ``TritonPlan`` (``tiles``; ``keep``: keep its ``keep_cols``
    columns) and CuTe plan (or None): also each token chunk of the gradient-in-forward
    strategy (``triton_grad_in_forward``)."""
    plan = tiles
    n, h = x.shape
    v = weight.shape[0]
    keep_cols = plan.keep_cols if keep else 0
    if cute is not None:  # compiles and launches once per configuration, else Triton (one warning)
        from logitless.cute_lib import launch as cute_launch

        cute = cute_launch.ready(cute, x, weight, smooth=need_smooth,
                                 keep_block=plan.block_v if cdiv(keep_cols, plan.block_v) else 0)
    splits = cute.splits if cute is not None else plan.vocab_splits
    blocks_per_split = cdiv(cdiv(v, plan.block_v), splits)
    # One allocation for the partial statistics (max, sum, target logit, then smoothing
    # sum and the argmax pair when asked for); absent ones alias part_max (never read).
    parts = launch.partials(3 + need_smooth + 2 * need_argmax, splits, n, x.device)
    part_max, part_sum, part_tgt = parts[:3]
    part_smooth = parts[3] if need_smooth else part_max
    part_best, part_arg = (parts[-2], parts[-1].view(torch.int32)) if need_argmax else (part_max, part_max)
    keep_blocks = cdiv(keep_cols, plan.block_v)
    keep_view = keep_max = None
    prerounded = launch.runs_prerounded(plan, x.dtype)
    # fp32 at "high": x rounded to TF32 once, W chunk by chunk (launches over whole splits).
    use_tma, steps = launch.forward_launches(x, weight, plan, prerounded) if cute is None else (False, ())
    keep_op = None
    if keep_blocks:
        keep_buf, keep_view, keep_max, keep_op = launch.keep_buffers(plan, n, x, use_tma)
    if cute is not None:  # (kept columns in the same buffers, as the Triton kernel keeps them)
        cute_launch.forward_partials("linear_cross_entropy", x, weight, target, (part_max, part_sum, part_tgt),
                                     splits, smooth=part_smooth if need_smooth else None,
                                     stages=cute.stages, specialised=cute.specialised, group=cute.group,
                                     keep=(keep_view, keep_max, plan.block_v) if keep_view is not None else None)
    row_blocks = cdiv(n, plan.block_n)
    flags = _flags(bias, class_weight, softcap, x.dtype, prerounded)
    for step in steps:
        x_op, w_op, xr, w_rows, launch_splits, extra = step()
        launch.run_kernel(
            K.forward_stats_kernel, (row_blocks * launch_splits,),
            x_op, w_op, bias if bias is not None else x, class_weight if class_weight is not None else x,
            target, part_max, part_sum, part_tgt, part_smooth, part_best, part_arg,
            keep_op if keep_view is not None else x, keep_max if keep_max is not None else x,
            n, v, h, xr.stride(0), xr.stride(1), w_rows.stride(0), w_rows.stride(1),
            keep_view.stride(0) if keep_view is not None else 0,
            blocks_per_split, keep_blocks, float(softcap or 1.0), launch_splits, plan.group_n or row_blocks,
            NEED_SMOOTH=need_smooth, NEED_ARGMAX=need_argmax, KEEP=keep_view is not None, USE_TMA=use_tma,
            FLATTEN=plan.flatten, **flags,
            BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, BLOCK_H=plan.block_h,
            num_warps=plan.num_warps, num_stages=plan.num_stages,
            **extra,
        )
    kept = (keep_buf, keep_max) if keep_view is not None else None
    if loss_opts is not None:
        lse, loss, w_t = ce_epilogue.forward_loss(part_max, part_sum, part_tgt, part_smooth if need_smooth else None,
                                                  target, class_weight, loss_opts, v)
        argmax = _merge_argmax(part_best, part_arg) if need_argmax else None
        return TokenStats(lse=lse, target_logit=None, smooth_sum=None, argmax=argmax), kept, loss, w_t
    # Merge the splits: lse = M + log sum_j s_j exp(m_j - M). max() propagates NaN.
    big_m = part_max.max(dim=0).values
    m_safe = torch.where(big_m == float("-inf"), torch.zeros_like(big_m), big_m)
    lse = m_safe + torch.log((part_sum * torch.exp(part_max - m_safe)).sum(dim=0))
    stats = TokenStats(
        lse=lse,
        target_logit=part_tgt.sum(dim=0),
        smooth_sum=part_smooth.sum(dim=0) if need_smooth else None,
        argmax=_merge_argmax(part_best, part_arg) if need_argmax else None,
    )
    return stats, kept


def _merge_argmax(part_best: Tensor, part_arg: Tensor) -> Tensor:
    first = part_best.argmax(dim=0, keepdim=True)  # first split holding the maximum
    return part_arg.gather(0, first)[0].long()


def grad_coefficients(grad_loss: Tensor, grad_lse: Optional[Tensor], lse: Tensor, w_t: Tensor, target: Tensor,
                      class_weight: Optional[Tensor], opts: CrossEntropyOptions, num_classes: int) -> Tensor:
    """The backward's (3, N) A, B, C in one launch (``ce_epilogue.grad_coefficients``)."""
    return ce_epilogue.grad_coefficients(grad_loss, grad_lse, lse, w_t, target, class_weight, opts, num_classes)


def _keep_allowed(dtype: torch.dtype, softcap: Optional[float], need_grad: bool) -> bool:
    # fp16 cannot hold exp(z - m) down to exp(-2 * softcap): recompute those instead.
    return need_grad and not (dtype == torch.float16 and softcap is not None)


class TritonBackend(TritonKind):
    """backend="triton" (``contract.LceBackend``): its Config is the call's
    ``planning.plans.LinearPlan`` (tiles, kept columns, the gradient-in-forward chunk, the
    CuTe choice). ``grad_in_forward``: the strategy that runs when the Config chose it
    (``triton_grad_in_forward.forward_with_grad``, given by the table in ``api``)."""


    def __init__(self, grad_in_forward: Callable):
        self.grad_in_forward = grad_in_forward


    plan = staticmethod(plan)
    kept_shapes = staticmethod(kept_shapes)
    grad_coefficients = staticmethod(grad_coefficients)

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                class_weight: Optional[Tensor], opts: CrossEntropyOptions, config: LinearPlan, *,
                need_argmax: bool, loss: bool = True, need_dx: bool = False, need_dw: bool = False,
                need_db: bool = False) -> LceForward:
        need_smooth = opts.needs_smooth_sum
        if config.grad_in_forward:  # the loss from the formulas, the gradients for a unit upstream one
            stats, grads = self.grad_in_forward(x, weight, bias, target, class_weight, opts, plan=config,
                                                need_smooth=need_smooth, need_argmax=need_argmax, need_dx=need_dx,
                                                need_dw=need_dw, need_db=need_db)
            loss_tok, w_t = token_loss(stats, target, weight.shape[0], class_weight, opts)
            return LceForward(stats, reduce(loss_tok, w_t, opts.reduction), w_t, None, grads)
        if not loss:
            stats, kept = forward_launches(x, weight, bias, target, class_weight, opts.softcap, need_smooth=need_smooth,
                                           need_argmax=need_argmax, tiles=config.forward, keep=config.keeps,
                                           cute=config.cute)
            return LceForward(stats, None, None, kept)
        stats, kept, out, w_t = forward_launches(x, weight, bias, target, class_weight, opts.softcap,
                                                 need_smooth=need_smooth, need_argmax=need_argmax,
                                                 tiles=config.forward, keep=config.keeps, cute=config.cute,
                                                 loss_opts=opts)
        return LceForward(stats, out, w_t, kept)

    def backward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                 class_weight: Optional[Tensor], softcap: Optional[float], lse: Tensor, coef: Tensor,
                 config: LinearPlan, *, kept: Optional[Kept], need_dx: bool, need_dw: bool,
                 need_db: bool, dx_acc: bool = False):
        """dx, dW, db under the call's Config. ``kept``: what ``forward`` returned for this
        call and where their dz goes (or None); pass them to one backward only. ``dx_acc``:
        dx as the fp32 accumulator (also for one chunk), not cast to x's dtype (a partial
        sum that the caller reduces first: vocab parallelism)."""
        n, h = x.shape
        v = weight.shape[0]
        # The forward's tiles when it kept columns (they are laid out by them), else the backward's.
        plan = config.forward if kept is not None else config.backward
        coef = coef.contiguous()
        cw_arg = class_weight if class_weight is not None else x
        prerounded = launch.runs_prerounded(plan, x.dtype)  # reads the fp32 matmul precision once
        flags = _flags(bias, class_weight, softcap, x.dtype, prerounded)
        kernels = launch.DlogitsKernels(
            kept_kernel=K.kept_dlogits_kernel, kept_head=(cw_arg, target, lse, coef, n, v),
            kept_tail=(float(softcap or 1.0),),
            kept_flags=dict(HAS_SOFTCAP=softcap is not None, HAS_CW=class_weight is not None),
            kept_log=softcap is not None,
            kernel=K.dlogits_kernel, inputs=(bias if bias is not None else x, cw_arg, target, lse, coef),
            scalars=(float(softcap or 1.0),), flags=flags, prerounded=prerounded,
        )
        return launch.chunked_backward(x, weight, bias, plan, kept, kernels, need_dx=need_dx, need_dw=need_dw,
                                       need_db=need_db, dx_acc=dx_acc)
