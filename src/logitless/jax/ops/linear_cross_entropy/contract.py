"""The contract of a linear_cross_entropy backend (JAX): what each one plans, returns and
receives.

Every backend (``XlaBackend``, ``TritonBackend``, ``MosaicGpuBackend``,
``MosaicTpuBackend``: one class each, listed in ``backends.BACKENDS``) is an
``LceBackend``. Per call, in this order (``api``, inside one ``jax.custom_vjp``):

    config = backend.plan(x2d.shape, (V, H), x2d.dtype, budget=..., weight_layout=...)  # once
    stats = backend.forward(x2d, w, bias, target, config, softcap=..., need_smooth=...,
                            class_weight=..., need_argmax=...[, keep=True])          # LceStats
    res = LceResiduals(x2d, w, bias, target, class_weight, stats.lse, stats.kept)  # the custom_vjp's
    coef = formulas.cross_entropy.grad_coefficients(...)                # (3, N), from the cotangents
    dx, dw, db = backend.backward(res, coef, config, softcap=...)       # LceGrads

``keep=True`` (passed only to backends with ``keeps``, and only by the custom_vjp's forward,
never by a call without gradients): the forward may also return what its backward takes
instead of recomputing the logits (``LceStats.kept``, e.g. mosaic_gpu's exp(z - m) of the
columns its Config's budget holds); the backward finds it in ``res.kept``.

``config`` is the backend's frozen Config (``XlaConfig``, ``TritonConfig``,
``MosaicGpuConfig``, ``MosaicTpuConfig``), a static argument of the custom_vjp: the
backward gets the forward's, never a new one. The sharded paths call the same methods per
device (``sharded.py``: targets shifted to the local columns, ``common.contract.local_plan``
for per-device shapes). The math of each array is in the package docstring.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol

from logitless.jax.ops.common.contract import Backend


class LceStats(NamedTuple):
    """What a backend's ``forward`` returns, each (N,): lse and target_logit (float32),
    smooth_sum (float32, or None without ``need_smooth``); with ``need_argmax`` (backends
    with ``argmax``) best (the row maximum, float32) and argmax (int32, local column ids,
    the first maximum), else None; kept: with ``keep=True``, the backend's own arrays for
    its backward (a tuple), or None."""

    lse: Any
    target_logit: Any
    smooth_sum: Optional[Any] = None
    best: Optional[Any] = None
    argmax: Optional[Any] = None
    kept: Optional[Any] = None


class LceResiduals(NamedTuple):
    """What the backward receives from the forward: its inputs (``target``: the ids the
    backend saw, local ones per device), the forward's lse and what it kept (``LceStats.kept``)."""

    x2d: Any
    w: Any
    bias: Optional[Any]
    target: Any
    class_weight: Optional[Any]
    lse: Any
    kept: Optional[Any] = None


class LceGrads(NamedTuple):
    """dx (N, H) in x2d.dtype, dw in w's layout and dtype, db (V,) or None."""

    dx: Any
    dw: Any
    db: Optional[Any]


class LceBackend(Backend, Protocol):
    """One backend of linear_cross_entropy (module docstring). ``native_hv``: it takes an
    (H, V) weight as it is (``weight_layout="hv"`` in the Config); ``class_weights``: its
    forward and backward take ``class_weight``; ``argmax``: its forward computes the argmax;
    ``keeps``: its forward takes ``keep`` (module docstring)."""

    native_hv: bool
    class_weights: bool
    argmax: bool
    keeps: bool

    def forward(self, x2d, w, bias, target, config: Any, *, softcap: Optional[float], need_smooth: bool,
                class_weight=None, need_argmax: bool = False, keep: bool = False) -> LceStats:
        """``keep`` is passed only to backends with ``keeps`` (the others need not take it)."""
        ...

    def backward(self, res: LceResiduals, coef, config: Any, *, softcap: Optional[float]) -> LceGrads:
        """``coef``: (3, N) float32 rows [A, B, C] (``formulas.cross_entropy.grad_coefficients``)."""
        ...

    def refit_kept(self, config: Any, x2d_shape: tuple, w_shape: tuple, dtype: Any, *, budget: int,
                   sizes: tuple) -> Optional[Any]:
        """(backends with ``keeps``) ``config`` changed so that ``forward(keep=True)`` keeps
        arrays of exactly ``sizes`` elements, one per kept array, within ``budget``: what
        another split of the same problem keeps (a sharded jit's residual slots,
        ``sharded.kept_slots``); None when it cannot (the backward then recomputes)."""
        ...
