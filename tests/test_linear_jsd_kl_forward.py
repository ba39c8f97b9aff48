"""linear_jsd's fused forward for the KL limits (beta 0: forward KL, beta 1: reverse KL;
16-bit inputs): both heads' logits tiles and the online row statistics in one kernel
(``triton_lib.linear_jsd_kernels.jsd_kl_forward_kernel``), the splits merged by
``triton_lib.jsd_rows.finish_kl_partials``. Against float64, against the unfused forward
(cuBLAS fp32 logit chunks + the statistics kernels, ``override(jsd_fused_forward=False)``),
and the planner's choice of it (the cost model: fused where the chunks' GEMMs would be
weight-read-bound). Tests of the kernel force it with ``override(jsd_fused_forward=True)``.

Runs on the GPU when there is one; otherwise the Triton backend runs on the CPU
interpreter (conftest.py), at small sizes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import logitless
from logitless.ops.linear_jsd import cost_model as jsd_cost_model
from logitless.ops.linear_jsd import triton_backend
from logitless.ops.linear_jsd.api import BACKENDS
from logitless.ops.linear_jsd.planning import jsd_kl_fused, linear_jsd_plan
from logitless.ops.linear_jsd.reference import linear_jsd_reference
from logitless.options import JSDOptions
from logitless.planning import cost_model, device
from logitless.planning.overrides import override
from tests.conftest import DEVICE, HAS_CUDA
from tests.planning_seams import H100, on_device
from tests.test_linear_jsd import OPTIONS, check, make_inputs

HALF = [torch.bfloat16, torch.float16]


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fused forward's launches (proof that a call took the path)."""
    calls = []
    real = triton_backend._forward_fused

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "_forward_fused", spy)
    return calls


def _loss(opts, dtype, lead, hs, ht, v, reduction, seed, fused=True, budget=None):
    """(loss, (dx, dW)) with the fused forward forced on (True), off (False) or the model's (None)."""
    xs, ws, xt, wt, target, kw = make_inputs(lead, hs, ht, v, dtype, opts, seed)
    with override(jsd_fused_forward=fused):
        loss = logitless.linear_jsd(xs, ws, xt, wt, target, reduction=reduction, backend="triton",
                                    memory_budget=budget, **kw)
        grads = torch.autograd.grad(loss.sum(), [xs, ws])
    return loss.detach(), grads


# --------------------------------------------------------------------------- which path


@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("dtype", HALF)
def test_kl_limits_on_16_bit_inputs_take_the_fused_forward(beta, dtype, fused_calls):
    _loss(dict(beta=beta), dtype, (2, 9), 24, 40, 101, "mean", seed=1)
    assert fused_calls == [18]


@pytest.mark.parametrize("case", ["mixture", "fp32", "override"])
def test_other_calls_keep_the_unfused_forward(case, fused_calls):
    """Never for 0 < beta < 1 (the mixture needs full rows) nor fp32, even when forced."""
    beta = 0.5 if case == "mixture" else 1.0
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    _loss(dict(beta=beta), dtype, (2, 9), 24, 40, 101, "mean", seed=1, fused=case != "override")
    assert fused_calls == []
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    w = torch.zeros(16, 8, dtype=torch.bfloat16)
    plan = BACKENDS["triton"].plan
    with override(jsd_fused_forward=True):
        assert plan(x, w, x, JSDOptions(beta=0.0), budget=1 << 20).fused
        assert not plan(x, w, x, JSDOptions(beta=0.999), budget=1 << 20).fused
        assert not plan(x.float(), w.float(), x.float(), JSDOptions(beta=1.0), budget=1 << 20).fused


