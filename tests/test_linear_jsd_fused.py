"""linear_jsd's host-side path (issue 23 leftovers): the eager fast path (a plain
autograd.Function around the custom ops' implementations) and the fused O(N) epilogues
(one Triton launch for the per-token loss and its reduction, one for the upstream
gradient), against the custom ops, the torch formulas and float64.

Runs on the GPU when there is one; otherwise the Triton backend runs on the CPU
interpreter (conftest.py), at small sizes.
"""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless.planning.overrides import override
from tests.conftest import DEVICE
from tests.helpers import eager_fast_path, load_benchmark
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
    with eager_fast_path(fast), override(strategy=strategy):
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
    (``helpers.eager_fast_path(False)``): the same loss and gradients bitwise, for the
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




#: Device ops per eager forward+backward of linear_jsd (bf16, Triton, 45 tokens, one
#: chunk), at most: ATen ops (the count includes the step's own ``.sum().backward()``
#: seed and gradient accumulation, ~3) and Triton launches. Before the fused epilogues:
#: 26 ATen ops + 4 launches ("plain", "kl"), 39 + 4 ("all_options": 7 of them the
#: CPU-only target range check, which the GPU skips).
MAX_OPS = {"plain": (9, 6), "kl": (9, 5), "all_options": (16, 6), "none": (9, 6)}


