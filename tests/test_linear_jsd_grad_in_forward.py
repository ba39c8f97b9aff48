"""linear_jsd's gradient-in-forward strategy (issue 23), forced with
``override(strategy=("grad_in_forward", tokens))``, against float64; and the cost model
that picks it.

Runs on the GPU when there is one; otherwise the Triton backend runs on the CPU
interpreter (conftest.py), at small sizes.
"""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless.ops.linear_jsd import cost_model as jsd_cost_model
from logitless.ops.linear_jsd.api import BACKENDS
from logitless.ops.linear_jsd.reference import linear_jsd_reference
from logitless.planning import cost_model
from logitless.planning.overrides import override
from tests.helpers import assert_close_to_ref
from tests.planning_seams import H100
from tests.test_linear_jsd import OPTIONS, check, make_inputs


@pytest.fixture
def calls(monkeypatch):
    """Counts the strategy's forwards, so a test knows it ran (and how many chunks)."""
    seen = []
    triton = BACKENDS["triton"]  # (the strategy as the op's table gives it to the Triton backend)
    real = triton.grad_in_forward

    def spy(*args, **kw):
        seen.append(kw["config"].grad_in_forward)
        return real(*args, **kw)

    monkeypatch.setattr(triton, "grad_in_forward", spy)
    return seen


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("option", ["plain", "ignore", "bias", "softcaps", "hard", "shift", "no-target", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_float64(calls, beta, option, reduction):
    """Every option alone and combined, each divergence mode, both reductions; 3 chunks of
    a (3, 7) input (the last one ragged) with a temperature."""
    opts = dict(OPTIONS[option], beta=beta, temperature=1.7)
    seed = int(beta * 10) * 100 + list(OPTIONS).index(option)
    with override(strategy=("grad_in_forward", 8)):
        check("triton", torch.bfloat16, (3, 7), 24, 40, 101, opts, reduction, seed=seed)
    assert calls == [8]


@pytest.mark.parametrize("chunk", [1, 5, 21, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunkings_and_dtypes(calls, chunk, dtype):
    """One token per chunk, ragged chunks, one chunk for every token (dW in the weight's
    dtype directly), more than every token; fp32 weights accumulate into dW itself."""
    with override(strategy=("grad_in_forward", chunk)):
        check("triton", dtype, (21,), 19, 16, 67, dict(OPTIONS["all"], beta=0.3), "mean", seed=chunk)
    assert calls == [min(chunk, 21)]


def test_one_token_and_3d(calls):
    with override(strategy=("grad_in_forward", 4)):
        check("triton", torch.float16, (1,), 24, 24, 101, OPTIONS["hard"], "mean", seed=1)
        check("triton", torch.bfloat16, (2, 3, 5), 24, 32, 53, OPTIONS["ignore"], "sum", seed=2)
    assert len(calls) == 2


def test_grad_output_scales_and_frozen_weight(calls):
    """grad_output != 1 scales the forward's gradients; a frozen student weight gets none
    (and costs no dW)."""
    xs, ws, xt, wt, target, kw = make_inputs((9,), 16, 24, 41, torch.bfloat16, OPTIONS["bias"], seed=4)
    with override(strategy=("grad_in_forward", 4)):
        loss = logitless.linear_jsd(xs, ws, xt, wt, target, backend="triton", **kw)
    ref = linear_jsd_reference(xs, ws, xt, wt, target, **kw)
    same = linear_jsd_reference(xs, ws, xt, wt, target, dtype=torch.bfloat16, **kw)
    inputs = [xs, ws, kw["student_bias"]]
    ours = torch.autograd.grad(loss * -3.25, inputs)
    refs = torch.autograd.grad(ref * -3.25, inputs)
    sames = torch.autograd.grad(same * -3.25, inputs)
    for name, o, r, s in zip(["dx", "dW", "db"], ours, refs, sames):
        assert_close_to_ref(name, o, s, r, torch.bfloat16)
    ws.requires_grad_(False)
    with override(strategy=("grad_in_forward", 4)):
        loss = logitless.linear_jsd(xs, ws, xt, wt, target, backend="triton", **kw)
    (dx,) = torch.autograd.grad(loss, [xs])
    assert torch.isfinite(dx.float()).all()
    assert len(calls) == 2


def test_bitwise_repeatable(calls):
    xs, ws, xt, wt, target, kw = make_inputs((13,), 16, 24, 41, torch.bfloat16, OPTIONS["all"], seed=5)
    outs = []
    for _ in range(2):
        with override(strategy=("grad_in_forward", 4)):
            loss = logitless.linear_jsd(xs, ws, xt, wt, target, backend="triton", **kw)
        outs.append((loss, *torch.autograd.grad(loss, [xs, ws])))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_not_used_where_it_cannot_be(calls):
    """reduction="none" (per-token upstream unknown), no gradient, empty inputs and the
    torch backend keep the two-pass design; all still match float64."""
    with override(strategy=("grad_in_forward", 4)):
        check("triton", torch.bfloat16, (6,), 16, 24, 41, OPTIONS["plain"], "none", seed=6)
        check("torch", torch.float32, (6,), 16, 24, 41, OPTIONS["plain"], "mean", seed=7)
        xs, ws, xt, wt, target, kw = make_inputs((0,), 16, 24, 41, torch.bfloat16, {}, seed=8)
        loss = logitless.linear_jsd(xs, ws, xt, wt, target, backend="triton", reduction="sum")
        assert loss.item() == 0 and torch.equal(torch.autograd.grad(loss, [ws])[0], torch.zeros_like(ws))
        with torch.no_grad():
            xs, ws, xt, wt, target, kw = make_inputs((6,), 16, 24, 41, torch.bfloat16, {}, seed=9)
            logitless.linear_jsd(xs, ws, xt, wt, target, backend="triton")
    assert calls == []


def test_all_ignored_mean_is_nan_with_zero_grads(calls):
    xs, ws, xt, wt, target, kw = make_inputs((5,), 16, 24, 41, torch.bfloat16, {}, seed=10)
    target = torch.full_like(target, -100)
    with override(strategy=("grad_in_forward", 2)):
        loss = logitless.linear_jsd(xs, ws, xt, wt, target, backend="triton")
    dx, dw = torch.autograd.grad(loss, [xs, ws])
    assert torch.isnan(loss) and not dx.any() and not dw.any()
    assert calls == [2]


# ----------------------------------------------------------------- the cost model

SHAPES = [(4096, 4096, 8192, 128256), (4096, 2048, 2048, 151936), (512, 896, 1536, 151936), (16384, 4096, 4096, 128256)]


@pytest.mark.parametrize("n,hs,ht,v", SHAPES)
@pytest.mark.parametrize("dev", [cost_model.H100, cost_model.H200])
def test_predicted_time_never_rises_with_the_budget(n, hs, ht, v, dev):
    last = None
    for mib in [16, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 16384, 65536]:
        c = jsd_cost_model.choose_jsd(n, hs, ht, v, 2, mib << 20, device_model=dev)
        assert last is None or c.time_s <= last.time_s + 1e-12, (mib, c, last)
        assert c.memory <= max(mib << 20, min(x.memory for x in jsd_cost_model.jsd_candidates(
            n, hs, ht, v, 2, device_model=dev)))
        last = c


def test_grad_in_forward_only_with_memory_for_it():
    """At 256 MiB the fp32 dW accumulator alone does not fit: recompute. With several GB
    the strategy wins (4 GEMMs instead of 6); fp32 weights need no accumulator."""
    small = jsd_cost_model.choose_jsd(4096, 4096, 8192, 128256, 2, 256 << 20, device_model=cost_model.H100)
    large = jsd_cost_model.choose_jsd(4096, 4096, 8192, 128256, 2, 8 << 30, device_model=cost_model.H100)
    assert small.strategy == "recompute" and large.strategy == "grad_in_forward"
    assert large.time_s < 0.75 * small.time_s
    fp32 = jsd_cost_model.choose_jsd(4096, 2048, 2048, 151936, 4, 2 << 30, device_model=cost_model.H100,
                                 weight_fp32=True)
    assert fp32.strategy == "grad_in_forward" and fp32.memory <= 2 << 30


def test_grad_in_forward_budgets_the_accumulator_beyond_the_dw_it_becomes():
    """The fp32 dW accumulator becomes the returned dW: the plan's memory (peak beyond the
    inputs and the returned gradients, as every plan's) counts (4 - itemsize) V H_s of it
    beside the chunk's buffers, and at least all of it (the backward's cast). At 16k
    tokens of llama 8B <- 70B an H100's default budget (3%) then holds chunks of 1024
    tokens: 4 GEMMs, predicted well under the keep plan that fits (measured on an H100:
    158.8 ms against 194.9; docs/design.md, linear_jsd strategies)."""
    n, hs, ht, v = 16384, 4096, 8192, 128256
    c = jsd_cost_model.predict_jsd_grad_in_forward(cost_model.H100, n, hs, ht, v, 2, 1024)
    assert c.memory == 10 * 1024 * v + 2 * v * hs
    one = jsd_cost_model.predict_jsd_grad_in_forward(cost_model.H100, 1024, hs, ht, v, 2, 1024)
    assert one.memory == 10 * 1024 * v  # one chunk: dW written once, no accumulator
    small = jsd_cost_model.predict_jsd_grad_in_forward(cost_model.H100, n, hs, ht, v, 2, 16)
    assert small.memory == 4 * v * hs  # the cast: the whole accumulator beside dW
    default = int(0.03 * 79.1 * (1 << 30))
    pick = jsd_cost_model.choose_jsd(n, hs, ht, v, 2, default, device_model=cost_model.H100, keep=True)
    keep = jsd_cost_model.choose_jsd(n, hs, ht, v, 2, default, device_model=cost_model.H100, keep=True,
                                     grad_in_forward=False)
    assert (pick.strategy, pick.token_chunk) == ("grad_in_forward", 1024) and pick.memory <= default
    assert keep.strategy == "keep" and pick.time_s < 0.85 * keep.time_s


def test_default_plan_forward_rows_match_the_budget():
    """The recompute plan the model picks at 256 MiB takes the forward chunk the
    backend uses (budget / 8 V rows, multiples of 8: 216 rows, 19 chunks of 4096 tokens;
    multiples of 16 took 208 rows, 20 chunks)."""
    from logitless.ops.linear_jsd.planning import linear_jsd_plan

    c = jsd_cost_model.choose_jsd(4096, 2048, 2048, 151936, 2, 256 << 20, device_model=cost_model.H100)
    plan = linear_jsd_plan(4096, 151936, 2048, 2, 256 << 20, H100)
    assert c.token_chunk == plan.forward_rows == 216


@pytest.mark.parametrize("allowed", [True, False])
def test_a_strategy_of_the_forward_op(calls, allowed):
    """The strategy is one of the forward custom op's: its bool argument allows it, the
    planner picks it (forced here); the gradient outputs are there only then, the fake
    gives their exact shapes (opcheck) and the backward scales them. Not allowed: empty
    gradient outputs and the usual backward, with the same loss."""
    from logitless.ops.common.contract import Needs
    from logitless.ops.linear_jsd.api import OPS
    from logitless.ops.linear_jsd.contract import LjsdCall
    from logitless.options import JSDOptions, VocabParallelOptions

    xs, ws, xt, wt, t, kw = make_inputs((9,), 16, 12, 37, torch.float32, {"_bias": True}, seed=4)
    bs, bt = kw["student_bias"], kw["teacher_bias"]
    call = LjsdCall(xs, ws, bs, xt, wt, bt, t, JSDOptions(), "sum", 1 << 20, "triton", grad_in_forward=allowed,
                    need=Needs(True, True, True), tp=VocabParallelOptions())
    with override(strategy=("grad_in_forward", 4)):
        torch.library.opcheck(OPS.forward_op, OPS.args(call),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        out = OPS.outputs_of(OPS.forward_op(*OPS.args(call)))
    loss, gx, gw, gb = out.loss, out.gx, out.gw, out.gb
    assert (gx.shape, gw.shape, gb.shape) == ((xs.shape, ws.shape, bs.shape) if allowed else ((0,),) * 3)
    assert bool(calls) == allowed and set(calls) <= {4}
    grads = torch.autograd.grad(loss * 0.5, (xs, ws, bs))
    ref = logitless.linear_jsd(xs, ws, xt, wt, t, student_bias=bs, teacher_bias=bt, reduction="sum",
                               backend="triton")
    torch.testing.assert_close(loss, ref)
    for a, e in zip(grads, torch.autograd.grad(ref * 0.5, (xs, ws, bs))):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch", "helion"])
def test_allowed_only_for_a_backend_that_has_it(monkeypatch, backend):
    """The public function allows the strategy (``LjsdCall.grad_in_forward``) for a backend
    whose ``grad_in_forward`` capability is set (the Triton backend's strategy), never for
    one without (torch, Helion), asked after the backend is resolved (the call it builds
    is recorded, not run)."""
    from logitless.ops.linear_jsd import api

    class Built(Exception):
        pass

    def recording(call):
        raise Built(call)

    monkeypatch.setattr(api, "OPS", recording)
    xs, ws, xt, wt, target, kw = make_inputs((6,), 16, 24, 41, torch.float32, {}, seed=3)
    with pytest.raises(Built) as built:
        logitless.linear_jsd(xs, ws, xt, wt, target, backend=backend)
    call = built.value.args[0]
    assert (call.backend, call.grad_in_forward) == (backend, backend == "triton")
    assert (BACKENDS[backend].grad_in_forward is not None) == (backend == "triton")
