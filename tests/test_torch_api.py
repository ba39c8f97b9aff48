"""``logitless.patch_torch``: torch's own ``F.linear_cross_entropy`` / ``nn.LinearCrossEntropyLoss``
(torch >= 2.13) computed by logitless, with torch's arguments and results.

Every case compares the patched call with torch's original function (same dtype) and
with torch's original in float64 (the reference), loss and gradients of input,
linear_weight and linear_bias, and checks that the logitless custom op ran (a dispatch
mode records it), so a patch that does nothing fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import logitless
from logitless.integrations import torch_api

from .conftest import DEVICE
from .helpers import AllocationRecorder, assert_close_to_ref

pytestmark = pytest.mark.skipif(
    not hasattr(F, "linear_cross_entropy"),
    reason=f"torch {torch.__version__} has no F.linear_cross_entropy (added in torch 2.13)",
)

ORIGINAL_F = getattr(F, "linear_cross_entropy", None)
ORIGINAL_FORWARD = getattr(getattr(torch.nn, "LinearCrossEntropyLoss", None), "forward", None)


@pytest.fixture(autouse=True)
def _restore():
    """No test leaves torch patched, whatever it does."""
    yield
    logitless.unpatch_torch()
    assert F.linear_cross_entropy is ORIGINAL_F


class LogitlessOps(TorchDispatchMode):
    """Records the logitless custom ops that run while active."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "logitless":
            self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


def _inputs(n, h, v, dtype, *, bias=False, class_weight=False, unbatched=False, ignore=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * h**-0.5 * 3
    t = torch.randint(0, v, (n,), generator=g)
    if ignore is not None and n:
        t[::3] = ignore  # every third token ignored
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    cw = torch.rand(v, generator=g, dtype=torch.float64) + 0.5 if class_weight else None
    if unbatched:
        x, t = x[0], t[0]
    return x, w, t, b, cw


def _leaves(x, w, b, dtype):
    def leaf(a):
        return None if a is None else a.to(DEVICE, dtype).detach().requires_grad_(True)
    return leaf(x), leaf(w), leaf(b)


def _run(fn, x, w, t, b, cw, dtype, kwargs):
    xl, wl, bl = _leaves(x, w, b, dtype)
    cwl = None if cw is None else cw.to(DEVICE, dtype)
    loss = fn(xl, wl, t.to(DEVICE), linear_bias=bl, weight=cwl, **kwargs)
    grads = [None, None, None]
    if loss.numel() and loss.requires_grad:
        seed = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype, device=loss.device).reshape(loss.shape)
        wanted = [a for a in (xl, wl, bl) if a is not None]
        got = torch.autograd.grad(loss, wanted, seed, allow_unused=True)
        grads = list(got) + [None] * (3 - len(got))
    return loss.detach(), grads


def _check_case(n, h, v, dtype, kwargs, **make):
    """The patched call against torch's original (same dtype) and torch's in float64."""
    x, w, t, b, cw = _inputs(n, h, v, dtype, **make)
    ref_loss, ref_grads = _run(ORIGINAL_F, x, w, t, b, cw, torch.float64, kwargs)
    same_loss, same_grads = _run(ORIGINAL_F, x, w, t, b, cw, dtype, kwargs)
    with logitless.patch_torch(), LogitlessOps() as ops:
        loss, grads = _run(F.linear_cross_entropy, x, w, t, b, cw, dtype, kwargs)
    assert "logitless::lce_forward" in ops.ops, f"the patched call did not run logitless: {ops.ops}"
    assert loss.dtype == same_loss.dtype and loss.shape == same_loss.shape
    if ref_loss.isnan().all():  # e.g. "mean" over no tokens: NaN, as torch
        assert same_loss.isnan().all() and loss.isnan().all()
    else:
        assert_close_to_ref("loss", loss, same_loss, ref_loss, dtype)
    for name, ours, same, ref in zip(("d_input", "d_linear_weight", "d_linear_bias"), grads, same_grads, ref_grads):
        if ref is None:
            assert ours is None or not ours.any(), name
            continue
        assert ours is not None and ours.dtype == dtype, name
        assert_close_to_ref(name, ours, same, ref, dtype)


