"""The contract of a jsd backend (student and teacher logits the caller holds): what
each one plans, returns and receives.

Every backend (``TorchBackend``, ``TritonBackend``: one class each, listed in
``api.BACKENDS``) is a ``JsdBackend``. Per call, in this order:

    config = backend.plan(student_logits, teacher_logits, budget=...)           # once
    stats = backend.forward(student_logits, teacher_logits, target, opts, config)  # (6, N)
    dz = backend.backward(g, student_logits, teacher_logits, target, stats, opts, config)

Logits (N, V) with N > 0 (the custom ops answer N = 0 themselves); ``stats`` the (6, N)
row statistics of ``formulas.jsd``; ``g`` the per-token upstream gradient
(``formulas.jsd.upstream``); ``dz`` d loss / d student logits in their dtype.
``config`` is the backend's frozen Config (``TorchConfig``, ``TritonConfig``): the
backward gets the forward's, never a new one (through the custom ops the backward op
plans it again: ``custom_op.replan``, the memoised planner's same object).

The custom ops (``custom_op``) are declared at the bottom: ``JsdCall`` -> ``JsdOutputs``
(``logitless::jsd_forward``), ``JsdBackwardCall`` -> d loss / d student logits
(``jsd_backward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from torch import Tensor

from logitless.ops.common.contract import Backend
from logitless.ops.common.glue import Call, Replanned
from logitless.options import JSDOptions
from logitless.planning.logits import CETritonPlan, JSDStatsPlan


@dataclass(frozen=True)
class TorchConfig:
    """The torch backend's rows per chunk (``planning.logits.jsd_torch_rows`` of the
    budget), the forward's and the backward's."""

    rows: int


@dataclass(frozen=True)
class TritonConfig:
    """The Triton backend's launches: the row statistics' (``planning.logits.jsd_stats_plan``)
    and the backward's tiles (``planning.logits.ce_triton_plan``)."""

    stats: JSDStatsPlan
    backward: CETritonPlan


class JsdBackend(Backend, Protocol):
    """One backend of jsd (module docstring)."""

    def plan(self, student_logits: Tensor, teacher_logits: Tensor, *, budget: int) -> Any:
        """The call's Config."""
        ...

    def forward(self, student_logits: Tensor, teacher_logits: Tensor, target: Tensor, opts: JSDOptions,
                config: Any) -> Tensor:
        """The (6, N) statistics in the compute dtype (fp32 on Triton)."""
        ...

    def backward(self, g: Tensor, student_logits: Tensor, teacher_logits: Tensor, target: Tensor, stats: Tensor,
                 opts: JSDOptions, config: Any) -> Tensor:
        """d loss / d student logits (N, V) in the student logits' dtype."""
        ...


# --------------------------------------------------------------------------- the custom ops


@dataclass(frozen=True)
class JsdCall(Call):
    """One call of the forward op (``custom_op``), from the public function's checked inputs.

    student_logits, teacher_logits (N, V) (any strides; the teacher gets no gradient),
    target (N,) int64 (all 0 with ``opts.ignore_index`` -1 when the caller gave none);
    ``budget``: bytes of temporaries (the torch backend's chunks); ``backend``: its name in
    ``api.BACKENDS``."""

    differentiable = ("student_logits",)

    student_logits: Tensor
    teacher_logits: Tensor
    target: Tensor
    opts: JSDOptions
    budget: int
    backend: str


class JsdOutputs(NamedTuple):
    """The forward op's outputs: the per-token loss (N,) and the (6, N) row statistics of
    ``formulas.jsd``, fp32 (fp64 for fp64); config: the backend's Config (None without
    tokens)."""

    loss: Tensor
    stats: Tensor
    config: Any


@dataclass(frozen=True)
class JsdBackwardCall(Call):
    """One call of the backward op (-> d loss / d student logits): the per-token loss's
    upstream gradient, the forward's inputs, statistics and Config (the object on the eager
    path; through the custom ops planned again from both logits and ``budget``)."""

    grad_loss: Tensor
    student_logits: Tensor
    teacher_logits: Tensor
    target: Tensor
    stats: Tensor
    config: Replanned
    opts: JSDOptions
    backend: str
    budget: int
