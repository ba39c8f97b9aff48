"""Top-k distillation (``linear_topk_kl``) for JAX, written once: the JAX twin of
``logitless/formulas/topk_kl.py`` (whose docstring is the spec; summary here).

The student's log-probabilities at temperature T from its fp32 logits z: a_j = z_j / T,
log q_j = a_j - lse(a). The teacher gives per token K distinct ids I and their log-probs
lp under its full distribution; p_i = exp(lp_i), q_i = q[I_i], P = sum p_i, Q = sum q_i:

    tail="none"         forward  sum p_i (lp_i - log q_i);  reverse  sum q_i (log q_i - lp_i)
    tail="renormalize"  the same over p_i / P and q_i / Q
    tail="bucket"       the same over K + 1 bins, the last one (1 - P, 1 - Q)

(0 log 0 = 0), plus hard_label_weight times the cross-entropy at T = 1 on the target.

What a backend computes per token of full rows (``TopKStats``): lse_tail = log sum over
the columns NOT among the ids of exp(a_j) (masked in the pass, so log(1 - Q) = lse_tail -
lse stays exact when the ids hold nearly all of the student's mass), z at the ids, z at
the target and lse(z) (hard labels). ``token_terms`` turns them into the loss and the
gradient's coefficients with O(tokens x K) work, in float64 when jax_enable_x64 is on,
else float32 (the torch twin always uses float64: here 1 - P of fp32 log-probs keeps
about 7 digits, not 15).

The gradient (d loss / d z) is dense outside the ids and sparse at them:

    dz_j = c_r exp(a_j - lse_tail) + c_q exp(z_j - lse1) - c_b [j = t]   (j not in I)
    dz_{I_k} = sparse_k

with (c_r, c_q, c_b) the per-token ``coef`` and ``sparse`` (N, K) (table in the torch
twin's docstring); both scale with the token's upstream gradient.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from logitless.options import TopKKLOptions


class TopKStats(NamedTuple):
    """Per-token statistics of full rows (fp32): lse_tail (N,) (-inf where the ids cover
    the vocabulary), z_ids (N, K) (z at the ids, any value at an id outside [0, V)), z_t
    (N,) z at the target and lse1 (N,) log sum_j exp(z_j) (both hard labels only, else None)."""

    lse_tail: jax.Array
    z_ids: jax.Array
    z_t: Optional[jax.Array] = None
    lse1: Optional[jax.Array] = None


class TopKTerms(NamedTuple):
    """``token_terms``' results: the per-token loss (fp32, 0 at ignored tokens) and, with
    ``grad``, for a unit upstream gradient the dense coefficients (3, N) and the sparse
    values (N, K) (fp32, 0 at ignored tokens)."""

    loss: jax.Array
    coef: Optional[jax.Array]
    sparse: Optional[jax.Array]


def wide_dtype():
    """float64 where jax_enable_x64 is on, else float32: the O(tokens x K) math's dtype."""
    return jnp.float64 if jax.config.read("jax_enable_x64") else jnp.float32


