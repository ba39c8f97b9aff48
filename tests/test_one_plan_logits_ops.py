"""One plan per call for the ops on logits the caller holds: every backend of
cross_entropy, log_probs and jsd decides its Config once per forward+backward
(``ops/<op>/contract.py``), on the eager fast path and through the custom ops.

Each backend's ``plan`` is wrapped to count its calls; a forward must plan exactly once
and the backward (also a second one, retain_graph=True) never; the planners a backend
consults (``PLANNERS``) must run inside its ``plan`` only. log_probs' truncated and
batch-invariant calls are Configs of the same backends (``contract.Blocks``): planned
once too. A dispatch mode (``tests.helpers.PassThrough``) turns the eager fast path off, so the
custom ops run: each backward op plans again and gets the forward's decision
(``tests.helpers.ONE_PLAN``).
"""

from __future__ import annotations

import contextlib
import importlib
import typing

import pytest
import torch

import logitless
from tests.conftest import DEVICE
from tests.helpers import ONE_PLAN, PassThrough, count_plans, same_decision

N, V = 13, 37
OPS = ("cross_entropy", "log_probs", "jsd")
BACKENDS = ("torch", "triton")

#: The planners a backend's ``plan`` consults (op, backend module, attribute): none may run
#: outside it.
PLANNERS = (
    ("cross_entropy", "torch_backend", "ce_torch_plan"), ("cross_entropy", "triton_backend", "ce_triton_plan"),
    ("log_probs", "torch_backend", "ce_torch_plan"), ("log_probs", "triton_backend", "ce_triton_plan"),
    ("jsd", "torch_backend", "jsd_torch_rows"), ("jsd", "triton_backend", "jsd_stats_plan"),
    ("jsd", "triton_backend", "ce_triton_plan"),
)




@pytest.fixture
def counted(monkeypatch):
    """(op, backend) -> the Configs its ``plan`` returned, one per call; ``calls["outside"]``:
    planners run outside a ``plan`` (must stay empty)."""
    tables = {op: importlib.import_module(f"logitless.ops.{op}.api").BACKENDS for op in OPS}
    return count_plans(monkeypatch, {(op, name): tables[op][name] for op in OPS for name in BACKENDS},
                       [(f"logitless.ops.{op}.{m}", a) for op, m, a in PLANNERS])


def _logits(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, V, generator=g) * 2).to(DEVICE).requires_grad_()


def _tokens(seed=3):
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(seed))
    t[1] = -100
    return t.to(DEVICE)


def _loss(op, backend, z, **kw):
    if op == "cross_entropy":
        loss, stats = logitless.cross_entropy(z, _tokens(), backend=backend, label_smoothing=0.1, softcap=5.0,
                                              return_stats=True, **kw)
        return loss + stats.lse.sum()  # (the differentiable lse too)
    if op == "log_probs":
        lp, ent = logitless.log_probs(z, _tokens(), backend=backend, temperature=0.8, entropy=True, **kw)
        return torch.where(torch.isinf(lp), torch.zeros_like(lp), lp).sum() + ent.sum()
    zt = _logits(7).detach()
    return logitless.jsd(z, zt, _tokens(), backend=backend, beta=0.3, hard_label_weight=0.2, **kw)


def _one_call(calls, op, backend, *, mode=None, twice=True, **kw):
    """Forward, backward (twice: retain_graph=True, then again); the plan counts after each."""
    z = _logits(0)
    with mode if mode is not None else contextlib.nullcontext():
        loss = _loss(op, backend, z, **kw)
    after_forward = len(calls[op, backend])
    loss.backward(retain_graph=twice)
    after_backward = len(calls[op, backend])
    if twice:
        loss.backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()
    assert calls["outside"] == []  # every heuristic ran inside the one ``plan``
    return after_forward, after_backward, len(calls[op, backend])


def _modes(path):
    return PassThrough() if path == "custom_op" else None


@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_plans_once_per_call(counted, op, backend, path):
    assert _one_call(counted, op, backend, mode=_modes(path)) == ONE_PLAN[path]
    assert same_decision(counted, (op, backend))
    config = counted[op, backend][0]
    table = importlib.import_module(f"logitless.ops.{op}.api").BACKENDS
    plan = type(table[backend]).plan
    assert isinstance(config, typing.get_type_hints(plan)["return"])  # the Config class its plan declares
    assert getattr(config, "blocks", None) is None  # (log_probs: the streaming plan)


TRUNCATIONS = {"top_k": dict(top_k=5), "top_p_min_p": dict(top_p=0.9, min_p=0.02),
               "batch_invariant": dict(batch_invariant=True), "both": dict(top_k=7, batch_invariant=True)}


@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(TRUNCATIONS))
def test_log_probs_truncation_is_a_config_planned_once(counted, case, backend, path):
    kw = TRUNCATIONS[case]
    assert _one_call(counted, "log_probs", backend, mode=_modes(path), **kw) == ONE_PLAN[path]
    assert same_decision(counted, ("log_probs", backend))
    config = counted["log_probs", backend][0]
    assert config.blocks is not None and config.blocks.padded == kw.get("batch_invariant", False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_inplace_backward_plans_once(counted, backend):
    assert _one_call(counted, "cross_entropy", backend, twice=False, inplace_backward=True) == (1, 1, 1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_no_tokens_no_plan(counted, op, backend):
    z = torch.zeros(0, V, device=DEVICE, requires_grad=True)
    kw = {"reduction": "sum"} if op != "log_probs" else {}
    if op == "cross_entropy":
        loss = logitless.cross_entropy(z, torch.zeros(0, dtype=torch.int64, device=DEVICE), backend=backend, **kw)
    elif op == "log_probs":
        loss = logitless.log_probs(z, torch.zeros(0, dtype=torch.int64, device=DEVICE), backend=backend).sum()
    else:
        loss = logitless.jsd(z, torch.zeros(0, V, device=DEVICE), backend=backend, **kw)
    loss.backward()
    assert counted[op, backend] == [] and z.grad.shape == z.shape
