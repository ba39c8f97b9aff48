"""One plan per call: every backend of linear_topk_kl decides its Config once per
forward+backward (``ops.linear_topk_kl.contract``), on every path.

Each backend's ``plan`` is wrapped to count its calls; a forward must plan exactly once and
the backward (also a second one, retain_graph=True) never; the planners a ``plan`` consults
never run outside one. Triton: keep every column, keep part, keep none (recompute); paths:
the eager fast path, the custom ops (under a dispatch mode), a vocab-parallel head (a
one-rank gloo group).
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import logitless
from logitless.ops.linear_topk_kl.api import BACKENDS
from tests.conftest import DEVICE
from tests.helpers import ONE_PLAN, PassThrough, count_plans, same_decision

N, H, V, K = 24, 16, 104, 6

#: The planners a backend's ``plan`` consults (module, attribute): none may run outside it.
PLANNERS = (("torch_backend", "linear_torch_plan"), ("triton_backend", "linear_plan"), ("triton_backend", "id_slots"))
TRITON_BUDGETS = {"keep": 1 << 30, "partial": 10_000, "recompute": 1}


@pytest.fixture
def counted(monkeypatch):
    return count_plans(monkeypatch, {name: BACKENDS[name] for name in ("torch", "triton")},
                       [(f"logitless.ops.linear_topk_kl.{m}", a) for m, a in PLANNERS], record="need_grad")


def _one_call(calls, backend, *, mode=None, **kw):
    """Forward, backward twice; the plan counts after each."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.3).to(DEVICE).requires_grad_()
    lp, ids = torch.log_softmax(torch.randn(N, V, generator=g), -1).topk(K, -1)
    t = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    with mode if mode is not None else contextlib.nullcontext():
        loss = logitless.linear_topk_kl(x, w, ids.to(DEVICE), lp.to(DEVICE), t, backend=backend,
                                        hard_label_weight=0.2, **kw)
    after_forward = len(calls[backend])
    loss.backward(retain_graph=True)
    after_backward = len(calls[backend])
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert calls["outside"] == []  # every heuristic ran inside the one ``plan``
    return after_forward, after_backward, len(calls[backend])


@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_torch_plans_once(counted, path):
    mode = PassThrough() if path == "custom_op" else None
    assert _one_call(counted, "torch", mode=mode, softcap=5.0, temperature=0.8) == ONE_PLAN[path]
    assert same_decision(counted, "torch")


@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("strategy", sorted(TRITON_BUDGETS))
def test_triton_plans_once_per_strategy(counted, strategy, path):
    mode = PassThrough() if path == "custom_op" else None
    assert _one_call(counted, "triton", mode=mode, memory_budget=TRITON_BUDGETS[strategy]) == ONE_PLAN[path]
    assert same_decision(counted, "triton")
    if DEVICE.type == "cuda":  # (the budgets are sized for the interpreter's tiles)
        return
    config = counted["configs"][-1].linear
    cols = config.forward.keep_cols if config.keeps else 0
    assert {"keep": cols >= V, "partial": 0 < cols < V, "recompute": cols == 0}[strategy], config


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
    assert _one_call(counted, backend, process_group=one_rank_group) == (1, 1, 1)