N, H, V = 13, 20, 37  # odd sizes: V prime, H not a multiple of 16

OPTION_CASES = {
    "plain": ({}, {}),
    "sum": ({"reduction": "sum"}, {}),
    "none": ({"reduction": "none"}, {}),
    "ignore_default": ({}, {"ignore": -100}),
    "ignore_index_5": ({"ignore_index": 5}, {"ignore": 5}),
    "ignore_none_reduction": ({"reduction": "none"}, {"ignore": -100}),
    "label_smoothing": ({"label_smoothing": 0.1}, {}),
    "class_weight": ({}, {"class_weight": True}),
    "class_weight_sum": ({"reduction": "sum"}, {"class_weight": True}),
    "bias": ({}, {"bias": True}),
    "unbatched": ({}, {"unbatched": True}),
    "unbatched_none": ({"reduction": "none"}, {"unbatched": True}),
    "options_default": ({"options": "default"}, {}),
    "options_chunk": ({"options": "chunk"}, {}),
    "all": ({"label_smoothing": 0.2, "ignore_index": 3}, {"bias": True, "class_weight": True, "ignore": 3}),
    "all_none": ({"reduction": "none", "label_smoothing": 0.2}, {"bias": True, "class_weight": True, "ignore": -100}),
}


def _options(kwargs):
    kwargs = dict(kwargs)
    if kwargs.get("options") == "default":
        kwargs["options"] = torch.nn.LinearCrossEntropyOptions()
    elif kwargs.get("options") == "chunk":
        kwargs["options"] = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=4)
    return kwargs


@pytest.mark.filterwarnings("ignore:linear_cross_entropy")  # torch's "options ignored" for its own calls
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_matches_torch_fp32(case):
    kwargs, make = OPTION_CASES[case]
    _check_case(N, H, V, torch.float32, _options(kwargs), **make)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("case", ["plain", "none", "all", "unbatched"])
def test_matches_torch_dtypes(case, dtype):
    kwargs, make = OPTION_CASES[case]
    _check_case(N, H, V, dtype, _options(kwargs), **make)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_and_empty(reduction):
    _check_case(6, H, V, torch.float32, {"reduction": reduction}, ignore=-100, seed=1)  # 2 of 6 ignored
    x, w, _, _, _ = _inputs(6, H, V, torch.float32)
    t = torch.full((6,), -100)
    same = ORIGINAL_F(x.float(), w.float(), t, reduction=reduction)
    with logitless.patch_torch(), LogitlessOps() as ops:
        xl = x.float().requires_grad_(True)
        ours = F.linear_cross_entropy(xl, w.float(), t, reduction=reduction)
        ours.sum().backward()
    assert ops.ops and torch.equal(ours.isnan(), same.isnan())
    assert torch.equal(torch.nan_to_num(ours), torch.nan_to_num(same))
    assert not xl.grad.any()
    _check_case(0, H, V, torch.float32, {"reduction": reduction})  # empty batch


def test_one_token_and_one_class():
    _check_case(1, 7, 1, torch.float32, {})
    _check_case(1, 7, 2, torch.float32, {"reduction": "none"}, bias=True)


def test_module_created_before_the_patch():
    """nn.LinearCrossEntropyLoss looks F.linear_cross_entropy up at each forward."""
    torch.manual_seed(1)
    cw = torch.rand(V) + 0.5
    module = torch.nn.LinearCrossEntropyLoss(H, V, bias=True, weight=cw, ignore_index=4, label_smoothing=0.1)
    x = torch.randn(N, H)
    t = torch.randint(0, V, (N,))
    t[0] = 4
    expected = module(x, t)
    with logitless.patch_torch(), LogitlessOps() as ops:
        got = module(x, t)
    assert "logitless::lce_forward" in ops.ops
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.nn.LinearCrossEntropyLoss.forward is ORIGINAL_FORWARD


