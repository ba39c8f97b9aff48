"""The contract of a linear_cross_entropy backend: what each one plans, returns and receives.

Every backend (``TorchBackend``, ``TritonBackend``, ``HelionBackend``: one class each, listed
in ``api.BACKENDS``) is an ``LceBackend``. Per call, in this order:

    config = backend.plan(x, weight, bias, class_weight, opts, budget=..., need_grad=...,
                          need_argmax=..., grad_in_forward=..., need_dw=...)      # once
    out = backend.forward(x, weight, bias, target, class_weight, opts, config,
                          need_argmax=..., loss=True, need_dx=..., ...)       # LceForward
    coef = backend.grad_coefficients(grad_loss, grad_lse, out.lse, out.w_t, ...)  # (3, N)
    dx, dw, db = backend.backward(x, weight, bias, target, class_weight, opts.softcap,
                                  lse, coef, config, kept=out.kept, need_dx=..., ...)

``config`` is the backend's frozen Config (``TorchConfig``, ``planning.plans.LinearPlan``,
``HelionConfig``): the backward gets the forward's. On the eager path the object itself;
through the custom ops the backward op plans it again from the same inputs (``LcePlanned``,
``custom_op.replan``): the planners are memoised pure functions of them, so it is the
forward's object, and no Config crosses the ops as a tensor (they may run inside a CUDA
graph). The vocab-parallel path (``vocab_parallel``) calls the
same methods on a rank's rows (``loss=False``: the statistics to merge; ``dx_acc``: dx as the
fp32 partial sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol

from torch import Tensor

from logitless.formulas.cross_entropy import TokenStats
from logitless.ops.common.contract import Backend, Needs
from logitless.ops.common.glue import Call, Owned, Replanned
from logitless.ops.common.kept import Kept
from logitless.options import CrossEntropyOptions, VocabParallelOptions
from logitless.planning.plans import LinearPlan, TorchPlan


@dataclass(frozen=True)
class TorchConfig:
    """The torch backend's tiles: the forward's (one logits tile per step) and the
    backward's (one more with a soft-cap; dW's accumulator for 16-bit inputs)."""

    forward: TorchPlan
    backward: TorchPlan


@dataclass(frozen=True)
class HelionConfig:
    """Helion runs the call (both None), or the backend that runs in its place, under its
    own Config (``ops.common.helion_choice``): ``torch`` on CPU tensors (or without
    triton), ``triton`` on CUDA tensors. Decided in ``plan``, followed by the backward.
    ``budget``: the memory budget the Helion backward sizes its vocabulary chunks by."""

    budget: int = 0
    torch: Optional[TorchConfig] = None
    triton: Optional[LinearPlan] = None


class LceForward(NamedTuple):
    """What a backend's ``forward`` returns.

    stats: the per-token statistics (with ``loss``: lse and argmax at least; without:
        every field the options need, to merge over a vocab-parallel head);
    loss, w_t: the reduced loss and the per-token target weights (``loss=True``), else None;
    kept: (keep, keep_max), the columns of exp(z - m) kept for the backward (one backward
        only: it may turn them into dz over themselves, ``ops.common.kept.Kept``), or None;
    grads: (dx, dw, db) for a unit upstream gradient when the Config chose the
        gradient-in-forward strategy (``ops.common.grad_in_forward.scale_grads``), or None.
    """

    stats: TokenStats
    loss: Optional[Tensor] = None
    w_t: Optional[Tensor] = None
    kept: Optional[tuple[Tensor, Tensor]] = None
    grads: Optional[tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]] = None


class LceBackend(Backend, Protocol):
    """One backend of linear_cross_entropy (module docstring)."""

    def plan(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], class_weight: Optional[Tensor],
             opts: CrossEntropyOptions, *, budget: int, need_grad: bool, need_argmax: bool,
             grad_in_forward: bool = False, need_dw: bool = True, cute: bool = True,
             kept_owned: bool = True) -> Any:
        """The call's Config. ``grad_in_forward``: the caller allows that strategy (eager,
        single device); ``cute=False``: without the CuTe choice (a fake: no memory);
        ``kept_owned``: the backward may overwrite what the forward keeps for it (eager;
        ``glue.Owned``), else the plan budgets a copy of its own."""
        ...

    def kept_shapes(self, config: Any, n: int) -> Optional[tuple[tuple, tuple]]:
        """Shapes of ``LceForward.kept`` under ``config`` (the fake's), or None."""
        ...

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                class_weight: Optional[Tensor], opts: CrossEntropyOptions, config: Any, *, need_argmax: bool,
                loss: bool = True, need_dx: bool = False, need_dw: bool = False,
                need_db: bool = False) -> LceForward:
        ...

    def grad_coefficients(self, grad_loss: Tensor, grad_lse: Optional[Tensor], lse: Tensor, w_t: Tensor,
                          target: Tensor, class_weight: Optional[Tensor], opts: CrossEntropyOptions,
                          num_classes: int) -> Tensor:
        """The backward's (3, N) coefficients A, B, C."""
        ...

    def backward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                 class_weight: Optional[Tensor], softcap: Optional[float], lse: Tensor, coef: Tensor,
                 config: Any, *, kept: Optional[Kept], need_dx: bool, need_dw: bool,
                 need_db: bool, dx_acc: bool = False) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """dx, dW, db (None where not needed); ``kept``: the forward's kept columns and where
        their dz goes; ``dx_acc``: dx as the fp32 accumulator."""
        ...


