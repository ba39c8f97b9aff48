"""The contract of a linear_log_probs backend: what each one plans, returns and receives.

Every backend (``TorchBackend``, ``TritonBackend``, ``HelionBackend``: one class each, listed
in ``api.BACKENDS``) is an ``LlpBackend``. Per call, in this order:

    config = backend.plan(x, weight, bias, opts, budget=..., need_grad=..., need_dw=...,
                          truncated=..., k_max=..., block=...)                     # once
    (logp, entropy, lse), kept = backend.forward(x, weight, bias, tokens, opts, config)
    coef = backend.grad_coefficients(entropy, tokens, g_logp, g_entropy, V, opts, lse)   # (3, N)
    dx, dw, db = backend.backward(x, weight, bias, tokens, opts, lse, coef, config,
                                  kept=kept, need_dx=..., need_dw=..., need_db=...)

``config`` is the backend's frozen Config (``TorchConfig``, ``TritonConfig``, ``HelionConfig``):
the backward gets the forward's, never a new one. On the eager path the object itself;
through the custom ops the backward op plans it again from the same inputs (``LlpPlanned``,
``custom_op.replan``): the planners are memoised pure functions of them, so it is the
forward's object, and no Config crosses the ops as a tensor (they may run inside a CUDA
graph). Truncated sampling (top-k / top-p / min-p) and ``batch_invariant`` are Configs of
the same backends: ``Truncated`` in the Config (its blocks, the threshold pass's plans,
whether the search and the sparse backward may run), planned from the call's arguments;
the steps that follow the data (the search's C from the largest top_k, which rows a
threshold pass settles) run in ``truncation`` under that Config. The vocab-parallel path
(``vocab_parallel``) calls the same methods on a rank's rows (``outputs=False``: the
statistics to merge; ``dx_acc``: dx as the fp32 partial sum).
The custom ops' declared calls (``LlpCall`` -> ``LlpOutputs``, ``LlpBackwardCall``:
``ops.common.glue``) are at the bottom.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol

from torch import Tensor

from logitless.formulas.truncation import MIN_CANDIDATES
from logitless.ops.common.contract import Backend, Needs
from logitless.ops.common.glue import Call, Owned, Replanned
from logitless.ops.common.kept import Kept
from logitless.options import LogProbOptions, VocabParallelOptions
from logitless.planning.plans import LinearPlan, TorchPlan
from logitless.planning.tiles import TritonPlan


@dataclass(frozen=True)
class Truncated:
    """What a truncated or batch-invariant call decides once (``decide``, in the backends' ``plan``),
    from the call's arguments only (never from the data: the backward op plans it again).

    search: the backend's threshold search (``threshold_search``: Triton's candidates / mass
        search) may find the thresholds: it does where the largest per-token top_k, known
        to the forward (the caller's ``k_max``, or read there: a host sync), needs at most
        MAX_CANDIDATES candidates and no CUDA graph is being captured; else the chunked pass;
        width: columns of the sparse backward's candidates (0: the call cannot take it);
        block: rows per block under batch invariance (0: one block).
    """

    search: bool = False
    width: int = 0
    block: int = 0


#: Candidates of the Triton threshold pass at most (a power of two; ``truncation``).
MAX_CANDIDATES = 256


def candidate_count(k_max: int) -> int:
    """C of the Triton threshold pass: the least power of two >= max(MIN_CANDIDATES, k_max + 1)."""
    c = MIN_CANDIDATES
    while c < k_max + 1:
        c *= 2
    return c


def tensor_k_max(top_k: Tensor, block: int) -> int:
    """The largest per-token top_k (a host sync); under batch_invariant (``block``) at
    least MAX_CANDIDATES - 1: one C whatever the neighbours' top_k."""
    k_max = int(top_k.max())
    if block and k_max < MAX_CANDIDATES:
        k_max = MAX_CANDIDATES - 1
    return k_max


class Searches(Protocol):
    """What ``sparse_width``, ``may_keep`` and ``decide`` read of a backend (an instance or
    its class: a capability is a class attribute, ``LlpBackend``)."""

    @property
    def threshold_search(self) -> bool: ...


def sparse_width(impl: Searches, v: int, k_max: int, need_grad: bool, truncated: bool, parallel: bool) -> int:
    """Columns of the forward op's ``sparse`` output (the sparse backward's candidates,
    padded), or 0 when the call cannot take the sparse backward: only a backend with the
    ``threshold_search`` gives them. ``k_max`` -1 (a per-token top_k not read on the
    host): the widest C. (The fake's shapes: from the op's arguments only.)"""
    if not (truncated and need_grad and not parallel and impl.threshold_search):
        return 0
    c = candidate_count(k_max) if k_max >= 0 else MAX_CANDIDATES
    return min(c, v) if c <= MAX_CANDIDATES else 0


def may_keep(impl: Searches, k_max: int, block: int, need_grad: bool, truncated: bool, softcap, parallel: bool):
    """Whether the forward may keep columns for the backward (the backend's forward over
    all rows, ``need_grad``): not blocked (a plan that keeps may tile differently), not
    with a soft-cap and a threshold, and never where the threshold search may run (its
    outputs need no forward) or may not (``k_max`` -1): the fake must know the shapes."""
    if block or not need_grad or (truncated and softcap is not None):
        return False
    return parallel or not impl.threshold_search or (k_max >= 0 and candidate_count(k_max) > MAX_CANDIDATES)


def decide(impl: Searches, v: int, truncated: bool, k_max: int, block: int, need_grad: bool, parallel: bool,
           softcap: Optional[float] = None):
    """(``Truncated``, may the forward keep columns) of a truncated or batch-invariant call:
    the part of a backend's ``plan`` that is the same for every backend. ``k_max``: the op's
    argument (-1: the forward reads it; the fake's shapes follow the argument)."""
    width = sparse_width(impl, v, k_max, need_grad, truncated, parallel)
    keep = may_keep(impl, k_max, block, need_grad, truncated, softcap, parallel)
    search = truncated and not parallel and impl.threshold_search \
        and (k_max < 0 or candidate_count(k_max) <= MAX_CANDIDATES)
    return Truncated(search, width, block), keep


def search_candidates(search: bool, k_max: Optional[int]) -> int:
    """C of the threshold search of a call whose Config allows it (``Truncated.search``) and
    whose largest top_k the forward knows (``k_max``; None: not read, while a CUDA graph is
    captured), or 0: the chunked pass finds the thresholds."""
    if not search or k_max is None:
        return 0
    c = candidate_count(k_max)
    return c if c <= MAX_CANDIDATES else 0


@dataclass(frozen=True)
class TorchConfig:
    """The torch backend's tiles: the forward's (of a block under batch invariance), the
    backward's (over the batch; dW's accumulator for 16-bit inputs when dW is needed), the
    chunked threshold pass's (truncation) and the truncation's decisions."""

    forward: Optional[TorchPlan]
    backward: Optional[TorchPlan]
    thresholds: Optional[TorchPlan] = None
    trunc: Optional[Truncated] = None


@dataclass(frozen=True)
class TritonConfig:
    """The Triton backend's plans: ``main`` the forward's (of a block under batch
    invariance; its kept columns and the backward's tiles), ``backward`` the backward's over
    the batch when the forward ran in blocks, ``search`` the threshold passes' (nothing
    kept, no CuTe), ``thresholds`` the chunked threshold pass's steps; the Triton search's
    (``triton_lib.log_probs_candidates``): the candidates kernel's tiles and the mass
    kernel's (its C and vocabulary splits follow the largest top_k, which the forward
    knows: ``search_candidates``). ``main`` is None on a vocab-parallel rank without real
    rows (only the threshold steps serve there)."""

    main: Optional[LinearPlan] = None
    backward: Optional[LinearPlan] = None
    search: Optional[LinearPlan] = None
    thresholds: Optional[TorchPlan] = None
    trunc: Optional[Truncated] = None
    candidate_tiles: Optional[TritonPlan] = None
    mass_tiles: Optional[TritonPlan] = None


@dataclass(frozen=True)
class HelionConfig:
    """Helion runs the call (both None), or the backend that runs in its place, under its
    own Config (``ops.common.helion_choice``): ``torch`` on CPU tensors (or without
    triton), ``triton`` on CUDA tensors. ``budget``: the Helion backward's."""

    budget: int = 0
    torch: Optional[TorchConfig] = None
    triton: Optional[TritonConfig] = None


class LlpBackend(Backend, Protocol):
    """One backend of linear_log_probs (module docstring). Its capabilities (class attributes):

    truncates: it runs truncated and batch-invariant calls (a ``Truncated`` Config); where
        not (Helion: no threshold kernels), ``api`` runs such a call on the backend that
        runs in its place (``ops.common.helion_choice.fallback_name``);
    threshold_search: its thresholds come from the Triton candidates / mass search
        (``truncation.search_triton``), which also gives the sparse backward's candidates;
        else from the chunked pass (``truncation.thresholds``).
    """

    truncates: bool
    threshold_search: bool

    def plan(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], opts: LogProbOptions, *, budget: int,
             need_grad: bool, need_dw: bool = True, truncated: bool = False, k_max: int = -1, block: int = 0,
             parallel: bool = False, plan_rows: Optional[int] = None, cute: bool = True,
             kept_owned: bool = True) -> Any:
        """The call's Config. ``truncated`` (top-k / top-p / min-p) or ``block``: the truncated /
        batch-invariant Config, ``k_max`` the op's argument (the largest top_k, -1: not
        given; the Config never depends on a value read from the data); ``parallel``, ``plan_rows``: a rank's rows
        of a vocab-parallel head (the threshold steps sized for ``plan_rows`` columns);
        ``cute=False``: without the CuTe choice (a fake: no memory); ``kept_owned``: the
        backward may overwrite what the forward keeps for it (eager; ``glue.Owned``), else the
        plan budgets a copy of its own."""
        ...

    def kept_shapes(self, config: Any, n: int) -> Optional[tuple[tuple, tuple]]:
        """Shapes of the kept columns under ``config`` (the fake's), or None."""
        ...

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
                config: Any, *, outputs: bool = True, tau: Optional[Tensor] = None, keep: bool = True):
        """((logp, entropy or None, lse), kept) with ``outputs``, else (LogProbStats, kept);
        kept: (buffer, tile maxima) laid out by the Config (the backward turns it into dz in
        place: one backward only) or None. ``tau`` (N,): columns a < tau left out;
        ``keep=False``: keep nothing (rows other than the Config's)."""
        ...

    def grad_coefficients(self, entropy: Optional[Tensor], tokens: Tensor, g_lp: Optional[Tensor],
                          g_h: Optional[Tensor], num_classes: int, opts: LogProbOptions, lse: Tensor) -> Tensor:
        """The backward's (3, N) coefficients A, B, C."""
        ...

    def backward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
                 lse: Tensor, coef: Tensor, config: Any, *, kept: Optional[Kept], need_dx: bool,
                 need_dw: bool, need_db: bool, dx_acc: bool = False, tau: Optional[Tensor] = None):
        """dx, dW, db (None where not needed); ``kept``: the forward's kept columns and where
        their dz goes; ``dx_acc``: dx as the fp32 accumulator."""
        ...