def test_delegated_calls_give_torch_results():
    """Soft targets, K-dimensional losses, uint8 targets, negative label smoothing: torch's
    own function computes them (no logitless op), with torch's result."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g)
    soft = torch.rand(N, V, generator=g).softmax(-1)
    w3 = torch.randn(V, 3, H, generator=g)
    t3 = torch.randint(0, V, (N, 3), generator=g)
    t8 = torch.randint(0, V, (N,), generator=g).to(torch.uint8)
    calls = [
        lambda f: f(x, w, soft),
        lambda f: f(x, w, soft, label_smoothing=0.1, reduction="none"),
        lambda f: f(x[0], w, soft[0]),
        lambda f: f(x, w3, t3),
        lambda f: f(x, w, t8),
        lambda f: f(x, w, t8.long(), label_smoothing=-0.1),
    ]
    for call in calls:
        expected = call(ORIGINAL_F)
        with logitless.patch_torch(), LogitlessOps() as ops:
            got = call(F.linear_cross_entropy)
        assert ops.ops == []
        torch.testing.assert_close(got, expected)


BAD_INPUTS = {
    "3-D input": lambda x, w, t: dict(input=x[None], target=t[None]),
    "H mismatch": lambda x, w, t: dict(linear_weight=w[:, :5]),
    "target shape": lambda x, w, t: dict(target=t[:3]),
    "target 2-D": lambda x, w, t: dict(target=t[:, None]),
    "target int32": lambda x, w, t: dict(target=t.int()),
    "target float": lambda x, w, t: dict(target=t.float()),
    "target out of range": lambda x, w, t: dict(target=torch.full_like(t, V)),
    "target negative": lambda x, w, t: dict(target=torch.full_like(t, -3)),
    "dtype mismatch": lambda x, w, t: dict(linear_weight=w.bfloat16()),
    "class weight dtype": lambda x, w, t: dict(weight=torch.rand(V, dtype=torch.float64)),
    "class weight shape": lambda x, w, t: dict(weight=torch.rand(V + 1)),
    "bias shape": lambda x, w, t: dict(linear_bias=torch.rand(V + 1)),
    "bias dtype": lambda x, w, t: dict(linear_bias=torch.rand(V).bfloat16()),
    "reduction": lambda x, w, t: dict(reduction="avg"),
    "label smoothing": lambda x, w, t: dict(label_smoothing=1.5),
    "soft target with ignore_index": lambda x, w, t: dict(target=torch.rand(N, V).softmax(-1), ignore_index=-100),
    "integer input": lambda x, w, t: dict(input=x.long(), linear_weight=w.long()),
    "1-D weight": lambda x, w, t: dict(linear_weight=w[0]),
    "class weight requires grad": lambda x, w, t: dict(weight=torch.rand(V, requires_grad=True)),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_errors_match_torch(case):
    x, w, t = torch.randn(N, H), torch.randn(V, H), torch.randint(0, V, (N,))
    args = dict(input=x, linear_weight=w, target=t)
    args.update(BAD_INPUTS[case](x, w, t))
    with pytest.raises(Exception) as theirs:
        ORIGINAL_F(**args)
    with logitless.patch_torch():
        with pytest.raises(Exception) as ours:
            F.linear_cross_entropy(**args)
    assert type(ours.value) is type(theirs.value), (ours.value, theirs.value)
    assert str(ours.value)


def test_no_tokens_by_vocab_allocation():
    """The patched call allocates no (N x V) tensor, forward or backward (torch's does)."""
    n, h, v = 48, 16, 160
    x = torch.randn(n, h, requires_grad=True)
    w = torch.randn(v, h, requires_grad=True)
    b = torch.randn(v, requires_grad=True)
    t = torch.randint(0, v, (n,))
    with AllocationRecorder(threshold=n * v) as rec:
        ORIGINAL_F(x, w, t, linear_bias=b)
    assert rec.big, "the recorder should see torch's logits"
    with logitless.patch_torch(memory_budget=4096):
        with AllocationRecorder(threshold=n * v) as fwd:
            loss = F.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1,
                                          options=torch.nn.LinearCrossEntropyOptions())
        assert fwd.big == [] and fwd.largest > 0
        with AllocationRecorder(threshold=n * v) as bwd:
            torch.autograd.grad(loss, (x, w, b))
        assert bwd.big == []


