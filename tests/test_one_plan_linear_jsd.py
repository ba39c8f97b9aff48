"""One plan per call: every backend of linear_jsd decides its Config once per
forward+backward (``ops.linear_jsd.contract``), on every strategy and path.

Each backend's ``plan`` is wrapped to count its calls; a forward must plan exactly once
and the backward (also a second one, retain_graph=True) never; the planners a ``plan``
consults never run outside one. Divergences: beta 0, 0.5 and 1 with a temperature.
Strategies of the Triton backend: recompute (several forward chunks with a shorter last
one, or one), the KL limits' fused forward, gradient-in-forward; Helion falling back to
another backend; paths: the eager fast path, the custom ops (under a dispatch mode), a
vocab-parallel head (a one-rank gloo group).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

import logitless
from logitless.ops.common import helion_choice
from logitless.ops.linear_jsd.api import BACKENDS
from logitless.planning.overrides import override
from tests.conftest import DEVICE
from tests.helpers import ONE_PLAN, PassThrough, count_plans, same_decision

N, HS, HT, V = 24, 16, 12, 104
#: Budgets: both heads' fp32 logits of 10 tokens (forward chunks of 10, 10 and 4), or all.
BUDGETS = {"chunks": 8 * V * 10, "one": 1 << 30}
BETAS = [0.0, 0.5, 1.0]




#: The planners a backend's ``plan`` consults (module, attribute): none may run outside it.
PLANNERS = (("torch_backend", "jsd_torch_rows"), ("torch_backend", "torch_plan"), ("torch_backend", "_vocab_step"),
            ("triton_backend", "linear_jsd_plan"), ("triton_backend", "jsd_kl_fused"),
            ("triton_backend", "linear_jsd_strategy"), ("triton_backend", "jsd_stats_plan"),
            ("helion_backend", "helion_choice.fallback_name_of_call"))


@pytest.fixture
def counted(monkeypatch):
    """backend name -> a list that gets one entry per call of that backend's ``plan``;
    ``calls["outside"]``: planners run outside a ``plan`` (must stay empty); ``calls["configs"]``:
    the Configs planned."""
    return count_plans(monkeypatch, {name: BACKENDS[name] for name in ("torch", "triton", "helion")},
                       [(f"logitless.ops.linear_jsd.{m}", a) for m, a in PLANNERS], record="grad_in_forward")


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(N, HS, generator=g).to(dtype).to(DEVICE).requires_grad_()
    ws = (torch.randn(V, HS, generator=g) * 0.3).to(dtype).to(DEVICE).requires_grad_()
    xt = torch.randn(N, HT, generator=g).to(dtype).to(DEVICE)
    wt = (torch.randn(V, HT, generator=g) * 0.3).to(dtype).to(DEVICE)
    t = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    t[3] = -100
    return xs, ws, xt, wt, t


def _one_call(calls, backend, *, mode=None, dtype=torch.float32, overrides=None, **kw):
    """Forward, backward twice (retain_graph); the plan counts after each."""
    xs, ws, xt, wt, t = _inputs(dtype=dtype)
    with override(**overrides) if overrides else contextlib.nullcontext():
        with mode if mode is not None else contextlib.nullcontext():
            loss = logitless.linear_jsd(xs, ws, xt, wt, t, temperature=1.3, backend=backend, **kw)
        after_forward = len(calls[backend])
        loss.backward(retain_graph=True)
        after_backward = len(calls[backend])
        loss.backward()
    assert xs.grad is not None and torch.isfinite(xs.grad).all() and torch.isfinite(ws.grad).all()
    assert calls["outside"] == []  # every heuristic ran inside the one ``plan``
    return after_forward, after_backward, len(calls[backend])


def _mode(path):
    return PassThrough() if path == "custom_op" else None


@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("beta", BETAS)
def test_torch_plans_once(counted, beta, budget, path):
    counts = _one_call(counted, "torch", mode=_mode(path), beta=beta, memory_budget=BUDGETS[budget],
                       hard_label_weight=0.3)
    assert counts == ONE_PLAN[path] and same_decision(counted, "torch")


@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("strategy", ["chunks", "one", "fused", "grad_in_forward"])
@pytest.mark.parametrize("beta", BETAS)
def test_triton_plans_once_per_strategy(counted, beta, strategy, path):
    kw = dict(beta=beta, mode=_mode(path), student_softcap=4.0)
    if strategy == "grad_in_forward":
        counts = _one_call(counted, "triton", overrides=dict(strategy=("grad_in_forward", 8)), memory_budget=1 << 30,
                           reduction="sum", **kw)
    elif strategy == "fused":  # (the KL limits on 16-bit inputs; 0 < beta < 1 keeps the chunks)
        counts = _one_call(counted, "triton", overrides=dict(jsd_fused_forward=True), dtype=torch.bfloat16,
                           memory_budget=1 << 30, **kw)
    else:
        counts = _one_call(counted, "triton", memory_budget=BUDGETS[strategy], **kw)
    # (gradient-in-forward: the first backward scales the forward's gradients, no backward op)
    assert counts == ((1, 1, 2) if strategy == "grad_in_forward" and path == "custom_op" else ONE_PLAN[path])
    assert same_decision(counted, "triton")
    config = counted["configs"][-1]  # the strategy the test is about is the one planned
    if strategy == "grad_in_forward":
        assert config.grad_in_forward == 8, config
    elif strategy == "fused":
        assert config.fused == (beta in (0.0, 1.0)) and not config.grad_in_forward, config
    elif DEVICE.type != "cuda":  # (the budgets are sized for the interpreter's tiles)
        assert (config.tail_stats is not None) == (strategy == "chunks") and not config.fused, config


@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("beta", BETAS)
def test_helion_falling_back_plans_once(counted, monkeypatch, beta, path):
    """Helion unusable (a recorded failure): the backend in its place runs under the
    Config that Helion's ``plan`` made (one plan of Helion's, one of that backend's)."""
    monkeypatch.setattr(helion_choice, "_FAILED", ["a test's failure"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", helion_choice.HelionFallbackWarning)
        counts = _one_call(counted, "helion", mode=_mode(path), beta=beta)
    assert counts == ONE_PLAN[path] and same_decision(counted, "helion")
    other = "triton" if DEVICE.type == "cuda" else "torch"
    assert len(counted[other]) == ONE_PLAN[path][-1] and not counted["configs"][-1].helion


@pytest.mark.skipif(os.environ.get("HELION_INTERPRET", "0") != "1" and DEVICE.type != "cuda",
                    reason="Helion on the CPU needs HELION_INTERPRET=1")
@pytest.mark.parametrize("beta", BETAS)
def test_helion_plans_once(counted, beta):
    if helion_choice.cause() is not None:
        pytest.skip(f"Helion cannot run: {helion_choice.cause()}")
    assert _one_call(counted, "helion", beta=beta) == (1, 1, 1)


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
@pytest.mark.parametrize("beta", BETAS)  # (0.5: the second pass, the column sums, under the same Config)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vocab_parallel_plans_once(counted, one_rank_group, backend, beta):
    counts = _one_call(counted, backend, process_group=one_rank_group, beta=beta, memory_budget=BUDGETS["chunks"])
    assert counts == (1, 1, 1)
