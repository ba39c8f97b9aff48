"""The contract every loss op keeps, one suite parametrised over the op specs
(tests/op_specs.py): values and gradients against float64 for every option, backend and
dtype; odd sizes; empty and all-ignored inputs; bad input raises a clear error;
``torch.library.opcheck`` of its custom ops; no (tokens x vocab) allocation.

Op-specific behaviour (budgets and plans, in-place backward, strided inputs, TRL's
convention, finite differences, ...) lives in test_<op>.py.

Reductions: on a GPU every option runs with every reduction. On the CPU the torch
backend does too; the Triton interpreter (slow) runs each option with one reduction,
taken in turn from a fixed rotation over the option list (deterministic, and every
reduction is covered); the "all" option with every reduction is in the op files.
Ops with per-token outputs (log_probs, linear_log_probs) take no reduction: their specs
list ``reductions=("none",)``.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import DEVICE, HAS_CUDA
from tests.helpers import AllocationRecorder, assert_close_to_ref
from tests.op_specs import SPECS, OpSpec

BACKENDS = ["torch", "triton"]
REDUCTIONS = ("mean", "sum", "none")


def _params(per_spec):
    return [pytest.param(name, *rest, id="-".join([name, *map(str, rest)]))
            for name, spec in SPECS.items() for rest in per_spec(spec)]


def reductions_for(spec: OpSpec, option: str, backend: str) -> tuple:
    """Every reduction where it is cheap; else one, in turn by the option's position."""
    if HAS_CUDA or backend == "torch":
        return spec.reductions
    return (spec.reductions[list(spec.options).index(option) % len(spec.reductions)],)


def check_against_reference(spec: OpSpec, backend, dtype, size, option, reduction, seed):
    """Loss (and stats) and gradients against float64, with torch in the same dtype
    (logits materialised) as the yardstick: |ours - ref| <= |torch - ref| + tol."""
    case = spec.make(size, dtype, spec.options[option], seed)
    kw = dict(dict(memory_budget=spec.budget), **case.kwargs, reduction=reduction, backend=backend)
    if spec.stats:
        loss, stats = spec.fn(*case.args, return_stats=True, **kw)
    else:
        loss = spec.fn(*case.args, **kw)
    ref, ref_lse, ref_correct = spec.reference(case, reduction)
    same = spec.reference(case, reduction, dtype)[0]
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close_to_ref("loss", loss, same, ref, dtype)
    if spec.stats:
        lse_dtype = torch.float32 if spec.lse_exact or dtype == torch.float32 else dtype
        assert_close_to_ref("lse", stats.lse, None, ref_lse, torch.float64 if dtype == torch.float64 else lse_dtype)
        if spec.lse_exact or dtype in (torch.float32, torch.float64):  # 16-bit near-ties may flip the argmax
            assert torch.equal(stats.correct.cpu(), ref_correct.cpu())
        assert stats.num_tokens.item() == case.num_tokens
        # argmax (float64 ids in test_cross_entropy / test_linear_cross_entropy): -1 exactly
        # at the ignored tokens, a class elsewhere, the target where ``correct``.
        am = stats.argmax
        assert am.dtype == torch.int64 and am.shape == stats.correct.shape
        assert int((am >= 0).sum()) == case.num_tokens and bool((am >= -1).all())
        assert bool((am[stats.correct] >= 0).all())

    g = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(loss.shape, generator=g) if reduction == "none" else torch.rand((), generator=g) + 0.5
    grad_out = grad_out.to(DEVICE)
    ours = torch.autograd.grad(loss, case.grads, grad_out.to(loss.dtype))
    refs = torch.autograd.grad(ref, case.grads, grad_out.double())
    sames = torch.autograd.grad(same, case.grads, grad_out.to(same.dtype))
    for i, (o, r, s) in enumerate(zip(ours, refs, sames)):
        assert o.dtype == dtype and o.shape == case.grads[i].shape
        assert_close_to_ref(f"grad of input {i}", o, s, r, dtype)


def _is_prime(n):
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


@pytest.mark.parametrize("op", list(SPECS))
def test_spec_is_complete(op):
    """What the contract needs of a spec (a new op's spec fails here first)."""
    spec = SPECS[op]
    assert {"plain", "all"} <= set(spec.options)
    sizes = [size for size, _, _ in spec.sizes.values()]
    assert any(_is_prime(s["vocab"]) and s["vocab"] > 100 for s in sizes), "a prime vocabulary"
    assert any(len(s["lead"]) == 2 and min(s["lead"]) > 1 for s in sizes), "3-D inputs"
    assert any(torch.Size(s["lead"]).numel() == 1 for s in sizes), "one token"
    if "hidden" in spec.base_size:
        assert any(s["hidden"] % 16 for s in sizes), "a hidden size not a multiple of 16"
    assert len(spec.bad_calls()) >= 5