def test_unpatch_restores_identity_and_is_idempotent():
    assert not torch_api.is_patched()
    logitless.patch_torch()
    logitless.patch_torch()
    assert torch_api.is_patched() and F.linear_cross_entropy is not ORIGINAL_F
    assert F.linear_cross_entropy.__wrapped__ is ORIGINAL_F  # torch's signature and docs
    logitless.unpatch_torch()
    assert F.linear_cross_entropy is ORIGINAL_F and not torch_api.is_patched()
    logitless.unpatch_torch()
    assert F.linear_cross_entropy is ORIGINAL_F
    assert torch.nn.LinearCrossEntropyLoss.forward is ORIGINAL_FORWARD


def test_context_manager_nests_and_restores_on_exception():
    with logitless.patch_torch(memory_budget=1 << 20):
        with logitless.patch_torch(memory_budget=1 << 21):
            assert torch_api._active.memory_budget == 1 << 21
        assert torch_api.is_patched() and torch_api._active.memory_budget == 1 << 20
    assert F.linear_cross_entropy is ORIGINAL_F
    with pytest.raises(ZeroDivisionError):
        with logitless.patch_torch():
            assert torch_api.is_patched()
            raise ZeroDivisionError("an exception inside the block")
    assert F.linear_cross_entropy is ORIGINAL_F and not torch_api.is_patched()


def test_bad_settings():
    with pytest.raises(ValueError, match="backend"):
        logitless.patch_torch(backend="cuda")
    with pytest.raises(ValueError, match="memory_budget"):
        logitless.patch_torch(memory_budget=-1)
    assert F.linear_cross_entropy is ORIGINAL_F


def test_old_torch_raises(monkeypatch):
    """Without the API (torch < 2.13): a RuntimeError that says what to call instead."""
    monkeypatch.delattr(F, "linear_cross_entropy")
    with pytest.raises(RuntimeError, match=r"torch >= 2\.13.*logitless\.linear_cross_entropy"):
        logitless.patch_torch()
    logitless.unpatch_torch()  # does nothing


def test_saved_reference_after_unpatch_runs_torch():
    with logitless.patch_torch():
        patched = F.linear_cross_entropy
    x, w, t = torch.randn(N, H), torch.randn(V, H), torch.randint(0, V, (N,))
    with LogitlessOps() as ops:
        got = patched(x, w, t)
    assert ops.ops == []
    torch.testing.assert_close(got, ORIGINAL_F(x, w, t))


def test_torch_compile_fullgraph():
    def step(x, w, t, b):
        return F.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1, ignore_index=2)

    x = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    b = torch.randn(V, requires_grad=True)
    t = torch.randint(0, V, (N,))
    expected = ORIGINAL_F(x, w, t, linear_bias=b, label_smoothing=0.1, ignore_index=2)
    want = torch.autograd.grad(expected, (x, w, b))
    graphs = []

    def backend(gm, example_inputs):  # records dynamo's graph, then runs it with aot_eager
        graphs.append(str(gm.graph))
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    with logitless.patch_torch():
        compiled = torch.compile(step, fullgraph=True, backend=backend)
        loss = compiled(x, w, t, b)
        got = torch.autograd.grad(loss, (x, w, b))
    assert len(graphs) == 1 and "logitless" in graphs[0], graphs
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()



