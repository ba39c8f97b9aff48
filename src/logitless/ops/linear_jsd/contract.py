"""The contract of a linear_jsd backend: what each one plans, returns and receives.

Every backend (``TorchBackend``, ``TritonBackend``, ``HelionBackend``: one class each, listed
in ``api.BACKENDS``) is a ``LjsdBackend``. Per call, in this order:

    config = backend.plan(xs, ws, xt, opts, budget=..., grad_in_forward=...)     # once
    out = backend.forward(xs, ws, bs, xt, wt, bt, target, opts, config,
                          reduction=..., need_dx=..., ...)                        # LjsdForward
    g = backend.upstream(grad_loss, target, ignore_index, reduction)              # (N,)
    dx, dw, db = backend.backward(g, xs, ws, bs, xt, wt, bt, target, stats, opts, config, ...)

``config`` is the backend's frozen Config (``TorchConfig``, ``TritonConfig``,
``HelionConfig``): the backward gets the forward's, never a new one (through the custom
ops the backward op plans it again: ``custom_op.replan``). The vocab-parallel path (``vocab_parallel``) calls the
same methods on a rank's rows (``reduction=None``: the statistics only; ``column_sums``:
its second pass for 0 < beta < 1; ``dx_acc``: dx as the partial sum in fp32).

The custom ops' declarations (``ops.common.glue``) close the file: ``LjsdCall`` (the forward
op's inputs by name), ``LjsdOutputs`` and ``LjsdBackwardCall`` (what the backward op reads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol

from torch import Tensor

from logitless.ops.common.contract import Backend, Needs
from logitless.ops.common.glue import Call, Replanned
from logitless.options import JSDOptions, VocabParallelOptions
from logitless.planning.logits import JSDStatsPlan
from logitless.planning.plans import TorchPlan

from .planning import LinearJSDPlan


@dataclass(frozen=True)
class TorchConfig:
    """The torch backend's chunks: the forward's rows and vocabulary slices (full rows of
    both heads), the backward's tiles, and the column sums' tiles (vocab-parallel heads'
    second pass; None when the call has none)."""

    forward_rows: int
    vocab_step: int
    backward: TorchPlan
    column_sums: Optional[TorchPlan] = None


@dataclass(frozen=True)
class TritonConfig:
    """The Triton backend's plan of one call.

    forward: the forward's token chunks (``forward_rows``; also the column sums') and the
        fused forward's tiles; backward: the backward's chunks and tiles;
    stats, tail_stats: the row statistics' launches for a chunk of the forward's rows (of
        ``grad_in_forward`` tokens when that strategy runs) and for the last, shorter one
        (None when every chunk is full);
    fused: the KL limits' fused forward (``jsd_kl_forward_kernel``) runs;
    grad_in_forward: tokens per chunk of the gradient-in-forward strategy (0: not used);
    keep_cols: the "keep" strategy (``cost_model``): the forward's chunks (``forward``'s
        rows) also write dz of columns [0, keep_cols) of every token, which the backward
        uses instead of recomputing them (``backward``: the other columns' chunks; 0: none).
    """

    forward: LinearJSDPlan
    backward: LinearJSDPlan
    stats: JSDStatsPlan
    tail_stats: Optional[JSDStatsPlan] = None
    fused: bool = False
    grad_in_forward: int = 0
    keep_cols: int = 0


@dataclass(frozen=True)
class HelionConfig:
    """``helion``: Helion runs the call (``budget`` sizes its chunks); else the backend whose
    Config is set runs in its place (``ops.common.helion_choice``). With Helion running,
    a set Config is that of the backend computing the column sums of a vocab-parallel head
    (no Helion kernel takes given log-sum-exps)."""

    helion: bool = True
    budget: int = 0
    torch: Optional[TorchConfig] = None
    triton: Optional[TritonConfig] = None


class LjsdForward(NamedTuple):
    """What a backend's ``forward`` returns.

    stats: the (6, N) statistics of ``formulas.jsd``, fp32 (fp64 for fp64);
    loss: the loss (reduced, or per token for "none") when a reduction was given, else None;
    grads: (dx, dw, db) for a unit upstream gradient when the Config chose the
        gradient-in-forward strategy (``ops.common.grad_in_forward.scale_grads``), or None;
    kept: (N, keep_cols rounded up to 8) in x's dtype when the Config chose the "keep"
        strategy: in its first keep_cols columns dz of those columns for the upstream
        gradient at grad_output = 1 (the backward's ``kept``), else None.
    """

    stats: Tensor
    loss: Optional[Tensor] = None
    grads: Optional[tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]] = None
    kept: Optional[Tensor] = None


class LjsdBackend(Backend, Protocol):
    """One backend of linear_jsd (module docstring).

    Capability: ``grad_in_forward``, the backend's gradient-in-forward strategy (the
    Triton backend's ``triton_grad_in_forward.forward_with_grad``, run by its ``forward``
    when the Config chose it), or None (torch, Helion): the public function allows the
    strategy (``LjsdCall.grad_in_forward``) only for a backend that has one."""

    @property
    def grad_in_forward(self) -> Optional[Callable]: ...  # (read-only: a class attribute or set at init)

    def plan(self, xs: Tensor, ws: Tensor, xt: Tensor, opts: JSDOptions, *, budget: int,
             grad_in_forward: bool = False, keep: bool = False, column_sums: bool = False) -> Any:
        """The call's Config. ``grad_in_forward``: the caller allows that strategy (eager,
        a reduced loss, one device's heads, a backend that has it); ``keep``: it allows
        the "keep" strategy (the same, compiled too); ``column_sums``: the call runs
        ``column_sums``."""
        ...

    def forward(self, xs: Tensor, ws: Tensor, bs: Optional[Tensor], xt: Tensor, wt: Tensor, bt: Optional[Tensor],
                target: Tensor, opts: JSDOptions, config: Any, *, reduction: Optional[str] = None,
                need_dx: bool = False, need_dw: bool = False, need_db: bool = False) -> LjsdForward:
        ...

    def upstream(self, grad: Tensor, target: Tensor, ignore_index: int, reduction: str) -> Tensor:
        """The per-token upstream gradient of a gradient of the (reduced) loss."""
        ...

    def backward(self, g: Tensor, xs: Tensor, ws: Tensor, bs: Optional[Tensor], xt: Tensor, wt: Tensor,
                 bt: Optional[Tensor], target: Tensor, stats: Tensor, opts: JSDOptions, config: Any, *,
                 need_dx: bool, need_dw: bool, need_db: bool, dx_acc: bool = False,
                 kept: Optional[tuple[Tensor, Tensor]] = None
                 ) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """The student's dx, dW, db (None where not needed); ``dx_acc``: dx as the fp32 accumulator;
        ``kept``: (the forward's ``LjsdForward.kept``, grad_output (), fp32) when its Config
        kept columns (only a backend whose Config keeps columns gets it)."""
        ...

    def column_sums(self, xs: Tensor, ws: Tensor, bs: Optional[Tensor], xt: Tensor, wt: Tensor,
                    bt: Optional[Tensor], target: Tensor, lse_s: Tensor, lse_t: Tensor, opts: JSDOptions,
                    config: Any) -> Tensor:
        """(3, N): S, K and the student's target logit summed over these columns only, with
        the given log-sum-exps of the full rows (``vocab_parallel``'s second pass)."""
        ...


# --------------------------------------------------------------------------- the custom ops


@dataclass(frozen=True)
class LjsdCall(Call):
    """One call of the forward op (``custom_op``), from the public function's checked inputs.

    student_x (N, H_s), student_weight (V, H_s), student_bias (V,) or None; teacher_x
    (N, H_t), teacher_weight (V, H_t), teacher_bias (V,) or None (constants: no gradient);
    target (N,) int64 (``opts.ignore_index`` -1 when the caller gave none); with
    ``tp.tp_group`` both weights are this rank's blocks of rows of vocab-parallel heads
    (``vocab_parallel``). ``reduction``: of the loss, inside the op; ``budget``: bytes of
    temporaries; ``grad_in_forward``: the caller allows the gradient-in-forward strategy
    (eager, "mean"/"sum", one device's heads, a backend that has it: the Config decides);
    ``need``: the student's gradients that a backward wants; ``keep``: a backward follows
    and the caller allows the "keep" strategy (as ``grad_in_forward``, compiled too)."""

    differentiable = ("student_x", "student_weight", "student_bias")

    student_x: Tensor
    student_weight: Tensor
    student_bias: Optional[Tensor]
    teacher_x: Tensor
    teacher_weight: Tensor
    teacher_bias: Optional[Tensor]
    target: Tensor
    opts: JSDOptions
    reduction: str
    budget: int
    backend: str
    grad_in_forward: bool
    need: Needs
    tp: VocabParallelOptions
    keep: bool = False


class LjsdOutputs(NamedTuple):
    """The forward op's outputs. loss: () for "mean"/"sum", (N,) for "none"; stats: the
    (6, N) statistics of ``formulas.jsd``; both fp32 (fp64 for fp64); config: the backend's
    Config; gx, gw, gb: the gradient-in-forward strategy's student gradients for a unit
    upstream gradient (gw fp32 unless one chunk covers every token), size 0 otherwise;
    keep: the "keep" strategy's kept dz columns (``LjsdForward.kept``), else a dummy of
    ``ops.common.kept.NOTHING_KEPT`` shape."""

    loss: Tensor
    stats: Tensor
    config: Any
    gx: Tensor
    gw: Tensor
    gb: Tensor
    keep: Tensor


@dataclass(frozen=True)
class LjsdPlanned:
    """The scalars an ``LjsdCall``'s Config was planned with (its ``budget``,
    ``grad_in_forward``; ``keeps``: its ``keep``), carried to the backward op, which plans
    it again from them."""

    budget: int
    grad_in_forward: bool
    keeps: bool


@dataclass(frozen=True)
class LjsdBackwardCall(Call):
    """One call of the backward op: the gradient of the (reduced) loss, the forward's
    tensors and statistics, its Config (the object on the eager path; through the custom
    ops planned again from ``planned``: the forward's), the options and the student's
    gradients wanted; ``keep``: the forward's kept dz columns (a ``NOTHING_KEPT`` dummy:
    none, or spent by a first backward)."""

    grad_loss: Tensor
    student_x: Tensor
    student_weight: Tensor
    student_bias: Optional[Tensor]
    teacher_x: Tensor
    teacher_weight: Tensor
    teacher_bias: Optional[Tensor]
    target: Tensor
    stats: Tensor
    config: Replanned
    opts: JSDOptions
    reduction: str
    backend: str
    need: Needs
    tp: VocabParallelOptions
    keep: Tensor
    planned: LjsdPlanned
