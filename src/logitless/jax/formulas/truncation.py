"""Truncated sampling (min-p, top-k, top-p) as one per-row threshold, for JAX: the twin
of ``logitless/formulas/truncation.py`` (whose docstring is the spec): the kept set is
{a >= tau}; tau is the midpoint between the last kept and the first dropped value of
the row's descending candidates (``resolve``), or, for rows the candidates do not
settle, the bisection of ``ops/linear_log_probs/truncation.py``."""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp
import numpy as np

#: Candidates: at least this many, and more than a Python-int top_k.
MIN_CANDIDATES = 64
#: Candidates for a per-token top_k array (its values are not known at trace time):
#: values above this - 1 leave their rows to the bisection.
ARRAY_TOP_K_CANDIDATES = 1025


def _is_concrete(a) -> bool:
    try:
        np.asarray(a)
        return True
    except Exception:  # a tracer
        return False


def _bound(v) -> str:
    """A range bound as a reader writes it: 2147483647, not 2.14748e+09."""
    return str(int(v)) if float(v).is_integer() and abs(v) >= 1e6 else f"{v:g}"


def check_param(name, value, shape, lo, hi, lo_open, off, hint, integer=False):
    """(N,) array of the parameter, or None when it is off (a Python number); ValueError
    for a number (or a concrete array) out of range."""
    n = int(np.prod(shape))
    rng = f"{'(' if lo_open else '['}{_bound(lo)}, {_bound(hi)}]"
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number or an array, got bool")
    if isinstance(value, numbers.Real) and not hasattr(value, "shape"):  # (Python numbers)
        v = float(value)
        if not math.isfinite(v) or not ((lo < v) if lo_open else (lo <= v)) or v > hi:
            raise ValueError(f"{name} must be in {rng} ({hint}), got {value}")
        if integer and v != int(v):
            raise ValueError(f"{name} must be an integer >= 0 (0 or None: off), got {value}")
        if v == off:
            return None
        return jnp.full((n,), int(v) if integer else v, jnp.int32 if integer else jnp.float32)
    if not hasattr(value, "shape"):
        raise TypeError(f"{name} must be a number, None or an array, got {type(value).__name__}")
    if tuple(value.shape) not in (tuple(shape), (n,)):
        raise ValueError(f"{name} has shape {tuple(value.shape)}: give one value per token, shape "
                         f"{tuple(shape)} or ({n},)")
    if integer and jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"top_k must be an integer array, got {value.dtype}")
    if _is_concrete(value) and n:
        a = np.asarray(value, dtype=np.float64).reshape(-1)
        bad = (a <= lo if lo_open else a < lo) | (a > hi) | np.isnan(a)
        if bad.any():
            raise ValueError(f"{name} must be in {rng} ({hint}); got {a[bad][:4].tolist()}")
    return jnp.reshape(value, (n,)).astype(jnp.int32 if integer else jnp.float32)


def check(top_k, top_p, min_p, shape):
    """(top_k, top_p, min_p) (N,) arrays (off: 0, 1, 0) and the static candidate count
    floor, or None when no truncation is asked."""
    k = check_param("top_k", top_k, shape, 0, float(2 ** 31 - 1), False, 0, "0 or None: off", integer=True)
    p = check_param("top_p", top_p, shape, 0.0, 1.0, True, 1.0, "1: off")
    mp = check_param("min_p", min_p, shape, 0.0, 1.0, False, 0.0, "0: off")
    if k is None and p is None and mp is None:
        return None
    n = int(np.prod(shape))
    if k is None:
        c = MIN_CANDIDATES
    elif isinstance(top_k, numbers.Real) and not hasattr(top_k, "shape"):
        c = max(MIN_CANDIDATES, int(top_k) + 1)
    else:
        c = ARRAY_TOP_K_CANDIDATES
    return (k if k is not None else jnp.zeros((n,), jnp.int32), p if p is not None else jnp.ones((n,), jnp.float32),
            mp if mp is not None else jnp.zeros((n,), jnp.float32)), c


def resolve(cand, row_sum, v: int, k, p, mp):
    """(tau, resolved) per row from descending candidates (n, C), s = sum exp(a - max)
    over the row (``logitless.formulas.truncation.resolve``)."""
    n, c = cand.shape
    complete = c >= v
    unknown = v + 1
    cd = cand.dtype
    m = cand[:, :1]
    idx = jnp.arange(c)

    def count(ge):
        cnt = jnp.sum(ge, axis=1)
        return cnt if complete else jnp.where(cnt < c, cnt, unknown)

    full = jnp.full((n,), v)
    log_mp = jnp.where(mp > 0, jnp.log(jnp.maximum(mp, 1e-38)), -jnp.inf).astype(cd)
    n_m = jnp.where(mp > 0, count(cand >= m + log_mp[:, None]), full)
    k_on = (k > 0) & (k < v)
    k_in = k_on & (k < c)
    kth = jnp.take_along_axis(cand, (jnp.clip(k, 1, c) - 1)[:, None], axis=1)
    n_k = jnp.where(k_on, jnp.where(k_in, count(cand >= kth), unknown), full)
    n1 = jnp.minimum(n_m, n_k)
    p_on = p < 1
    w = jnp.where(idx[None, :] < n1[:, None], jnp.exp(cand - m), 0.0)
    z1 = jnp.where(n1 <= c, jnp.sum(w, axis=1), row_sum)
    before = (jnp.cumsum(w, axis=1) - w) / z1[:, None]
    r_p = jnp.maximum(jnp.sum((before < p[:, None].astype(cd)) & (idx[None, :] < n1[:, None]), axis=1), 1)
    r_p = jnp.where(((r_p >= c) & (n1 > c)) | (n1 == unknown), unknown, r_p)
    last = jnp.take_along_axis(cand, (jnp.clip(r_p, 1, c) - 1)[:, None], axis=1)
    r_p = jnp.where(r_p == unknown, r_p, count(cand >= last))
    r = jnp.where(p_on, r_p, n1)
    resolved = (r < c) | (complete & (r <= v))
    i = jnp.clip(r, 1, c)
    lo = jnp.take_along_axis(cand, jnp.minimum(i, c - 1)[:, None], axis=1)[:, 0]
    hi = jnp.take_along_axis(cand, (i - 1)[:, None], axis=1)[:, 0]
    tau = jnp.where(r < c, hi + (lo - hi) / 2, -jnp.inf)
    return tau, resolved