@pytest.mark.parametrize("shape, fused", [
    ((4096, 2048, 2048, 151936), True),    # forward measured 0.66x the chunked one, f+b 0.83-0.84x (H100)
    ((4096, 896, 3584, 151936), True),     # 0.68-0.69x, f+b 0.84x
    ((4096, 4096, 8192, 128256), False),   # 0.99-1.01x, f+b 0.99-1.01x: a tie
    ((16384, 4096, 8192, 128256), False),  # 1.06-1.10x, f+b 1.05x
])
def test_the_cost_model_picks_the_measured_faster_forward(shape, fused):
    """The default choice (``ops.linear_jsd.planning.jsd_kl_fused``, H100 constants) at the four shapes of
    the KL probe (a removed probe; default budget, 4 stages: ``probe-jsd-kl-4stages-H100-2026-11-24``,
    in git history, docs/design.md#evidence); an override wins over it."""
    n, hs, ht, v = shape
    dev = torch.device("cpu")  # (the interpreter plans with the H100 model)
    assert jsd_kl_fused(n, v, hs, ht, 2, 256 << 20, dev) is fused
    with override(jsd_fused_forward=not fused):
        assert jsd_kl_fused(n, v, hs, ht, 2, 256 << 20, dev) is (not fused)


@pytest.mark.parametrize("shape, fused", [
    ((4096, 2048, 2048, 151936), True),    # H200: forward 0.79x the chunked one, f+b 0.91x
    ((4096, 896, 3584, 151936), True),     # 0.80x, f+b 0.91x
    ((4096, 4096, 8192, 128256), False),   # 0.94-0.97x, f+b 0.99x: a tie, kept chunked
    ((16384, 4096, 8192, 128256), False),  # 0.98x, f+b 0.99x: a tie
])
def test_the_h200_model_picks_the_measured_faster_forward(shape, fused):
    """The H200's model (``cost_model.H200``: the fused forward's L2-miss factor and the
    chunked forward's stream bandwidth measured there, ``probe-jsd-kl-H200-2026-11-24``, in git history)
    at the probe's four shapes; with the H100's jsd fields it chose the chunked forward
    at all four, 8-9% slower f+b at the small heads."""
    n, hs, ht, v = shape
    rows = linear_jsd_plan(n, v, hs, 2, 256 << 20, torch.device("cpu")).forward_rows
    assert jsd_cost_model.jsd_kl_fused_faster(cost_model.H200, n, hs, ht, v, 2, rows) is fused
    # and the predicted forwards within 15% of the measured ones where the choice is made
    if fused:
        measured = {2048: 8.96, 896: 9.88}[hs]
        predicted = jsd_cost_model.jsd_kl_forward_s(cost_model.H200, n, hs, ht, v, 2)
        assert predicted * 1e3 == pytest.approx(measured, rel=0.15)


def test_override_switches_take_booleans_only():
    """A switch given a non-boolean (``"no"`` is truthy: it would force the fused path) is
    refused with the field's name; None is allowed where None means the planner's choice."""
    for field, bad in (("jsd_fused_forward", "no"), ("jsd_fused_forward", 0), ("tf32_preround", "yes"),
                       ("cute", 1)):
        with pytest.raises(TypeError, match=field):
            with override(**{field: bad}):
                pass
    with override(jsd_fused_forward=None, cute=None, tf32_preround=False) as o:
        assert o.jsd_fused_forward is None and o.tf32_preround is False


# --------------------------------------------------------------------------- against float64

CASES = ["plain", "ignore", "bias", "softcaps", "hard", "shift", "no-target", "all"]


@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_forward_matches_float64(beta, name, reduction, fused_calls):
    """Loss and student gradients within torch's own bf16 error of float64, every option
    alone and all combined (the "all" set at its own temperature 1.5)."""
    opts = dict(OPTIONS[name], beta=beta)
    with override(jsd_fused_forward=True):
        check("triton", torch.bfloat16, (3, 7), 24, 40, 101, opts, reduction, seed=CASES.index(name) + int(7 * beta))
    assert fused_calls


