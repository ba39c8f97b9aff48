"""Triton backend of linear_jsd (CUDA tensors; CPU under TRITON_INTERPRET=1).

GEMM count, against the floor of four (student logits, teacher logits, student dx,
student dW), in units where a GEMM over H costs H:

forward  (2 GEMMs): the KL limits (beta 0 or 1) on 16-bit inputs, where the cost model
         says so (``TritonConfig.fused``): one fused kernel (``jsd_kl_forward_kernel``)
         computes both heads' logits tiles and their online row statistics for a split
         of the vocabulary per program, nothing (N, V)-sized in memory;
         ``jsd_rows.finish_kl_partials`` merges the splits. Otherwise, for each chunk of ``plan.forward_rows``
         tokens (a multiple of 8: each chunk's GEMMs read both weights once), cuBLAS writes both heads' fp32
         logits (rows x V each, the budget's size), then ``jsd_rows.row_stats`` (shared
         with ``jsd``; each row split over several programs when the rows are few,
         ``logits.jsd_stats_plan``) reduces them to the (6, N) row statistics: lse of
         both, S = KL(p || m), K = KL(q || m), lse at T = 1 and the target logit. Full
         rows are needed because S enters every element's gradient.
backward (4 GEMMs): for each chunk [v0, v1) of ``plan.vocab_chunk`` columns,
         ``jsd_dlogits_kernel`` recomputes both heads' tiles (fused, in registers) and
         writes dz in the input dtype; then dW_s[v0:v1] = dz^T x_s, db_s = column sums
         (fp32), dx_s += dz W_s[v0:v1] into an fp32 (N, H_s) accumulator (cuBLAS).
Total: 2 (H_s + H_t) + 2 H_s against the floor 3 H_s + H_t: 1.5x for equal hidden
sizes, 1.6x for a teacher twice as wide. No (N, V) tensor beyond the budget's chunks,
no atomics (bitwise repeatable), no host syncs. Where a backward follows ("mean"/"sum",
one device) the planner (``cost_model``) may pick instead "keep": each forward chunk also
writes dz of the first ``TritonConfig.keep_cols`` columns (``jsd_rows.dz_rows``, from the
fp32 logits it holds; every column where the budget holds N V input-dtype elements beside
the chunk: the default budget on an H100 does at 4096 tokens), and the backward runs only
their dW and dx GEMMs (grad_output applied to x's rows, the fp32 dx and db), recomputing
the rest as above: 4 GEMMs with every column kept. In eager mode also the
gradient-in-forward strategy (``triton_grad_in_forward``: 4 GEMMs, an fp32 dW accumulator).
fp32 at matmul precision "high" (``launch.tf32_prerounded``): the backward rounds both
x's to TF32 once and each chunk's rows of both weights into scratch buffers
(``launch.prerounded_dlogits_operands``; budgeted by ``linear_jsd_plan``), and the
kernel multiplies those TF32-exact operands with DOT_PRECISION "tf32" (the products of
rounding in registers, with TMA loads straight into the tensor cores). The forward's
and the dx/dW GEMMs are cuBLAS, which rounds at "high" itself. The loss epilogue and
the upstream gradient are one launch each (``triton_lib.jsd_epilogue``).
Vocabulary parallelism (``vocab_parallel``) also calls ``column_sums``: its second pass
for 0 < beta < 1 (the divergence sums of this rank's columns with the merged lse's).
Every chunk, tile and choice comes from the call's Config (``plan``, memoised: once per
call, by the forward custom op).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import apply_softcap
from logitless.ops.common.contract import TritonKind
from logitless.options import JSDOptions
from logitless.planning.logits import jsd_stats_plan
from logitless.planning.memo import memoised
from logitless.triton_lib import launch
from logitless.triton_lib import linear_jsd_kernels as K
from logitless.triton_lib.jsd_epilogue import forward_loss, upstream
from logitless.triton_lib.jsd_rows import PARTS, divergence_sums, dz_rows, finish_kl_partials, row_stats, scalar_args

from .contract import LjsdForward, TritonConfig
from .planning import LinearJSDPlan, jsd_kl_fused, linear_jsd_plan, linear_jsd_strategy


def _operands(xs, ws, xt, wt, tiles):
    """(xs, ws, xt, wt as the kernels take them, use_tma): TMA descriptors for both heads
    when both allow them, else the plain tensors for both."""
    xs_op, ws_op, tma_s = launch.operands(xs, ws, tiles)
    xt_op, wt_op, tma_t = launch.operands(xt, wt, tiles)
    if tma_s and tma_t:
        return xs_op, ws_op, xt_op, wt_op, True
    return xs, ws, xt, wt, False


@memoised
def plan(n: int, v: int, hidden_s: int, hidden_t: int, dtype: torch.dtype, budget: int, device, *, kl: bool,
         grad_in_forward: bool, keep: bool = False) -> TritonConfig:
    """The Config of a call (``contract.TritonConfig``) of n > 0 tokens; ``kl``: beta is 0 or 1.
    The fused forward: only the KL limits (every statistic is an online sum) on 16-bit
    inputs (fp32 keeps cuBLAS, which rounds to TF32 at "high" itself), and there where
    ``planning.jsd_kl_fused`` says (the cost model: where the chunks' GEMMs would be
    weight-read-bound; ``override(jsd_fused_forward=...)``). ``grad_in_forward``, ``keep``: the
    caller allows that strategy, which ``planning.linear_jsd_strategy`` picks or not (the
    recompute plan priced with the forward it would run)."""
    isz = dtype.itemsize
    forward = linear_jsd_plan(n, v, hidden_s, isz, budget, device)
    backward = linear_jsd_plan(n, v, hidden_s, isz, budget, device, hidden_t=hidden_t,
                               prerounded=launch.tf32_prerounded(dtype))
    fused = kl and dtype in (torch.bfloat16, torch.float16) and jsd_kl_fused(n, v, hidden_s, hidden_t, isz, budget,
                                                                             device)
    chunk = keep_cols = 0
    if grad_in_forward or keep:
        c = linear_jsd_strategy(n, v, hidden_s, hidden_t, isz, budget, device, weight_fp32=dtype == torch.float32,
                                fused_forward=fused, grad_in_forward=grad_in_forward, keep=keep)
        chunk = min(c.token_chunk, n) if c.strategy == "grad_in_forward" and grad_in_forward else 0
        if c.strategy == "keep" and keep:
            # The chunked forward writes the kept columns' dz: its chunk is the strategy's, the
            # backward's recomputed chunks take what the kept columns leave of the budget.
            keep_cols, fused = min(c.keep_cols, v), False
            forward = replace(forward, forward_rows=min(c.token_chunk, n))
            backward = linear_jsd_plan(n, v, hidden_s, isz, max(0, budget - isz * n * keep_cols), device,
                                       hidden_t=hidden_t, prerounded=launch.tf32_prerounded(dtype))
    rows = chunk or forward.forward_rows  # (the statistics' launches: per chunk of rows, the last one shorter)
    tail = n % rows
    return TritonConfig(forward, backward, jsd_stats_plan(rows, v, 4, device),
                        jsd_stats_plan(tail, v, 4, device) if tail else None, fused=fused, grad_in_forward=chunk,
                        keep_cols=keep_cols)


def _forward(xs, ws, bs, xt, wt, bt, target, opts: JSDOptions, config: TritonConfig,
             reduction: Optional[str]) -> tuple[Tensor, Optional[Tensor]]:
    """(6, N) fp32 statistics: the fused forward, or cuBLAS chunks of both heads' logits;
    and the kept dz columns (``config.keep_cols`` of them: the "keep" strategy, for the
    upstream gradient of ``reduction`` at grad_output = 1), or None."""
    if config.fused:
        return _forward_fused(xs, ws, bs, xt, wt, bt, target, opts, config.forward), None
    rows = config.forward.forward_rows
    stats = torch.empty(6, xs.shape[0], dtype=torch.float32, device=xs.device)
    keep = g = None
    if config.keep_cols:
        assert reduction is not None  # (the strategy is allowed for a reduced loss only)
        keep = launch.padded_buffer(xs.shape[0], launch.cdiv(config.keep_cols, 8) * 8, xs)  # (rows of 16 bytes)
        g = upstream(None, target, opts.ignore_index, reduction)
    for n0, n1, zs, zt in launch.head_logit_chunks(xs, ws, bs, xt, wt, bt, rows):
        # the statistics' launches for fp32 logits of the chunk's rows (rows split when few),
        # written in place into columns [n0, n1) of the statistics
        chunk_stats = stats[:, n0:n1]
        plan = config.stats if n1 - n0 == rows else config.tail_stats
        assert plan is not None  # (a Config plans its tail's statistics)
        row_stats(zs, zt, target[n0:n1], chunk_stats, opts, plan)
        if keep is not None and g is not None:
            dz_rows(zs, zt, keep[n0:n1, : config.keep_cols], target[n0:n1], chunk_stats, g[n0:n1], opts, plan)
    return stats, keep


def column_sums(xs, ws, bs, xt, wt, bt, target, lse_s, lse_t, opts: JSDOptions, config: TritonConfig) -> Tensor:
    """(3, N) fp32: S, K and the student's soft-capped logit at ``target``
    (0 where the target is not among these columns), summed over these columns only, with
    GIVEN log-sum-exps of the full rows (vocabulary parallelism's second pass: the merged
    lse's of all ranks). Per chunk of the forward's rows: both heads' fp32 logits by
    cuBLAS (the chunked forward's buffers and GEMMs), then one sweep of the split
    statistics' phase-2 kernel with those lse's (``jsd_rows.divergence_sums``)."""
    n, v = xs.shape[0], ws.shape[0]
    out = torch.zeros(3, n, dtype=torch.float32, device=xs.device)
    if v == 0 or n == 0:
        return out
    rows = config.forward.forward_rows
    lse_s, lse_t = lse_s.float(), lse_t.float()
    for n0, n1, zs, zt in launch.head_logit_chunks(xs, ws, bs, xt, wt, bt, rows):
        out[:2, n0:n1] = divergence_sums(zs, zt, lse_s[n0:n1], lse_t[n0:n1], opts,
                                         config.stats if n1 - n0 == rows else config.tail_stats)
        t = target[n0:n1]
        held = (t >= 0) & (t < v)
        z_t = apply_softcap(zs.gather(1, torch.where(held, t, torch.zeros_like(t))[:, None])[:, 0],
                            opts.student_softcap)
        out[2, n0:n1] = torch.where(held, z_t, torch.zeros_like(z_t))
    return out


def _forward_fused(xs, ws, bs, xt, wt, bt, target, opts: JSDOptions, plan: LinearJSDPlan) -> Tensor:
    """The KL limits' statistics (6, N) from one fused launch and the splits' merge.
    Temporary memory: 7 floats per token and split (plus one per token)."""
    n, v = xs.shape[0], ws.shape[0]
    tiles = plan.tiles
    splits = tiles.vocab_splits
    part = torch.empty(PARTS, splits, n, dtype=torch.float32, device=xs.device)
    z_target = torch.empty(n, dtype=torch.float32, device=xs.device)
    stats = torch.empty(6, n, dtype=torch.float32, device=xs.device)
    target = target.contiguous()
    xs_op, ws_op, xt_op, wt_op, use_tma = _operands(xs, ws, xt, wt, tiles)
    sargs = scalar_args(opts)
    row_blocks = launch.cdiv(n, tiles.block_n)
    launch.run_kernel(
        K.jsd_kl_forward_kernel, (row_blocks * splits,),
        xs_op, ws_op, bs if bs is not None else xs, xt_op, wt_op, bt if bt is not None else xt, target, part, z_target,
        n, v, xs.shape[1], xt.shape[1], xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1),
        xt.stride(0), xt.stride(1), wt.stride(0), wt.stride(1),
        plan.blocks_per_split, splits, tiles.group_n or row_blocks, sargs["inv_t"], sargs["cap_s"], sargs["cap_t"],
        MODE=sargs["MODE"], HAS_HARD=sargs["HAS_HARD"], HAS_CAP_S=sargs["HAS_CAP_S"], HAS_CAP_T=sargs["HAS_CAP_T"],
        HAS_BIAS_S=bs is not None, HAS_BIAS_T=bt is not None,
        DOT_PRECISION=launch.dot_precision(xs.dtype), USE_TMA=use_tma,
        BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    finish_kl_partials(part, z_target, target, stats, opts, v)
    return stats


def backward(g, xs, ws, bs, xt, wt, bt, target, stats, opts: JSDOptions, config: TritonConfig, *,
             need_dx: bool, need_dw: bool, need_db: bool, dx_acc: bool = False,
             kept: Optional[tuple[Tensor, Tensor]] = None):
    """dx, dW, db of the student; ``dx_acc``: dx as the fp32 accumulator, not cast
    (a partial sum that the caller reduces first: vocab parallelism); ``kept``: (the
    forward's kept columns, grad_output) of the "keep" strategy: dz of columns [0,
    config.keep_cols) for grad_output = 1. Their GEMMs run first, grad_output applied to
    what is small: x's rows for dW (exact at 1), dx in fp32, db; the chunks of
    ``config.backward`` recompute the other columns."""
    n, h = xs.shape
    v = ws.shape[0]
    plan = config.backward
    tiles = plan.tiles
    # fp32 at "high": both x's rounded to TF32 once, each chunk's rows of both weights
    # (scratch buffers; the kernel then multiplies TF32-exact operands with "tf32").
    prerounded = launch.runs_prerounded(tiles, xs.dtype)
    if prerounded:
        round_s = launch.prerounded_dlogits_operands(xs, ws, tiles, 0)
        round_t = launch.prerounded_dlogits_operands(xt, wt, tiles, 0)
    g = g.float().contiguous()
    stats = stats.float().contiguous()
    target = target.contiguous()
    k = config.keep_cols if kept is not None else 0
    chunks = [(v0, min(v, v0 + plan.vocab_chunk)) for v0 in range(k, v, plan.vocab_chunk)]
    # (with kept columns dx always has an fp32 accumulator: grad_output scales it there)
    dw, db, dx_sum = launch.gradient_buffers(xs, ws, bs, len(chunks), need_dx=need_dx, need_dw=need_dw,
                                             need_db=need_db, keep_acc=dx_acc or k > 0)
    dx = None
    if kept is not None and k:
        dz, scale = kept[0][:, :k], kept[1].float()
        if dw is not None:
            torch.mm(dz.T, (xs.float() * scale).to(xs.dtype), out=dw[:k])
        if db is not None:
            db[:k].copy_(dz.sum(dim=0, dtype=torch.float32) * scale)
        if dx_sum is not None:
            launch.dx_accumulate(dx_sum, dz, ws[:k])
            dx_sum.mul_(scale)
    if not chunks:
        return launch.finished_dx(dx, dx_sum, dx_acc, xs.dtype), dw, db
    dz_buf = torch.empty(n, min(plan.vocab_chunk, v - k), dtype=xs.dtype, device=xs.device)
    xs_op, ws_op, xt_op, wt_op, use_tma = _operands(xs, ws, xt, wt, tiles)
    sargs = scalar_args(opts)
    dot_precision = "tf32" if prerounded else launch.dot_precision(xs.dtype)
    for v0, v1 in chunks:
        dz = dz_buf[:, : v1 - v0]
        row_blocks = launch.cdiv(n, tiles.block_n)
        grid = (row_blocks * launch.cdiv(v1 - v0, tiles.block_v),)
        a_s, a_ws, a_t, a_wt = xs, ws, xt, wt  # (for the strides)
        if prerounded:
            xs_op, ws_op, tma_s, a_s, a_ws = round_s(v0, v1)
            xt_op, wt_op, tma_t, a_t, a_wt = round_t(v0, v1)
            use_tma = tma_s and tma_t
            if not use_tma:
                xs_op, ws_op, xt_op, wt_op = a_s, a_ws, a_t, a_wt
        launch.run_kernel(
            K.jsd_dlogits_kernel, grid,
            xs_op, ws_op, bs if bs is not None else xs, xt_op, wt_op, bt if bt is not None else xt,
            target, stats, g, dz,
            n, v, h, xt.shape[1], a_s.stride(0), a_s.stride(1), a_ws.stride(0), a_ws.stride(1),
            a_t.stride(0), a_t.stride(1), a_wt.stride(0), a_wt.stride(1), dz.stride(0),
            v0, v1, wp=opts.weights[1], hlw=opts.hard_label_weight, **sargs, group_n=tiles.group_n or row_blocks,
            HAS_BIAS_S=bs is not None, HAS_BIAS_T=bt is not None,
            DOT_PRECISION=dot_precision, USE_TMA=use_tma,
            BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, W_CHUNK=prerounded,
        )
        dx_chunk = launch.chunk_gradients(
            dz, xs, ws[v0:v1], dw[v0:v1] if need_dw else None, db[v0:v1] if need_db else None,
            dx_sum, need_dx)
        if dx_chunk is not None:
            dx = dx_chunk
    return launch.finished_dx(dx, dx_sum, dx_acc, xs.dtype), dw, db


class TritonBackend(TritonKind):
    """backend="triton" (``contract.LjsdBackend``): its Config (``TritonConfig``) holds the
    chunks and tiles of the call, the fused forward's choice and the gradient-in-forward
    chunk. ``grad_in_forward`` (the capability of ``contract.LjsdBackend``): the strategy
    that runs when the Config chose it (``triton_grad_in_forward.forward_with_grad``, given
    by the table in ``api``)."""


    def __init__(self, grad_in_forward: Callable):
        self.grad_in_forward = grad_in_forward


    def plan(self, xs: Tensor, ws: Tensor, xt: Tensor, opts: JSDOptions, *, budget: int,
             grad_in_forward: bool = False, keep: bool = False, column_sums: bool = False) -> TritonConfig:
        return plan(xs.shape[0], ws.shape[0], xs.shape[1], xt.shape[1], xs.dtype, budget, xs.device,
                    kl=opts.beta in (0.0, 1.0), grad_in_forward=grad_in_forward, keep=keep)

    def forward(self, xs, ws, bs, xt, wt, bt, target, opts: JSDOptions, config: TritonConfig, *,
                reduction: Optional[str] = None, need_dx: bool = False, need_dw: bool = False,
                need_db: bool = False) -> LjsdForward:
        """The statistics, the loss (one launch, ``jsd_epilogue``) and, when the Config chose
        the gradient-in-forward strategy, the student's gradients for a unit upstream one;
        when it chose "keep", the kept dz columns."""
        grads = kept = None
        if config.grad_in_forward:
            stats, grads = self.grad_in_forward(xs, ws, bs, xt, wt, bt, target, opts, reduction, config=config,
                                                need_dx=need_dx, need_dw=need_dw, need_db=need_db)
        else:
            stats, kept = _forward(xs, ws, bs, xt, wt, bt, target, opts, config, reduction)
        loss = forward_loss(stats, target, ws.shape[0], opts, reduction) if reduction else None
        return LjsdForward(stats, loss, grads, kept)

    upstream = staticmethod(upstream)
    backward = staticmethod(backward)
    column_sums = staticmethod(column_sums)
