"""The contract of a cross_entropy backend (logits the caller holds): what each one
plans, returns and receives.

Every backend (``TorchBackend``, ``TritonBackend``: one class each, listed in
``api.BACKENDS``) is a ``CeBackend``. Per call, in this order:

    config = backend.plan(logits, budget=...)                                   # once
    stats = backend.forward(logits, target, class_weight, opts, config,
                            need_argmax=...)                                    # TokenStats
    backend.backward(logits, target, class_weight, opts.softcap, lse, coef, out, config)

``logits`` (N, V) with N > 0 (the custom ops answer N = 0 themselves); ``config`` is the
backend's frozen Config (``TorchConfig``; Triton's is ``planning.logits.CETritonPlan``):
the backward gets the forward's, never a new one, and it crosses the custom ops as
``backend.codec`` encodes it. ``coef`` holds the (3, N) coefficients A, B, C of
``formulas.cross_entropy.grad_coefficients``; ``backward`` writes d loss / d logits into
``out`` (N, V), which may be the logits themselves (``inplace_backward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

from torch import Tensor

from logitless.formulas.cross_entropy import TokenStats
from logitless.ops.common.contract import Backend
from logitless.options import CrossEntropyOptions


@dataclass(frozen=True)
class TorchConfig:
    """The torch backend's rows per chunk (``planning.logits.ce_torch_plan`` of the budget),
    the forward's and the backward's."""

    rows: int


class CeBackend(Backend, Protocol):
    """One backend of cross_entropy (module docstring)."""

    def plan(self, logits: Tensor, *, budget: int) -> Any:
        """The call's Config."""
        ...

    def forward(self, logits: Tensor, target: Tensor, class_weight: Optional[Tensor], opts: CrossEntropyOptions,
                config: Any, *, need_argmax: bool) -> TokenStats:
        """Per-token lse, target logit, smooth sum (label smoothing) and argmax (when
        asked), in the compute dtype."""
        ...

    def backward(self, logits: Tensor, target: Tensor, class_weight: Optional[Tensor], softcap: Optional[float],
                 lse: Tensor, coef: Tensor, out: Tensor, config: Any) -> None:
        """Writes d loss / d logits into ``out``."""
        ...
