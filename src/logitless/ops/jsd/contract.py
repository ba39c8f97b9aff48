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
backward gets the forward's, never a new one, and it crosses the custom ops as
``backend.codec`` encodes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from logitless.ops.common.contract import Backend
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
