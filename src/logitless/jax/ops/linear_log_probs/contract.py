"""The contract of a linear_log_probs backend (JAX): what each one plans, returns and
receives.

Every backend (``XlaBackend``, ``TritonBackend``, ``MosaicGpuBackend``,
``MosaicTpuBackend``: one class each, listed in ``backends.BACKENDS``) is an
``LlpBackend``. Per call, in this order (``api`` or ``sharded``, inside one
``jax.custom_vjp``):

    config = backend.plan(x2d.shape, (V, H), x2d.dtype, budget=..., weight_layout=...,
                          has_bias=...)                                        # once
    stats = backend.forward(x2d, w, bias, tokens, config, opts=opts)          # LlpStats
    res = LlpResiduals(x2d, w, bias, tokens, stats.lse)                       # the custom_vjp's
    coef = formulas.log_probs.grad_coefficients(...)                          # (3, N), from the cotangents
    dx, dw, db = backend.backward(res, coef, config, opts=opts)               # LlpGrads

``config`` is the backend's frozen Config, a static argument of the custom_vjp: the
backward gets the forward's, never a new one (per device: ``common.contract.local_plan``).
The math of each array is in the package docstring.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol

from logitless.jax.ops.common.contract import Backend
from logitless.options import LogProbOptions


class LlpStats(NamedTuple):
    """What a backend's ``forward`` returns, each (N,) fp32 (fp64 for fp64 inputs): lse and
    token_logit of a = softcap(x w^T + b) / T, entropy (None without ``opts.entropy``)."""

    lse: Any
    token_logit: Any
    entropy: Optional[Any] = None


class LlpResiduals(NamedTuple):
    """What the backward receives from the forward: its inputs (``tokens``: the ids the
    backend saw, local ones per device) and the forward's lse."""

    x2d: Any
    w: Any
    bias: Optional[Any]
    tokens: Any
    lse: Any


class LlpGrads(NamedTuple):
    """dx (N, H) in x2d.dtype, dw in w's layout and dtype, db (V,) or None."""

    dx: Any
    dw: Any
    db: Optional[Any]


class LlpBackend(Backend, Protocol):
    """One backend of linear_log_probs (module docstring). ``native_hv``: it takes an
    (H, V) weight as it is (``weight_layout="hv"`` in the Config)."""

    native_hv: bool

    def forward(self, x2d, w, bias, tokens, config: Any, *, opts: LogProbOptions) -> LlpStats:
        ...

    def backward(self, res: LlpResiduals, coef, config: Any, *, opts: LogProbOptions) -> LlpGrads:
        """``coef``: (3, N) rows from ``formulas.log_probs.grad_coefficients``."""
        ...
