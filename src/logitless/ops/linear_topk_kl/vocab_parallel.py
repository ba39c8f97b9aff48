"""linear_topk_kl over a vocab-parallel head (``logitless.distributed``).

Rank r holds rows [start_r, start_r + V_r) of the full weight; x, the (global) teacher ids
and log-probs and the targets are the same on every rank. The custom ops call these
functions when their ``tp_group`` is set.

forward:  the backend's statistics over this rank's rows, with the ids and the target
          shifted by the rank's first row (an id another rank holds lies outside [0, V_r):
          no column matches it, its z is 0 here): the log-sum-exp of this rank's columns
          outside the ids (and of all of them at temperature 1 for hard labels at T != 1),
          z at the ids it holds, z at the target. Then two collectives of O(tokens x K)
          floats (``merge.merge_shards``): a MAX of the log-sum-exps, a SUM of their
          rescaled sums, of z at the ids (each id is one rank's) and of the target's z.
          The loss follows from the merged statistics with the global V and global ids
          (``formulas.topk_kl.token_terms``): the same bits on every rank.
backward: the coefficients of the merged statistics; the backend's backward on the local
          rows (the ids shifted as above: the values at another rank's ids are never
          written here) gives this rank's rows of dW and db and a partial sum of dx in fp32
          (fp64 for fp64), all-reduced in that dtype (one collective of N x H), then cast.

Nothing of size tokens x vocab and no weight is ever communicated.
"""

from __future__ import annotations

import torch
from torch import Tensor

from logitless.distributed import merge_shards, vocab_shard
from logitless.formulas.common import compute_dtype
from logitless.formulas.topk_kl import TopKStats
from logitless.ops.common.vocab_parallel import no_class_grads, rank_grads

from .contract import TopKBackend, TopKBackwardCall, TopKCall


def vocab_size(call) -> int:
    """The full vocabulary's size (the group's row counts: exchanged once, then cached)."""
    return vocab_shard(call.tp.tp_group, call.weight.shape[0], call.x.device, call.tp.vocab_size).vocab_size


def plan(impl: TopKBackend, call: TopKCall | TopKBackwardCall):
    """The backend's Config of this rank's real rows (``forward``'s), or None (no tokens, or a
    rank without real rows)."""
    shard = vocab_shard(call.tp.tp_group, call.weight.shape[0], call.x.device, call.tp.vocab_size)
    w = shard.real_rows(call.weight)
    if call.ids.shape[0] == 0 or w.shape[0] == 0:
        return None
    return impl.plan(call.x, w, shard.real_rows(call.bias), call.opts, budget=call.budget, need_grad=call.need_grad,
                     k=call.ids.shape[1], kept_owned=call.owned)


def forward(impl: TopKBackend, call: TopKCall):
    """(TopKStats of the full rows, kept or None, the Config or None)."""
    x, weight, ids, target, opts, tp = call.x, call.weight, call.ids, call.target, call.opts, call.tp
    shard = vocab_shard(tp.tp_group, weight.shape[0], x.device, tp.vocab_size)
    n, k = ids.shape
    sd = compute_dtype(x.dtype)
    w, b = shard.real_rows(weight), shard.real_rows(call.bias)
    if n == 0:  # the same on every rank: no collective
        empty = x.new_empty(0, dtype=sd)
        return TopKStats(empty, x.new_empty((0, k), dtype=sd), empty, empty), None, None
    kept = config = None
    if w.shape[0] == 0:  # a rank without real classes: neutral statistics
        none = torch.full((n,), float("-inf"), dtype=sd, device=x.device)
        zero = torch.zeros(n, dtype=sd, device=x.device)
        local = TopKStats(none, torch.zeros(n, k, dtype=sd, device=x.device), zero if opts.hard else None,
                          none if opts.hard_at_other_temperature else None)
    else:
        config = plan(impl, call)  # once
        out = impl.forward(x, w, b, ids - shard.start, shard.local_target(target), opts, config)
        local, kept = out.stats, out.kept
    lse1, z_t = local.lse1, local.z_t  # (present with those options)
    lses = [local.lse_tail.to(sd)] + ([lse1.to(sd)] if opts.hard_at_other_temperature and lse1 is not None else [])
    sums = list(local.z_ids.to(sd).T) + ([z_t.to(sd)] if opts.hard and z_t is not None else [])
    merged = merge_shards(shard.group, lses, sums=sums)
    z_ids = torch.stack(merged.sums[:k], dim=1) if k else x.new_empty((n, 0), dtype=sd)
    stats = TopKStats(merged.lse[0], z_ids, merged.sums[k] if opts.hard else None,
                      merged.lse[1] if opts.hard_at_other_temperature else None)
    return stats, kept, config


def backward(impl: TopKBackend, b: TopKBackwardCall, coef: Tensor, sparse: Tensor, config, kept):
    """(dx, dW, db) of this rank (None where not needed) from the scaled coefficients."""
    x, weight, need = b.x, b.weight, b.need
    shard = vocab_shard(b.tp.tp_group, weight.shape[0], x.device, b.tp.vocab_size)  # cached: no collective
    w, bias = shard.real_rows(weight), shard.real_rows(b.bias)
    if w.shape[0] == 0:
        dx, dw, db = no_class_grads(x, w, bias, need.need_dx, need.need_dw, need.need_db)
    else:
        dx, dw, db = impl.backward(x, w, bias, b.ids - shard.start, shard.local_target(b.target), b.opts, b.rows,
                                   coef, sparse, config, kept=kept, need_dx=need.need_dx, need_dw=need.need_dw,
                                   need_db=need.need_db, dx_acc=True)
    return rank_grads(shard, x, dx, dw, db, b.tp.partial_dx)
