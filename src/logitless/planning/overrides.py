"""Overrides of the planner's choices, as a context: for tests, probes and the tuner.

    from logitless.planning.overrides import override
    with override(strategy=("grad_in_forward", 64), group_rows=2):
        loss = logitless.linear_cross_entropy(...)

The library itself never sets one: with no override active, every plan follows the
shape, dtype, budget and device class alone (``plans``, ``cost_model``, ``tuned``).
Overrides nest (an inner one replaces the fields it names) and are per thread and per
asyncio task (a ``contextvars.ContextVar``), not module globals. A call's backward runs
under the overrides of its forward (``restored``; the ops capture them in their autograd
context): autograd runs CUDA backwards on a thread of its own, where the caller's
context is not in effect. Each field's default is the shipped behaviour:

    kernel_options  scheduling switches of the fused GEMM kernels (``plans.KERNEL_OPTIONS``:
                    group, flatten, dz_tma, dlogits_programs); a dict of those to change
    group_rows      row blocks per group of the grouped program order (None: the
                    working-set rule ``plans.group_rows``)
    model_plans     the cost model picks kept columns and chunk widths on GPUs (False:
                    the greedy rule, keep as many columns as fit)
    strategy        (name, token_chunk): the strategy ``plans.lce_strategy`` returns
                    when a gradient is wanted, e.g. ("grad_in_forward", 64); also
                    ``plans.linear_jsd_strategy``'s ("grad_in_forward" or "recompute")
    tiles           (block_n, block_v, block_h, num_warps, num_stages) for every plan
    tf32_round      fp32 at matmul precision "high": round operands to TF32 in the
                    kernel (as cuBLAS); False lets the tensor cores truncate them
    tf32_preround   fp32 at "high": None (shipped): the planner prices both paths and
                    takes the cheaper (``plans.tf32_choice``); True: round x and W to TF32
                    into scratch buffers first (W in vocabulary chunks) and multiply them
                    by TMA; False: round them in the kernels' registers (same results)
    plan            a function TritonPlan -> TritonPlan applied to linear_cross_entropy's
                    plans (e.g. force one kept tile and narrow chunks in a test)
    num_sms         multiprocessors the planner assumes (None: the device's own)
    device_model    a ``cost_model.DeviceModel`` for the planner (None: the device's class)
    cute            the CuTe DSL forward kernel on Hopper (``planning.cute``): None (shipped):
                    wherever supported unless LOGITLESS_CUTE=0; False: never; True:
                    wherever supported, whatever the environment variable says
    cute_available  None: check that ``cutlass.cute`` imports (once); True/False: assume it
    cute_probe      a function called with a dict (op, n, v, h, splits, dtype, flags) at
                    each CuTe kernel launch (tests and probes: proof the path was taken)
    eager_fast_path eager calls of the fused linear ops run their custom ops' Python
                    implementations through a plain autograd.Function (False: through
                    the torch.library custom ops, as under torch.compile; the same
                    results bitwise: ``ops.common.autograd.EagerOp``)
    jsd_fused_forward  linear_jsd's Triton forward for the KL limits (beta 0 or 1, 16-bit
                    inputs): None (shipped): the cost model picks the fused kernel (row
                    statistics from GEMM tiles, no logits in memory) or cuBLAS fp32 logit
                    chunks + the statistics kernels (``plans.jsd_kl_fused``); True / False:
                    always / never the fused kernel (results agree to fp32 rounding, not
                    bitwise)
    jsd_tp_merge    vocab-parallel linear_jsd at the KL limits (beta 0 or 1): True (shipped):
                    each rank's own divergence sum is merged with the log-sum-exps (one
                    pass over the columns, ``ops.linear_jsd.vocab_parallel``); False: the
                    second pass over this rank's columns with the merged log-sum-exps that
                    0 < beta < 1 needs (the same statistics to fp32 rounding)
    split_model     the 16-bit fused forward's vocabulary splits from the program-cost model
                    (``tiles.forward_blocks_per_split``; False: the WAVES rule alone, as
                    before it: the same statistics up to the fp32 order of the split merge)
    fast_launch     repeated Triton launches call the cached compiled kernel directly
                    (``triton_lib.launch.run_kernel``; False: every launch through
                    ``kernel[grid]``, as LOGITLESS_FAST_LAUNCH=0 does for the whole
                    process; the same kernels and results bitwise). For the in-process
                    A/B of a probe listed in docs/history.md.
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
    kernel_options: Optional[dict] = None
    group_rows: Optional[int] = None
    model_plans: bool = True
    strategy: Optional[tuple] = None
    tiles: Optional[tuple] = None
    tf32_round: bool = True
    tf32_preround: Optional[bool] = None
    plan: Optional[Callable] = None
    num_sms: Optional[int] = None
    device_model: Any = None
    eager_fast_path: bool = True
    fast_launch: bool = True
    jsd_fused_forward: Optional[bool] = None
    jsd_tp_merge: bool = True
    split_model: bool = True

    cute: Optional[bool] = None
    cute_available: Optional[bool] = None
    cute_probe: Optional[Callable] = None


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
    unknown = set(fields) - {f.name for f in dataclasses.fields(Overrides)}
    if unknown:
        raise TypeError(f"unknown override(s) {sorted(unknown)}; known: "
                        f"{[f.name for f in dataclasses.fields(Overrides)]}")
    for f in dataclasses.fields(Overrides):  # switches take True / False (None: the planner's choice)
        if f.name in fields and f.type in ("bool", "Optional[bool]"):
            v = fields[f.name]
            if not (isinstance(v, bool) or (v is None and f.type != "bool")):
                raise TypeError(f"override {f.name}={v!r}: expected {f.type}")
    if fields.get("tiles") is not None:
        fields["tiles"] = tuple(int(t) for t in fields["tiles"])
    token = _CURRENT.set(dataclasses.replace(_CURRENT.get(), **fields))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def restored(saved: Overrides):
    """Context in which ``saved`` (an earlier ``current()``, all of its fields) is in
    effect: a backward runs under its forward's overrides, whichever thread runs it."""
    token = _CURRENT.set(saved)
    try:
        yield saved
    finally:
        _CURRENT.reset(token)
