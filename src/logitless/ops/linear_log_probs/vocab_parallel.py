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

Truncated sampling and ``batch_invariant`` (``truncation``'s steps) take
``ShardedBackend``: the same contract as a backend, over this rank's rows and the merged
statistics. One Config per call (``plan``: the backend's over this rank's real rows).
Its thresholds: each rank's top-C candidates of its columns, an all-gather of (tokens x C)
floats and a top-C of the ranks' candidates, with the row max and sum merged as above;
the forward and backward above with the per-token tau. Batch invariance: the merge's SUM
added in rank order (``merge.sum_in_rank_order``), so a row's bits do not follow the
collective's algorithm for the message size.

Nothing of size tokens x vocab and no weight is ever communicated.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from logitless.distributed import VocabShard, gather_rows, merge_online, vocab_shard
from logitless.formulas.common import compute_dtype
from logitless.formulas.log_probs import LogProbStats, finish, grad_coefficients, partials_of, token_outputs
from logitless.formulas.truncation import resolve
from logitless.ops.common.validate import check_targets_in_range
from logitless.ops.common.vocab_parallel import no_class_grads, rank_grads
from logitless.options import LogProbOptions, VocabParallelOptions

from .contract import MAX_CANDIDATES, candidate_count
from .truncation import _merged_candidates
from .truncation import thresholds as _thresholds


def plan(impl, x: Tensor, weight: Tensor, bias: Optional[Tensor], opts: LogProbOptions, tp: VocabParallelOptions,
         **kw):
    """The backend's Config of this rank's real rows (None for a plain call on no tokens or
    no real rows: nothing runs there); the threshold steps sized for the largest rank's."""
    shard = vocab_shard(tp.tp_group, weight.shape[0], x.device, tp.vocab_size)
    w, b = shard.real_rows(weight), shard.real_rows(bias)
    if not kw.get("truncated") and not kw.get("block") and not (x.shape[0] and w.shape[0]):
        return None
    return impl.plan(x, w, b, opts, parallel=True, plan_rows=shard.max_rows, **kw)


def _merged_stats(impl, shard: VocabShard, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor,
                  opts: LogProbOptions, config, *, tau: Optional[Tensor] = None, ordered: bool = False):
    """(LogProbStats of the full rows, kept or None): the backend's statistics over this
    rank's real rows merged over the group (``config``: the backend's Config of those rows)."""
    n = x.shape[0]
    sd = compute_dtype(x.dtype)
    w, b = shard.real_rows(weight), shard.real_rows(bias)
    if n == 0:  # the same on every rank: no collective
        empty = x.new_empty(0, dtype=sd)
        return LogProbStats(empty, empty, empty if opts.entropy else None), None
    kept = None
    if w.shape[0] == 0:  # a rank without real classes: neutral statistics
        m = torch.full((n,), float("-inf"), dtype=sd, device=x.device)
        s = torch.zeros(n, dtype=sd, device=x.device)
        u = s if opts.entropy else None
        a_t = s
    else:
        local, kept = impl.forward(x, w, b, shard.local_target(tokens), opts, config, outputs=False, tau=tau)
        lse = local.lse.to(sd)
        m, s, u = partials_of(lse, local.entropy.to(sd) if opts.entropy else None)
        if tau is not None:  # every column of the row below tau here: no mass (lse -inf, H NaN)
            empty = lse == float("-inf")
            s = torch.where(empty, torch.zeros_like(s), s)
            u = torch.where(empty, torch.zeros_like(u), u) if u is not None else None
        a_t = local.target.to(sd)  # a NaN lse makes e^(m - M) s NaN: the SUM spreads it
    big, s, u, (a_t,) = merge_online(shard.group, m, s, u, [a_t], ordered=ordered)
    lse, ent = finish(big, s, u)
    return LogProbStats(lse=lse, target=a_t, entropy=ent), kept


def _rank_backward(impl, shard: VocabShard, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor,
                   opts: LogProbOptions, lse: Tensor, coef: Tensor, partial_dx: bool, config, *, need_dx: bool,
                   need_dw: bool, need_db: bool, kept, tau: Optional[Tensor] = None):
    """This rank's (dx, dW, db) from the merged lse and the coefficients."""
    w, b = shard.real_rows(weight), shard.real_rows(bias)
    if w.shape[0] == 0:
        dx, dw, db = no_class_grads(x, w, b, need_dx, need_dw, need_db)
    else:
        dx, dw, db = impl.backward(x, w, b, shard.local_target(tokens), opts, lse, coef, config, kept=kept,
                                   need_dx=need_dx, need_dw=need_dw, need_db=need_db, dx_acc=True, tau=tau)
    return rank_grads(shard, x, dx, dw, db, partial_dx)


def forward(impl, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
            tp: VocabParallelOptions, config):
    """(logp, entropy or None, lse, kept or None): the custom op's forward under TP
    (``config``: ``plan``'s)."""
    shard = vocab_shard(tp.tp_group, weight.shape[0], x.device, tp.vocab_size)
    check_targets_in_range(tokens, shard.vocab_size, opts.ignore_index, name="tokens")
    stats, kept = _merged_stats(impl, shard, x, weight, bias, tokens, opts, config)
    logp, ent = token_outputs(stats, tokens, shard.vocab_size, opts)
    return logp, ent, stats.lse, kept


def backward(impl, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], x: Tensor, weight: Tensor,
             bias: Optional[Tensor], tokens: Tensor, lse: Tensor, entropy_out: Optional[Tensor], opts: LogProbOptions,
             tp: VocabParallelOptions, config, *, need_dx: bool, need_dw: bool, need_db: bool, kept):
    """(dx, dW, db) of this rank (None where not needed): the custom op's backward under TP
    (``config``, ``kept``: the forward's)."""
    shard = vocab_shard(tp.tp_group, weight.shape[0], x.device, tp.vocab_size)  # cached: no collective
    coef = grad_coefficients(entropy_out if opts.entropy else None, tokens, grad_logp,
                             grad_entropy if opts.entropy else None, shard.vocab_size, opts, lse)
    return _rank_backward(impl, shard, x, weight, bias, tokens, opts, lse, coef, tp.partial_dx, config,
                          need_dx=need_dx, need_dw=need_dw, need_db=need_db, kept=kept)


