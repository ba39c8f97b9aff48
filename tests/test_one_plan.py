"""One plan per call: every backend of linear_cross_entropy decides its Config once per
forward+backward (``ops.linear_cross_entropy.contract``), on every strategy and path.

Each backend's ``plan`` is wrapped to count its calls; a forward must plan exactly once
and the backward (also a second one, retain_graph=True) never on the eager path; through
the custom ops each backward op plans again, the forward's decision (``helpers.ONE_PLAN``). Strategies of the Triton
backend: keep every column, keep part, keep none (recompute), gradient-in-forward;
paths: the eager fast path, the custom ops (under a dispatch mode), a vocab-parallel head
(a one-rank gloo group), ``batch_invariant`` (one Config for every block, one for the
backward over the batch).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import logitless
from logitless.ops.linear_cross_entropy.api import BACKENDS
from logitless.planning.overrides import override
from tests.conftest import DEVICE
from tests.helpers import ONE_PLAN, PassThrough, count_plans, same_decision

N, H, V = 24, 16, 104




#: The planners a backend's ``plan`` consults (module, attribute): none may run outside it.
PLANNERS = (("torch_backend", "linear_torch_plan"), ("triton_backend", "linear_plan"),
            ("triton_backend", "cute_planning.forward_plan"), ("helion_backend", "helion_choice.fallback_name_of_call"))


@pytest.fixture
def counted(monkeypatch):
    """backend name -> a list that gets one entry per call of that backend's ``plan``;
    ``calls["outside"]``: planners run outside a ``plan`` (must stay empty); ``calls["configs"]``:
    the Configs planned."""
    return count_plans(monkeypatch, {name: BACKENDS[name] for name in ("torch", "triton", "helion")},
                       [(f"logitless.ops.linear_cross_entropy.{m}", a) for m, a in PLANNERS], record="need_grad")


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=g).to(dtype).to(DEVICE).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.3).to(dtype).to(DEVICE).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    return x, w, t


def _one_call(calls, backend, *, mode=None, strategy=None, **kw):
    """Forward, backward twice; the plan counts after each."""
    x, w, t = _inputs()
    with override(strategy=strategy) if strategy else contextlib.nullcontext():
        with mode if mode is not None else contextlib.nullcontext():
            loss = logitless.linear_cross_entropy(x, w, t, backend=backend, **kw)
        if isinstance(loss, tuple):
            loss = loss[0] + loss[1].lse.sum()  # (the differentiable lse too)
        after_forward = len(calls[backend])
        loss.backward(retain_graph=True)
        after_backward = len(calls[backend])
        loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert calls["outside"] == []  # every heuristic ran inside the one ``plan``
    return after_forward, after_backward, len(calls[backend])


TRITON_BUDGETS = {"keep": 1 << 30, "partial": 10_000, "recompute": 1}  # (partial: 64 of 104 columns on the interpreter)


@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("backend", ["torch", "helion"])
def test_torch_and_helion_plan_once(counted, backend, path):
    if backend == "helion" and os.environ.get("HELION_INTERPRET", "0") != "1" and DEVICE.type != "cuda":
        pytest.skip("Helion on the CPU needs HELION_INTERPRET=1")
    mode = PassThrough() if path == "custom_op" else None
    assert _one_call(counted, backend, mode=mode, label_smoothing=0.1, softcap=5.0) == ONE_PLAN[path]
    assert same_decision(counted, backend)


@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("strategy", sorted(TRITON_BUDGETS) + ["grad_in_forward"])
def test_triton_plans_once_per_strategy(counted, strategy, path):
    mode = PassThrough() if path == "custom_op" else None
    if strategy == "grad_in_forward":
        if path == "custom_op":
            pytest.skip("the gradient-in-forward strategy is eager only")
        counts = _one_call(counted, "triton", strategy=("grad_in_forward", 8), memory_budget=1 << 30)
    else:
        counts = _one_call(counted, "triton", mode=mode, memory_budget=TRITON_BUDGETS[strategy])
    assert counts == ONE_PLAN[path] and same_decision(counted, "triton")
    if DEVICE.type == "cuda":  # (the budgets are sized for the interpreter's tiles)
        return
    config = counted["configs"][-1]  # the strategy the test is about is the one planned
    cols = config.forward.keep_cols if config.keeps else 0
    assert {"keep": cols >= V, "partial": 0 < cols < V, "recompute": cols == 0,
            "grad_in_forward": config.grad_in_forward == 8}[strategy], config


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_batch_invariant_plans_blocks_once_and_the_backward_once(counted, backend):
    from logitless.ops.common import invariant
    from logitless.ops.linear_cross_entropy.api import BACKENDS

    x, w, t = _inputs(1)
    block = invariant.rows(BACKENDS[backend], DEVICE)
    x = torch.cat([x.detach()] * (2 * block // N + 1)).requires_grad_()
    t = torch.cat([t] * (2 * block // N + 1))
    loss = logitless.linear_cross_entropy(x, w, t, backend=backend, batch_invariant=True)
    # three blocks under one Config, and the backward's over the whole batch: both in the forward
    assert counted[backend] == [False, False]
    loss.backward()
    assert counted[backend] == [False, False]  # the backward follows the forward's Config


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group (this process), destroyed after the test."""
    if dist.is_initialized():
        pytest.skip("a process group is initialised already")
    path = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a one-rank gloo group on the CPU")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vocab_parallel_plans_once(counted, one_rank_group, backend):
    assert _one_call(counted, backend, process_group=one_rank_group, return_stats=True) == (1, 1, 1)
