"""linear_jsd's host-side path (issue 23 leftovers): the eager fast path (a plain
autograd.Function around the custom ops' implementations) and the fused O(N) epilogues
(one Triton launch for the per-token loss and its reduction, one for the upstream
gradient), against the custom ops, the torch formulas and float64.

Runs on the GPU when there is one; otherwise the Triton backend runs on the CPU
interpreter (conftest.py), at small sizes.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import logitless
from logitless.planning.overrides import override
from tests.conftest import DEVICE
from tests.test_linear_jsd import OPTIONS, check, make_inputs

# --------------------------------------------------------------------------- eager fast path

FAST_PATH_CASES = [
    ("plain", {}, "mean"),
    ("all", dict(beta=0.3, temperature=0.7), "sum"),
    ("kl", dict(beta=0.0), "none"),
    ("reverse_bias", dict(beta=1.0, _bias=True, hard_label_weight=0.2), "mean"),
    ("chunks", dict(_ignore=0.3), "mean", 1 << 12),  # several forward row chunks and vocab chunks
    ("gif", dict(beta=0.5, _bias=True, _ignore=0.2), "sum", ("grad_in_forward", 8)),
]


def _graph_nodes(fn, depth=4):
    if fn is None or depth == 0:
        return []
    return [type(fn).__name__] + [m for nxt, _ in fn.next_functions for m in _graph_nodes(nxt, depth - 1)]


def _run(opts, reduction, fast, extra=None):
    budget = extra if isinstance(extra, int) else None
    strategy = extra if isinstance(extra, tuple) else None
    xs, ws, xt, wt, target, kw = make_inputs((3, 7), 24, 40, 101, torch.bfloat16, opts, seed=11)
    with override(eager_fast_path=fast, strategy=strategy):
        loss = logitless.linear_jsd(xs, ws, xt, wt, target, reduction=reduction, backend="triton",
                                    memory_budget=budget, **kw)
        kind = " ".join(_graph_nodes(loss.grad_fn))
        weights = torch.linspace(0.5, 1.5, loss.numel(), device=DEVICE).reshape(loss.shape)
        inputs = [t for t in (xs, ws, kw.get("student_bias")) if t is not None]
        grads = torch.autograd.grad((loss * weights).sum(), inputs)
    return [loss.detach(), *grads], kind


@pytest.mark.parametrize("case", FAST_PATH_CASES, ids=lambda c: c[0])
def test_eager_fast_path_is_bitwise_the_custom_op(case):
    """The public function's eager fast path against the custom ops
    (``override(eager_fast_path=False)``): the same loss and gradients bitwise, for the
    default (recompute) plan, several chunks and gradient-in-forward."""
    name, opts, reduction, *extra = case
    if name == "all":
        opts = dict(OPTIONS["all"], **opts)
    fast, kind_fast = _run(opts, reduction, True, *extra)
    slow, kind_slow = _run(opts, reduction, False, *extra)
    assert "Eager" in kind_fast and "Eager" not in kind_slow, (kind_fast, kind_slow)
    for a, b in zip(fast, slow):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


def test_eager_fast_path_matches_float64():
    """The fast path is the default in eager mode: it meets the float64 bar (every option)."""
    check("triton", torch.bfloat16, (2, 9), 24, 40, 101, dict(OPTIONS["all"], beta=0.4), "mean", seed=5)


def test_compile_takes_the_custom_op():
    """Under torch.compile the op is the custom op (the graph sees it), not the fast path."""
    xs, ws, xt, wt, target, kw = make_inputs((9,), 24, 40, 101, torch.float32, {}, seed=2)
    seen = []

    def spy_backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    fn = torch.compile(lambda a, b: logitless.linear_jsd(a, b, xt, wt, target, backend="triton"),
                       backend=spy_backend, fullgraph=True)
    loss = fn(xs, ws)
    loss.backward()
    assert any("linear_jsd_forward" in s for s in seen), seen
    assert torch.isfinite(xs.grad).all()


# --------------------------------------------------------------------------- launch count


def _probe_host():
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probe_host.py")
    spec = importlib.util.spec_from_file_location("probe_host", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
