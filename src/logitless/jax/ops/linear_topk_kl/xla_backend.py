"""The "xla" backend of linear_topk_kl: plain JAX, any platform (``common/rows.py``
describes the shape of the computation; the math is ``formulas/topk_kl.py``).

    forward   per chunk of ``rows`` tokens (a fori_loop, the last chunk its own static
              step): the fp32 logits of the chunk's full local rows (one GEMM); z at the
              ids and at the target (gathers), then -inf written at the ids (a scatter of
              K values per row) and the log-sum-exp of the rest: the tail's, exact
              however much mass the ids hold; merged over the vocabulary devices; the
              per-token terms (``token_terms``); with ``g_unit``, dz of the leading
              ``keep`` columns (the dense line, the sparse values written at the ids),
              in the input dtype, into the kept (tokens, keep) buffer
    backward  the kept columns: two GEMMs (``rows.kept_gradients``); the others tile by
              tile: the logits recomputed, masked at the ids, the dense dz and the
              sparse values, then the two GEMMs (``rows.recompute_gradients``)

GEMMs with every column kept: three (the floor of a cross-entropy); with none: four.
Memory: one chunk's fp32 logits (and their masked copy) and the kept dz, from the budget
(``planning.rows_plan``); the recomputed tiles' (``planning.xla_plan``).
"""

from __future__ import annotations

import jax.numpy as jnp

from logitless.jax.formulas import topk_kl as tk
from logitless.jax.formulas.cross_entropy import logsumexp_rows
from logitless.jax.ops.common.chunks import chunk_loop, put, take, uninitialised
from logitless.jax.ops.common.rows import (
    W_AXIS,
    RowsConfig,
    acc_dtype,
    kept_gradients,
    logits,
    plan_rows,
    recompute_gradients,
    varying_like,
)
from logitless.jax.ops.common.xla import XlaBase
from logitless.jax.ops.linear_topk_kl.contract import TopKForward, TopKResiduals


def chunk_statistics(z, ids, target, off, opts, merge):
    """(TopKStats of the rows, their logits masked at the ids) from a chunk's fp32 logits
    of this device's columns (``off``: its first global column)."""
    il = ids - off
    z_ids = tk.gather_ids(z, il)
    z_t = None
    if opts.hard:
        tl = (target - off)[:, None]
        z_t = tk.gather_ids(z, tl)[:, 0]
    zm = tk.masked_logits(z, il)
    a = zm / opts.temperature if opts.temperature != 1.0 else zm
    lses = merge.lse(logsumexp_rows(a), *([logsumexp_rows(zm)] if opts.hard_at_other_temperature else []))
    sums = merge.sum(z_ids, *([z_t] if opts.hard else []))
    lse1 = None
    if opts.hard_at_other_temperature:  # all columns: the tail's and the ids' parts (positive sums)
        lse1 = jnp.logaddexp(lses[1], logsumexp_rows(sums[0]))
    return tk.TopKStats(lses[0], sums[0], sums[1] if opts.hard else None, lse1), zm


def dz_of(zm, lse_tail, lse1, coef, sparse, ids_local, target_local, opts):
    """The fp32 dz of a tile of rows from its logits masked at the ids (columns 0.. of
    the tile; ``ids_local``/``target_local`` in the tile's column ids)."""
    dz = tk.dense_dlogits(zm, lse_tail, lse1, coef, target_local, opts)
    return tk.put_sparse(dz, ids_local, sparse)