def log1mexp(x):
    """log(1 - exp(x)) for x <= 0, accurate everywhere (-inf at x >= 0)."""
    x = jnp.minimum(x, 0.0)
    return jnp.where(x > -math.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def _xlogy_terms(w, d):
    """w * d where w > 0, else 0 (a zero-mass bin adds nothing, even where d is -inf)."""
    return jnp.where(w > 0, w * d, 0.0)


def _logsumexp(x, axis):
    m = jnp.max(x, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return jnp.squeeze(m, axis) + jnp.log(jnp.sum(jnp.exp(x - m), axis=axis))


def token_terms(stats: TopKStats, teacher_log_probs, ids, target, opts: TopKKLOptions, num_classes: int, *,
                grad: bool) -> TopKTerms:
    """The loss of every token and, with ``grad``, its unit-gradient coefficients (module
    docstring), from the statistics of the full rows (``ids``: global, in the order of
    ``teacher_log_probs``)."""
    f = wide_dtype()
    t_inv = 1.0 / opts.temperature
    valid = target != opts.ignore_index
    ids_ok = (ids >= 0) & (ids < num_classes)
    z = jnp.where(ids_ok, stats.z_ids.astype(f), jnp.nan)
    a = z * t_inv
    lse_tail = stats.lse_tail.astype(f)
    lse_k = _logsumexp(a, 1)
    lse = jnp.logaddexp(lse_tail, lse_k)
    lq = a - lse[:, None]
    u = lse_tail - lse  # log(1 - Q), from the tail's own log-sum-exp
    lp = teacher_log_probs.astype(f)
    log_p = _logsumexp(lp, 1)
    forward = opts.direction == "forward"
    if opts.tail == "renormalize":
        lp_n = lp - log_p[:, None]
        lq_n = a - lse_k[:, None]
        p_n, q_n = jnp.exp(lp_n), jnp.exp(lq_n)
        if forward:
            loss = _xlogy_terms(p_n, lp_n - lq_n).sum(1)
            d = q_n - p_n
        else:
            loss = _xlogy_terms(q_n, lq_n - lp_n).sum(1)
            g_i = _xlogy_terms(q_n, lq_n - lp_n + 1.0)
            d = g_i - g_i.sum(1, keepdims=True) * q_n
        c_tail = jnp.zeros_like(lse)
    else:
        p, q = jnp.exp(lp), jnp.exp(lq)
        tail_q = jnp.exp(u)  # 1 - Q
        bucket = opts.tail == "bucket"
        if forward:
            loss = _xlogy_terms(p, lp - lq).sum(1)
            if bucket:
                log_pt = log1mexp(log_p)
                p_t = jnp.exp(log_pt)  # 1 - P
                loss = loss + _xlogy_terms(p_t, log_pt - u)
                d, c_tail = q - p, tail_q - p_t
            else:
                big_p = jnp.exp(log_p)
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
        lse1 = stats.lse1.astype(f) if opts.hard_at_other_temperature else lse
        in_range = (target >= 0) & (target < num_classes)
        hard = jnp.where(valid & ~in_range, jnp.nan, lse1 - stats.z_t.astype(f))
        loss = loss + hw * hard
    loss = jnp.where(valid, loss, 0.0).astype(jnp.float32)
    if not grad:
        return TopKTerms(loss, None, None)
    sparse = d * t_inv
    c_r, c_q = c_tail * t_inv, jnp.zeros_like(c_tail)
    c_b = jnp.full_like(c_tail, hw)
    if opts.hard:
        sparse = sparse + hw * (jnp.exp(z - lse1[:, None]) - (ids == target[:, None]).astype(f))
        if opts.hard_at_other_temperature:
            c_q = jnp.full_like(c_tail, hw)
        else:
            c_r = c_r + hw * jnp.exp(u)  # q_j = (1 - Q) r_j on the tail's columns
    coef = jnp.where(valid[None, :], jnp.stack([c_r, c_q, c_b]), 0.0).astype(jnp.float32)
    sparse = jnp.where(valid[:, None], sparse, 0.0).astype(jnp.float32)
    return TopKTerms(loss, coef, sparse)


def masked_logits(z, ids_local):
    """z of a tile of full rows (fp32, (rows, V_l)) with -inf at each row's ids
    (``ids_local`` (rows, K): column ids of this tile, any value outside [0, V_l) for
    an id that is not here): the scatter writes K values per row, nothing else."""
    rows, v = z.shape
    here = (ids_local >= 0) & (ids_local < v)
    cols = jnp.where(here, ids_local, v)  # out of bounds: dropped
    r = jnp.broadcast_to(jnp.arange(rows)[:, None], ids_local.shape)
    return z.at[r, cols].set(-jnp.inf, mode="drop")


def gather_ids(z, ids_local):
    """z at each row's ids that fall in this tile's columns, 0 at the others: (rows, K)."""
    v = z.shape[1]
    here = (ids_local >= 0) & (ids_local < v)
    got = jnp.take_along_axis(z, jnp.clip(ids_local, 0, v - 1), axis=1)
    return jnp.where(here, got, 0.0)


def dense_dlogits(z_masked, lse_tail, lse1, coef, target_local, opts: TopKKLOptions):
    """The dense part of d loss / d z of a tile of rows (columns 0.. of this tile;
    ``target_local`` in the tile's column ids): c_r exp(a - lse_tail) + c_q exp(z -
    lse1) - c_b [j = t] (0 at the -inf id columns of ``z_masked``, which the caller
    overwrites with the sparse values). ``lse_tail`` -inf is taken as 0 (no column
    outside the ids: every one is overwritten)."""
    c_r, c_q, c_b = coef[0][:, None], coef[1][:, None], coef[2][:, None]
    shift = jnp.where(lse_tail == -jnp.inf, 0.0, lse_tail)[:, None]
    a = z_masked / opts.temperature if opts.temperature != 1.0 else z_masked
    dz = c_r * jnp.exp(a - shift)
    if opts.hard_at_other_temperature:
        dz = dz + c_q * jnp.exp(z_masked - lse1[:, None])
    if opts.hard:
        cols = jnp.arange(z_masked.shape[1], dtype=target_local.dtype)
        dz = dz - jnp.where(cols[None, :] == target_local[:, None], c_b, 0.0)
    return dz


def put_sparse(dz, ids_local, sparse):
    """dz (rows, cols) with ``sparse`` (rows, K) written at each row's ids in its columns
    (ids outside [0, cols) dropped; distinct ids: no collisions)."""
    rows, v = dz.shape
    here = (ids_local >= 0) & (ids_local < v)
    cols = jnp.where(here, ids_local, v)
    r = jnp.broadcast_to(jnp.arange(rows)[:, None], ids_local.shape)
    return dz.at[r, cols].set(sparse.astype(dz.dtype), mode="drop")