# --------------------------------------------------------------------------- the custom ops


@dataclass(frozen=True)
class LlpCall(Call):
    """One call of the forward op (``custom_op``), from the public function's checked inputs.

    x (N, H), weight (V, H) (this rank's rows with ``tp.tp_group``), bias (V,) or None,
    tokens (N,) int64; ``budget``: bytes of temporaries; ``need_grad``: a backward will
    follow (plan kept columns), ``need_dw``: it wants dW; truncated sampling: ``top_k``
    (int64), ``top_p``, ``min_p`` (float64), (N,) each, or None (none), ``checked``: their
    values were range-checked (``formulas.truncation.Truncation.checked``; else the
    forward checks them on the CPU), ``k_max`` the largest top_k when read on the host
    (-1: not read); ``block``: rows per block under ``batch_invariant`` (0: none). A call
    with neither truncation nor block is the default one. ``owned``: the backward will own
    what the forward keeps (eager; False through the custom ops, ``glue.Owned``)."""

    differentiable = ("x", "weight", "bias")

    x: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    tokens: Tensor
    opts: LogProbOptions
    backend: str
    budget: int
    need_grad: bool
    need_dw: bool
    top_k: Optional[Tensor]
    top_p: Optional[Tensor]
    min_p: Optional[Tensor]
    checked: bool
    k_max: int
    block: int
    tp: VocabParallelOptions
    owned: Owned = Owned(True)


