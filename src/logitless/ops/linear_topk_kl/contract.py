"""The contract of a linear_topk_kl backend: what each one plans, returns and receives.

Every backend (``TorchBackend``, ``TritonBackend``: one class each, listed in
``api.BACKENDS``) is a ``TopKBackend``. Per call, in this order:

    config = backend.plan(x, weight, bias, opts, budget=..., need_grad=..., k=...)   # once
    out = backend.forward(x, weight, bias, ids, target, opts, config)                # TopKForward
    (loss, coefficients: formulas.topk_kl.token_terms on out.stats)
    dx, dw, db = backend.backward(x, weight, bias, ids, target, opts, rows, coef, sparse, config,
                                  kept=out.kept, need_dx=..., need_dw=..., need_db=...)

``ids`` (N, K) int64 are ascending per row and index this weight's rows: on a
vocab-parallel rank they are the global ids minus the rank's first row, so some lie
outside [0, V) (another rank's): a backend matches no column to those, and its ``z_ids``
hold 0 there (the ranks' values are summed). ``config`` is the backend's frozen Config
(``TorchConfig``, ``TritonConfig``): the backward gets the forward's, never a
new one (through the custom ops the backward op plans it again: ``custom_op.replan``,
the memoised planner's same object). The vocab-parallel path
(``vocab_parallel``) calls the same methods on a rank's rows (``dx_acc``: dx as the fp32
partial sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol

from torch import Tensor

from logitless.formulas.topk_kl import TopKStats
from logitless.ops.common.contract import Backend, Needs
from logitless.ops.common.glue import Call, Owned, Replanned
from logitless.ops.common.kept import Kept
from logitless.options import TopKKLOptions, VocabParallelOptions
from logitless.planning.plans import LinearPlan, TorchPlan


@dataclass(frozen=True)
class TorchConfig:
    """The torch backend's tiles: the forward's and the backward's."""

    forward: TorchPlan
    backward: TorchPlan


@dataclass(frozen=True)
class TritonConfig:
    """The Triton backend's: ``linear``, cross-entropy's plan of the call (tiles, splits,
    kept columns, chunks: ``planning.plans.linear_plan``), and ``slots``, the ids per row and
    tile the forward's fast pass compares unrolled (a program with a tile holding more is
    recomputed by its retry pass: ``triton_backend.id_slots``)."""

    linear: LinearPlan
    slots: int


class TopKForward(NamedTuple):
    """What a backend's ``forward`` returns: the statistics of its rows (``TopKStats``:
    lse over the columns outside the ids, z at the ids, the hard-label term's), and the
    kept columns of exp(a - m) for the backward (None when it keeps none; one backward
    only: it may turn them into dz over themselves, ``ops.common.kept.Kept``)."""

    stats: TopKStats
    kept: Optional[tuple[Tensor, Tensor]] = None


class TopKBackend(Backend, Protocol):
    """One backend of linear_topk_kl (module docstring)."""

    def plan(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], opts: TopKKLOptions, *, budget: int,
             need_grad: bool, k: int = 0, cute: bool = True, kept_owned: bool = True) -> Any:
        """The call's Config (``k``: the teacher's ids per token); ``cute=False``: a fake's
        (no choice that needs memory); ``kept_owned``: the backward may overwrite what the
        forward keeps for it (eager; ``glue.Owned``), else the plan budgets a copy of its own."""
        ...

    def kept_shapes(self, config: Any, n: int) -> Optional[tuple[tuple, tuple]]:
        """Shapes of ``TopKForward.kept`` under ``config`` (the fake's), or None."""
        ...

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, target: Tensor,
                opts: TopKKLOptions, config: Any) -> TopKForward:
        """``target``: in this weight's rows (-1 where it is not one; only read with hard labels)."""
        ...

    def backward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, target: Tensor,
                 opts: TopKKLOptions, rows: Tensor, coef: Tensor, sparse: Tensor, config: Any, *,
                 kept: Optional[Kept], need_dx: bool, need_dw: bool, need_db: bool,
                 dx_acc: bool = False) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """dx, dW, db (None where not needed) from the dense coefficients ``coef`` (3, N),
        the values at the ids ``sparse`` (N, K) (``formulas.topk_kl``, times the upstream
        gradient) and ``rows`` (2, N) = (lse_tail, lse1); ``dx_acc``: dx as the fp32
        accumulator."""
        ...


# --------------------------------------------------------------------------- the custom ops


@dataclass(frozen=True)
class TopKCall(Call):
    """One call of the forward op, from the public function's checked inputs.

    x (N, H), weight (V, H) (this rank's rows with ``tp.tp_group``), bias (V,) or None;
    ids (N, K) int64, ascending per row (global ids), teacher_log_probs (N, K) in their
    order; target (N,) int64 (``ignore_index`` where a token counts for nothing; the
    hard-label term's class otherwise); ``budget``: bytes of temporaries; ``need_grad``: a
    backward will follow (keep columns, compute the coefficients); ``need``: the gradients
    that backward wants; ``owned``: the backward will own what the forward keeps (eager;
    False through the custom ops, ``glue.Owned``)."""

    differentiable = ("x", "weight", "bias")

    x: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    ids: Tensor
    teacher_log_probs: Tensor
    target: Tensor
    opts: TopKKLOptions
    backend: str
    budget: int
    need_grad: bool
    need: Needs
    tp: VocabParallelOptions
    owned: Owned = Owned(True)


class TopKOutputs(NamedTuple):
    """The forward op's outputs. loss: reduced ((N,) for "none"); w (N,): 1 where a token
    counts; rows (2, N): lse_tail and lse1 (lse_tail again when not needed); coef (3, N)
    and sparse (N, K): the unit-gradient coefficients (``formulas.topk_kl``; size 0
    without ``need_grad``); keep, keep_max: the kept columns (``NOTHING_KEPT``-shaped
    dummies when none); config: the backend's Config."""

    loss: Tensor
    w: Tensor
    rows: Tensor
    coef: Tensor
    sparse: Tensor
    keep: Tensor
    keep_max: Tensor
    config: Any


@dataclass(frozen=True)
class TopKBackwardCall(Call):
    """One call of the backward op: the upstream gradient of the loss, the forward's
    inputs, its per-token results, its kept columns (turned into dz over themselves where
    ``owned``) and Config (the object on the eager path; through the custom ops planned again
    from the inputs, ``budget`` and ``need_grad``: the forward's)."""

    grad_loss: Tensor
    x: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    ids: Tensor
    target: Tensor
    w: Tensor
    rows: Tensor
    coef: Tensor
    sparse: Tensor
    keep: Tensor
    keep_max: Tensor
    config: Replanned
    opts: TopKKLOptions
    backend: str
    need: Needs
    tp: VocabParallelOptions
    budget: int
    need_grad: bool
    owned: Owned = Owned(False)
