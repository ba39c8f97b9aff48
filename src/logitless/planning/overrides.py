"""Overrides of the planner's choices, as a context (users, the tuner, tests).

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

A plan for a device this machine does not have is a ``device.DeviceFacts`` passed to
the planners (tests, probes), not a setting here.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Overrides:
    """The user-facing settings (module docstring); each default is the shipped behaviour."""

    strategy: Optional[tuple] = None
    tiles: Optional[tuple] = None
    tf32_preround: Optional[bool] = None
    cute: Optional[bool] = None
    jsd_fused_forward: Optional[bool] = None


#: The overrides outside any ``override(...)``: a frozen dataclass, never mutated, only
#: replaced (``override``). ``planning.memo`` keys plans made under it by identity.
DEFAULT = Overrides()
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("logitless_overrides", default=DEFAULT)  # noqa: B039


#: current() -> Overrides: the overrides in effect (all defaults outside any ``override``);
#: the context variable's own C-level getter (no Python call on the hot path).
current = _CURRENT.get


@contextlib.contextmanager
def override(**fields):
    """Context in which the named fields of ``Overrides`` replace the current ones."""
    known = [f.name for f in dataclasses.fields(Overrides)]
    unknown = set(fields) - set(known)
    if unknown:
        raise TypeError(f"unknown override(s) {sorted(unknown)}; known: {known}")
    for f in dataclasses.fields(Overrides):  # switches take True / False (None: the planner's choice)
        if f.name in fields and f.type == "Optional[bool]":
            v = fields[f.name]
            if not (v is None or isinstance(v, bool)):
                raise TypeError(f"override {f.name}={v!r}: expected {f.type}")
    if fields.get("tiles") is not None:
        fields["tiles"] = tuple(int(t) for t in fields["tiles"])
    token = _CURRENT.set(dataclasses.replace(_CURRENT.get(), **fields))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def saved() -> Overrides:
    """The overrides in effect, for ``restored``."""
    return _CURRENT.get()


@contextlib.contextmanager
def restored(state: Overrides):
    """Context in which ``state`` (an earlier ``saved()``) is in effect: a backward runs
    under its forward's overrides, whichever thread runs it."""
    token = _CURRENT.set(state)
    try:
        yield state
    finally:
        _CURRENT.reset(token)