@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("lead, hs, ht, v", [
    ((1,), 24, 24, 101),        # one token
    ((2, 5), 20, 12, 1009),     # V prime, 3-D, teacher narrower
    ((33,), 17, 23, 67),        # H not a multiple of 16
    ((1, 1), 8, 8, 3),          # a vocabulary smaller than one block
])
def test_fused_forward_odd_sizes(beta, lead, hs, ht, v, fused_calls):
    opts = dict(OPTIONS["all"], beta=beta, temperature=0.7, shift=False, _ignore=0.0)  # (no token ignored)
    with override(jsd_fused_forward=True):
        check("triton", torch.float16, lead, hs, ht, v, opts, "mean", seed=v)
    assert fused_calls


@pytest.mark.parametrize("sms", [1, 3, 64])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_splits_agree_with_the_unfused_forward(sms, beta, fused_calls):
    """Few to many splits of the vocabulary (a ragged last split, one block per split):
    per-token losses agree with the unfused forward to fp32 rounding, and the targets of
    every split (hard labels) are found."""
    opts = dict(OPTIONS["all"], beta=beta, shift=False)
    with on_device(dataclasses.replace(device.facts(DEVICE), sms=sms)):
        plan = linear_jsd_plan(70, 1009, 24, 2, 1 << 30, torch.device(DEVICE))
        fused, g_fused = _loss(opts, torch.bfloat16, (70,), 24, 40, 1009, "none", seed=sms)
        plain, g_plain = _loss(opts, torch.bfloat16, (70,), 24, 40, 1009, "none", seed=sms, fused=False)
    assert fused_calls == [70]
    if sms > 1:
        assert plan.tiles.vocab_splits > 1
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_fused, g_plain):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


def test_fused_forward_is_bitwise_repeatable():
    opts = dict(OPTIONS["all"], beta=1.0)
    a, ga = _loss(opts, torch.bfloat16, (3, 7), 24, 40, 101, "none", seed=5)
    b, gb = _loss(opts, torch.bfloat16, (3, 7), 24, 40, 101, "none", seed=5)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_all_tokens_ignored_gives_nan_mean_and_zero_gradients():
    xs, ws, xt, wt, target, kw = make_inputs((5,), 24, 40, 101, torch.bfloat16, {}, seed=3)
    target = torch.full_like(target, -100)
    with override(jsd_fused_forward=True):
        loss = logitless.linear_jsd(xs, ws, xt, wt, target, beta=0.0, hard_label_weight=0.5, backend="triton")
    ref = linear_jsd_reference(xs, ws, xt, wt, target, beta=0.0, hard_label_weight=0.5)
    assert torch.isnan(loss) and torch.isnan(ref)
    dx, dw = torch.autograd.grad(loss, [xs, ws])
    assert not dx.any() and not dw.any()


def test_target_beyond_the_vocabulary_is_refused_or_nan():
    """As documented: raises on the CPU, that token's loss NaN on a GPU (no host sync)."""
    xs, ws, xt, wt, target, kw = make_inputs((5,), 24, 40, 101, torch.bfloat16, {}, seed=3)
    target[2] = 101
    if not HAS_CUDA:
        with pytest.raises(ValueError):
            logitless.linear_jsd(xs, ws, xt, wt, target, beta=1.0, hard_label_weight=0.5, backend="triton")
        return
    with override(jsd_fused_forward=True):
        loss = logitless.linear_jsd(xs, ws, xt, wt, target, beta=1.0, hard_label_weight=0.5, backend="triton",
                                    reduction="none")
    assert torch.isnan(loss[2]) and not torch.isnan(loss[[0, 1, 3, 4]]).any()


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA: the fused forward at an H100-class split count (GPU only)")
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_fused_forward_on_the_gpu_at_a_real_split_count(beta, fused_calls):
    with override(jsd_fused_forward=True):
        check("triton", torch.bfloat16, (300,), 256, 384, 32003, dict(OPTIONS["all"], beta=beta), "mean", seed=7)
    assert fused_calls


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_fused_forward_under_torch_compile(beta, fused_calls):
    """Inductor, fullgraph, through the custom ops (as a compiled training step calls it):
    the fused forward runs and loss and student gradients equal the eager call's, in bf16
    under autocast from fp32 hidden states and weights (the mixed-precision way)."""
    xs, ws, xt, wt, target, _ = make_inputs((2, 5), 24, 40, 101, torch.float32, {}, seed=23)
    dev = xs.device.type

    def f(*a):
        with torch.autocast(dev, dtype=torch.bfloat16):
            return logitless.linear_jsd(*a, beta=beta, hard_label_weight=0.25, backend="triton")

    with override(jsd_fused_forward=True):
        le = f(xs, ws, xt, wt, target)
        ge = torch.autograd.grad(le, (xs, ws))
        torch._dynamo.reset()
        lc = torch.compile(f, fullgraph=True)(xs, ws, xt, wt, target)
        gc = torch.autograd.grad(lc, (xs, ws))
    assert len(fused_calls) == 2
    assert lc.dtype == torch.float32 and gc[0].dtype == torch.float32
    torch.testing.assert_close(lc, le)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the planner


