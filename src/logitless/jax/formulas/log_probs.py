"""Token log-probabilities and entropy for JAX, written once: the JAX twin of
``logitless/formulas/log_probs.py`` (whose docstring is the spec; summary here).

For a token's row of logits z (soft-capped first when ``softcap`` s is set) and T > 0:

    a_c  = z_c / T              (fp32, from the fp32 logits)
    lse  = log sum_c exp(a_c),  logp = a_t - lse,  H = lse - sum_c p_c a_c

Online statistics over column tiles: running max m, s = sum exp(a - m),
u = sum exp(a - m) (a - m) (entropy only); when m grows to m',
s <- e^(m - m') s + ...,  u <- e^(m - m') (u + (m - m') s) + ...;
finally lse = m + log s and H = log s - u / s.

Gradient for upstream g_lp, g_H of a token (w.r.t. the soft-capped logit z_j):

    dz_j = p_j (A + C log p_j) - B [j == t]
    A = -(g_lp + g_H H) / T,  B = -g_lp / T,  C = -g_H / T

times (1 - (z_j / s)^2) with a soft-cap. Coefficients are 0 at ignored tokens and NaN
at tokens outside [0, V).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from logitless.options import LogProbOptions

_F32 = jnp.float32


def _masks(tokens, num_classes: int, opts: LogProbOptions):
    valid = tokens != opts.ignore_index
    bad = valid & ((tokens < 0) | (tokens >= num_classes))
    return valid, bad


def compute_dtype(dtype):
    """fp32 statistics, fp64 for fp64 inputs."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.dtype(jnp.float64) else _F32


def scaled_logits(z, opts: LogProbOptions):
    """fp32 logits z (pre-cap) -> a = softcap(z) / T."""
    if opts.softcap is not None:
        z = opts.softcap * jnp.tanh(z / opts.softcap)
    if opts.temperature != 1.0:
        z = z / opts.temperature
    return z


def online_update(a, m, s, u: Optional[jnp.ndarray]):
    """One step of the online statistics over a (rows, cols) tile of scaled logits a:
    returns the new (m, s, u) (u None without entropy)."""
    m_new = jnp.maximum(m, jnp.max(a, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    d = m - m_safe  # -inf while the row had nothing (then s = u = 0)
    scale = jnp.exp(d)
    a = a - m_safe[:, None]
    e = jnp.exp(a)
    s_new = s * scale + jnp.sum(e, axis=1)
    u_new = None
    if u is not None:
        corr = jnp.where(s > 0, d * s, 0.0)
        ea = jnp.where(e > 0, e * a, 0.0)
        u_new = scale * (u + corr) + jnp.sum(ea, axis=1)
    return m_new, s_new, u_new


def finish(m, s, u):
    """(lse, H or None) from the statistics (m, s, u)."""
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    log_s = jnp.log(s)
    return m_safe + log_s, (None if u is None else log_s - u / s)


def token_outputs(lse, target, ent, tokens, num_classes: int, opts: LogProbOptions):
    """(logp, H or None) per token in lse's dtype (fp32; fp64 for fp64 inputs): 0 at ignored
    tokens, NaN at out-of-range ones."""
    valid, bad = _masks(tokens, num_classes, opts)

    def clean(t):
        t = jnp.where(valid, t, 0.0)
        return jnp.where(bad, jnp.nan, t).astype(lse.dtype)

    return clean(target - lse), (None if ent is None else clean(ent))


def grad_coefficients(ent, tokens, g_lp, g_h, num_classes: int, opts: LogProbOptions, dtype=_F32):
    """(A, B, C) of the module docstring as a (3, N) array in ``dtype`` (the compute
    dtype); a missing upstream gradient (None) counts as 0."""
    inv_t = 1.0 / opts.temperature
    g_lp = jnp.zeros(tokens.shape, dtype) if g_lp is None else g_lp.astype(dtype).reshape(-1)
    if g_h is not None and ent is not None:
        g_h = g_h.astype(dtype).reshape(-1)
        a = -(g_lp + g_h * ent) * inv_t
        c = -g_h * inv_t
    else:
        a = -g_lp * inv_t
        c = jnp.zeros_like(g_lp)
    coef = jnp.stack([a, -g_lp * inv_t, c])
    valid, bad = _masks(tokens, num_classes, opts)
    coef = jnp.where(valid[None, :], coef, 0.0)
    return jnp.where(bad[None, :], jnp.nan, coef).astype(dtype)


def dlogits(a, lse, coef, tokens, col0, opts: LogProbOptions):
    """A tile of scaled logits a = softcap(z) / T (rows: tokens, columns col0 ...) ->
    d / d(pre-cap z): the one place the backward epilogue is written in JAX."""
    a_c, b, c = coef[0][:, None], coef[1][:, None], coef[2][:, None]
    logp = a - lse[:, None]
    p = jnp.exp(logp)
    if opts.entropy:
        dz = jnp.where(p > 0, p * (a_c + c * logp), 0.0)  # p log p -> 0
    else:
        dz = p * a_c
    cols = col0 + jnp.arange(a.shape[1], dtype=tokens.dtype)
    dz = dz - jnp.where(cols[None, :] == tokens[:, None], b, 0.0)
    if opts.softcap is not None:
        capped = a * (opts.temperature / opts.softcap)
        dz = dz * (1.0 - capped * capped)
    return dz


def merge_splits(part_max, part_sum, part_u: Optional[jnp.ndarray]):
    """(lse, H or None) of rows whose statistics (m, s, u) were computed in parts along
    axis 0 (vocabulary splits): M = max_j m_j (0 where every part is -inf),
    s = sum_j e^(m_j - M) s_j, u = sum_j e^(m_j - M) (u_j + (m_j - M) s_j), then
    ``finish``. The twin of ``logitless.formulas.log_probs.merge_splits``."""
    big_m = part_max.max(axis=0)
    m_safe = jnp.where(big_m == -jnp.inf, 0.0, big_m)
    d = part_max - m_safe[None]
    scale = jnp.exp(d)
    s = jnp.sum(part_sum * scale, axis=0)
    u = None
    if part_u is not None:
        corr = jnp.where(part_sum > 0, d * part_sum, 0.0)
        u = jnp.sum(scale * (part_u + corr), axis=0)
    return finish(big_m, s, u)