@pytest.mark.parametrize("which", sorted(MAX_OPS))
def test_launch_count_per_forward_backward(which):
    """A regression guard on the device ops one f+b issues: the loss and its reduction
    are one launch (``jsd_loss_epilogue_kernel``), the upstream gradient one
    (``jsd_upstream_kernel``), the statistics are written in place (no copy)."""
    probe = load_benchmark("probe_host")
    g = torch.Generator().manual_seed(0)
    n, hs, ht, v = 45, 24, 40, 101
    x = torch.randn(n, hs, generator=g).to(DEVICE, torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, hs, generator=g) * 0.3).to(DEVICE, torch.bfloat16).requires_grad_(True)
    xt = torch.randn(n, ht, generator=g).to(DEVICE, torch.bfloat16)
    wt = (torch.randn(v, ht, generator=g) * 0.3).to(DEVICE, torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    kw = {"plain": {}, "kl": dict(beta=0.0), "none": dict(reduction="none"),
          "all_options": dict(beta=0.3, temperature=0.7, hard_label_weight=0.2, student_softcap=20.0,
                              teacher_softcap=25.0, ignore_index=3, reduction="sum")}[which]

    def step():
        logitless.linear_jsd(x, w, xt, wt, t, backend="triton", **kw).sum().backward()

    ops, launches = probe.count_ops(step, run_kernels=True)
    aten, triton_launches = sum(ops.values()), sum(launches.values())
    bound_aten, bound_triton = MAX_OPS[which]
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    assert aten <= bound_aten and triton_launches <= bound_triton, (dict(ops), dict(launches))
    assert launches["jsd_loss_epilogue_kernel"] == 1 and launches["jsd_upstream_kernel"] == 1
    for name in ("copy_", "where", "div", "zeros_like"):  # the torch epilogue's ops are gone
        assert ops[name] == 0, dict(ops)


# --------------------------------------------------------------------------- the epilogues vs the formulas

EPILOGUE_CASES = [
    dict(beta=0.5),
    dict(beta=0.0),
    dict(beta=1.0),
    dict(beta=0.3, hard_label_weight=0.4),
    dict(beta=0.7, hard_label_weight=1.0, ignore_index=2),
]


def _random_stats(n, v, seed, ignore_index):
    g = torch.Generator().manual_seed(seed)
    stats = torch.randn(6, n, generator=g).abs() * 3
    target = torch.randint(0, v, (n,), generator=g)
    target[torch.rand(n, generator=g) < 0.3] = ignore_index
    return stats.to(DEVICE), target.to(DEVICE)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", EPILOGUE_CASES, ids=str)
@pytest.mark.parametrize("n", [1, 37, 2500])  # one token, a block, several blocks of the loop
def test_fused_loss_epilogue_matches_the_formulas(case, reduction, n):
    """``jsd_epilogue.forward_loss`` against ``formulas.jsd`` (token_loss, reduce): per
    token bitwise; reduced within fp32 rounding of the sum's order (and vs float64)."""
    from logitless.formulas.jsd import reduce, token_loss
    from logitless.options import JSDOptions
    from logitless.triton_lib.jsd_epilogue import forward_loss

    v = 50
    opts = JSDOptions.checked(**case)
    stats, target = _random_stats(n, v, n + len(str(case)), opts.ignore_index)
    ours = forward_loss(stats, target, v, opts, reduction)
    spec = reduce(token_loss(stats, target, v, opts), target, reduction, opts.ignore_index)
    exact = reduce(token_loss(stats.double(), target, v, opts), target, reduction, opts.ignore_index)
    assert ours.shape == spec.shape and ours.dtype == torch.float32
    if reduction == "none":
        assert torch.equal(ours, spec)
    elif exact.isnan():  # every token ignored under "mean"
        assert ours.isnan() and spec.isnan()
    else:
        tol = 4 * torch.finfo(torch.float32).eps * max(1.0, float(exact.abs()))
        assert abs(float(ours) - float(exact)) <= abs(float(spec) - float(exact)) + tol
    strided = torch.zeros(6, n + 5, device=DEVICE)[:, 2:n + 2]  # columns of a larger statistics tensor
    strided.copy_(stats)
    again = forward_loss(strided, target, v, opts, reduction)
    assert torch.equal(again.isnan(), ours.isnan())
    if reduction == "none":  # per token: bitwise
        assert torch.equal(again[~again.isnan()], ours[~ours.isnan()])
    elif not exact.isnan():  # a sum: on a GPU the load layout (so the order of the sum) may
        # follow the strides' alignment; within the same bound as the contiguous call
        tol = 4 * torch.finfo(torch.float32).eps * max(1.0, float(exact.abs()))
        assert abs(float(again) - float(exact)) <= abs(float(spec) - float(exact)) + tol


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("n", [1, 37, 2500])
def test_fused_upstream_matches_autograd_through_reduce(reduction, n):
    """``jsd_epilogue.upstream`` against autograd through ``formulas.jsd.reduce`` then
    ``formulas.jsd.upstream``: bitwise; also for a strided/expanded "none" gradient,
    an inf gradient (0 at ignored tokens), no gradient (= 1), and the torch backend's twin."""
    from logitless.formulas.jsd import reduce
    from logitless.formulas.jsd import upstream as spec_upstream
    from logitless.ops.linear_jsd import torch_backend
    from logitless.triton_lib.jsd_epilogue import upstream

    g = torch.Generator().manual_seed(n)
    target = torch.randint(0, 9, (n,), generator=g)
    target[torch.rand(n, generator=g) < 0.4] = -100
    target = target.to(DEVICE)
    loss_tok = torch.randn(n, generator=g).to(DEVICE).requires_grad_(True)
    out = reduce(loss_tok, target, reduction, -100)
    grads = [torch.randn(out.shape, generator=g).to(DEVICE)]
    if reduction == "none":
        grads.append(torch.randn(2 * n, generator=g).to(DEVICE)[::2])  # strided
        grads.append(torch.tensor(0.7, device=DEVICE).expand(n))  # stride 0 (after .sum())
    else:
        grads.append(torch.tensor(float("inf"), device=DEVICE))
    for grad in grads:
        (auto,) = torch.autograd.grad(out, loss_tok, grad, retain_graph=True)
        spec = spec_upstream(auto, target, -100)
        assert torch.equal(upstream(grad, target, -100, reduction), spec)
        assert torch.equal(torch_backend.upstream(grad, target, -100, reduction), spec)
    if reduction != "none":
        (auto,) = torch.autograd.grad(out, loss_tok, torch.tensor(1.0, device=DEVICE))
        assert torch.equal(upstream(None, target, -100, reduction), spec_upstream(auto, target, -100))


def test_fused_epilogues_edge_cases():
    """Every token ignored: "mean" is NaN (0/0) and its upstream 0; NaN statistics stay
    NaN at counted tokens; a hard-label target out of range gives NaN there only."""
    from logitless.options import JSDOptions
    from logitless.triton_lib.jsd_epilogue import forward_loss, upstream

    stats, _ = _random_stats(5, 10, 0, -100)
    ignored = torch.full((5,), -100, device=DEVICE)
    opts = JSDOptions.checked(beta=0.5)
    assert forward_loss(stats, ignored, 10, opts, "mean").isnan()
    assert float(forward_loss(stats, ignored, 10, opts, "sum")) == 0.0
    assert torch.equal(upstream(torch.tensor(1.0, device=DEVICE), ignored, -100, "mean"), torch.zeros(5, device=DEVICE))
    target = torch.tensor([1, 2, 30, -100, 4], device=DEVICE)
    hard = JSDOptions.checked(beta=0.5, hard_label_weight=0.5)
    per_tok = forward_loss(stats, target, 10, hard, "none")
    assert per_tok.isnan().tolist() == [False, False, True, False, False] and per_tok[3] == 0
    nan_stats = stats.clone()
    nan_stats[3, 1] = float("nan")  # K of token 1
    assert forward_loss(nan_stats, target, 10, opts, "none").isnan().tolist() == [False, True, False, False, False]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_epilogues_within_rounding_of_before_and_float64(reduction):
    """The whole op with the fused epilogues against float64, every option combined,
    several forward chunks (a small budget: statistics written in place per chunk)."""
    check("triton", torch.bfloat16, (3, 11), 24, 40, 101, dict(OPTIONS["all"], beta=0.6), reduction, seed=21,
          budget=1 << 13)
    check("triton", torch.float32, (17,), 19, 16, 67, dict(OPTIONS["all"], beta=0.0), reduction, seed=22)
