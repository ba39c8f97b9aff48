"""The "xla" backend of linear_log_probs: chunked over the vocabulary (and the tokens
when the budget asks), plain JAX (CPU, GPU, TPU).

    forward   for each column chunk j (fori_loop), for each row chunk i:
                  a = softcap(x_i @ w_j.T + b_j) / T         fp32 (one GEMM; fp64 for fp64 inputs)
                  (m, s, u) <- online update with a           (u only with entropy)
                  a_t += a[c == t]
              lse = m + log s,  H = log s - u / s
    backward  for each column chunk j, for each row chunk i:
                  a recomputed (GEMM 1), dz = p (A + C log p) - B [c == t] (x cap')
                  dx_i += dz @ w_j (GEMM 2),  dw_j += dz.T @ x_i (GEMM 3),  db_j += sum dz

Memory traffic: the forward reads x once per column chunk and W once, and writes
O(tokens) statistics; the backward recomputes the logits (3 GEMMs in all). Memory:
one tile of logits and its temporaries (``planning.xla_plan`` sizes it from the
budget, as for linear_cross_entropy), the fp32 dx accumulator (N x H) and one fp32 dW
chunk; never N x V. The ragged last chunk is a separate statically shaped step, so
padded columns never enter the statistics. Dots accumulate in fp32; dz is cast to the
input dtype before the gradient GEMMs.

Weight layouts: (V, H), or (H, V) with ``weight_layout="hv"`` (``native_hv``): the same
GEMMs with the other contracting dimension of the w tile (``dot_general``), dW in w's
layout; no transposed copy.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from jax import lax

from logitless.jax.formulas import log_probs as lpf
from logitless.jax.ops.common.chunks import chunk_loop, put, take, uninitialised
from logitless.jax.ops.common.xla import XlaBase, XlaConfig
from logitless.jax.ops.linear_log_probs.contract import LlpGrads, LlpResiduals, LlpStats
from logitless.jax.planning import XlaPlan, xla_plan
from logitless.options import LogProbOptions

#: Contracting dimensions by weight layout (a w tile is (v, H) for "vh", (H, v) for "hv").
_W_AXIS = {"vh": 0, "hv": 1}  # the vocabulary axis of w
_Z_DIMS = {"vh": (((1,), (1,)), ((), ())), "hv": (((1,), (0,)), ((), ()))}   # x @ w^T
_DX_DIMS = {"vh": (((1,), (0,)), ((), ())), "hv": (((1,), (1,)), ((), ()))}  # dz @ w
_DW_DIMS = (((0,), (0,)), ((), ()))  # dz^T @ x ("vh"), x^T @ dz ("hv")


def _scaled(x, w, b, opts, layout="vh"):
    cdt = lpf.compute_dtype(x.dtype)
    z = lax.dot_general(x, w, _Z_DIMS[layout], preferred_element_type=cdt)
    if b is not None:
        z = z + b.astype(cdt)[None, :]
    return lpf.scaled_logits(z, opts)


def _plan(x2d, vocab, budget):
    n, h = x2d.shape
    return xla_plan(n, vocab, h, jnp.dtype(x2d.dtype).itemsize, budget)


def _tiles(x2d, w, weight_layout: str, budget: Optional[int], plan: Optional[XlaPlan]):
    """(w's vocabulary axis, V, the tiles: ``plan``, or planned here from ``budget``)."""
    vaxis = _W_AXIS[weight_layout]
    vocab = w.shape[vaxis]
    return vaxis, vocab, _plan(x2d, vocab, budget) if plan is None else plan


def forward(x2d, w, bias, tokens, *, opts: LogProbOptions, budget: Optional[int] = None, weight_layout: str = "vh",
            tau=None, plan: Optional[XlaPlan] = None):
    """(lse, a at the token, H or None). ``tau`` (N,): a per-token threshold, columns
    with a < tau left out (truncated sampling; a token left out gets a = -inf).
    ``plan``: the tiles (``XlaBackend.plan``'s); None: planned here from ``budget``."""
    n = x2d.shape[0]
    vaxis, vocab, plan = _tiles(x2d, w, weight_layout, budget, plan)
    cdt = lpf.compute_dtype(x2d.dtype)
    tokens = tokens.astype(jnp.int32)

    def col_step(c0, vc, carry):
        wj = take(w, c0, vc, vaxis)
        bj = None if bias is None else take(bias, c0, vc)
        cols = c0 + jnp.arange(vc, dtype=jnp.int32)

        def row_step(r0, nr, carry):
            m, s, u, at = carry
            a = _scaled(take(x2d, r0, nr), wj, bj, opts, weight_layout)
            if tau is not None:
                a = jnp.where(a >= take(tau, r0, nr)[:, None], a, -jnp.inf)
            hit = cols[None, :] == take(tokens, r0, nr)[:, None]
            at = put(at, take(at, r0, nr) + jnp.sum(jnp.where(hit, a, 0.0), axis=1), r0)
            mr, sr, ur = lpf.online_update(a, take(m, r0, nr), take(s, r0, nr),
                                           None if u is None else take(u, r0, nr))
            m, s = put(m, mr, r0), put(s, sr, r0)
            if u is not None:
                u = put(u, ur, r0)
            return m, s, u, at

        return chunk_loop(n, plan.token_chunk, row_step, carry)

    init = (jnp.full((n,), -jnp.inf, cdt), jnp.zeros((n,), cdt),
            jnp.zeros((n,), cdt) if opts.entropy else None, jnp.zeros((n,), cdt))
    m, s, u, at = chunk_loop(vocab, plan.vocab_chunk, col_step, init)
    lse, ent = lpf.finish(m, s, u)
    return lse, at, ent


def backward(x2d, w, bias, tokens, lse, coef, *, opts: LogProbOptions, budget: Optional[int] = None,
             weight_layout: str = "vh", tau=None, plan: Optional[XlaPlan] = None):
    """dx, dw (in the layout of w), db; ``tau``: the forward's threshold (dz = 0 where a < tau);
    ``plan`` as for ``forward``."""
    n, h = x2d.shape
    vaxis, vocab, plan = _tiles(x2d, w, weight_layout, budget, plan)
    cdt = lpf.compute_dtype(x2d.dtype)
    tokens = tokens.astype(jnp.int32)

    def col_step(c0, vc, carry):
        dx, dw, db = carry
        wj = take(w, c0, vc, vaxis)
        bj = None if bias is None else take(bias, c0, vc)

        def row_step(r0, nr, carry):
            dx, dwj, dbj = carry
            xr = take(x2d, r0, nr)
            a = _scaled(xr, wj, bj, opts, weight_layout)
            dz = lpf.dlogits(a, take(lse, r0, nr), take(coef, r0, nr, axis=1),
                             take(tokens, r0, nr), c0, opts)
            if tau is not None:
                dz = jnp.where(a >= take(tau, r0, nr)[:, None], dz, 0.0)
            dzl = dz.astype(x2d.dtype)
            dx = put(dx, take(dx, r0, nr) + lax.dot_general(dzl, wj, _DX_DIMS[weight_layout],
                                                            preferred_element_type=cdt), r0)
            pair = (dzl, xr) if weight_layout == "vh" else (xr, dzl)
            dwj = dwj + lax.dot_general(*pair, _DW_DIMS, preferred_element_type=cdt)
            if dbj is not None:
                dbj = dbj + jnp.sum(dz, axis=0)
            return dx, dwj, dbj

        dwj = jnp.zeros((vc, h) if weight_layout == "vh" else (h, vc), cdt)
        dbj = None if db is None else jnp.zeros((vc,), cdt)
        dx, dwj, dbj = chunk_loop(n, plan.token_chunk, row_step, (dx, dwj, dbj))
        dw = put(dw, dwj.astype(w.dtype), c0, vaxis)
        if db is not None:
            db = put(db, dbj.astype(db.dtype), c0)
        return dx, dw, db

    init = (jnp.zeros((n, h), cdt), uninitialised(w.shape, w.dtype),  # every column chunk writes its part
            None if bias is None else jnp.zeros(bias.shape, bias.dtype))
    dx, dw, db = chunk_loop(vocab, plan.vocab_chunk, col_step, init)
    return dx.astype(x2d.dtype), dw, db


class XlaBackend(XlaBase):
    """The "xla" backend (``contract.LlpBackend``; ``XlaBase``: every case, every platform);
    its forward and backward also take ``tau`` (truncated sampling, ``truncation.py``)."""

    def forward(self, x2d, w, bias, tokens, config: XlaConfig, *, opts: LogProbOptions, tau=None) -> LlpStats:
        return LlpStats(*forward(x2d, w, bias, tokens, opts=opts, weight_layout=config.weight_layout, tau=tau,
                                 plan=config.plan))

    def backward(self, res: LlpResiduals, coef, config: XlaConfig, *, opts: LogProbOptions, tau=None) -> LlpGrads:
        return LlpGrads(*backward(res.x2d, res.w, res.bias, res.tokens, res.lse, coef, opts=opts,
                                  weight_layout=config.weight_layout, tau=tau, plan=config.plan))
