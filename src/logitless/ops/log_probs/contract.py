"""The contract of a log_probs backend (logits the caller holds): what each one plans,
returns and receives.

Every backend (``TorchBackend``, ``TritonBackend``: one class each, listed in
``api.BACKENDS``) is an ``LpBackend``. Per call, in this order:

    config = backend.plan(logits, opts, budget=..., truncated=..., batch_invariant=...)  # once
    out = backend.forward(logits, tokens, truncation, opts, config)                    # LpForward
    dz = backend.backward(grad_logp, grad_entropy, logits, tokens, out.logp, out.entropy,
                          out.lse, out.tau, opts, config)

``logits`` (N, V) with N > 0 (the custom ops answer N = 0 themselves). ``truncated``: the
call has top-k / top-p / min-p (``truncation``, a ``formulas.truncation.Truncation``, else
None); with it or ``batch_invariant`` the Config holds ``Blocks``: plain torch ops on
blocks of rows (``truncation.py``, shared by the backends), else the backend's own
streaming plan. ``config`` is the backend's frozen Config (``TorchConfig``,
``TritonConfig``): the backward gets the forward's, never a new one (through the custom
ops the backward op plans it again from the same arguments: the memoised planner returns
the forward's object). The custom ops' declared calls (``LpCall`` ->
``LpOutputs``, ``LpBackwardCall``: ``ops.common.glue``) are at the bottom.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol

from torch import Tensor

from logitless.formulas.truncation import Truncation
from logitless.ops.common.contract import Backend
from logitless.ops.common.glue import Call, Replanned
from logitless.options import LogProbOptions
from logitless.planning.logits import CETritonPlan


@dataclass(frozen=True)
class Blocks:
    """The truncated and batch-invariant path (``truncation.py``): blocks of ``rows`` rows,
    the last one padded to ``rows`` when ``padded`` (batch_invariant: a row's bits do not
    depend on the batch)."""

    rows: int
    padded: bool


@dataclass(frozen=True)
class TorchConfig:
    """The torch backend's rows per chunk (``planning.logits.ce_torch_plan`` of the budget;
    the forward's and the backward's), or the blocks of the truncated path."""

    rows: int = 0
    blocks: Optional[Blocks] = None


@dataclass(frozen=True)
class TritonConfig:
    """The Triton backend's tiles (``planning.logits.ce_triton_plan``; the forward's and the
    backward's), or the blocks of the truncated path."""

    tiles: Optional[CETritonPlan] = None
    blocks: Optional[Blocks] = None


class LpForward(NamedTuple):
    """What a backend's ``forward`` returns, per token in the compute dtype: log p at the
    token, the entropy (None without ``opts.entropy``), the lse (on the truncated path
    the kept set's) and ``tau`` (the truncated path's threshold per row, -inf: nothing
    truncated; else None)."""

    logp: Tensor
    entropy: Optional[Tensor]
    lse: Tensor
    tau: Optional[Tensor] = None


class LpBackend(Backend, Protocol):
    """One backend of log_probs (module docstring). Its capability (a class attribute):

    strided_logits: its streaming forward and backward read the logits through their
        strides (Triton); where not (torch), ``api`` makes rows whose last dimension is
        strided contiguous first.
    """

    strided_logits: bool

    def plan(self, logits: Tensor, opts: LogProbOptions, *, budget: int, truncated: bool,
             batch_invariant: bool) -> Any:
        """The call's Config."""
        ...

    def forward(self, logits: Tensor, tokens: Tensor, truncation: Optional[Truncation], opts: LogProbOptions,
                config: Any) -> LpForward:
        ...

    def backward(self, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], logits: Tensor, tokens: Tensor,
                 logp: Optional[Tensor], entropy: Optional[Tensor], lse: Tensor, tau: Optional[Tensor],
                 opts: LogProbOptions, config: Any) -> Tensor:
        """d / d logits (N, V), a new tensor in the logits' dtype. ``logp``, ``tau``: the
        forward's on the truncated path (where logp is -inf no gradient flows), else None;
        ``entropy``: None without ``opts.entropy``."""
        ...


# --------------------------------------------------------------------------- the custom ops


@dataclass(frozen=True)
class LpCall(Call):
    """One call of the forward op (``custom_op``): logits (N, V), tokens (N,) int64; ``budget``:
    bytes of temporaries (the torch backend's rows per chunk); truncated sampling: ``top_k``
    (int64), ``top_p``, ``min_p`` (float64), (N,) each, or None (none), ``checked``: their
    values were range-checked (``formulas.truncation.Truncation.checked``; else the forward
    checks them on the CPU), ``k_max`` the largest top_k when known on the host (-1: read
    from top_k); ``batch_invariant``."""

    differentiable = ("logits",)

    logits: Tensor
    tokens: Tensor
    opts: LogProbOptions
    backend: str
    budget: int
    top_k: Optional[Tensor]
    top_p: Optional[Tensor]
    min_p: Optional[Tensor]
    checked: bool
    k_max: int
    batch_invariant: bool


class LpOutputs(NamedTuple):
    """The forward op's outputs, per token in the compute dtype: logp, entropy (None without
    ``opts.entropy``), lse, tau (truncated or batch-invariant calls: the threshold per row,
    -inf where nothing is truncated; else None), config: the backend's Config. (None outputs
    cross the custom ops as size-0 tensors: ``glue``.)"""

    logp: Tensor
    entropy: Optional[Tensor]
    lse: Tensor
    tau: Optional[Tensor]
    config: Any


@dataclass(frozen=True)
class LpPlanned:
    """The scalars an ``LpCall``'s Config was planned with (``truncated``: ``top_k`` given),
    carried to the backward op, which plans it again from them."""

    budget: int
    truncated: bool
    batch_invariant: bool


@dataclass(frozen=True)
class LpBackwardCall(Call):
    """One call of the backward op (-> d / d logits, a new tensor): the upstream gradients,
    the forward's inputs, statistics and Config; ``logp`` the forward's on the truncated
    path (no gradient where it is -inf), else None. ``planned``: what the forward planned
    from (``custom_op.replan``)."""

    grad_logp: Optional[Tensor]
    grad_entropy: Optional[Tensor]
    logits: Tensor
    tokens: Tensor
    logp: Optional[Tensor]
    entropy_out: Optional[Tensor]
    lse: Tensor
    tau: Optional[Tensor]
    config: Replanned
    opts: LogProbOptions
    backend: str
    planned: LpPlanned