class LlpOutputs(NamedTuple):
    """The forward op's outputs, per token in the compute dtype. logp; entropy (None without
    ``opts.entropy``); lse; keep, keep_max: the kept columns of exp(a - m)
    (``NOTHING_KEPT``-shaped dummies when none; the backward turns them into dz);
    config: the backend's Config; tau, sparse, inside (truncated / batch-invariant calls,
    else None): the per-token thresholds ((0,) without truncation), the sparse backward's
    candidates ((2, N, W) int32: their fp32 bits and their columns) and the rows it takes.
    (None outputs cross the custom ops as size-0 tensors: ``glue``.)"""

    logp: Tensor
    entropy: Optional[Tensor]
    lse: Tensor
    keep: Tensor
    keep_max: Tensor
    config: Any
    tau: Optional[Tensor]
    sparse: Optional[Tensor]
    inside: Optional[Tensor]


@dataclass(frozen=True)
class LlpPlanned:
    """The scalars an ``LlpCall``'s Config was planned with (its fields of the same names;
    ``dw``: ``need_dw``, ``truncated``: ``top_k`` given), carried to the backward op, which
    plans it again from them."""

    budget: int
    need_grad: bool
    dw: bool
    truncated: bool
    k_max: int
    block: int


@dataclass(frozen=True)
class LlpBackwardCall(Call):
    """One call of the backward op: the upstream gradients of logp and of the entropy, the
    forward's inputs, statistics, kept columns (turned into dz over themselves where
    ``owned``) and Config; truncated calls: the forward's logp, tau and the sparse backward's
    candidates and rows; ``planned``: what the forward planned from (``custom_op.replan``)."""

    grad_logp: Optional[Tensor]
    grad_entropy: Optional[Tensor]
    x: Tensor
    weight: Tensor
    bias: Optional[Tensor]
    tokens: Tensor
    lse: Tensor
    entropy_out: Optional[Tensor]
    keep: Tensor
    keep_max: Tensor
    config: Replanned
    opts: LogProbOptions
    backend: str
    need: Needs
    logp: Optional[Tensor]
    tau: Optional[Tensor]
    sparse: Optional[Tensor]
    inside: Optional[Tensor]
    tp: VocabParallelOptions
    planned: LlpPlanned
    owned: Owned = Owned(False)
