"""linear_topk_kl per device: inside ``jax.shard_map`` (``vocab_axis_name`` /
``token_axis_name``) and under a multi-device ``jax.jit`` (``custom_partitioning``; the
machinery is ``logitless/jax/sharding.py``, shared with the other ops).

Local computation (shapes per device): the weight's V_l columns are global classes
``[off, off + V_l)`` (``off = V_l x index`` along the vocabulary axes); the teacher's ids
and the target stay global. Per forward chunk of rows each device masks the ids among
its columns and reduces the rest to the tail's log-sum-exp, merged with one MAX and one
SUM over the vocabulary axes (``common.rows.VocabMerge``); z at the ids (each in one
device's columns) and at the target are summed with one more SUM: O(rows x K) per chunk,
never the weight, x or a logit. The per-token terms are then the same on every device.
Backward: the local columns' dx summed over the vocabulary axes (O(tokens x H)); dW
keeps its rows, summed over the token axes (reduce-scattered back where the weight is
split along a token axis, FSDP). Under custom_partitioning the forward keeps no dz (the
backward recomputes: a residual's shape per device is not known when the program is
traced); inside shard_map it keeps as on one device.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from jax import lax

from logitless.jax.ops.common.contract import w_axis
from logitless.jax.ops.common.rows import VocabMerge, local_backend
from logitless.jax.ops.linear_topk_kl.backends import BACKENDS
from logitless.jax.ops.linear_topk_kl.contract import TopKForward, TopKResiduals
from logitless.jax.sharding import partitioned, reduce_weight_grads
from logitless.options import TopKKLOptions


def local_forward(backend, x2d, w, ids, lp, target, config, *, opts: TopKKLOptions, vocab_axes: tuple,
                  num_classes: int, grad: bool, g_unit=None) -> TopKForward:
    """The terms of this device's tokens over every column (and the kept dz of its own)."""
    return backend.forward(x2d, w, ids, lp, target, config, opts=opts, merge=VocabMerge(vocab_axes),
                           num_classes=num_classes, grad=grad, g_unit=g_unit)


def local_backward(backend, res: TopKResiduals, g, g_kept, config, *, opts: TopKKLOptions, vocab_axes: tuple):
    """(dx summed over the vocabulary axes, dW of the local rows)."""
    dx, dw = backend.backward(res, g, g_kept, config, opts=opts, merge=VocabMerge(vocab_axes))
    return (lax.psum(dx, vocab_axes) if vocab_axes else dx), dw


class Static(NamedTuple):
    """The static arguments of the partitioned functions."""

    backend: str
    opts: TopKKLOptions
    budget: int
    weight_layout: str
    num_classes: int


def _config(static: Static, x2d, w):
    """(backend, RowsConfig) of this device's shapes (``rows.local_backend``)."""
    return local_backend(BACKENDS, static.backend, tuple(x2d.shape), tuple(w.shape), x2d.dtype,
                         budget=static.budget, weight_layout=static.weight_layout)


@functools.cache
def forward_fn(static: Static, grad: bool):
    """fn(x2d, w, ids, lp, target) -> (loss, lse_tail[, lse1][, coef, sparse]) per device."""
    hard_t = static.opts.hard_at_other_temperature

    def local(args, axes, scatter):
        x2d, w, ids, lp, target = args
        backend, config = _config(static, x2d, w)
        out = local_forward(backend, x2d, w, ids, lp, target, config, opts=static.opts, vocab_axes=axes.vocab,
                            num_classes=static.num_classes, grad=grad)
        return tuple(a for a in out[:5] if a is not None)

    outs = ("n", "n") + (("n",) if hard_t else ()) + (("kn", "nk") if grad else ())
    return partitioned(local, in_kinds=("x", "w", "nk", "nk", "n"), out_kinds=outs,
                       vaxis=w_axis(static.weight_layout))


@functools.cache
def backward_fn(static: Static):
    """fn(x2d, w, ids, target, lse_tail[, lse1], coef, sparse, g) -> (dx, dW) per device."""
    hard_t = static.opts.hard_at_other_temperature

    def local(args, axes, scatter):
        x2d, w, ids, target, lse_tail, *rest = args
        lse1 = rest.pop(0) if hard_t else None
        coef, sparse, g = rest
        backend, config = _config(static, x2d, w)
        res = TopKResiduals(x2d, w, ids, target, lse_tail, lse1, coef, sparse)
        dx, dw = local_backward(backend, res, g, 1.0, config, opts=static.opts, vocab_axes=axes.vocab)
        dw, _ = reduce_weight_grads(dw, None, axes.token, scatter)
        return dx, dw

    ins = ("x", "w", "nk", "n", "n") + (("n",) if hard_t else ()) + ("kn", "nk", "n")
    return partitioned(local, in_kinds=ins, out_kinds=("x", "w"), vaxis=w_axis(static.weight_layout))
