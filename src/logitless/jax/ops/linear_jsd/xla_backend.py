"""The "xla" backend of linear_jsd: plain JAX, any platform (``common/rows.py`` describes
the shape of the computation; the math is ``formulas/jsd.py``).

    forward   per chunk of ``rows`` tokens (a fori_loop, the last chunk its own static
              step): both heads' fp32 logits of the chunk's full local rows (two GEMMs),
              lse(a), lse(b) (and lse(zs)) merged over the vocabulary devices, then S, K
              (and zs at the target) with the merged ones, summed over them; with
              ``g_unit``, dz of the leading ``keep`` columns for a unit upstream gradient,
              in the input dtype, into the kept (tokens, keep) buffer
    backward  the kept columns: dx = g (dz @ W_s), dW_s = dz^T (g x_s) (two GEMMs); the
              others tile by tile: both heads' logits recomputed, dz, then the two GEMMs
              (``rows.recompute_gradients``)

GEMMs with every column kept: the floor (both heads' logits, dx, dW); with none: two
more per column (the recomputed logits of both heads). Memory: one chunk's fp32 logits
of both heads and the kept dz, both from the budget (``planning.rows_plan``); the
recomputed tiles' (``planning.xla_plan``).
"""

from __future__ import annotations

import jax.numpy as jnp

from logitless.jax.formulas import jsd as jf
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
from logitless.jax.ops.linear_jsd.contract import JsdForward, JsdResiduals


def forward(xs, ws, xt, wt, target, config: RowsConfig, *, opts, merge, g_unit=None) -> JsdForward:
    """The contract's forward (``target``: this device's column ids)."""
    n = xs.shape[0]
    layout = config.weight_layout
    plan = config.grad if g_unit is not None else config.plain
    keep = plan.keep if g_unit is not None else 0
    hard = opts.needs_lse1
    acc = acc_dtype(xs.dtype)

    def step(r0, nr, carry):
        stats, kept = carry
        zs = logits(take(xs, r0, nr), ws, layout)
        zt = logits(take(xt, r0, nr), wt, layout)
        lse_s, lse_t, lse1 = jf.row_lses(zs, zt, opts)
        lses = merge.lse(lse_s, lse_t, *([lse1] if hard else []))
        lse_s, lse_t = lses[:2]
        lse1 = lses[2] if hard else None
        s, k = jf.row_sums(zs, zt, lse_s, lse_t, opts)
        t = take(target, r0, nr)
        parts = (s, k) + ((jf.target_logit(zs, t),) if hard else ())
        sums = merge.sum(*parts)
        chunk = jf.JsdStats(lse_s, lse_t, sums[0], sums[1], lse1, sums[2] if hard else None)
        stats = jf.JsdStats(*[None if a is None else put(a, b, r0) for a, b in zip(stats, chunk)])
        if keep:
            dz = jf.dlogits(zs[:, :keep], zt[:, :keep], chunk, take(g_unit, r0, nr), t, 0, opts)
            kept = put(kept, dz.astype(xs.dtype), r0)
        return stats, kept

    zero = jnp.zeros((n,), acc)
    stats = jf.JsdStats(zero, zero, zero, zero, zero if hard else None, zero if hard else None)
    kept = uninitialised((n, keep), xs.dtype) if keep else None  # every chunk writes its rows
    # (inside shard_map: the statistics are merged over the vocabulary axes, the kept dz is not)
    stats = varying_like(stats, xs, xt, g_unit)  # (target: local ids, varying over the vocabulary axes)
    kept = varying_like(kept, xs, ws, xt, wt, target, g_unit)
    stats, kept = chunk_loop(n, plan.rows, step, (stats, kept))
    return JsdForward(stats, kept)


def backward(res: JsdResiduals, g, g_kept, config: RowsConfig, *, opts):
    """The contract's backward: the kept columns' GEMMs, then the recomputed tiles'."""
    xs, ws, xt, wt, target, stats, kept = res
    layout = config.weight_layout
    vaxis = W_AXIS[layout]
    start, dx, dw = kept_gradients(kept, xs, ws, g_kept, layout=layout)

    def dz_tile(r0, nr, c0, vc):
        zs = logits(take(xs, r0, nr), take(ws, c0, vc, vaxis), layout)
        zt = logits(take(xt, r0, nr), take(wt, c0, vc, vaxis), layout)
        st = jf.JsdStats(*[None if a is None else take(a, r0, nr) for a in stats])
        return jf.dlogits(zs, zt, st, take(g, r0, nr), take(target, r0, nr), c0, opts)

    dx, dw = recompute_gradients(xs, ws, start, config.recompute.plan, dz_tile, layout=layout, dx=dx, dw=dw,
                                 refs=(xt, wt, target, g, *stats))
    return dx.astype(xs.dtype), dw


class XlaBackend(XlaBase):
    """The "xla" backend (``contract.JsdBackend``; ``XlaBase``: every case and platform)."""

    def plan_call(self, x2d_shape, w_shape, dtype, *, budget: int, weight_layout: str = "vh") -> RowsConfig:
        return plan_rows(self, x2d_shape, w_shape, dtype, budget=budget, weight_layout=weight_layout, arrays=2,
                         heads=2)

    def forward(self, xs, ws, xt, wt, target, config: RowsConfig, *, opts, merge, g_unit=None) -> JsdForward:
        return forward(xs, ws, xt, wt, target, config, opts=opts, merge=merge, g_unit=g_unit)

    def backward(self, res: JsdResiduals, g, g_kept, config: RowsConfig, *, opts):
        return backward(res, g, g_kept, config, opts=opts)
