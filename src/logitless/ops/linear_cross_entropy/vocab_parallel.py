"""linear_cross_entropy over a vocab-parallel head (``logitless.distributed``).

Rank r holds rows [start_r, start_r + V_r) of the full weight; x and the (global)
targets are the same on every rank. The custom ops call these functions when their
``tp_group`` is set.

forward:  the backend's statistics over this rank's real rows (targets shifted by the
          rank's offset, -1 where another rank holds the target: a column no kernel
          matches), then two collectives of O(tokens) floats: a MAX of the local lse
          (and of the local row maxima for return_stats), a SUM of exp(lse_r - M), the
          target logit and sum_c w_c z_c; a third (a MIN of N int64) for the argmax of
          return_stats. The loss follows from the merged statistics with the global V,
          global targets and the full class-weight vector, so every option keeps its
          meaning over the full vocabulary and every rank computes the same loss.
backward: the A, B, C coefficients from the global lse; the backend's backward on the
          local rows gives this rank's rows of dW and db exactly and a partial sum of
          dx in fp32 (fp64 for fp64), all-reduced in that dtype (one collective of
          N x H) unless ``partial_dx``, then cast once. Padding rows get zero gradient.

Nothing of size tokens x vocab and no weight is ever communicated.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.distributed import VocabShard, merge_argmax, merge_shards, vocab_shard
from logitless.formulas.common import apply_softcap, compute_dtype, reduce
from logitless.formulas.cross_entropy import TokenStats, grad_coefficients, token_loss, upstream_per_token
from logitless.ops.common.validate import check_targets_in_range
from logitless.ops.common.vocab_parallel import no_class_grads, rank_grads
from logitless.options import CrossEntropyOptions, VocabParallelOptions

from .contract import LceBackend


def full_class_weight(class_weight: Optional[Tensor], shard: VocabShard) -> Optional[Tensor]:
    """The full class-weight vector over the real classes: (vocab_size,) or (all rows,)
    (the padding entries are then dropped); a ValueError for any other length."""
    if class_weight is None:
        return None
    total = shard.total_rows
    if class_weight.dim() != 1 or class_weight.shape[0] not in (shard.vocab_size, total):
        raise ValueError(f"class_weight must be the full vector of the vocabulary, shape ({shard.vocab_size},) "
                         f"(or ({total},) with padding rows), on every rank; got {tuple(class_weight.shape)}")
    return class_weight[: shard.vocab_size]


def _row_max(x: Tensor, weight: Tensor, bias: Optional[Tensor], arg: Tensor, softcap, dtype) -> Tensor:
    """The (soft-capped) logit z[n, arg[n]] of local rows, in ``dtype`` (O(N H) work,
    in chunks of 1024 tokens)."""
    out = torch.empty(x.shape[0], dtype=dtype, device=x.device)
    for n0 in range(0, x.shape[0], 1024):
        n1 = min(x.shape[0], n0 + 1024)
        a = arg[n0:n1]
        z = (x[n0:n1].to(dtype) * weight[a].to(dtype)).sum(dim=1)
        if bias is not None:
            z = z + bias[a].to(dtype)
        out[n0:n1] = apply_softcap(z, softcap)
    return out


def plan(impl: LceBackend, x: Tensor, weight: Tensor, bias: Optional[Tensor], class_weight: Optional[Tensor],
         opts: CrossEntropyOptions, tp: VocabParallelOptions, *, budget: int, need_argmax: bool, need_grad: bool,
         need_dw: bool = True, kept_owned: bool = True):
    """The backend's Config of this rank's real rows (``forward``'s), or None (no tokens, or
    a rank without real rows). ``kept_owned``: ``LceBackend.plan``'s."""
    shard = vocab_shard(tp.tp_group, weight.shape[0], x.device, tp.vocab_size)
    w = shard.real_rows(weight)
    if x.shape[0] == 0 or w.shape[0] == 0:
        return None
    cw = shard.class_slice(full_class_weight(class_weight, shard))
    return impl.plan(x, w, shard.real_rows(bias), cw, opts, budget=budget, need_grad=need_grad,
                     need_argmax=need_argmax, need_dw=need_dw, kept_owned=kept_owned)


