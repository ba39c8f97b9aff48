"""linear_log_probs over a vocab-parallel head (``logitless.distributed``).

Rank r holds rows [start_r, start_r + V_r) of the full weight; x and the (global) token
ids are the same on every rank. The custom ops call these functions when their
``tp_group`` is set.

forward:  the backend's statistics over this rank's real rows (tokens shifted by the
          rank's offset, -1 where another rank holds the token: a column no kernel
          matches), as partials (m, s, u) = (lse_r, 1, -H_r) (``partials_of``; a rank
          without real rows: (-inf, 0, 0)), then two collectives of O(tokens) floats
          (``merge.merge_online``): a MAX of m, a SUM of the rescaled s, u and the token's
          a. logp and the entropy follow from the merged statistics with the global V and
          global tokens (``token_outputs``), so ignore_index, temperature, softcap and
          entropy keep their meaning over the full vocabulary, and every rank computes
          the same bits.
backward: the A, B, C coefficients from the merged lse and entropy; the backend's
          backward on the local rows gives this rank's rows of dW and db exactly and a
          partial sum of dx in fp32 (fp64 for fp64), all-reduced in that dtype (one
          collective of N x H) unless ``partial_dx``, then cast once. Padding rows get
          zero gradient.

Nothing of size tokens x vocab and no weight is ever communicated.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.distributed import merge_online, vocab_shard
from logitless.formulas.common import compute_dtype
from logitless.formulas.log_probs import LogProbStats, finish, grad_coefficients, partials_of, token_outputs
from logitless.ops.common.validate import check_targets_in_range
from logitless.ops.common.vocab_parallel import no_class_grads, rank_grads
from logitless.options import LogProbOptions, VocabParallelOptions


def forward(impl, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
            tp: VocabParallelOptions, *, budget: int, need_grad: bool):
    """(logp, entropy or None, lse, kept or None, plan or None): the custom op's forward
    under TP (``plan``: the backend's plan of this rank's rows)."""
    shard = vocab_shard(tp.tp_group, weight.shape[0], x.device, tp.vocab_size)
    v = shard.vocab_size
    check_targets_in_range(tokens, v, opts.ignore_index, name="tokens")
    n = x.shape[0]
    sd = compute_dtype(x.dtype)
    w, b = shard.real_rows(weight), shard.real_rows(bias)
    kept = plan = None
    if n == 0:  # the same on every rank: no collective
        empty = x.new_empty(0, dtype=sd)
        stats = LogProbStats(empty, empty, empty if opts.entropy else None)
    else:
        if w.shape[0] == 0:  # a rank without real classes: neutral statistics
            m = torch.full((n,), float("-inf"), dtype=sd, device=x.device)
            s = torch.zeros(n, dtype=sd, device=x.device)
            u = s if opts.entropy else None
            a_t = s
        else:
            plan = impl.plan(x, w, b, opts, budget=budget, need_grad=need_grad)
            local, kept = impl.forward(x, w, b, shard.local_target(tokens), opts, budget=budget, plan=plan)
            m, s, u = partials_of(local.lse.to(sd), local.entropy.to(sd) if opts.entropy else None)
            a_t = local.target.to(sd)  # a NaN lse makes e^(m - M) s NaN: the SUM spreads it
        big, s, u, (a_t,) = merge_online(shard.group, m, s, u, [a_t])
        lse, ent = finish(big, s, u)
        stats = LogProbStats(lse=lse, target=a_t, entropy=ent)
    logp, ent = token_outputs(stats, tokens, v, opts)
    return logp, ent, stats.lse, kept, plan


def backward(impl, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], x: Tensor, weight: Tensor,
             bias: Optional[Tensor], tokens: Tensor, lse: Tensor, entropy_out: Tensor, opts: LogProbOptions,
             tp: VocabParallelOptions, *, budget: int, need_dx: bool, need_dw: bool, need_db: bool, plan, kept):
    """(dx, dW, db) of this rank (None where not needed): the custom op's backward under TP
    (``plan``, ``kept``: the forward's, or None)."""
    shard = vocab_shard(tp.tp_group, weight.shape[0], x.device, tp.vocab_size)  # cached: no collective
    coef = grad_coefficients(entropy_out if opts.entropy else None, tokens, grad_logp,
                             grad_entropy if opts.entropy else None, shard.vocab_size, opts, lse)
    w, b = shard.real_rows(weight), shard.real_rows(bias)
    if w.shape[0] == 0:
        dx, dw, db = no_class_grads(x, w, b, need_dx, need_dw, need_db)
    else:
        dx, dw, db = impl.backward(x, w, b, shard.local_target(tokens), opts, lse, coef, need_dx=need_dx,
                                   need_dw=need_dw, need_db=need_db, budget=budget, plan=plan, kept=kept,
                                   dx_acc=True)
    return rank_grads(shard, x, dx, dw, db, tp.partial_dx)