def test_autocast():
    """Under autocast (fp32 parameters, bf16 compute) the loss is fp32 as torch's, and the
    gradients come back in the parameters' dtype."""
    x, w, t, b, cw = _inputs(N, H, V, torch.float32, bias=True, class_weight=True, ignore=-100)
    ref_loss, ref_grads = _run(ORIGINAL_F, x, w, t, b, cw, torch.float64, {})
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        same_loss, same_grads = _run(ORIGINAL_F, x, w, t, b, cw, torch.float32, {})
        with logitless.patch_torch(), LogitlessOps() as ops:
            loss, grads = _run(F.linear_cross_entropy, x, w, t, b, cw, torch.float32, {})
    assert "logitless::lce_forward" in ops.ops
    assert loss.dtype == same_loss.dtype == torch.float32
    assert_close_to_ref("loss", loss, same_loss, ref_loss, torch.bfloat16)
    for name, ours, same, ref in zip(("d_input", "d_linear_weight", "d_linear_bias"), grads, same_grads, ref_grads):
        assert ours.dtype == torch.float32, name
        assert_close_to_ref(name, ours, same, ref, torch.bfloat16)


def test_tensor_subclass_goes_to_torch():
    """A Tensor subclass (here one with no __torch_function__ override, as DTensor) is
    handed to torch's own function; nn.Parameter is a plain tensor for the patch."""

    class Sub(torch.Tensor):
        __torch_function__ = torch._C._disabled_torch_function_impl

    x, w, t = torch.randn(N, H), torch.randn(V, H), torch.randint(0, V, (N,))
    for xs, ws, logitless_ran in ((x.as_subclass(Sub), w, False), (x, torch.nn.Parameter(w), True)):
        with logitless.patch_torch(), LogitlessOps() as ops:
            got = F.linear_cross_entropy(xs, ws, t)
        assert bool(ops.ops) is logitless_ran
        torch.testing.assert_close(got.as_subclass(torch.Tensor), ORIGINAL_F(x, w, t))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_small_memory_budget_chunks_and_matches(reduction, monkeypatch):
    """patch_torch(memory_budget=...) reaches logitless (a budget far below the logits
    makes it chunk over the vocabulary); the results stay torch's."""
    n, h, v = 33, 24, 1031
    x, w, t, b, cw = _inputs(n, h, v, torch.float32, bias=True, class_weight=True, ignore=-100, seed=3)
    kwargs = {"reduction": reduction, "label_smoothing": 0.05}
    ref_loss, ref_grads = _run(ORIGINAL_F, x, w, t, b, cw, torch.float64, kwargs)
    seen = []
    op = torch_api._logitless_lce

    def spy(*args, **kw):
        seen.append(kw["memory_budget"])
        return op(*args, **kw)

    monkeypatch.setattr(torch_api, "_logitless_lce", spy)
    with logitless.patch_torch(memory_budget=8192):
        loss, grads = _run(F.linear_cross_entropy, x, w, t, b, cw, torch.float32, kwargs)
    assert seen == [8192]
    assert_close_to_ref("loss", loss, None, ref_loss, torch.float32)
    for name, ours, ref in zip(("d_input", "d_linear_weight", "d_linear_bias"), grads, ref_grads):
        assert_close_to_ref(name, ours, None, ref, torch.float32)


def test_options_never_fail_and_retain_graph():
    """Any LinearCrossEntropyOptions is accepted (ignored); a second backward works."""
    x = torch.randn(N, H, requires_grad=True)
    w, t = torch.randn(V, H), torch.randint(0, V, (N,))
    expected = ORIGINAL_F(x, w, t)
    for options in (torch.nn.LinearCrossEntropyOptions(),
                    torch.nn.LinearCrossEntropyOptions(batch_chunk_size=1, acc_policy="compact"),
                    torch.nn.LinearCrossEntropyOptions(chunking_method="aspect_ratio:4", acc_dtype=torch.float64)):
        x.grad = None
        with logitless.patch_torch(), LogitlessOps() as ops:
            loss = F.linear_cross_entropy(x, w, t, options=options)
            loss.backward(retain_graph=True)
            first = x.grad.clone()
            loss.backward()
        assert ops.ops
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(x.grad, 2 * first)
