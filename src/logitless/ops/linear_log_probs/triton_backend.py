"""Triton backend of linear_log_probs (CUDA tensors; CPU under TRITON_INTERPRET=1).

forward  (1 GEMM): ``logp_forward_kernel`` over (row blocks x vocabulary splits) writes
         O(N * splits) partial statistics (max, sum, entropy term, token logit), merged
         here by ``formulas.log_probs.merge_splits`` with O(N * splits) torch ops. When
         a backward will follow it also keeps e = exp(a - m) for the leading
         ``plan.keep_cols`` columns that the budget holds (all of them when the budget
         is at least the logits in the input dtype), so they need no second GEMM.
         On Hopper with the optional CuTe DSL, ``planning.cute.forward_plan`` may pick
         the warp-specialised ``cute_lib.forward_stats`` kernel instead (same partials;
         bf16/fp16, no bias/soft-cap, nothing kept for the backward).
backward (2 GEMMs + 1 per recomputed column): kept columns become dz (in place where
         the call owns them, ``ops.common.kept.Kept``; ``logp_kept_dlogits_kernel``), the
         others are recomputed chunk by chunk (``logp_dlogits_kernel``); each chunk of dz
         feeds dW = dz^T x, db = column sums and dx += dz W
         (``triton_lib.launch.chunk_gradients``, an fp32 dx accumulator when there are
         several chunks).
One plan per call (``TritonBackend.plan``: a ``contract.TritonConfig`` around
``planning.plans.LinearPlan``s from ``plans.linear_plan``, the same tiles, splits, kept
columns and chunks as linear_cross_entropy, and the CuTe choice), made by the forward
custom op and followed by the forward and the backward. Truncated / batch-invariant calls:
``truncation``.
No (N, V) tensor unless the budget allows it; no atomics (bitwise repeatable); no host
syncs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.log_probs import LogProbStats, merge_splits
from logitless.ops.common.contract import TritonKind
from logitless.ops.common.kept import Kept
from logitless.ops.common.torch_tiles import linear_torch_plan
from logitless.options import LogProbOptions
from logitless.planning import cute as cute_planning
from logitless.planning.memo import memoised
from logitless.planning.plans import LinearPlan, linear_plan
from logitless.triton_lib import launch, log_probs_epilogue, log_probs_fields
from logitless.triton_lib import log_probs_kernels as K
from logitless.triton_lib.fast_launch import public_launch
from logitless.triton_lib.launch import cdiv

from .contract import TritonConfig, decide

#: exp(a - m) stays a normal bf16/fp32 number down to a - m = -87; with a soft-cap s,
#: a - m >= -2 s / T, and the kept columns need z back from log(e): keep only then.
_MAX_CAP_RANGE = 80.0


def keep_allowed(dtype: torch.dtype, opts: LogProbOptions, need_grad: bool) -> bool:
    """Whether the forward may keep exp(a - m) for the backward: fp16 underflows below
    e^-17, where log e (entropy, soft-cap) would be lost; a wide soft-cap range likewise."""
    if not need_grad:
        return False
    if dtype == torch.float16 and (opts.entropy or opts.softcap is not None):
        return False
    if opts.softcap is not None and 2.0 * opts.softcap / opts.temperature > _MAX_CAP_RANGE:
        return False
    return True


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], opts: LogProbOptions, *, budget: int,
           need_grad: bool, cute: bool = True, rows: Optional[int] = None, kept_owned: bool = True) -> LinearPlan:
    """The ``LinearPlan`` of x's rows (``rows``: of that many rows instead). ``cute=False``: no
    CuTe choice (the fake: it needs the tensors' memory; the truncated passes). ``kept_owned``:
    the backward may overwrite the kept columns (``planning.plans.triton_plan``). Memoised
    (``_linear``) by what it reads of the tensors (the layout: what ``cute_planning.layout_fits`` reads)."""
    n, h = x.shape
    layout = (x.dtype == weight.dtype, x.stride(), weight.stride(), x.data_ptr() % 16,
              weight.data_ptr() % 16) if cute else None
    return _linear(n, weight.shape[0], h, x.dtype, x.device, budget, opts, need_grad, bias is not None,
                   n if rows is None else rows, layout, kept_owned)


@memoised
def _linear(n: int, v: int, h: int, dtype: torch.dtype, device, budget: int, opts: LogProbOptions, need_grad: bool,
            has_bias: bool, rows: int, layout: Optional[tuple], kept_owned: bool = True) -> LinearPlan:
    """``linear`` from its tensors' facts (``layout``: None for no CuTe choice)."""
    p = _linear_plan(rows, v, h, dtype, device, budget, opts, need_grad, kept_owned)
    if layout is None:
        return p
    # Hopper + the CuTe DSL: the warp-specialised kernel computes the same partials (``planning.cute``).
    keep_ok = keep_allowed(dtype, opts, need_grad)
    c = cute_planning.forward_plan(device, dtype, n, v, h, cute_planning.layout_fits(layout, h, dtype),
                                   keep_cols=p.forward.keep_cols if keep_ok else 0, keep_block=p.forward.block_v,
                                   bias=has_bias, softcap=opts.softcap is not None, entropy=opts.entropy)
    return p if c is None else replace(p, cute=c)


def _linear_plan(rows: int, v: int, h: int, dtype: torch.dtype, device, budget: int, opts: LogProbOptions,
                 need_grad: bool, kept_owned: bool = True) -> LinearPlan:
    return linear_plan(rows, v, h, dtype.itemsize, budget, device, keep_allowed=keep_allowed(dtype, opts, need_grad),
                       prerounded=launch.tf32_prerounded(dtype), kept_owned=kept_owned)


@memoised
def truncated_config(n: int, h: int, v: int, dtype: torch.dtype, device, budget: int, opts: LogProbOptions,
                     truncated: bool, k_max: int, block: int, need_grad: bool, parallel: bool,
                     plan_rows: Optional[int], kept_owned: bool = True) -> TritonConfig:
    """The Config of a truncated / batch-invariant call (``TritonConfig``): pure in its
    arguments, so memoised (``planning.memo``). ``k_max``: the op's argument. The search's
    kernels' tiles, a block's rows' (``log_probs_candidates``)."""
    from logitless.triton_lib import log_probs_candidates as LC

    decided, keep = decide(TritonBackend, v, truncated, k_max, block, need_grad, parallel, opts.softcap)
    rows = block or n
    main = backward = search_plan = steps = cand_tiles = masses = None
    if v:
        main = _linear_plan(rows, v, h, dtype, device, budget, opts, keep, kept_owned)
        if block:
            backward = _linear_plan(n, v, h, dtype, device, budget, opts, False)
        if truncated:
            search_plan = _linear_plan(rows, v, h, dtype, device, budget, opts, False)
            cand_tiles = LC.candidate_tiles(search_plan.forward, device)
            if decided.search:
                masses = LC.mass_tiles(search_plan.forward, device)
    if truncated:  # (shape and dtype are what the planner reads)
        steps = linear_torch_plan(torch.empty((rows, h), dtype=dtype, device="meta"), plan_rows or v, budget, tiles=3,
                                  accumulators=0)
    return TritonConfig(main, backward, search_plan, steps, decided, cand_tiles, masses)


def _flags(bias, opts: LogProbOptions, dtype, prerounded=False):
    return dict(HAS_BIAS=bias is not None, HAS_SOFTCAP=opts.softcap is not None, ENTROPY=opts.entropy,
                DOT_PRECISION="tf32" if prerounded else launch.dot_precision(dtype))


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions, *,
            plan: LinearPlan, outputs: bool = False, tau: Optional[Tensor] = None, fields: bool = False,
            keep: bool = True):
    """(LogProbStats, kept) under ``plan`` (``keep=False``: nothing kept): kept is
    None or (buffer, tile maxima), which ``backward`` turns into dz (one backward only).
    ``outputs`` (N > 0): ((logp, entropy or None, lse), kept) instead, the merge and
    ``token_outputs`` in one launch (``log_probs_epilogue.forward_outputs``). ``tau``
    (N,) fp32: a per-token threshold, columns a < tau left out (truncated sampling; kept
    e = 0 there); its Config (``truncation``) has no CuTe choice and, with a soft-cap, no kept
    columns (the soft-cap's factor from log e would be NaN).
    ``fields`` (with ``outputs``; no CuTe, no ``tau``): TRL's extra fields from the same pass,
    ((logp, entropy or None, lse, log_sum_sq_probs, mean_logits, is_top1 as bool), kept)
    (``triton_lib.log_probs_fields``)."""
    n, h = x.shape
    v = weight.shape[0]
    keep_ok, cute, tiles = plan.keeps and keep, (plan.cute if tau is None and not fields else None), plan.forward
    if cute is not None:  # compiles and launches once per configuration, else Triton (one warning)
        from logitless.cute_lib import launch as cute_launch

        cute = cute_launch.ready(cute, x, weight, entropy=opts.entropy,
                                 keep_block=tiles.block_v if keep_ok and cdiv(tiles.keep_cols, tiles.block_v) else 0)
    splits = cute.splits if cute is not None else tiles.vocab_splits
    blocks_per_split = cdiv(cdiv(v, tiles.block_v), splits)
    # One allocation for the partial statistics (max, sum, token logit, entropy term).
    parts = launch.partials(3 + opts.entropy, splits, n, x.device)
    part_max, part_sum, part_tgt = parts[:3]
    part_u = parts[3] if opts.entropy else part_max
    keep_blocks = cdiv(tiles.keep_cols, tiles.block_v) if keep_ok else 0
    prerounded = launch.runs_prerounded(tiles, x.dtype)
    # fp32 at "high": x rounded to TF32 once, W chunk by chunk (launches over whole splits).
    use_tma, steps = launch.forward_launches(x, weight, tiles, prerounded) if cute is None else (False, ())
    keep_view = keep_max = keep_buf = None
    keep_op = x
    if keep_blocks:
        keep_buf, keep_view, keep_max, keep_op = launch.keep_buffers(tiles, n, x, use_tma)
    if cute is not None:  # (kept columns in the same buffers, as the Triton kernel keeps them)
        cute_launch.forward_partials("linear_log_probs", x, weight, tokens, (part_max, part_sum, part_tgt),
                                     splits, scale=1.0 / opts.temperature,
                                     entropy=part_u if opts.entropy else None,
                                     stages=cute.stages, specialised=cute.specialised, group=cute.group,
                                     keep=(keep_view, keep_max, tiles.block_v) if keep_view is not None else None)
    row_blocks = cdiv(n, tiles.block_n)
    flags = _flags(bias, opts, x.dtype, prerounded)
    thr = _threshold_args(tau)
    if fields:
        fparts = launch.partials(3, splits, n, x.device)
        f_arg = torch.empty(splits, n, dtype=torch.int32, device=x.device)
        thr = dict(thr, part_s2_ptr=fparts[0], part_zsum_ptr=fparts[1], part_best_ptr=fparts[2], part_arg_ptr=f_arg,
                   FIELDS=True)
    for step in steps:
        x_op, w_op, xr, w_rows, launch_splits, extra = step()
        launch.run_kernel(
            K.logp_forward_kernel, (row_blocks * launch_splits,),
            x_op, w_op, bias if bias is not None else x, tokens,
            part_max, part_sum, part_u, part_tgt, keep_op, keep_max if keep_max is not None else x,
            n, v, h, xr.stride(0), xr.stride(1), w_rows.stride(0), w_rows.stride(1),
            keep_view.stride(0) if keep_view is not None else 0,
            blocks_per_split, keep_blocks, float(opts.softcap or 1.0), 1.0 / opts.temperature, launch_splits,
            tiles.group_n or row_blocks,
            KEEP=keep_view is not None, USE_TMA=use_tma, FLATTEN=tiles.flatten, **flags,
            BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_H=tiles.block_h,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, **extra, **thr,
        )
    kept = (keep_buf, keep_max) if keep_view is not None else None
    if outputs:
        res = log_probs_epilogue.forward_outputs(part_max, part_sum, part_u if opts.entropy else None, part_tgt,
                                                 tokens, opts, v)
        if fields:
            res = (*res, *_field_outputs(part_max, part_sum, fparts, f_arg, tokens, opts, v))
        return res, kept
    lse, ent = merge_splits(part_max, part_sum, part_u if opts.entropy else None)
    stats = LogProbStats(lse=lse, target=part_tgt.sum(dim=0), entropy=ent)
    return stats, kept


