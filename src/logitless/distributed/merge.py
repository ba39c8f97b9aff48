"""Collectives that merge per-shard row statistics into those of the full row.

Every function runs the same collectives on every rank of the group, in the same order,
on tensors of the same shapes (O(tokens) elements): no host sync, no float atomics (NCCL
and gloo give every rank the same reduced values, so the merged statistics, and what is
computed from them, are identical on every rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch
from torch import Tensor


class Merged(NamedTuple):
    """``merge_shards``' results, in the order of its arguments."""

    lse: list  # the full rows' log-sum-exps
    sums: list  # plain sums over all columns
    means: list  # expectations under the full rows' softmax
    maxes: list  # maxima over all columns


def _all_reduce(t: Tensor, op, pg) -> None:
    import torch.distributed as dist

    dist.all_reduce(t, op=op, group=pg)


def merge_shards(pg, lse: Sequence[Tensor], *, sums: Sequence[Tensor] = (),
                 means: Sequence[tuple[Tensor, int]] = (), maxes: Sequence[Tensor] = (),
                 ordered: bool = False) -> Merged:
    """Merge each rank's statistics of its columns into the full rows' (two collectives).

    lse:   log-sum-exps over this rank's columns, one (N,) tensor per distribution (-inf
           for a rank without columns). Merged: M = max_r lse_r, lse = M + log sum_r
           exp(lse_r - M) (M taken as 0 where every rank has -inf).
    sums:  (N,) plain sums over this rank's columns (0 where none apply): summed.
    means: (values, k): values = E^r[f] = sum_c exp(z_c - lse_r[k]) f_c, an expectation
           under this rank's own softmax of distribution k. Merged: sum_r exp(lse_r - M)
           E^r[f] / sum_r exp(lse_r - M) (a rank whose weight is 0 adds 0, even if its
           values are NaN for want of columns; a NaN lse still makes the result NaN).
    maxes: (N,) maxima over this rank's columns: their maxima.

    Collective 1: MAX of the stacked lse's and maxes; collective 2: SUM of the stacked
    exp(lse_r - M), sums and weighted means. All tensors share one float dtype.
    ``ordered``: the SUM added in rank order (``sum_in_rank_order``; batch invariance).
    """
    import torch.distributed as dist

    k = len(lse)
    top = torch.stack([*lse, *maxes])
    _all_reduce(top, dist.ReduceOp.MAX, pg)
    big = top[:k]
    safe = torch.where(big == float("-inf"), torch.zeros_like(big), big)
    weights = torch.exp(torch.stack(list(lse)) - safe)
    weighted = [torch.where(weights[j] == 0, torch.zeros_like(v), weights[j] * v) for v, j in means]
    packed = torch.cat([weights, *(t[None] for t in (*sums, *weighted))])
    packed = _sum(packed, pg, ordered)
    total = packed[:k]
    merged_lse = safe + torch.log(total)
    summed = [packed[k + i] for i in range(len(sums))]
    meaned = [packed[k + len(sums) + i] / total[j] for i, (_, j) in enumerate(means)]
    return Merged(list(merged_lse), summed, meaned, list(top[k:]))


def merge_argmax(pg, best: Tensor, argmax: Tensor, best_all: Tensor) -> Tensor:
    """The first global index of the row maximum (as ``torch.argmax``): ``best``/``argmax``
    are this rank's maximum and its first GLOBAL index, ``best_all`` the maximum over
    all ranks (from ``merge_shards``' maxes). One MIN collective of N int64; rows whose
    maximum is nowhere equal to ``best_all`` (NaN) get int64's maximum."""
    import torch.distributed as dist

    none = torch.full_like(argmax, torch.iinfo(torch.int64).max)
    candidate = torch.where(best == best_all, argmax.to(torch.int64), none)
    _all_reduce(candidate, dist.ReduceOp.MIN, pg)
    return candidate


def all_reduce_(t: Tensor, pg) -> Tensor:
    """In-place SUM over the group (the partial gradients of x); returns ``t``."""
    import torch.distributed as dist

    _all_reduce(t, dist.ReduceOp.SUM, pg)
    return t


def sum_in_rank_order(t: Tensor, pg) -> Tensor:
    """The elementwise sum over the group of every rank's ``t``, added in rank order
    (((t_0 + t_1) + t_2) + ...) after an all-gather: each element's bits depend on the
    ranks' values only, not on the tensor's size or the collective's algorithm (an
    all-reduce's order may follow the message size: batch invariance needs this)."""
    parts = _gather(t, pg)
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def gather_rows(t: Tensor, pg) -> Tensor:
    """(N, K) from every rank -> (N, world * K): the ranks' columns side by side, in rank order."""
    return torch.cat(_gather(t, pg), dim=1)


def _gather(t: Tensor, pg) -> list:
    """Every rank's ``t``, in rank order (one all-gather)."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(parts, t.contiguous(), group=pg)
    return parts


def _sum(packed: Tensor, pg, ordered: bool) -> Tensor:
    """The SUM over the group of ``packed``: an all-reduce, or in rank order (``ordered``)."""
    import torch.distributed as dist

    if ordered:
        return sum_in_rank_order(packed, pg)
    _all_reduce(packed, dist.ReduceOp.SUM, pg)
    return packed


def merge_online(pg, m: Tensor, s: Tensor, u: Optional[Tensor], sums: Sequence[Tensor] = (), *,
                 ordered: bool = False):
    """Merge each rank's online softmax statistics (``formulas.log_probs``) of its columns
    into the full rows' (two collectives): (M, s, u or None, sums).

    m, s, u: (N,) running max, sum_c exp(a_c - m) and sum_c exp(a_c - m) (a_c - m) over
    this rank's columns (m = -inf, s = u = 0 for a rank without columns; u None when no
    entropy is wanted); sums: (N,) plain sums over this rank's columns (the token's a).
    Collective 1: MAX of m -> M; collective 2: SUM of the stacked e^(m - M) s,
    e^(m - M) (u + (m - M) s) and the sums (M taken as 0 where every rank has -inf).
    ``formulas.log_probs.finish(M, s, u)`` then gives the full rows' lse and entropy;
    the differences m - M keep the entropy free of cancellation between large numbers.
    ``ordered``: the SUM added in rank order (``sum_in_rank_order``; batch invariance).
    """
    import torch.distributed as dist

    big = m.clone()
    _all_reduce(big, dist.ReduceOp.MAX, pg)
    safe = torch.where(big == float("-inf"), torch.zeros_like(big), big)
    d = m - safe  # -inf for a rank without columns (then s = u = 0)
    scale = torch.exp(d)
    parts = [scale * s]
    if u is not None:
        corr = torch.where(s > 0, d * s, torch.zeros_like(s))
        parts.append(scale * (u + corr))
    packed = torch.stack([*parts, *sums])
    packed = _sum(packed, pg, ordered)
    k = len(parts)
    return big, packed[0], (packed[1] if u is not None else None), [packed[k + i] for i in range(len(sums))]
