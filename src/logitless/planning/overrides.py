"""Overrides of the planner's choices, as a context (users, the tuner, tests), and the
planning what-ifs of tests and probes.

    from logitless.planning.overrides import override
    with override(strategy=("grad_in_forward", 64), tiles=(64, 128, 64, 8, 3)):
        loss = logitless.linear_cross_entropy(...)

The library itself never sets one: with no override active, every plan follows the
shape, dtype, budget and device class alone (``plans``, ``cost_model``, ``tuned``).
Overrides nest (an inner one replaces the fields it names) and are per thread and per
asyncio task (a ``contextvars.ContextVar``), not module globals. A call's backward runs
under the overrides of its forward (``restored``; the ops capture them in their autograd
context): autograd runs CUDA backwards on a thread of its own, where the caller's
context is not in effect. Each field's default is the shipped behaviour:

    strategy        (name, token_chunk): the strategy ``plans.lce_strategy`` returns
                    when a gradient is wanted, e.g. ("grad_in_forward", 64); also
                    linear_jsd's ``planning.linear_jsd_strategy``'s ("grad_in_forward" or "recompute")
    tiles           (block_n, block_v, block_h, num_warps, num_stages) for every plan
                    (what ``python -m logitless.tune`` times)
    tf32_preround   fp32 at "high": None (shipped): the planner prices both paths and
                    takes the cheaper (``plans.tf32_choice``); True: round x and W to TF32
                    into scratch buffers first (W in vocabulary chunks) and multiply them
                    by TMA; False: round them in the kernels' registers (same results)
    cute            the CuTe DSL forward kernel on Hopper (``planning.cute``): None (shipped):
                    wherever supported unless LOGITLESS_CUTE=0; False: never; True:
                    wherever supported, whatever the environment variable says
    jsd_fused_forward  linear_jsd's Triton forward for the KL limits (beta 0 or 1, 16-bit
                    inputs): None (shipped): the cost model picks the fused kernel (row
                    statistics from GEMM tiles, no logits in memory) or cuBLAS fp32 logit
                    chunks + the statistics kernels (linear_jsd's ``planning.jsd_kl_fused``); True / False:
                    always / never the fused kernel (results agree to fp32 rounding, not
                    bitwise)

Planning what-ifs, ``what_if(...)`` (tests and probes only, not settings: a plan for a
described device on another machine, a plan reshaped by hand, proof a kernel ran); a
context like ``override`` (nesting, per thread and task, backwards under the forward's):

    num_sms         multiprocessors the planner assumes (None: the device's own)
    device_model    a ``cost_model.DeviceModel`` for the planner (None: the device's class)
    plan            a function TritonPlan -> TritonPlan applied to linear_cross_entropy's
                    plans (e.g. force one kept tile and narrow chunks in a test)
    cute_available  None: check that ``cutlass.cute`` imports (once); True/False: assume it
    cute_probe      a function called with a dict (op, n, v, h, splits, dtype, flags) at
                    each CuTe kernel launch (proof the path was taken)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Overrides:
    """The user-facing settings (module docstring); each default is the shipped behaviour."""

    strategy: Optional[tuple] = None
    tiles: Optional[tuple] = None
    tf32_preround: Optional[bool] = None
    cute: Optional[bool] = None
    jsd_fused_forward: Optional[bool] = None


@dataclass(frozen=True)
class WhatIf:
    """The planning what-ifs of tests and probes (module docstring)."""

    num_sms: Optional[int] = None
    device_model: Any = None
    plan: Optional[Callable] = None
    cute_available: Optional[bool] = None
    cute_probe: Optional[Callable] = None


#: The overrides outside any ``override(...)``: a frozen dataclass, never mutated, only
#: replaced (``override``). ``planning.memo`` keys plans made under it by identity.
DEFAULT = Overrides()
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("logitless_overrides", default=DEFAULT)  # noqa: B039


#: current() -> Overrides: the overrides in effect (all defaults outside any ``override``);
#: the context variable's own C-level getter (no Python call on the hot path).
current = _CURRENT.get

#: The what-ifs outside any ``what_if(...)`` (keyed by identity as ``DEFAULT`` is).
NO_WHAT_IF = WhatIf()
_WHAT_IF: contextvars.ContextVar = contextvars.ContextVar("logitless_what_if", default=NO_WHAT_IF)  # noqa: B039
#: what_ifs() -> WhatIf: the what-ifs in effect.
what_ifs = _WHAT_IF.get


def _replaced(var: contextvars.ContextVar, cls, what: str, fields: dict):
    unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"unknown {what}(s) {sorted(unknown)}; known: {[f.name for f in dataclasses.fields(cls)]}")
    for f in dataclasses.fields(cls):  # switches take True / False (None: the planner's choice)
        if f.name in fields and f.type in ("bool", "Optional[bool]"):
            v = fields[f.name]
            if not (isinstance(v, bool) or (v is None and f.type != "bool")):
                raise TypeError(f"{what} {f.name}={v!r}: expected {f.type}")
    if fields.get("tiles") is not None:
        fields["tiles"] = tuple(int(t) for t in fields["tiles"])
    return var.set(dataclasses.replace(var.get(), **fields))


@contextlib.contextmanager
def override(**fields):
    """Context in which the named fields of ``Overrides`` replace the current ones."""
    token = _replaced(_CURRENT, Overrides, "override", fields)
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def what_if(**fields):
    """Context in which the named fields of ``WhatIf`` replace the current ones (tests and
    probes)."""
    token = _replaced(_WHAT_IF, WhatIf, "what-if", fields)
    try:
        yield _WHAT_IF.get()
    finally:
        _WHAT_IF.reset(token)


def saved() -> tuple:
    """(overrides, what-ifs) in effect, for ``restored``."""
    return _CURRENT.get(), _WHAT_IF.get()


@contextlib.contextmanager
def restored(state: tuple):
    """Context in which ``state`` (an earlier ``saved()``) is in effect: a backward runs
    under its forward's overrides and what-ifs, whichever thread runs it."""
    token, token_w = _CURRENT.set(state[0]), _WHAT_IF.set(state[1])
    try:
        yield state
    finally:
        _WHAT_IF.reset(token_w)
        _CURRENT.reset(token)
