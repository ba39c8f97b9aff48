"""Top-k distillation (``linear_topk_kl``), written once (the spec).

The student's log-probabilities at a temperature T, from its soft-capped logits z (soft-cap
s: z <- s tanh(z / s)):

    a_j    = z_j / T,   lse = log sum_j exp(a_j),   log q_j = a_j - lse

The teacher gives, per token, K distinct ids I_1..I_K and its log-probabilities lp_i of them
under its full distribution (what vLLM returns). With p_i = exp(lp_i), q_i = q[I_i],
P = sum p_i and Q = sum q_i, the per-token loss is

    tail="none"         forward  sum p_i (lp_i - log q_i)
                        reverse  sum q_i (log q_i - lp_i)
    tail="renormalize"  the same over p_i / P and q_i / Q
    tail="bucket"       the same over K + 1 bins, the last one (1 - P, 1 - Q)

(0 log 0 = 0), plus ``hard_label_weight`` times the cross-entropy at temperature 1 on the
target, lse1 - z_t with lse1 = log sum_j exp(z_j). Tokens whose target is ``ignore_index``
count for nothing.

What a backend computes per token (``TopKStats``), with no (tokens x vocab) tensor:

    lse_tail = log sum_{j not in I} exp(a_j)   the tail's log-sum-exp, masked IN the pass
                                               (-inf when the ids cover the vocabulary)
    z_ids    z at the ids                       (K per token)
    z_t, lse1                                   the hard-label term's (lse1 only at T != 1)

Everything else follows, in float64 (O(tokens x K) work):

    lse_K      = log sum_i exp(a_{I_i})            log Q = lse_K - lse
    lse        = logaddexp(lse_tail, lse_K)        a sum of two positive parts: exact
    log(1 - Q) = lse_tail - lse                    never log(1 - Q) from Q: when the ids hold
                                                   nearly all of the student's mass, 1 - Q
                                                   is lost to rounding, lse_tail is not
    log P      = logsumexp(lp)                     (float64: 1 - P of fp32 log-probs stays
    log(1 - P) = log1mexp(log P)                    exact down to ~1e-15; P >= 1 gives 0)

renormalize: log p'_i = lp_i - log P, log q'_i = a_i - lse_K.

Gradient. With d a_j / d z_j = 1 / T, r_j = exp(a_j - lse_tail) (the tail's own softmax:
q_j = (1 - Q) r_j on the columns outside I), per token, for a unit upstream gradient:

    dL/da_j = c_tail r_j [j not in I]  +  d_k [j = I_k]

    direction, tail        c_tail                               d_k
    forward, none          P (1 - Q)                            P q_k - p_k
    forward, bucket        (1 - Q) - (1 - P)                    q_k - p_k
    forward, renormalize   0                                    q'_k - p'_k
    reverse, none          -G (1 - Q)                           g_k - G q_k
    reverse, bucket        (1 - Q)(u - log(1 - P) + 1 - G - g)  g_k - (G + g) q_k
    reverse, renormalize   0                                    g'_k - G' q'_k

with g_i = q_i (log q_i - lp_i + 1), G = sum g_i, u = log(1 - Q) and g = (1 - Q)(u -
log(1 - P) + 1) (0 when 1 - Q = 0); g'_i, G' the same over q', p'. (The forward bucket's
c_tail is a difference of two small numbers, each exact: not P - Q, which cancels.) The
hard-label term adds hard_label_weight (q1_j - [j = t]) in z, q1_j = exp(z_j - lse1): at T = 1
on the tail columns that is (1 - Q) r_j, folded into c_tail; at T != 1 a term of its own.

So d loss / d z_j (times 1 - (z_j / s)^2 with a soft-cap) on the columns outside the ids is

    dz_j = c_r exp(a_j - lse_tail) + c_q exp(z_j - lse1) - c_b [j = t]

with the per-token ``coef`` = (c_r, c_q, c_b) (``grad_terms``: c_r = c_tail / T plus the
folded hard term, c_q = hard_label_weight at T != 1, c_b = hard_label_weight), and at the
ids it is the per-(token, k) ``sparse`` value (d_k / T plus the hard term, the soft-cap's
factor included): a dense kernel of cross-entropy's shape, then K values overwritten per
token (distinct ids: no collisions). Both are zero at ignored tokens and scale with the
token's upstream gradient.

Bad values: an id outside [0, V) makes its token's loss and gradient NaN (the CPU raises
first); P > 1 (rounding) counts as P = 1 (an empty tail bin; reverse with a bucket: a tail
the student keeps and the teacher does not gives inf, as the definition does).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype, sub_at_target_
from logitless.options import TopKKLOptions


class TopKStats(NamedTuple):
    """Per-token statistics a backend computes from each row (compute dtype: fp32, fp64
    for fp64 inputs); the ids in the order given to the backend (ascending)."""

    lse_tail: Tensor  # (N,) log sum_{j not in ids} exp(a_j); -inf where no column is left
    z_ids: Tensor  # (N, K) soft-capped logits at the ids (any value at an id outside [0, V))
    z_t: Optional[Tensor]  # (N,) soft-capped logit at the target (hard labels), else None
    lse1: Optional[Tensor]  # (N,) log sum_j exp(z_j) (hard labels at T != 1), else None


class TopKTerms(NamedTuple):
    """``token_terms``' results (compute dtype): the per-token loss (0 at ignored tokens),
    the counted weight w (1, 0 at ignored tokens: the mean's denominator), and for a unit
    upstream gradient the dense coefficients ``coef`` (3, N) = (c_r, c_q, c_b) and the
    ``sparse`` (N, K) d loss / d z at the ids (None without ``grad``)."""

    loss: Tensor
    w: Tensor
    coef: Optional[Tensor]
    sparse: Optional[Tensor]


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, accurate everywhere (-inf at x >= 0)."""
    x = torch.clamp(x, max=0.0)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _xlogy_terms(w: Tensor, d: Tensor) -> Tensor:
    """w * d where w > 0, else 0 (0 log 0 = 0: a zero-mass bin adds nothing, even when its
    log is -inf)."""
    return torch.where(w > 0, w * d, torch.zeros_like(d))


def token_terms(stats: TopKStats, teacher_log_probs: Tensor, ids: Tensor, target: Tensor, opts: TopKKLOptions,
                num_classes: int, *, grad: bool) -> TopKTerms:
    """The loss of every token and, with ``grad``, its unit-gradient coefficients (module
    docstring), from the statistics of the full rows. ``ids``: the ids the statistics were
    taken at (global), ``teacher_log_probs`` in the same order."""
    cd = compute_dtype(stats.lse_tail.dtype)
    f64 = torch.float64
    t_inv = 1.0 / opts.temperature
    valid = target != opts.ignore_index
    ids_ok = (ids >= 0) & (ids < num_classes)
    z = torch.where(ids_ok, stats.z_ids.to(f64), torch.full((), math.nan, dtype=f64, device=ids.device))
    a = z * t_inv
    lse_tail = stats.lse_tail.to(f64)
    lse_k = torch.logsumexp(a, dim=1)
    lse = torch.logaddexp(lse_tail, lse_k)
    lq = a - lse[:, None]
    u = lse_tail - lse  # log(1 - Q)
    lp = teacher_log_probs.to(f64)
    log_p = torch.logsumexp(lp, dim=1)
    forward = opts.direction == "forward"
    c_tail = None
    if opts.tail == "renormalize":
        lp_n = lp - log_p[:, None]
        lq_n = a - lse_k[:, None]
        p_n, q_n = torch.exp(lp_n), torch.exp(lq_n)
        if forward:
            loss = _xlogy_terms(p_n, lp_n - lq_n).sum(1)
            d = q_n - p_n
        else:
            loss = _xlogy_terms(q_n, lq_n - lp_n).sum(1)
            g_i = _xlogy_terms(q_n, lq_n - lp_n + 1.0)
            d = g_i - g_i.sum(1, keepdim=True) * q_n
        c_tail = torch.zeros_like(lse)
    else:
        p, q = torch.exp(lp), torch.exp(lq)
        tail_q = torch.exp(u)  # 1 - Q
        bucket = opts.tail == "bucket"
        if forward:
            loss = _xlogy_terms(p, lp - lq).sum(1)
            if bucket:
                log_pt = log1mexp(log_p)
                p_t = torch.exp(log_pt)  # 1 - P
                loss = loss + _xlogy_terms(p_t, log_pt - u)
                d, c_tail = q - p, tail_q - p_t
            else:
                big_p = torch.exp(log_p)
                d, c_tail = big_p[:, None] * q - p, big_p * tail_q
        else:
            loss = _xlogy_terms(q, lq - lp).sum(1)
            g_i = _xlogy_terms(q, lq - lp + 1.0)
            big_g = g_i.sum(1)
            if bucket:
                log_pt = log1mexp(log_p)
                loss = loss + _xlogy_terms(tail_q, u - log_pt)
                g_t = _xlogy_terms(tail_q, u - log_pt + 1.0)
                d = g_i - (big_g + g_t)[:, None] * q
                c_tail = _xlogy_terms(tail_q, u - log_pt + 1.0 - big_g - g_t)
            else:
                d, c_tail = g_i - big_g[:, None] * q, -big_g * tail_q
    hw = opts.hard_label_weight
    if opts.hard:
        lse1 = stats.lse1.to(f64) if opts.hard_at_other_temperature else lse
        in_range = (target >= 0) & (target < num_classes)
        hard = lse1 - stats.z_t.to(f64)
        hard = torch.where(valid & ~in_range, torch.full_like(hard, math.nan), hard)
        loss = loss + hw * hard
    loss = torch.where(valid, loss, torch.zeros_like(loss)).to(cd)
    w = valid.to(cd)
    if not grad:
        return TopKTerms(loss, w, None, None)
    sparse = d * t_inv
    c_r, c_q = c_tail * t_inv, torch.zeros_like(c_tail)
    c_b = torch.full_like(c_tail, hw)
    if opts.hard:
        sparse = sparse + hw * (torch.exp(z - lse1[:, None]) - (ids == target[:, None]).to(f64))
        if opts.hard_at_other_temperature:
            c_q = torch.full_like(c_tail, hw)
        else:
            c_r = c_r + hw * torch.exp(u)  # q_j = (1 - Q) r_j
    if opts.softcap is not None:
        sparse = sparse * (1.0 - (z / opts.softcap) ** 2)
    coef = torch.stack([c_r, c_q, c_b])
    coef = torch.where(valid, coef, torch.zeros_like(coef)).to(cd)
    sparse = torch.where(valid[:, None], sparse, torch.zeros_like(sparse)).to(cd)
    return TopKTerms(loss, w, coef, sparse)


def dlogits_(z: Tensor, lse_tail: Tensor, lse1: Optional[Tensor], coef: Tensor, target: Tensor, col0: int,
             opts: TopKKLOptions) -> Tensor:
    """A tile of soft-capped logits z (rows: tokens, columns col0..) -> the dense part of
    d loss / d (pre-cap) z, in place: c_r exp(a - lse_tail) + c_q exp(z - lse1) - c_b [j = t],
    times the soft-cap's factor (module docstring; the PyTorch form of the kernels'
    epilogue). The ids' columns come out with any value: the caller overwrites them with
    ``sparse``. ``lse_tail``: -inf taken as 0 (no column outside the ids: every one is
    overwritten). One more tile with a soft-cap or at T != 1 with hard labels."""
    c_r, c_q, c_b = coef
    factor = None
    if opts.softcap is not None:
        factor = torch.div(z, opts.softcap).square_().neg_().add_(1.0)
    q1 = None
    if opts.hard_at_other_temperature:
        q1 = (z - lse1[:, None]).exp_().mul_(c_q[:, None])
    shift = torch.where(lse_tail == -math.inf, torch.zeros_like(lse_tail), lse_tail)
    if opts.temperature != 1.0:
        z.div_(opts.temperature)
    z.sub_(shift[:, None]).exp_().mul_(c_r[:, None])
    if q1 is not None:
        z.add_(q1)
        del q1
    if opts.hard:
        sub_at_target_(z, target, col0, c_b)
    if factor is not None:
        z.mul_(factor)
    return z