# ------------------------------------------------------------------ values and gradients


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op,option", _params(lambda spec: [(o,) for o in spec.options]))
def test_each_option(op, option, dtype, backend):
    spec = SPECS[op]
    for reduction in reductions_for(spec, option, backend):
        check_against_reference(spec, backend, dtype, spec.base_size, option, reduction,
                                seed=len(option) + REDUCTIONS.index(reduction))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(SPECS))
def test_float16_all_options(op, backend):
    spec = SPECS[op]
    check_against_reference(spec, backend, torch.float16, spec.base_size, "all", spec.reductions[0], seed=17)


@pytest.mark.parametrize("op,option", _params(lambda spec: [(o,) for o in spec.options]))
def test_float64_torch_backend(op, option):
    """fp64 inputs on the torch backend: the math in fp64, to fp64 rounding."""
    spec = SPECS[op]
    for reduction in spec.reductions:
        check_against_reference(spec, "torch", torch.float64, spec.base_size, option, reduction, seed=19)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,size", _params(lambda spec: [(s,) for s in spec.sizes]))
def test_odd_sizes(op, size, backend):
    """V prime, H not a multiple of 16, one token, 3-D, tiny vocabularies, empty."""
    spec = SPECS[op]
    shape, options, reduction = spec.sizes[size]
    for dtype in (torch.float32, torch.bfloat16):
        for option in options:
            check_against_reference(spec, backend, dtype, shape, option, reduction, seed=3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,reduction", _params(lambda spec: [(r,) for r in spec.reductions]))
def test_empty_and_all_ignored(op, reduction, backend):
    """As torch.nn.functional.cross_entropy: "mean" over no token is NaN (0/0), "sum"
    is 0, "none" has the target's shape and zeros; every gradient is zero."""
    spec = SPECS[op]
    for lead, ignore in (((0,), 0.0), ((0, 3), 0.0), ((5,), 1.0)):
        size = dict(spec.base_size, lead=lead)
        case = spec.make(size, torch.float32, {"_ignore": ignore}, seed=9)
        loss = spec.fn(*case.args, reduction=reduction, backend=backend, **case.kwargs)
        if reduction == "mean":
            assert loss.shape == () and torch.isnan(loss)
        elif reduction == "sum":
            assert loss.shape == () and loss.item() == 0.0
        else:
            assert loss.shape == lead and not loss.any()
        grads = torch.autograd.grad(loss, case.grads, torch.ones_like(loss))
        for g, t in zip(grads, case.grads):
            assert g.shape == t.shape and not g.any()


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("op,case", _params(lambda spec: [(c,) for c in spec.bad_calls()]))
def test_bad_input_raises(op, case):
    """A clear ValueError/TypeError naming the argument, never a silent wrong number."""
    call, exc, match = SPECS[op].bad_calls()[case]
    with pytest.raises(exc, match=match):
        call()


# ------------------------------------------------------------------ custom ops


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(SPECS))
def test_opcheck(op, backend):
    """Schema, fake (meta) kernels and autograd registration of the op's custom ops."""
    calls = 0
    for custom_op, args, utils in SPECS[op].opcheck(backend):
        kw = {} if utils is None else {"test_utils": utils}
        torch.library.opcheck(custom_op, args, **kw)
        calls += 1
    assert calls >= 2  # forward and backward


# ------------------------------------------------------------------ memory


@pytest.mark.parametrize("op,backend", _params(lambda spec: [(b,) for b in spec.alloc_backends]))
def test_no_tokens_by_vocab_allocation(op, backend):
    """Forward: no tensor of N x V elements (nor larger); backward: none besides the
    gradient of the logits themselves (ops that take logits). Inside the custom ops too."""
    spec = SPECS[op]
    size = spec.alloc_size
    n_v = size["vocab"] * torch.Size(size["lead"]).numel()
    case = spec.make(size, torch.float32, spec.options["all"], seed=1)
    with AllocationRecorder(threshold=n_v) as fwd:
        loss = spec.fn(*case.args, backend=backend, memory_budget=4096, **case.kwargs)
    assert fwd.big == [], f"forward created (N x V)-sized tensors: {fwd.big}"
    assert fwd.largest > 0
    with AllocationRecorder(threshold=n_v) as bwd:
        torch.autograd.grad(loss, case.grads, torch.ones_like(loss))  # (per-token outputs too)
    assert bwd.big == list(spec.grad_allocs), f"backward created (N x V)-sized tensors: {bwd.big}"


def test_allocation_recorder_sees_logits():
    """The recorder above would catch logits, and an fp32 copy of bf16 logits."""
    x, w = torch.randn(48, 16), torch.randn(160, 16)
    with AllocationRecorder(threshold=48 * 160) as rec:
        torch.nn.functional.cross_entropy(x @ w.T, torch.zeros(48, dtype=torch.long))
    assert rec.largest >= 48 * 160 and rec.big
    logits = torch.randn(48, 160, dtype=torch.bfloat16)
    with AllocationRecorder(threshold=48 * 160) as rec:
        logits.float()
    assert rec.big == ["aten._to_copy.default"]
