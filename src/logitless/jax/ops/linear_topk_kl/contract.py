"""The contract of a linear_topk_kl backend (JAX): what each one plans, returns and receives.

Every backend (one class per kind, listed in ``backends.BACKENDS``) is a
``TopKBackend``. Per call (``api``, inside one ``jax.custom_vjp``):

    config = backend.plan_call(x2d.shape, (V, H), x2d.dtype, budget=..., weight_layout=...)  # once
    out = backend.forward(x2d, w, ids, lp, target, config, opts=..., merge=...,
                          num_classes=V, grad=..., g_unit=...)                              # TopKForward
    res = TopKResiduals(x2d, w, ids, target, out.lse_tail, out.lse1, out.coef, out.sparse, out.kept)
    dx, dw = backend.backward(res, g, g_kept, config, opts=..., merge=...)

``config``: a ``common.rows.RowsConfig`` (the forward's row chunks, the kept columns, the
kind's Config for the recomputed ones), a static argument of the custom_vjp. ``ids`` and
``target`` hold global class ids; ``merge`` (``common.rows.VocabMerge``) gives this
device's first column and merges a row chunk's statistics over the devices that split the
vocabulary. The teacher's arrays get no gradient.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol

from logitless.jax.ops.common.rows import RowsBackend


class TopKForward(NamedTuple):
    """What ``forward`` returns, per token of full rows: the loss (fp32, 0 at ignored
    tokens), lse_tail (the log-sum-exp of a = z / T outside the ids) and lse1 (of z, hard
    labels at T != 1, else None); with ``grad`` the unit-gradient coefficients coef (3, N)
    and sparse (N, K) (``formulas.topk_kl.token_terms``); with ``g_unit`` the kept dz
    (N, keep) of leading local columns in x's dtype (at most ``config.grad.keep``; a
    kernel's may have more rows, its padding, zero there)."""

    loss: Any
    lse_tail: Any
    lse1: Optional[Any] = None
    coef: Optional[Any] = None
    sparse: Optional[Any] = None
    kept: Optional[Any] = None


class TopKResiduals(NamedTuple):
    """What the backward receives from the forward."""

    x2d: Any
    w: Any
    ids: Any
    target: Any
    lse_tail: Any
    lse1: Optional[Any]
    coef: Any
    sparse: Any
    kept: Optional[Any] = None


class TopKBackend(RowsBackend, Protocol):
    """One backend of linear_topk_kl (module docstring)."""

    def forward(self, x2d, w, ids, lp, target, config: Any, *, opts, merge, num_classes: int, grad: bool,
                g_unit=None) -> TopKForward:
        """``g_unit`` (N,): each token's upstream gradient for a unit gradient of the
        reduced loss ("mean"/"sum"): dz of ``config.grad.keep`` columns is kept."""
        ...

    def backward(self, res: TopKResiduals, g, g_kept, config: Any, *, opts, merge) -> tuple:
        """(dx in x's dtype over this device's columns only; dW in w's dtype and layout).
        ``g`` (N,): the per-token upstream gradient (scales coef and sparse for the
        recomputed columns); ``g_kept``: the scalar that scales the kept dz."""
        ...
