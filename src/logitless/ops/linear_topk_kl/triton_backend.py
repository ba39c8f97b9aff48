"""Triton backend of linear_topk_kl (CUDA tensors; CPU under TRITON_INTERPRET=1).

forward  (1 GEMM): ``topk_forward_kernel`` over (row blocks x vocabulary splits): the fused
         GEMM + online log-sum-exp of ``linear_cross_entropy`` with the teacher's ids
         masked out of the sum (exact tail) and their logits gathered in the same tiles;
         O(N * splits) partials merged here (``formulas.common.merge_splits``). When a
         backward follows it keeps exp(a - m) of the leading ``keep_cols`` columns the
         budget holds, as ``linear_cross_entropy``.
backward (2 GEMMs + 1 per recomputed column): the kept columns become the dense dz in place
         (``topk_kept_dlogits_kernel``), the others are recomputed chunk by chunk
         (``topk_dlogits_kernel``); in each chunk ``topk_patch_kernel`` writes the values at
         the ids; then dW, db and dx of the chunk as cross-entropy's
         (``triton_lib.launch.chunked_backward``).
One plan per call (``contract.TritonConfig``): ``planning.plans.linear_plan`` (cross-entropy's
tiles, splits, kept columns and chunks under the budget rule) and the forward's id slots
(``id_slots``), made by the forward custom op and followed by the backward. No CuTe
forward (its kernel has no id mask). No (N, V) tensor unless the budget allows it; no
atomics; no host syncs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
from torch import Tensor

from logitless.formulas.common import merge_splits
from logitless.formulas.topk_kl import TopKStats
from logitless.ops.common.contract import TritonKind
from logitless.options import TopKKLOptions
from logitless.planning.plans import linear_plan
from logitless.triton_lib import launch
from logitless.triton_lib import topk_kl_kernels as K
from logitless.triton_lib.launch import cdiv

from .contract import TopKForward, TritonConfig

#: exp(a - m) stays a normal bf16/fp32 number down to a - m = -87; with a soft-cap s,
#: a - m >= -2 s / T, and the kept columns need z back from log(e): keep only then.
_MAX_CAP_RANGE = 80.0
#: The patch kernel's rows and ids per step.
PATCH = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4)


def keep_allowed(dtype: torch.dtype, opts: TopKKLOptions, need_grad: bool) -> bool:
    """Whether the forward may keep exp(a - m) for the backward: not where z must come back
    from log(e) and e may underflow (fp16; a wide soft-cap range)."""
    if not need_grad:
        return False
    needs_z = opts.softcap is not None or opts.hard_at_other_temperature
    if dtype == torch.float16 and needs_z:
        return False
    return not (opts.softcap is not None and 2.0 * opts.softcap / opts.temperature > _MAX_CAP_RANGE)


#: The forward's id slots per row and tile it may unroll, and the cost model that picks one
#: (``id_slots``), in shares of a forward, from H100 runs at 8192 x 4096 x 128256 / 151936
#: (docs/design.md, "Top-k distillation"): a slot ~5% (its passes over the tile and the
#: registers they take: 4 slots spilled, 1.46-1.89x a GEMM), a program sent to the retry
#: pass ~2.5x its share (its fast pass is wasted, the loop kernel is not pipelined).
SLOTS = (1, 2, 3)
SLOT_COST = 0.05
RETRY_COST = 2.5


def id_slots(k: int, v: int, block_n: int, block_v: int, blocks_per_split: int) -> int:
    """The forward's unrolled id slots per row and tile: the count of ``SLOTS`` with the least
    predicted cost, slots x SLOT_COST + the share of programs retried x RETRY_COST, when K
    ids are spread uniformly over V columns (Poisson, mean K block_v / V per row and tile;
    a program covers block_n rows x blocks_per_split tiles). 2 at K = 20 of 128256 (2% of
    the programs retried), 3 at K = 100 (~10%). Ids that cluster (a teacher's top-k among
    frequent tokens) send more programs to the retry pass: correct, slower."""
    lam = k * block_v / max(v, 1)
    pairs = block_n * blocks_per_split
    best, best_cost = SLOTS[-1], math.inf
    term = cdf = math.exp(-lam)
    j = 0
    for slots in SLOTS:
        while j < slots:
            j += 1
            term *= lam / j
            cdf += term
        retried = 1.0 - (1.0 - max(0.0, 1.0 - cdf)) ** pairs
        cost = slots * SLOT_COST + retried * RETRY_COST
        if cost < best_cost:
            best, best_cost = slots, cost
    return best


def _flags(bias, opts: TopKKLOptions, dtype, prerounded=False):
    return dict(HAS_BIAS=bias is not None, HAS_SOFTCAP=opts.softcap is not None, HAS_HARD=opts.hard,
                HARD_T=opts.hard_at_other_temperature,
                DOT_PRECISION="tf32" if prerounded else launch.dot_precision(dtype))


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, target: Tensor, opts: TopKKLOptions,
            config: TritonConfig) -> TopKForward:
    linear = config.linear
    plan = linear.forward
    n, h = x.shape
    v = weight.shape[0]
    k = ids.shape[1]
    hard_t = opts.hard_at_other_temperature
    ids32 = ids.to(torch.int32).contiguous()
    z_ids = torch.zeros(n, k, dtype=torch.float32, device=x.device)
    splits = plan.vocab_splits
    vocab_blocks = cdiv(v, plan.block_v)
    blocks_per_split = cdiv(vocab_blocks, splits)
    table = torch.empty(n, vocab_blocks + 1, dtype=torch.int32, device=x.device)
    launch.run_kernel(K.id_blocks_kernel, (n,), ids32, table, k, vocab_blocks, BLOCK_V=plan.block_v,
                      BLOCK_K=triton.next_power_of_2(max(k, 1)), BINS=triton.next_power_of_2(vocab_blocks + 2),
                      num_warps=4)
    parts = launch.partials(3 + 2 * hard_t, splits, n, x.device)
    part_max, part_sum, part_tgt = parts[:3]
    part_max1, part_sum1 = (parts[3], parts[4]) if hard_t else (part_max, part_sum)
    keep_cols = plan.keep_cols if linear.keeps else 0
    keep_blocks = cdiv(keep_cols, plan.block_v)
    prerounded = launch.runs_prerounded(plan, x.dtype)
    use_tma, steps = launch.forward_launches(x, weight, plan, prerounded)
    keep = keep_max = keep_buf = None
    keep_op = x
    if keep_blocks:
        keep_buf, keep, keep_max, keep_op = launch.keep_buffers(plan, n, x, use_tma)
    row_blocks = cdiv(n, plan.block_n)
    flags = _flags(bias, opts, x.dtype, prerounded)
    overflow = torch.empty(row_blocks * splits, dtype=torch.int32, device=x.device)  # (the fast pass writes each)
    for step in steps:
        x_op, w_op, xr, w_rows, launch_splits, extra = step()
        # the fast pass (config.slots unrolled), then the retry of the programs it flagged (a loop)
        for slots, flatten in ((config.slots, plan.flatten), (0, False)):
            launch.run_kernel(
                K.topk_forward_kernel, (row_blocks * launch_splits,),
                x_op, w_op, bias if bias is not None else x, target, ids32, table, z_ids, overflow,
                part_max, part_sum, part_tgt, part_max1, part_sum1, keep_op, keep_max if keep_max is not None else x,
                n, v, h, k, xr.stride(0), xr.stride(1), w_rows.stride(0), w_rows.stride(1),
                keep.stride(0) if keep is not None else 0,
                blocks_per_split, keep_blocks, float(opts.softcap or 1.0), 1.0 / opts.temperature, launch_splits,
                plan.group_n or row_blocks, splits,
                KEEP=keep is not None, USE_TMA=use_tma, FLATTEN=flatten, **flags,
                BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, BLOCK_H=plan.block_h, SLOTS=slots,
                num_warps=plan.num_warps, num_stages=plan.num_stages, **extra,
            )
    stats = TopKStats(
        lse_tail=merge_splits(part_max, part_sum),
        z_ids=z_ids,
        z_t=part_tgt.sum(dim=0) if opts.hard else None,
        lse1=merge_splits(part_max1, part_sum1) if hard_t else None,
    )
    return TopKForward(stats, (keep_buf, keep_max) if keep_buf is not None and keep_max is not None else None)


def backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, target: Tensor, opts: TopKKLOptions,
             rows: Tensor, coef: Tensor, sparse: Tensor, config: TritonConfig, *, kept, need_dx: bool, need_dw: bool,
             need_db: bool, dx_acc: bool = False):
    n = x.shape[0]
    plan = config.linear.forward if kept is not None else config.linear.backward
    rows, coef = rows.float().contiguous(), coef.float().contiguous()
    sparse = sparse.float().contiguous()
    prerounded = launch.runs_prerounded(plan, x.dtype)
    flags = _flags(bias, opts, x.dtype, prerounded)
    needs_z = opts.softcap is not None or opts.hard_at_other_temperature
    kernels = launch.DlogitsKernels(
        kept_kernel=K.topk_kept_dlogits_kernel, kept_head=(target, rows, coef, n),
        kept_tail=(float(opts.softcap or 1.0), float(opts.temperature)),
        kept_flags=dict(HAS_SOFTCAP=opts.softcap is not None, HAS_HARD=opts.hard,
                        HARD_T=opts.hard_at_other_temperature),
        kernel=K.topk_dlogits_kernel, inputs=(bias if bias is not None else x, target, rows, coef),
        scalars=(float(opts.softcap or 1.0), 1.0 / opts.temperature), flags=flags, prerounded=prerounded,
        kept_log=needs_z,
        patch_kernel=K.topk_patch_kernel, patch_inputs=(ids.to(torch.int32).contiguous(), sparse, ids.shape[1]),
        patch_flags=PATCH,
    )
    return launch.chunked_backward(x, weight, bias, plan, kept, kernels, need_dx=need_dx, need_dw=need_dw,
                                   need_db=need_db, dx_acc=dx_acc)


class TritonBackend(TritonKind):
    """backend="triton" (``contract.TopKBackend``): its Config (``contract.TritonConfig``)
    is the call's ``planning.plans.LinearPlan`` (tiles, splits, kept columns, chunks) and
    the forward's id slots."""


    def plan(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], opts: TopKKLOptions, *, budget: int,
             need_grad: bool, k: int = 0, cute: bool = True, kept_owned: bool = True) -> TritonConfig:
        n, h = x.shape
        v = weight.shape[0]
        linear = linear_plan(n, v, h, x.element_size(), budget, x.device,
                             keep_allowed=keep_allowed(x.dtype, opts, need_grad),
                             prerounded=launch.tf32_prerounded(x.dtype), kept_owned=kept_owned)
        tiles = linear.forward
        per_split = cdiv(cdiv(v, tiles.block_v), tiles.vocab_splits)
        return TritonConfig(linear, id_slots(k, v, tiles.block_n, tiles.block_v, per_split))

    @staticmethod
    def kept_shapes(config: Optional[TritonConfig], n: int):
        if config is None or not config.linear.keeps:
            return None
        return launch.kept_shapes_of(config.linear.forward, n)

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, target: Tensor,
                opts: TopKKLOptions, config: TritonConfig) -> TopKForward:
        return forward(x, weight, bias, ids, target, opts, config)

    def backward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, target: Tensor,
                 opts: TopKKLOptions, rows: Tensor, coef: Tensor, sparse: Tensor, config: TritonConfig, *, kept=None,
                 need_dx: bool, need_dw: bool, need_db: bool, dx_acc: bool = False):
        return backward(x, weight, bias, ids, target, opts, rows, coef, sparse, config, kept=kept, need_dx=need_dx,
                        need_dw=need_dw, need_db=need_db, dx_acc=dx_acc)
