"""The contract of a linear_jsd backend (JAX): what each one plans, returns and receives.

Every backend (``XlaBackend``, ``TritonBackend``; one class each, listed in
``backends.BACKENDS``) is a ``JsdBackend``. Per call (``api``, inside one
``jax.custom_vjp``):

    config = backend.plan_call(xs.shape, (V, H_s), xs.dtype, budget=..., weight_layout=...)  # once
    out = backend.forward(xs, ws, xt, wt, target, config, opts=..., merge=..., g_unit=...)    # JsdForward
    res = JsdResiduals(xs, ws, xt, wt, target, out.stats, out.kept)
    dx, dw = backend.backward(res, g, g_kept, config, opts=...)

``config`` is a ``common.rows.RowsConfig`` (the forward's row chunks, the kept columns,
the kind's Config for the recomputed ones), a static argument of the custom_vjp: the
backward gets the forward's. ``target`` holds this device's column ids (global ids
minus the device's first column: ``sharded``); ``merge`` (``common.rows.VocabMerge``)
merges a row chunk's statistics over the devices that split the vocabulary. The teacher
gets no gradient.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol

from logitless.jax.formulas.jsd import JsdStats
from logitless.jax.ops.common.rows import RowsBackend


class JsdForward(NamedTuple):
    """What ``forward`` returns: the statistics of the full rows (global over the
    vocabulary) and, with ``g_unit``, the kept dz (N, keep) in the input dtype of the
    leading ``config.grad.keep`` local columns (None without)."""

    stats: JsdStats
    kept: Optional[Any] = None


class JsdResiduals(NamedTuple):
    """What the backward receives from the forward."""

    xs: Any
    ws: Any
    xt: Any
    wt: Any
    target: Any
    stats: JsdStats
    kept: Optional[Any] = None


class JsdBackend(RowsBackend, Protocol):
    """One backend of linear_jsd (module docstring)."""

    def forward(self, xs, ws, xt, wt, target, config: Any, *, opts, merge, g_unit=None) -> JsdForward:
        """``g_unit`` (N,): the upstream gradient of each token for a unit gradient of the
        reduced loss ("mean"/"sum"): the forward then keeps dz of ``config.grad.keep``
        columns (None: nothing kept, ``config.plain``'s chunks)."""
        ...

    def backward(self, res: JsdResiduals, g, g_kept, config: Any, *, opts) -> tuple:
        """(dx in xs's dtype, summed over this device's columns only; dW of the student in
        ws's dtype and layout). ``g`` (N,): the per-token upstream gradient of the
        recomputed columns; ``g_kept``: the scalar that scales the kept dz."""
        ...