def _field_outputs(part_max: Tensor, part_sum: Tensor, fparts, f_arg: Tensor, tokens: Tensor, opts: LogProbOptions,
                   v: int):
    """(log_sum_sq_probs, mean_logits, is_top1) (N,) from the splits' partials: one launch."""
    n = tokens.shape[0]
    sq = torch.empty(n, dtype=torch.float32, device=tokens.device)
    mean = torch.empty_like(sq)
    top1 = torch.empty(n, dtype=torch.int8, device=tokens.device)
    block = log_probs_epilogue.BLOCK
    public_launch(log_probs_fields.fields_epilogue_kernel, (cdiv(n, block),),
        part_max, part_sum, *fparts, f_arg, tokens.contiguous(), sq, mean, top1, n, v, part_max.shape[0],
        opts.ignore_index, BLOCK=block, num_warps=4,
    )
    return sq, mean, top1.view(torch.bool)


def _threshold_args(tau: Optional[Tensor]) -> dict:
    """The kernels' threshold arguments (none without one: the default launches unchanged)."""
    if tau is None:
        return {}
    return dict(tau_ptr=tau.to(torch.float32).contiguous(), HAS_THRESHOLD=True)


def grad_coefficients(entropy: Optional[Tensor], tokens: Tensor, g_lp: Optional[Tensor], g_h: Optional[Tensor],
                      num_classes: int, opts: LogProbOptions, lse: Optional[Tensor] = None) -> Tensor:
    """The backward's (3, N) A, B, C in one launch (``log_probs_epilogue.grad_coefficients``;
    ``lse``: not needed)."""
    return log_probs_epilogue.grad_coefficients(entropy, tokens, g_lp, g_h, num_classes, opts)


def backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
             lse: Tensor, coef: Tensor, *, need_dx: bool, need_dw: bool, need_db: bool, plan: LinearPlan,
             kept: Optional[Kept] = None, dx_acc: bool = False, tau: Optional[Tensor] = None):
    """dx, dW, db under ``plan`` (its ``forward`` tiles with ``kept``, else ``backward``). ``kept``
    (buffer, tile maxima, where their dz goes) laid out by the plan.
    ``dx_acc``: dx as the fp32 accumulator (also for one chunk), not cast to x's dtype
    (a partial sum the caller reduces first: vocab parallelism). ``tau``: the forward's
    per-token threshold (dz = 0 where a < tau in the recomputed columns; the kept ones
    hold e = 0 there)."""
    thr = _threshold_args(tau)
    n, h = x.shape
    tiles = plan.forward if kept is not None else plan.backward
    coef = coef.contiguous()
    lse = lse.contiguous()
    prerounded = launch.runs_prerounded(tiles, x.dtype)
    flags = _flags(bias, opts, x.dtype, prerounded)
    kernels = launch.DlogitsKernels(
        kept_kernel=K.logp_kept_dlogits_kernel, kept_head=(tokens, lse, coef, n),
        kept_tail=(float(opts.softcap or 1.0), float(opts.temperature)),
        kept_flags=dict(HAS_SOFTCAP=opts.softcap is not None, ENTROPY=opts.entropy),
        kernel=K.logp_dlogits_kernel, inputs=(bias if bias is not None else x, tokens, lse, coef),
        scalars=(float(opts.softcap or 1.0), 1.0 / opts.temperature), flags=dict(flags, **thr),
        prerounded=prerounded, kept_log=opts.entropy or opts.softcap is not None,
    )
    return launch.chunked_backward(x, weight, bias, tiles, kept, kernels, need_dx=need_dx, need_dw=need_dw,
                                   need_db=need_db, dx_acc=dx_acc)


