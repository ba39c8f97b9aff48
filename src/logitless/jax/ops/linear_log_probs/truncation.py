"""JAX linear_log_probs with truncated sampling (top-k / top-p / min-p) and/or
``batch_invariant=True`` ("xla" backend). Math: ``logitless.jax.formulas.truncation``.

Threshold pass (``thresholds``), from the hidden states in chunks (no tokens x V):
a running top-C per row (C static: 64, or k + 1 for a Python-int top_k, 1025 for a
per-token top_k array), the row max, min and s = sum exp(a - max); ``resolve`` gives
tau for the rows their candidates settle. Rows they do not (top-p over a flat row, a
wide min-p set, a per-token k >= C) take, under ``lax.cond`` only when there are any
(no host sync), a bisection on the value: ``BISECTION_STEPS`` passes that each count
per row the values above a trial t and their mass in the kept set, with
ok(t) = [t >= max + log min_p] & [count(a > t) < k] & [mass(a > t) < top_p Z1], Z1 the
mass of the min-p/top-k set (its own bisection first); tau = the lowest t found ok
(exact up to the values within the last interval: float ties). Cost of that fallback:
about 2 x 40 GEMM passes.

The forward and backward are the "xla" backend's with ``tau`` (columns a < tau out of
the statistics and of dz); log p = -inf outside the kept set, with no gradient there.

batch_invariant: the rows run in blocks of ``INVARIANT_ROWS`` (a ``lax.map`` over
blocks, the last padded), so every GEMM of a row has one shape whatever the batch.
Cost: up to one block of padding rows, and the blocks run one after another.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax.formulas import log_probs as lpf
from logitless.jax.formulas.truncation import resolve
from logitless.jax.ops.common.chunks import chunk_loop, put, take
from logitless.jax.ops.linear_log_probs import xla_backend as xla
from logitless.options import LogProbOptions

BISECTION_STEPS = 40
#: Rows per block with batch_invariant=True, per platform (others: 1024).
INVARIANT_ROWS = {"cpu": 64}


class Config(NamedTuple):
    opts: LogProbOptions
    budget: int
    num_classes: int
    candidates: int  # 0: no truncation


def _tiles(x2d, w, bias, opts, budget, body, carry):
    """body(a, r0, nr, c0, carry) over the (row chunk x column chunk) tiles of a."""
    n = x2d.shape[0]
    plan = xla._plan(x2d, w.shape[0], budget)

    def col_step(c0, vc, carry):
        wj = take(w, c0, vc)
        bj = None if bias is None else take(bias, c0, vc)

        def row_step(r0, nr, carry):
            return body(xla._scaled(take(x2d, r0, nr), wj, bj, opts), r0, nr, c0, carry)

        return chunk_loop(n, plan.token_chunk, row_step, carry)

    return chunk_loop(w.shape[0], plan.vocab_chunk, col_step, carry)


def thresholds(x2d, w, bias, trunc, cfg: Config):
    k, p, mp = trunc
    n, v = x2d.shape[0], w.shape[0]
    c = min(v, cfg.candidates)
    cdt = lpf.compute_dtype(x2d.dtype)

    def body(a, r0, nr, c0, carry):
        cand, m, s, lo = carry
        both = jnp.concatenate([take(cand, r0, nr), a], axis=1)
        cand = put(cand, lax.top_k(both, c)[0], r0)
        mr, sr, _ = lpf.online_update(a, take(m, r0, nr), take(s, r0, nr), None)
        lo = put(lo, jnp.minimum(take(lo, r0, nr), jnp.min(a, axis=1)), r0)
        return cand, put(m, mr, r0), put(s, sr, r0), lo

    init = (jnp.full((n, c), -jnp.inf, cdt), jnp.full((n,), -jnp.inf, cdt), jnp.zeros((n,), cdt),
            jnp.full((n,), jnp.inf, cdt))
    cand, m, s, rmin = _tiles(x2d, w, bias, cfg.opts, cfg.budget, body, init)
    tau, ok = resolve(cand, s, v, k, p.astype(cdt), mp.astype(cdt))

    def fallback(tau):
        return jnp.where(ok, tau, _bisection(x2d, w, bias, trunc, cfg, m, rmin))

    return lax.cond(jnp.all(ok), lambda t: t, fallback, tau)


def _bisection(x2d, w, bias, trunc, cfg: Config, m, rmin):
    k, p, mp = trunc
    n, v = x2d.shape[0], w.shape[0]
    cdt = m.dtype
    tau_m = jnp.where(mp > 0, m + jnp.log(jnp.maximum(mp, 1e-38)).astype(cdt), -jnp.inf)
    k_on = (k > 0) & (k < v)

    def stats(t, floor):
        """count(a > t) and sum over a > t, a >= floor of exp(a - m), per row."""
        def body(a, r0, nr, c0, carry):
            cnt, mass = carry
            tr, fr, mr = take(t, r0, nr)[:, None], take(floor, r0, nr)[:, None], take(m, r0, nr)[:, None]
            above = a > tr
            cnt = put(cnt, take(cnt, r0, nr) + jnp.sum(above, axis=1, dtype=jnp.int32), r0)
            e = jnp.where(above & (a >= fr), jnp.exp(a - mr), 0.0)
            return cnt, put(mass, take(mass, r0, nr) + jnp.sum(e, axis=1), r0)

        return _tiles(x2d, w, bias, cfg.opts, cfg.budget, body, (jnp.zeros((n,), jnp.int32), jnp.zeros((n,), cdt)))

    def search(ok_of):
        lo0 = rmin - 1.0

        def step(_, lohi):
            lo, hi = lohi
            mid = lo + (hi - lo) / 2
            good = ok_of(mid)
            return jnp.where(good, lo, mid), jnp.where(good, mid, hi)

        lo, hi = lax.fori_loop(0, BISECTION_STEPS, step, (lo0, m))
        return jnp.where(ok_of(lo0), -jnp.inf, hi)

    def ok1(t):
        cnt, _ = stats(t, t)
        return (t >= tau_m) & (~k_on | (cnt < k))

    tau1 = search(ok1)
    p_on = p < 1
    _, z1 = stats(jnp.full((n,), -jnp.inf, cdt), tau1)

    def ok(t):
        cnt, mass = stats(t, tau1)
        return (t >= tau_m) & (~k_on | (cnt < k)) & (~p_on | (mass < p.astype(cdt) * z1))

    return lax.cond(jnp.any(p_on), lambda: search(ok), lambda: tau1)


def _outputs(x2d, w, bias, tokens, tau, cfg: Config):
    lse, at, ent = xla.forward(x2d, w, bias, tokens, opts=cfg.opts, budget=cfg.budget, tau=tau)
    logp, h = lpf.token_outputs(lse, at, ent, tokens, cfg.num_classes, cfg.opts)
    return logp, (h if cfg.opts.entropy else jnp.zeros_like(logp)), lse


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _core(x2d, w, bias, tokens, tau, cfg: Config):
    return _outputs(x2d, w, bias, tokens, tau, cfg)[:2]


def _core_fwd(x2d, w, bias, tokens, tau, cfg):
    logp, h, lse = _outputs(x2d, w, bias, tokens, tau, cfg)
    return (logp, h), (x2d, w, bias, tokens, tau, lse, h, logp)


def _core_bwd(cfg, res, cot):
    x2d, w, bias, tokens, tau, lse, h, logp = res
    g_lp, g_h = cot
    g_lp = jnp.where(jnp.isinf(logp), 0.0, g_lp)  # -inf outside the kept set: no gradient
    coef = lpf.grad_coefficients(h if cfg.opts.entropy else None, tokens, g_lp,
                                 g_h if cfg.opts.entropy else None, cfg.num_classes, cfg.opts, dtype=lse.dtype)
    dx, dw, db = xla.backward(x2d, w, bias, tokens, lse, coef, opts=cfg.opts, budget=cfg.budget, tau=tau)
    return dx, dw, db, None, jnp.zeros_like(tau)


_core.defvjp(_core_fwd, _core_bwd)


def _rows(x2d, w, bias, tokens, trunc, cfg: Config):
    cdt = lpf.compute_dtype(x2d.dtype)
    if trunc is not None:
        tau = lax.stop_gradient(thresholds(lax.stop_gradient(x2d), lax.stop_gradient(w),
                                           None if bias is None else lax.stop_gradient(bias), trunc, cfg))
    else:
        tau = jnp.full((x2d.shape[0],), -jnp.inf, cdt)
    return _core(x2d, w, bias, tokens, tau, cfg)


def linear_log_probs_truncated(x2d, w, bias, tokens, trunc, cfg: Config, batch_invariant: bool):
    """(logp, entropy) (N,) of x2d (N, H), tokens (N,) int32; trunc: (k, p, min_p) or None."""
    if not batch_invariant:
        return _rows(x2d, w, bias, tokens, trunc, cfg)
    n, h = x2d.shape
    platform = jax.default_backend()
    r = INVARIANT_ROWS.get(platform, 1024)
    nb = -(-n // r)
    pad = nb * r - n
    xb = jnp.pad(x2d, ((0, pad), (0, 0))).reshape(nb, r, h)
    tb = jnp.pad(tokens, (0, pad), constant_values=cfg.opts.ignore_index).reshape(nb, r)
    if trunc is not None:
        k, p, mp = trunc
        trb = (jnp.pad(k, (0, pad)).reshape(nb, r), jnp.pad(p, (0, pad), constant_values=1.0).reshape(nb, r),
               jnp.pad(mp, (0, pad)).reshape(nb, r))
    else:
        trb = None

    def one(args):
        xr, tr, tru = args
        return _rows(xr, w, bias, tr, tru, cfg)

    logp, ent = lax.map(one, (xb, tb, trb))
    return logp.reshape(-1)[:n], ent.reshape(-1)[:n]