def forward(impl: LceBackend, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
            class_weight: Optional[Tensor], opts: CrossEntropyOptions, tp: VocabParallelOptions, *,
            budget: int, need_argmax: bool, need_grad: bool, need_dw: bool = True, ordered: bool = False,
            config=None, kept_owned: bool = True):
    """(loss, lse, argmax or None, w_t, kept or None, config or None): the custom op's
    forward under TP (``config``: the backend's Config of this rank's rows, planned here
    once unless given; None for a rank without rows or no tokens). ``ordered``: the
    merge's SUM in rank order (``batch_invariant``)."""
    shard = vocab_shard(tp.tp_group, weight.shape[0], x.device, tp.vocab_size)
    v = shard.vocab_size
    check_targets_in_range(target, v, opts.ignore_index)
    class_weight = full_class_weight(class_weight, shard)
    n = x.shape[0]
    sd = compute_dtype(x.dtype)
    w, b = shard.real_rows(weight), shard.real_rows(bias)
    cw, t = shard.class_slice(class_weight), shard.local_target(target)
    kept = None
    if n == 0:  # the same on every rank: no collective
        empty = x.new_empty(0, dtype=sd)
        stats = TokenStats(empty, empty, empty, target.new_empty(0, dtype=torch.int64))
    else:
        if w.shape[0] == 0:  # a rank without real classes: neutral statistics
            lse = torch.full((n,), float("-inf"), dtype=sd, device=x.device)
            zero = torch.zeros(n, dtype=sd, device=x.device)
            local = TokenStats(lse, zero, zero if opts.needs_smooth_sum else None,
                               torch.zeros(n, dtype=torch.int64, device=x.device) if need_argmax else None)
        else:
            if config is None:
                config = plan(impl, x, weight, bias, class_weight, opts, tp, budget=budget, need_grad=need_grad,
                              need_argmax=need_argmax, need_dw=need_dw, kept_owned=kept_owned)
            local, _, _, kept, _ = impl.forward(x, w, b, t, cw, opts, config, need_argmax=need_argmax, loss=False)
        sd = local.lse.dtype
        tgt, smooth = local.target_logit, local.smooth_sum
        assert tgt is not None  # (loss=False: the backend returns the target logits)
        sums = [tgt.to(sd)] + ([smooth.to(sd)] if opts.needs_smooth_sum and smooth is not None else [])
        best = local_argmax = None
        if need_argmax:
            local_argmax = local.argmax
            assert local_argmax is not None  # (asked for)
            best = (_row_max(x, w, b, local_argmax, opts.softcap, sd) if w.shape[0]
                    else torch.full((n,), float("-inf"), dtype=sd, device=x.device))
        merged = merge_shards(shard.group, [local.lse], sums=sums, maxes=[best] if best is not None else [],
                              ordered=ordered)
        argmax = None
        if best is not None and local_argmax is not None:  # (need_argmax)
            argmax = merge_argmax(shard.group, best, local_argmax + shard.start, merged.maxes[0])
        stats = TokenStats(merged.lse[0], merged.sums[0], merged.sums[1] if opts.needs_smooth_sum else None, argmax)
    loss_tok, w_t = token_loss(stats, target, v, class_weight, opts)
    return reduce(loss_tok, w_t, opts.reduction), stats.lse, stats.argmax, w_t, kept, config


def backward(impl: LceBackend, grad_loss: Tensor, grad_lse: Optional[Tensor], x: Tensor, weight: Tensor,
             bias: Optional[Tensor], target: Tensor, class_weight: Optional[Tensor], lse: Tensor, w_t: Tensor,
             opts: CrossEntropyOptions, tp: VocabParallelOptions, *, need_dx: bool,
             need_dw: bool, need_db: bool, config, kept):
    """(dx, dW, db) of this rank (None where not needed): the custom op's backward under TP
    (``config``, ``kept``: the forward's)."""
    shard = vocab_shard(tp.tp_group, weight.shape[0], x.device, tp.vocab_size)  # cached: no collective
    class_weight = full_class_weight(class_weight, shard)
    g = upstream_per_token(grad_loss, w_t, opts.reduction)
    coef = grad_coefficients(lse, target, g, shard.vocab_size, class_weight, opts)
    if grad_lse is not None:
        coef[0] += grad_lse.to(coef.dtype)
    w, b = shard.real_rows(weight), shard.real_rows(bias)
    if w.shape[0] == 0:
        dx, dw, db = no_class_grads(x, w, b, need_dx, need_dw, need_db)
    else:
        dx, dw, db = impl.backward(
            x, w, b, shard.local_target(target), shard.class_slice(class_weight), opts.softcap, lse, coef, config,
            kept=kept, need_dx=need_dx, need_dw=need_dw, need_db=need_db, dx_acc=True)
    return rank_grads(shard, x, dx, dw, db, tp.partial_dx)
