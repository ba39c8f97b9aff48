"""linear_jsd per device: inside ``jax.shard_map`` (``vocab_axis_name`` /
``token_axis_name``) and under a multi-device ``jax.jit`` (``custom_partitioning``; the
machinery is ``logitless/jax/sharding.py``, shared with the other ops).

Local computation (shapes per device): both heads' weights hold the same V_l columns
(global classes ``[off, off + V_l)``, ``off = V_l x index`` along the vocabulary axes);
the backend sees ``target - off``. Per forward chunk of rows the log-sum-exps are merged
with one MAX and one SUM over the vocabulary axes, then S, K (and the target logit) with
one more SUM (``common.rows.VocabMerge``): three collectives of O(rows) per chunk, never
the weights, x or a logit. Backward: the local columns' dx summed over the vocabulary
axes (O(tokens x H_s)); dW_s keeps its rows, summed over the token axes (reduce-scattered
back where the weight is split along a token axis, FSDP). Under custom_partitioning the
forward keeps no dz (the backward recomputes: a residual's shape per device is not
known when the program is traced); inside shard_map it keeps as on one device.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from jax import lax

from logitless.jax.formulas.jsd import JsdStats
from logitless.jax.ops.common.contract import w_axis
from logitless.jax.ops.common.rows import VocabMerge, local_backend
from logitless.jax.ops.linear_jsd.backends import BACKENDS
from logitless.jax.ops.linear_jsd.contract import JsdForward, JsdResiduals
from logitless.jax.sharding import partitioned, reduce_weight_grads
from logitless.options import JSDOptions


def local_targets(target, vocab_axes: tuple, local_v: int):
    """Global class ids as this device's column ids."""
    return target - VocabMerge(vocab_axes).offset(local_v) if vocab_axes else target


def local_forward(backend, xs, ws, xt, wt, target, config, *, opts: JSDOptions, vocab_axes: tuple,
                  g_unit=None) -> JsdForward:
    """The statistics of this device's tokens over every column (and the kept dz of its
    own columns), ``target`` global."""
    t = local_targets(target, vocab_axes, ws.shape[w_axis(config.weight_layout)])
    return backend.forward(xs, ws, xt, wt, t, config, opts=opts, merge=VocabMerge(vocab_axes), g_unit=g_unit)


def local_backward(backend, res: JsdResiduals, g, g_kept, config, *, opts: JSDOptions, vocab_axes: tuple):
    """(dx summed over the vocabulary axes, dW_s of the local rows); ``res.target`` global."""
    t = local_targets(res.target, vocab_axes, res.ws.shape[w_axis(config.weight_layout)])
    dx, dw = backend.backward(res._replace(target=t), g, g_kept, config, opts=opts)
    return (lax.psum(dx, vocab_axes) if vocab_axes else dx), dw


class Static(NamedTuple):
    """The static arguments of the partitioned functions."""

    backend: str
    opts: JSDOptions
    budget: int
    weight_layout: str


def _config(static: Static, xs, ws):
    """(backend, RowsConfig) of this device's shapes (``rows.local_backend``)."""
    return local_backend(BACKENDS, static.backend, tuple(xs.shape), tuple(ws.shape), xs.dtype, budget=static.budget,
                         weight_layout=static.weight_layout)


def _stats_count(opts: JSDOptions) -> int:
    return 6 if opts.needs_lse1 else 4


def _kinds(weight_layout: str):
    return ("x", "w", "x2", "w2" + weight_layout, "n")


@functools.cache
def forward_fn(static: Static):
    """fn(xs, ws, xt, wt, target) -> the JsdStats fields, partitioned per device."""
    k = _stats_count(static.opts)

    def local(args, axes, scatter):
        xs, ws, xt, wt, target = args
        backend, config = _config(static, xs, ws)
        out = local_forward(backend, xs, ws, xt, wt, target, config, opts=static.opts, vocab_axes=axes.vocab)
        return tuple(out.stats[:k])

    return partitioned(local, in_kinds=_kinds(static.weight_layout), out_kinds=("n",) * k,
                       vaxis=w_axis(static.weight_layout))


@functools.cache
def backward_fn(static: Static):
    """fn(xs, ws, xt, wt, target, g, *stats) -> (dx, dW_s), partitioned per device."""
    k = _stats_count(static.opts)

    def local(args, axes, scatter):
        xs, ws, xt, wt, target, g, *stats = args
        backend, config = _config(static, xs, ws)
        st = JsdStats(*stats, *([None] * (6 - k)))
        dx, dw = local_backward(backend, JsdResiduals(xs, ws, xt, wt, target, st), g, 1.0, config,
                                opts=static.opts, vocab_axes=axes.vocab)
        dw, _ = reduce_weight_grads(dw, None, axes.token, scatter)
        return dx, dw

    return partitioned(local, in_kinds=_kinds(static.weight_layout) + ("n",) * (1 + k), out_kinds=("x", "w"),
                       vaxis=w_axis(static.weight_layout))