def forward(x2d, w, ids, lp, target, config: RowsConfig, *, opts, merge, num_classes: int, grad: bool,
            g_unit=None) -> TopKForward:
    """The contract's forward."""
    n = x2d.shape[0]
    k = ids.shape[1]
    layout = config.weight_layout
    plan = config.grad if g_unit is not None else config.plain
    keep = plan.keep if g_unit is not None else 0
    off = merge.offset(w.shape[W_AXIS[layout]])
    acc = acc_dtype(x2d.dtype)

    def step(r0, nr, carry):
        out = carry
        z = logits(take(x2d, r0, nr), w, layout)
        i, t = take(ids, r0, nr), take(target, r0, nr)
        st, zm = chunk_statistics(z, i, t, off, opts, merge)
        terms = tk.token_terms(st, take(lp, r0, nr), i, t, opts, num_classes, grad=grad)
        kept = None
        if keep:
            gu = take(g_unit, r0, nr)
            kept = dz_of(zm[:, :keep], st.lse_tail, st.lse1, terms.coef * gu[None, :], terms.sparse * gu[:, None],
                         i - off, t - off, opts).astype(x2d.dtype)
        chunk = TopKForward(terms.loss, st.lse_tail, st.lse1, terms.coef, terms.sparse, kept)
        # every field is per token along axis 0 but coef (3, N), along axis 1
        return TopKForward(*[None if a is None else put(a, b.astype(a.dtype), r0, axis=1 if name == "coef" else 0)
                             for name, a, b in zip(TopKForward._fields, out, chunk)])

    zero = jnp.zeros((n,), acc)
    init = TopKForward(
        loss=jnp.zeros((n,), jnp.float32),
        lse_tail=zero,
        lse1=zero if opts.hard_at_other_temperature else None,
        coef=jnp.zeros((3, n), jnp.float32) if grad else None,
        sparse=jnp.zeros((n, k), jnp.float32) if grad else None,
        kept=uninitialised((n, keep), x2d.dtype) if keep else None,  # every chunk writes its rows
    )
    # (inside shard_map: the terms are merged over the vocabulary axes, the kept dz is not)
    init = varying_like(init._replace(kept=None), x2d, ids, lp, target, g_unit)._replace(
        kept=varying_like(init.kept, x2d, w, ids, lp, target, g_unit))
    return chunk_loop(n, plan.rows, step, init)


def backward(res: TopKResiduals, g, g_kept, config: RowsConfig, *, opts, merge):
    """The contract's backward: the kept columns' GEMMs, then the recomputed tiles'."""
    x2d, w, ids, target, lse_tail, lse1, coef, sparse, kept = res
    layout = config.weight_layout
    vaxis = W_AXIS[layout]
    off = merge.offset(w.shape[vaxis])
    start, dx, dw = kept_gradients(kept, x2d, w, g_kept, layout=layout)
    coef_g = coef * g[None, :]
    sparse_g = sparse * g[:, None]

    def dz_tile(r0, nr, c0, vc):
        z = logits(take(x2d, r0, nr), take(w, c0, vc, vaxis), layout)
        il = take(ids, r0, nr) - off - c0
        zm = tk.masked_logits(z, il)
        return dz_of(zm, take(lse_tail, r0, nr), None if lse1 is None else take(lse1, r0, nr),
                     take(coef_g, r0, nr, axis=1), take(sparse_g, r0, nr), il, take(target, r0, nr) - off - c0,
                     opts)

    dx, dw = recompute_gradients(x2d, w, start, config.recompute.plan, dz_tile, layout=layout, dx=dx, dw=dw,
                                 refs=(ids, target, lse_tail, lse1, coef_g, sparse_g))
    return dx.astype(x2d.dtype), dw


class XlaBackend(XlaBase):
    """The "xla" backend (``contract.TopKBackend``; ``XlaBase``: every case and platform)."""

    def plan_call(self, x2d_shape, w_shape, dtype, *, budget: int, weight_layout: str = "vh") -> RowsConfig:
        return plan_rows(self, x2d_shape, w_shape, dtype, budget=budget, weight_layout=weight_layout, arrays=2)

    def forward(self, x2d, w, ids, lp, target, config: RowsConfig, *, opts, merge, num_classes: int, grad: bool,
                g_unit=None) -> TopKForward:
        return forward(x2d, w, ids, lp, target, config, opts=opts, merge=merge, num_classes=num_classes, grad=grad,
                       g_unit=g_unit)

    def backward(self, res: TopKResiduals, g, g_kept, config: RowsConfig, *, opts, merge):
        return backward(res, g, g_kept, config, opts=opts, merge=merge)