class ShardedBackend:
    """A backend over a vocab-parallel head for ``truncation``'s steps: the contract of a
    backend (``forward``, ``grad_coefficients``, ``backward``) plus ``thresholds``, each
    over this rank's real rows with the statistics merged over the group; ``vocab_size``:
    the full vocabulary's. ``ordered``: the merges' sums in rank order (batch invariance)."""

    def __init__(self, impl, tp: VocabParallelOptions, weight: Tensor, device: torch.device, ordered: bool):
        self.impl, self.ordered = impl, ordered
        self.shard = vocab_shard(tp.tp_group, weight.shape[0], device, tp.vocab_size)
        self.vocab_size = self.shard.vocab_size
        self.partial_dx = tp.partial_dx

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
                config, *, outputs: bool = True, tau: Optional[Tensor] = None, keep: bool = True):
        """((logp, entropy or None, lse), kept or None) of the full rows."""
        stats, kept = _merged_stats(self.impl, self.shard, x, weight, bias, tokens, opts, config, tau=tau,
                                    ordered=self.ordered)
        logp, ent = token_outputs(stats, tokens, self.vocab_size, opts)
        return (logp, ent, stats.lse), kept

    def grad_coefficients(self, entropy: Optional[Tensor], tokens: Tensor, g_lp: Optional[Tensor],
                          g_h: Optional[Tensor], num_classes: int, opts: LogProbOptions, lse: Tensor) -> Tensor:
        return grad_coefficients(entropy, tokens, g_lp, g_h, self.vocab_size, opts, lse)

    def backward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
                 lse: Tensor, coef: Tensor, config, *, kept=None, need_dx: bool, need_dw: bool, need_db: bool,
                 dx_acc: bool = False, tau: Optional[Tensor] = None):
        return _rank_backward(self.impl, self.shard, x, weight, bias, tokens, opts, lse, coef, self.partial_dx,
                              config, need_dx=need_dx, need_dw=need_dw, need_db=need_db, kept=kept, tau=tau)

    def thresholds(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], opts: LogProbOptions, trunc,
                   budget: int, config) -> Tensor:
        """Per-token tau of the full rows: each rank's top-C candidates, row max and sum,
        merged over the group (``merge``), then ``formulas.truncation.resolve``. Triton (C
        <= MAX_CANDIDATES): the first pass is the candidates kernel on this rank's rows;
        rows it leaves (and every row otherwise) take ``truncation.thresholds``' chunked
        passes with the same merge."""
        shard, v = self.shard, self.vocab_size
        w, b = shard.real_rows(weight), shard.real_rows(bias)

        def merge(cand: Tensor, m: Tensor, s: Tensor, c: int):
            if cand.shape[1] < c:  # (fewer local columns than candidates)
                cand = F.pad(cand, (0, c - cand.shape[1]), value=-math.inf)
            cand = gather_rows(cand.contiguous(), shard.group).topk(min(c, v), dim=1).values
            big, s, _, _ = merge_online(shard.group, m, s, None, ordered=self.ordered)
            return cand, big, s

        search = getattr(config, "search", None)
        tiles = search.forward if search is not None else None
        kmax = trunc.k_max if trunc.k_max is not None else int(trunc.top_k.max())  # (host sync)
        c = candidate_count(kmax)
        if not self.impl.threshold_search or c > MAX_CANDIDATES or x.shape[0] == 0:
            return _thresholds(x, w, b, opts, trunc, budget, config.thresholds, tiles, vocab_size=v, merge=merge)
        cand, m, s = _candidates_triton(x, w, b, opts, c, config.candidate_tiles)
        cand, m, s = merge(cand, m, s, c)
        tau, ok = resolve(cand, m, s, v, trunc)
        tau = tau.to(compute_dtype(x.dtype))
        if not bool(ok.all()):  # (host sync; the same rows on every rank) the chunked passes, 4x C
            left = (~ok).nonzero()[:, 0]
            tau[left] = _thresholds(x[left], w, b, opts, trunc.rows(left), budget, config.thresholds, tiles,
                                    vocab_size=v, merge=merge, first_c=4 * c)
        return tau


def _candidates_triton(x: Tensor, w: Tensor, b: Optional[Tensor], opts: LogProbOptions, c: int, tiles):
    """(top-c descending (N, c), row max, row sum) of this rank's columns, fp32, from the
    Triton candidates kernel (``triton_lib.log_probs_candidates``; no logits) under the
    Config's candidates tiles; a rank without columns: (-inf, -inf, 0)."""
    n = x.shape[0]
    if w.shape[0] == 0:
        neg = torch.full((n,), -math.inf, dtype=torch.float32, device=x.device)
        return neg[:, None].expand(n, c), neg, torch.zeros_like(neg)
    from logitless.triton_lib import log_probs_candidates as LC

    none = torch.full((n,), -1, dtype=torch.int64, device=x.device)  # (no token logit needed)
    cand, m, s, _, _ = _merged_candidates(
        LC.candidates(x, w, b, none, tiles, opts.softcap, opts.temperature, c, False), c)
    return cand, m, s
