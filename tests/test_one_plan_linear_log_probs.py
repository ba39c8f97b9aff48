"""One plan per call: every backend of linear_log_probs decides its Config once per
forward+backward (``ops.linear_log_probs.contract``), on every path, truncated sampling
included (a Config of the same backends, ``contract.Truncated``).

Each backend's ``plan`` is wrapped to count its calls (a backend planning inside another's,
Helion's fallback, counts once: the outer call); a forward must plan exactly once and the
backward (also a second one, retain_graph=True) never on the eager path; through the custom
ops each backward op plans again and gets the forward's decision (``tests.helpers.ONE_PLAN``);
the planners a ``plan`` consults never run outside one. Options: plain, entropy,
temperature, top-k, top-p, min-p; paths: the eager fast path, the custom ops (under a
dispatch mode), a vocab-parallel head (a one-rank gloo group); Helion falls back on the CPU
(its Config holds the other backend's).
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
from logitless.ops.linear_log_probs.api import BACKENDS
from tests.conftest import DEVICE
from tests.helpers import ONE_PLAN, PassThrough, count_plans, same_decision

N, H, V = 24, 16, 104




#: The planners a backend's ``plan`` consults (module, attribute): none may run outside it.
PLANNERS = (("torch_backend", "linear_torch_plan"), ("triton_backend", "linear_plan"),
            ("triton_backend", "linear_torch_plan"), ("triton_backend", "cute_planning.forward_plan"),
            ("helion_backend", "helion_choice.fallback_name_of_call"), ("torch_backend", "decide"),
            ("triton_backend", "decide"), ("triton_backend", "truncated_config"))

OPTIONS = {
    "plain": {},
    "entropy": {"entropy": True},
    "temperature": {"temperature": 0.7, "entropy": True},
    "top_k": {"top_k": 5, "entropy": True},
    "top_p": {"top_p": 0.9, "temperature": 0.9},
    "min_p": {"min_p": 0.05, "entropy": True},
}


@pytest.fixture
def counted(monkeypatch):
    """``calls[name]``: one entry per outermost call of that backend's ``plan``;
    ``calls["outside"]``: planners run outside a ``plan`` (must stay empty)."""
    return count_plans(monkeypatch, {name: BACKENDS[name] for name in ("torch", "triton", "helion")},
                       [(f"logitless.ops.linear_log_probs.{m}", a) for m, a in PLANNERS], record="need_grad",
                       outermost=True)


def _plans(calls) -> int:
    return sum(len(calls[name]) for name in ("torch", "triton", "helion"))


def _one_call(calls, backend, *, mode=None, **kw):
    """Forward, backward twice; the plan counts after each."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.3).to(DEVICE).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    with mode if mode is not None else contextlib.nullcontext():
        out = logitless.linear_log_probs(x, w, t, backend=backend, **kw)
    lp, ent = out if isinstance(out, tuple) else (out, None)
    loss = torch.where(torch.isinf(lp), 0.0, lp).sum() + (ent.sum() if ent is not None else 0.0)
    after_forward = _plans(calls)
    loss.backward(retain_graph=True)
    after_backward = _plans(calls)
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert calls["outside"] == []  # every heuristic ran inside the one ``plan``
    return after_forward, after_backward, _plans(calls)


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("backend", ["torch", "triton", "helion"])
def test_plans_once(counted, monkeypatch, backend, path, options):
    if backend == "helion" and os.environ.get("HELION_INTERPRET", "0") != "1" and DEVICE.type != "cuda":
        # Helion cannot run CPU tensors here: it falls back (the Config names the backend in its place)
        from logitless.ops.common import helion_choice

        monkeypatch.setattr(helion_choice, "cause", lambda: "the test's stand-in cause")
    mode = PassThrough() if path == "custom_op" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback's warning)
        assert _one_call(counted, backend, mode=mode, **OPTIONS[options]) == ONE_PLAN[path]
    (planner,) = [name for name in ("torch", "triton", "helion") if counted[name]]  # (Helion's stand-in truncates)
    assert same_decision(counted, planner)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_batch_invariant_plans_once(counted, backend):
    """Every block and the backward over the batch: one Config."""
    assert _one_call(counted, backend, batch_invariant=True, top_p=0.9) == (1, 1, 1)


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
@pytest.mark.parametrize("options", ["plain", "entropy", "top_p", "min_p"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vocab_parallel_plans_once(counted, one_rank_group, backend, options):
    assert _one_call(counted, backend, process_group=one_rank_group, **OPTIONS[options]) == (1, 1, 1)