def test_cost_model_prices_the_fused_forward():
    """The fused forward holds no fp32 logit chunks: the recompute plan's memory is its
    backward's (dz chunk + fp32 dx), one candidate, and a faster predicted forward than
    the chunked one at the anchors; the choice still never slows down as the budget grows."""
    for n, hs, ht, v, faster in [(4096, 4096, 8192, 128256, False), (4096, 2048, 2048, 151936, True),
                                 (512, 896, 3584, 151936, True)]:
        fused = jsd_cost_model.jsd_candidates(n, hs, ht, v, 2, device_model=cost_model.H100, grad_in_forward=False,
                                          fused_forward=True)
        plain = jsd_cost_model.jsd_candidates(n, hs, ht, v, 2, device_model=cost_model.H100, grad_in_forward=False)
        at_256 = min((c for c in plain if c.memory <= 256 << 20), key=lambda c: c.time_s)
        assert len(fused) == 1 and fused[0].token_chunk == n
        assert fused[0].memory == 4 * n * hs + 2 * n * 4096 < at_256.memory
        # weight-read-bound forward chunks at small hidden sizes: the fused forward wins
        assert (fused[0].fwd_s < 0.85 * at_256.fwd_s) == faster
        last = None
        for mib in (64, 256, 1024, 4096, 16384):
            c = jsd_cost_model.choose_jsd(n, hs, ht, v, 2, mib << 20, device_model=cost_model.H100, fused_forward=True)
            assert last is None or c.time_s <= last + 1e-12
            last = c.time_s


def test_strategy_sees_the_fused_forward(monkeypatch):
    seen = []
    real = jsd_cost_model.choose_jsd

    def spy(*args, **kwargs):
        seen.append(kwargs.get("fused_forward"))
        return real(*args, **kwargs)

    monkeypatch.setattr(jsd_cost_model, "choose_jsd", spy)

    def plan(beta):  # (the Triton backend's plan, not memoised: the strategy is priced each time)
        triton_backend.plan.uncached(8, 64, 16, 16, torch.bfloat16, 1 << 20, torch.device("cpu"),
                                     kl=beta in (0.0, 1.0), grad_in_forward=True)

    with override(jsd_fused_forward=True):
        plan(1.0)
        plan(0.5)
    with override(jsd_fused_forward=False):
        plan(1.0)
    assert seen == [True, False, False]


def test_forcing_the_fused_forward_rules_out_keep():
    """The "keep" strategy runs the chunked forward (it writes the kept dz), so a forced fused
    forward takes it off the table; unforced, an H100 keeps every column of this call (which
    then runs the chunked forward: the GPU test above failed before this rule)."""
    args = (300, 32003, 256, 384, torch.bfloat16, 1 << 30, torch.device("cpu"))
    with on_device(H100):
        with override(jsd_fused_forward=True):
            forced = triton_backend.plan.uncached(*args, kl=True, grad_in_forward=False, keep=True)
        free = triton_backend.plan.uncached(*args, kl=True, grad_in_forward=False, keep=True)
    assert forced.fused and forced.keep_cols == 0
    assert not free.fused and free.keep_cols > 0
