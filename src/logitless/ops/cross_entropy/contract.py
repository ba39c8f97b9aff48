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
the backward gets the forward's, never a new one (through the custom ops the backward op
plans it again: ``custom_op.replan``, the memoised planner's same object). ``coef`` holds
the (3, N) coefficients A, B, C of ``formulas.cross_entropy.grad_coefficients``;
``backward`` writes d loss / d logits into ``out`` (N, V), which may be the logits
themselves (``inplace_backward``).

The custom ops (``custom_op``) are declared at the bottom: ``CeCall`` -> ``CeOutputs``
(``logitless::ce_forward``), ``CeBackwardCall`` -> d loss / d logits (``ce_backward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol

from torch import Tensor

from logitless.formulas.cross_entropy import TokenStats
from logitless.ops.common.contract import Backend
from logitless.ops.common.glue import Call, Replanned
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


# --------------------------------------------------------------------------- the custom ops


@dataclass(frozen=True)
class CeCall(Call):
    """One call of the forward op (``custom_op``), from the public function's checked inputs.

    logits (N, V) (any strides), target (N,) int64, class_weight (V,) or None; ``backend``:
    its name in ``api.BACKENDS``; ``budget``: bytes of temporaries (the torch backend's
    chunks); ``need_argmax``: return the per-token argmax (``return_stats``)."""

    differentiable = ("logits",)

    logits: Tensor
    target: Tensor
    class_weight: Optional[Tensor]
    opts: CrossEntropyOptions
    backend: str
    budget: int
    need_argmax: bool


class CeOutputs(NamedTuple):
    """The forward op's outputs: loss (() or (N,) for "none"), lse (N,) (differentiable),
    argmax (N,) int64 ((0,) without ``need_argmax``), w_t (N,) the per-token weights; fp32
    (fp64 for fp64 logits); config: the backend's Config (None without tokens)."""

    loss: Tensor
    lse: Tensor
    argmax: Tensor
    w_t: Tensor
    config: Any


@dataclass(frozen=True)
class CeBackwardCall(Call):
    """One call of the backward op (-> d loss / d logits): the upstream gradients of the
    loss and of the lse, the forward's inputs, statistics and Config (the object on the eager
    path; through the custom ops planned again from the logits and ``budget``)."""

    grad_loss: Tensor
    grad_lse: Optional[Tensor]
    logits: Tensor
    target: Tensor
    class_weight: Optional[Tensor]
    lse: Tensor
    w_t: Tensor
    config: Replanned
    opts: CrossEntropyOptions
    backend: str
    budget: int
