"""linear_jsd over vocab-parallel heads (``logitless.distributed``).

Both heads are split alike: rank r holds rows [start_r, start_r + V_r) of the student's
and of the teacher's full weight; the hidden states and the (global) targets are the
same on every rank. The custom ops call these functions when their ``tp_group`` is set.

forward:  the backend's Config of this rank's real rows (``plan``, once per call; the
          backward follows it), then pass 1, the backend's statistics over them: the local
          lse(zs / T), lse(zt / T) and lse(zs) (for 0 < beta < 1 those of the forward
          KL, the cheaper statistics that hold them); collectives 1 and 2 merge them
          (MAX, then SUM of exp(lse_r - M)).
          The KL limits (beta 0 or 1; ``_merge_kl_limits``): nothing more. With the
          rank's own softmaxes p^r, q^r, K = KL(q || p) splits over the ranks as
          K = sum_r w_r (K_r + lse_t^r - lse_s^r) - (lse_t - lse_s), w_r = exp(lse_t^r
          - lse_t) (sum_r w_r = 1, q_c = w_r q^r_c on rank r's columns), i.e. a mean
          under the teacher that collective 2 takes with the lse's (beta 1: S alike,
          under the student); the target logit is a SUM (only its rank holds it).
          0 < beta < 1: the mixture m = beta q + (1 - beta) p needs the GLOBAL p and q,
          so S = sum_c p_c (lp_c - lm_c), K = sum_c q_c (lq_c - lm_c) and the target
          logit zs[t] are sums over columns taken in pass 2 (both heads' logits of this
          rank's columns recomputed: 2 more GEMMs, the backend's ``column_sums``) with
          the merged lse's, then added by collective 3 (a SUM of 3 x N floats).
backward: the backend's backward on the local rows with the merged statistics gives
          this rank's rows of dW and db exactly and a partial dx (fp32), all-reduced
          (unless ``partial_dx``) and cast once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor

from logitless.distributed import all_reduce_, merge_shards, vocab_shard
from logitless.formulas.common import compute_dtype
from logitless.formulas.jsd import K_ROW, LSE1, LSE_S, LSE_T, NUM_STATS, S_ROW, ZTGT, token_loss
from logitless.ops.common.validate import check_targets_in_range
from logitless.ops.common.vocab_parallel import no_class_grads, rank_grads
from logitless.options import JSDOptions, VocabParallelOptions

from .contract import LjsdBackend


def _merge_kl_limits(pg, local: Tensor, local_t: Tensor, opts: JSDOptions) -> Tensor:
    """The full rows' (6, N) statistics at beta 0 or 1 from each rank's statistics of its
    own columns (``local``, the backend's forward over them; all -inf on a rank without
    columns), in the two collectives of ``merge_shards`` (module docstring).

    beta 0: the divergence is K = KL(q || p), a mean under the teacher (lse index 1) of
    K_r + lse_t^r - lse_s^r, less lse_t - lse_s of the full rows; beta 1: S = KL(p || q)
    under the student alike. The other divergence row stays 0 (its weight is 0). The
    difference of the two lse's costs about |lse| x eps absolute (1e-6 in fp32 at
    lse ~ 12), as the finish of the split statistics on one GPU (``jsd_finish_kernel``).
    The target logit: this rank's where it holds the target (``local_t`` >= 0), summed.
    """
    forward_kl = opts.beta == 0.0
    own, other, row = (LSE_T, LSE_S, K_ROW) if forward_kl else (LSE_S, LSE_T, S_ROW)
    value = local[row] + local[own] - local[other]
    lse_rows = [local[LSE_S], local[LSE_T]]
    sums = []
    if opts.needs_lse1:
        lse_rows.append(local[LSE1])
        sums.append(torch.where(local_t >= 0, local[ZTGT], torch.zeros_like(local[ZTGT])))
    merged = merge_shards(pg, lse_rows, sums=sums, means=[(value, 1 if forward_kl else 0)])
    stats = torch.zeros_like(local)
    stats[LSE_S], stats[LSE_T] = merged.lse[0], merged.lse[1]
    stats[row] = merged.means[0] - (stats[own] - stats[other])
    if opts.needs_lse1:
        stats[LSE1], stats[ZTGT] = merged.lse[2], merged.sums[0]
    return stats


def plan(impl: LjsdBackend, xs, ws, xt, opts: JSDOptions, tp: VocabParallelOptions, budget: int) -> Any:
    """The backend's Config of this rank's real rows (``forward``'s), or None (no tokens, or a
    rank without real rows). 0 < beta < 1 plans pass 1 as the forward KL (``forward``)."""
    shard = vocab_shard(tp.tp_group, ws.shape[0], xs.device, tp.vocab_size)
    ws = shard.real_rows(ws)
    if xs.shape[0] == 0 or ws.shape[0] == 0:
        return None
    kl = opts.beta in (0.0, 1.0)
    first = opts if kl else dataclasses.replace(opts, beta=0.0)
    return impl.plan(xs, ws, xt, first, budget=budget, column_sums=not kl)


def forward(impl: LjsdBackend, xs, ws, bs, xt, wt, bt, target, opts: JSDOptions, tp: VocabParallelOptions,
            budget: int) -> tuple[Tensor, Tensor, Any]:
    """(per-token loss (N,), merged statistics (6, N), the backend's Config of this rank's
    rows or None): the forward op under TP."""
    shard = vocab_shard(tp.tp_group, ws.shape[0], xs.device, tp.vocab_size)
    if wt.shape[0] != ws.shape[0]:
        raise ValueError(f"teacher_weight holds {wt.shape[0]} rows on this rank, student_weight {ws.shape[0]}: "
                         "both heads must be split alike")
    v = shard.vocab_size
    if opts.hard_label_weight != 0.0:
        check_targets_in_range(target, v, opts.ignore_index)
    n = xs.shape[0]
    dtype = compute_dtype(xs.dtype)
    if n == 0:
        stats = xs.new_zeros(NUM_STATS, 0, dtype=dtype)
        return token_loss(stats, target, v, opts).to(dtype), stats, None
    config = plan(impl, xs, ws, xt, opts, tp, budget)
    ws, bs, wt, bt = shard.real_rows(ws), shard.real_rows(bs), shard.real_rows(wt), shard.real_rows(bt)
    local_t = shard.local_target(target)
    kl = opts.beta in (0.0, 1.0)
    if ws.shape[0]:
        # 0 < beta < 1 takes only the lse's (and the target logit) from pass 1: it runs as
        # the forward KL, whose statistics hold them and cost less (online sums; on the
        # Triton backend the fused forward where the cost model picks it)
        first = opts if kl else dataclasses.replace(opts, beta=0.0)
        local = impl.forward(xs, ws, bs, xt, wt, bt, local_t, first, config).stats.to(dtype)
    else:
        local = torch.full((NUM_STATS, n), float("-inf"), dtype=dtype, device=xs.device)
    if kl:
        stats = _merge_kl_limits(shard.group, local, local_t, opts)
        return token_loss(stats, target, v, opts).to(dtype), stats, config
    if opts.needs_lse1:
        lse_rows = [local[LSE_S], local[LSE_T], local[LSE1]]
    else:
        lse_rows = [local[LSE_S], local[LSE_T]]
    merged = merge_shards(shard.group, lse_rows)
    sums = impl.column_sums(xs, ws, bs, xt, wt, bt, local_t, merged.lse[0], merged.lse[1], opts, config)
    all_reduce_(sums, shard.group)
    stats = torch.zeros(NUM_STATS, n, dtype=dtype, device=xs.device)
    stats[LSE_S], stats[LSE_T], stats[S_ROW], stats[K_ROW] = merged.lse[0], merged.lse[1], sums[0], sums[1]
    if opts.needs_lse1:
        stats[LSE1], stats[ZTGT] = merged.lse[2], sums[2]
    return token_loss(stats, target, v, opts).to(dtype), stats, config


def backward(impl: LjsdBackend, g: Tensor, xs, ws, bs: Optional[Tensor], xt, wt, bt, target, stats, opts: JSDOptions,
             tp: VocabParallelOptions, config, need_dx: bool, need_dw: bool, need_db: bool):
    """(dx, dW, db) of this rank's student head (None where not needed), under the
    forward's ``config``."""
    shard = vocab_shard(tp.tp_group, ws.shape[0], xs.device, tp.vocab_size)  # cached: no collective
    ws_r, bs_r, wt_r, bt_r = shard.real_rows(ws), shard.real_rows(bs), shard.real_rows(wt), shard.real_rows(bt)
    if ws_r.shape[0]:
        dx, dw, db = impl.backward(g, xs, ws_r, bs_r, xt, wt_r, bt_r, shard.local_target(target), stats, opts,
                                   config, need_dx=need_dx, need_dw=need_dw, need_db=need_db, dx_acc=True)
    else:
        dx, dw, db = no_class_grads(xs, ws_r, bs_r, need_dx, need_dw, need_db)
    return rank_grads(shard, xs, dx, dw, db, tp.partial_dx)