# --------------------------------------------------------------------------- the custom ops


@dataclass(frozen=True)
class LceCall(Call):
    """One call of the forward op (``custom_op``), from the public function's checked inputs.

    x (N, H), weight (V, H) (this rank's rows with ``tp.tp_group``), bias (V,) or None,
    target (N,) int64, class_weight (V,) or None (the full vector under TP); ``budget``: bytes
    of temporaries; ``need_grad``: a backward will follow (plan kept columns);
    ``grad_in_forward``: the caller allows the gradient-in-forward strategy (eager, one
    device; the Config decides); ``need``: the gradients that backward wants;
    ``batch_invariant``: the forward on fixed-size row blocks (``invariant.Blocked``);
    ``owned``: the backward will own what the forward keeps (eager; False through the custom
    ops, ``glue.Owned``)."""

    differentiable = ("x", "weight", "bias")

    x: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    target: Tensor
    class_weight: Optional[Tensor]
    opts: CrossEntropyOptions
    backend: str
    budget: int
    need_argmax: bool
    need_grad: bool
    grad_in_forward: bool
    need: Needs
    batch_invariant: bool
    tp: VocabParallelOptions
    owned: Owned = Owned(True)


class LceOutputs(NamedTuple):
    """The forward op's outputs (size 0 where absent). loss: reduced ((N,) for "none"); lse,
    w_t (N,) fp32 (fp64 for fp64); argmax (N,) int64 (``need_argmax``); keep, keep_max: the
    kept columns of exp(z - m) (``LceForward.kept``; ``NOTHING_KEPT``-shaped dummies when
    none; the backward turns them into dz); config: the backend's Config; gx, gw,
    gb: the gradient-in-forward strategy's gradients for a unit upstream gradient."""

    loss: Tensor
    lse: Tensor
    argmax: Tensor
    w_t: Tensor
    keep: Tensor
    keep_max: Tensor
    config: Any
    gx: Tensor
    gw: Tensor
    gb: Tensor


@dataclass(frozen=True)
class LcePlanned:
    """The scalars an ``LceCall``'s Config was planned with (its fields of the same names;
    ``dw``: ``need.need_dw``), carried to the backward op, which plans it again from them."""

    budget: int
    need_argmax: bool
    need_grad: bool
    grad_in_forward: bool
    dw: bool


@dataclass(frozen=True)
class LceBackwardCall(Call):
    """One call of the backward op: the upstream gradients of the loss (None: not
    materialised, under ``batch_invariant``) and of the lse, the forward's inputs and
    statistics, its kept columns (turned into dz over themselves where ``owned``) and
    Config (the object on the eager path; through the custom ops planned again from
    ``planned``)."""

    grad_loss: Optional[Tensor]
    grad_lse: Optional[Tensor]
    x: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    target: Tensor
    class_weight: Optional[Tensor]
    lse: Tensor
    w_t: Tensor
    keep: Tensor
    keep_max: Tensor
    config: Replanned
    opts: CrossEntropyOptions
    backend: str
    batch_invariant: bool
    need: Needs
    tp: VocabParallelOptions
    planned: LcePlanned
    owned: Owned = Owned(False)
