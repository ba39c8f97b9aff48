"""The distillation (generalized Jensen-Shannon) formulas for JAX, written once: the JAX
twin of ``logitless/formulas/jsd.py`` (whose docstring is the spec; summary here).

Per token (a row), for class c, with the student's and the teacher's fp32 logits zs, zt
and temperature T:

    a_c = zs_c / T,  b_c = zt_c / T,  lp_c = a_c - lse(a),  lq_c = b_c - lse(b)
    lm_c = log(beta q_c + (1 - beta) p_c)        (lp for beta == 0, lq for beta == 1)
    S = sum_c p_c (lp_c - lm_c),  K = sum_c q_c (lq_c - lm_c)      (0 log 0 = 0)
    loss = wq K + wp S + hlw (lse(zs) - zs_target)

with (wq, wp) = (beta, 1 - beta), (1, 0) at beta == 0, (0, 1) at beta == 1 (the exact
KL limits, ``JSDOptions.weights``) and hlw the hard-label weight (cross-entropy at T = 1).
No T**2 factor. The gradient with respect to the student's logit zs_j, for the upstream
gradient g of the token's loss:

    dz_j = g [ (wp p_j (lp_j - lm_j - S) + c0 (p_j - q_j)) / T + hlw (p1_j - [j == t]) ]

(c0 = 1 iff beta == 0; p1 = softmax(zs)). S depends on the whole row: the statistics
(``JsdStats``) need full rows before any dz. Two phases per row so that rows split over
the vocabulary (a tensor-parallel head) merge exactly: the log-sum-exps first
(``row_lses``, merged over the devices), then the sums with the merged ones
(``row_sums``, summed over them).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from logitless.jax.formulas.cross_entropy import logsumexp_rows
from logitless.options import JSDOptions


class JsdStats(NamedTuple):
    """Per-token fp32 statistics of full rows (each (N,)): lse of a and of b, S, K, and
    with hard labels lse(zs) and zs at the target (else None)."""

    lse_s: jax.Array
    lse_t: jax.Array
    s: jax.Array
    k: jax.Array
    lse1: Optional[jax.Array] = None
    z_target: Optional[jax.Array] = None


def row_lses(zs, zt, opts: JSDOptions):
    """(lse(a), lse(b), lse(zs) | None) of a tile of rows: the first phase."""
    t = opts.temperature
    lse_s = logsumexp_rows(zs / t if t != 1.0 else zs)
    lse_t = logsumexp_rows(zt / t if t != 1.0 else zt)
    lse1 = None
    if opts.needs_lse1:
        lse1 = lse_s if t == 1.0 else logsumexp_rows(zs)
    return lse_s, lse_t, lse1


def log_mixture(lp, lq, beta: float):
    """lm of the module docstring."""
    if beta == 0.0:
        return lp
    if beta == 1.0:
        return lq
    return jnp.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))


def _plogratio(p, lp, lm):
    """p (lp - lm) with 0 where p == 0 (NaN stays NaN)."""
    return jnp.where(p == 0, 0.0, p * (lp - lm))


def _log_probs(zs, zt, lse_s, lse_t, opts: JSDOptions):
    t = opts.temperature
    a = zs / t if t != 1.0 else zs
    b = zt / t if t != 1.0 else zt
    return a - lse_s[:, None], b - lse_t[:, None]


def row_sums(zs, zt, lse_s, lse_t, opts: JSDOptions):
    """(S, K) of a tile of rows (its columns only) with the full rows' lse(a), lse(b):
    the second phase. A term whose weight is 0 (S at beta == 0, K at beta == 1) is 0."""
    wq, wp, _ = opts.weights
    lp, lq = _log_probs(zs, zt, lse_s, lse_t, opts)
    lm = log_mixture(lp, lq, opts.beta)
    zero = jnp.zeros(zs.shape[:1], zs.dtype)
    s = jnp.sum(_plogratio(jnp.exp(lp), lp, lm), axis=1) if wp != 0.0 else zero
    k = jnp.sum(_plogratio(jnp.exp(lq), lq, lm), axis=1) if wq != 0.0 else zero
    return s, k


def target_logit(zs, target, col0=0):
    """zs at the target's column per row of a tile whose columns start at ``col0`` (0
    where the target is not among them)."""
    cols = col0 + jnp.arange(zs.shape[1], dtype=target.dtype)
    return jnp.sum(jnp.where(cols[None, :] == target[:, None], zs, 0.0), axis=1)


def token_loss(stats: JsdStats, target, num_classes: int, opts: JSDOptions):
    """Per-token loss (0 at ignored tokens; NaN at a counted target outside [0, V) when
    the hard-label term is on)."""
    wq, wp, _ = opts.weights
    loss = wq * stats.k + wp * stats.s
    valid = target != opts.ignore_index
    if opts.hard_label_weight != 0.0:
        loss = loss + opts.hard_label_weight * (stats.lse1 - stats.z_target)
        bad = valid & ((target < 0) | (target >= num_classes))
        loss = jnp.where(bad, jnp.nan, loss)
    return jnp.where(valid, loss, 0.0)


def dlogits(zs, zt, stats: JsdStats, g, target, col0, opts: JSDOptions):
    """d loss / d student logits of a tile (rows: tokens; columns col0 .., global ids),
    fp32, for the per-token upstream gradient g (0 at ignored tokens): the module
    docstring's line. zs, zt: the tile's fp32 logits; stats of the full rows."""
    t = opts.temperature
    _, wp, c0 = opts.weights
    lp, lq = _log_probs(zs, zt, stats.lse_s, stats.lse_t, opts)
    p = jnp.exp(lp)
    da = jnp.zeros_like(zs)
    if wp != 0.0:
        lm = log_mixture(lp, lq, opts.beta)
        da = da + wp * jnp.where(p == 0, 0.0, p * (lp - lm - stats.s[:, None]))
    if c0 != 0.0:
        da = da + c0 * (p - jnp.exp(lq))
    dz = da * (g / t)[:, None]
    if opts.hard_label_weight != 0.0:
        p1 = jnp.exp(zs - stats.lse1[:, None])
        cols = col0 + jnp.arange(zs.shape[1], dtype=target.dtype)
        hit = cols[None, :] == target[:, None]
        dz = dz + (opts.hard_label_weight * g)[:, None] * (p1 - jnp.where(hit, 1.0, 0.0))
    return dz