class TritonBackend(TritonKind):
    """backend="triton" (``contract.LlpBackend``): its Config (``contract.TritonConfig``) holds
    the call's ``LinearPlan`` (tiles, kept columns, the CuTe choice) and, for truncated /
    batch-invariant calls, the threshold passes' plans and the backward's over the batch."""

    truncates = True
    threshold_search = True  # (the candidates / mass search, ``truncation.search_triton``)

    def plan(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], opts: LogProbOptions, *, budget: int,
             need_grad: bool, need_dw: bool = True, truncated: bool = False, k_max: int = -1, block: int = 0,
             parallel: bool = False, plan_rows: Optional[int] = None, cute: bool = True,
             kept_owned: bool = True) -> TritonConfig:
        v = weight.shape[0]
        if not truncated and not block:
            return TritonConfig(linear(x, weight, bias, opts, budget=budget, need_grad=need_grad, cute=cute,
                                       kept_owned=kept_owned))
        n, h = x.shape
        return truncated_config(n, h, v, x.dtype, x.device, budget, opts, truncated, k_max, block, need_grad, parallel,
                                plan_rows, kept_owned)

    @staticmethod
    def kept_shapes(config: Optional[TritonConfig], n: int):
        """Shapes of the buffers ``forward`` keeps under ``config`` (the fake's), or None."""
        if config is None or config.main is None or not config.main.keeps:
            return None
        return launch.kept_shapes_of(config.main.forward, n)

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
                config: TritonConfig, *, outputs: bool = True, tau: Optional[Tensor] = None, keep: bool = True):
        assert config.main is not None  # (None: a vocab-parallel rank without rows, where nothing runs)
        return forward(x, weight, bias, tokens, opts, plan=config.main, outputs=outputs, tau=tau, keep=keep)

    grad_coefficients = staticmethod(grad_coefficients)

    def backward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
                 lse: Tensor, coef: Tensor, config: TritonConfig, *, kept: Optional[Kept] = None,
                 need_dx: bool, need_dw: bool, need_db: bool, dx_acc: bool = False, tau: Optional[Tensor] = None):
        plan = config.backward or config.main
        assert plan is not None  # (None: a vocab-parallel rank without rows, where nothing runs)
        return backward(x, weight, bias, tokens, opts, lse, coef, need_dx=need_dx, need_dw=need_dw,
                        need_db=need_db, plan=plan, kept=kept, dx_acc=dx_acc, tau=tau)
