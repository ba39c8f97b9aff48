"""The cost-model planner (``_cost_model``, ``_plans.lce_strategy``) and the
gradient-in-forward strategy of the Triton backend.

The model is checked as a model (monotone in the budget on every suite shape, within
reach of the recorded H100 measurements, deterministic); each strategy is checked
against the float64 reference (Triton interpreter on the CPU, small shapes).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import logitless
from logitless.options import DEFAULT_MEMORY_BUDGET
from logitless.planning import cost_model as M
from logitless.planning import plans as _plans
from logitless.planning.overrides import override
from logitless_bench.shapes import MODEL_SHAPES, RL_SHAPES, SHAPES, TOPK_SHAPES
from tests.conftest import DEVICE
from tests.planning_seams import H100
from tests.test_linear_cross_entropy import OPTIONS, check_against_reference, make_inputs

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "latest-lce-H100.json"
BUDGETS = [2**e for e in range(16, 37)] + [3 * 2**e for e in range(20, 34)]


# --------------------------------------------------------------------------- the model


@pytest.mark.parametrize("dev", [M.H100, M.H200], ids=lambda d: d.name)
def test_never_slower_when_the_budget_grows(dev):
    """Predicted time is non-increasing in the budget, for every suite shape, dtype and
    weight kind; the chosen plan fits the budget (or is the documented minimum)."""
    for s in MODEL_SHAPES:
        n, h, v = s.tokens, s.hidden, s.vocab
        for itemsize, wf in ((2, False), (4, False), (4, True)):
            logits = n * v * itemsize
            floor = M.minimum(n, h, v, itemsize, device_model=dev)
            prev = math.inf
            for b in sorted(BUDGETS + [logits, logits - 1, floor.memory]):
                c = M.choose(n, h, v, itemsize, b, device_model=dev, weight_fp32=wf)
                assert c.time_s <= prev * (1 + 1e-12), (s.name, itemsize, wf, b, c.label)
                assert c.memory <= max(b, floor.memory), (s.name, b, c.label, c.memory)
                prev = c.time_s
            # never slower than the default budget's plan once the budget is larger
            default = M.choose(n, h, v, itemsize, DEFAULT_MEMORY_BUDGET, device_model=dev, weight_fp32=wf)
            assert M.choose(n, h, v, itemsize, logits, device_model=dev, weight_fp32=wf).time_s <= default.time_s


def test_logits_budget_keeps_everything_when_keeping_pays():
    """At a budget of the logits' size the 3-GEMM plans (keep, or gradient-in-forward in
    one chunk) are affordable: the planner's time is at most the keep plan's."""
    for s in MODEL_SHAPES:
        n, h, v = s.tokens, s.hidden, s.vocab
        keep = M.predict_keep(M.H100, n, h, v, 2)
        assert keep.memory == n * v * 2
        assert M.choose(n, h, v, 2, n * v * 2).time_s <= keep.time_s


def test_partial_memory_lays_the_recomputed_dz_in_owned_kept_columns():
    """A partial plan's memory: kept columns + the fp32 dx accumulator + one dz chunk, except
    where the backward owns the kept columns and the chunk fits in them (``launch.dz_buffer``
    lays it there once their dz is spent). At an H200's default budget, RL at 16384 x 3584 x
    152064 then keeps more columns and is predicted faster; through the custom ops nothing
    changes."""
    n, h, v = 16384, 3584, 152064
    acc = 4 * n * h
    big = M.predict_partial(M.H200, n, h, v, 2, 130560, 16384, 256, kept_owned=True)
    assert big.memory == n * 130560 * 2 + acc
    assert M.predict_partial(M.H200, n, h, v, 2, 130560, 16384, 256).memory == big.memory + n * 16384 * 2
    few = M.predict_partial(M.H200, n, h, v, 2, 8192, 16384, 256, kept_owned=True)  # the chunk is wider
    assert few.memory == n * 8192 * 2 + acc + n * 16384 * 2
    budget = int(0.03 * 140.4 * 2**30)
    owned = M.choose(n, h, v, 2, budget, device_model=M.H200, grad_in_forward=False)
    custom = M.choose(n, h, v, 2, budget, device_model=M.H200, grad_in_forward=False, kept_owned=False)
    assert owned.memory <= budget and custom.memory <= budget
    assert owned.keep_cols > custom.keep_cols and owned.time_s < custom.time_s, (owned, custom)
    # beside kept columns, the remainder in one chunk is a candidate where it is wider than the family's widths
    assert owned.vocab_chunk >= v - owned.keep_cols, owned


def test_grad_in_forward_memory_counts_the_fp32_accumulator():
    n, h, v = 8192, 4096, 128256
    one = M.predict_grad_in_forward(M.H100, n, h, v, 2, n)
    two = M.predict_grad_in_forward(M.H100, n, h, v, 2, n // 2)
    assert one.memory == n * v * 2  # one chunk: dW written once, no accumulator
    # the accumulator becomes the returned dW: 2 bytes an element beyond it beside the chunk
    assert two.memory == (n // 2) * v * 2 + 2 * v * h
    small = M.predict_grad_in_forward(M.H100, n, h, v, 2, n // 64)
    assert small.memory == 4 * v * h  # the backward's cast: all of it, dW beside it
    fp32w = M.predict_grad_in_forward(M.H100, n, h, v, 4, n // 2, weight_fp32=True)
    assert fp32w.memory == (n // 2) * v * 4  # dW itself is the fp32 accumulator
    # The accumulator does not fit the default budget at llama's shape: never chosen there.
    assert M.choose(n, h, v, 2, DEFAULT_MEMORY_BUDGET).strategy != "grad_in_forward"


def test_grad_in_forward_wins_somewhere():
    """The model gives the new strategy a place: large token counts with a budget
    between the accumulator and the logits (bf16), and fp32 weights."""
    c = M.choose(32768, 2048, 128256, 2, 2 * 2**30)
    assert c.strategy == "grad_in_forward" and c.token_chunk < 32768
    assert M.choose(4096, 4096, 128256, 4, 2**30, weight_fp32=True).strategy == "grad_in_forward"


def test_choice_is_deterministic_and_device_classed():
    a = _plans.lce_strategy(4096, 128256, 4096, 2, 2**28, torch.device("cpu"))
    b = _plans.lce_strategy(4096, 128256, 4096, 2, 2**28, torch.device("cpu"))
    assert a == b
    assert M.device_class("NVIDIA H100 80GB HBM3") == "H100"
    assert M.device_class("NVIDIA H200") == "H200"
    assert M.device_class("NVIDIA GH200 480GB") == "H200"
    assert M.device_class("NVIDIA A100-SXM4-80GB") == "default"
    # the interpreter never picks gradient-in-forward by itself (only when forced)
    assert _plans.lce_strategy(32768, 128256, 2048, 2, 2**31, torch.device("cpu")).strategy != "grad_in_forward"


@pytest.mark.skipif(not RESULTS.exists(), reason="no recorded H100 results in benchmarks/results")
def test_predictions_match_recorded_h100_measurements():
    """The anchors' recorded H100 times (default budget, forward and forward+backward)
    are within 20% of the model's prediction of the plan that ran."""
    data = json.loads(RESULTS.read_text())
    rows = {(r["shape"], r["method"]): r for r in data["rows"]}
    for s in SHAPES:
        r = rows.get((s.name, "logitless"))
        if r is None or r["status"] != "ok":
            continue
        c = M.choose(s.tokens, s.hidden, s.vocab, 2, DEFAULT_MEMORY_BUDGET, grad_in_forward=False)
        f = M.predict_forward(M.H100, s.tokens, s.hidden, s.vocab, 2)
        assert abs(c.ms / r["fwdbwd_ms"] - 1) < 0.2, (s.name, c.ms, r["fwdbwd_ms"])
        assert abs(f.ms / r["fwd_ms"] - 1) < 0.2, (s.name, f.ms, r["fwd_ms"])
        g = M.gemm_s(M.H100, s.tokens, s.vocab, s.hidden, 2) * 1e3
        assert abs(g / data["units"]["gemm_ms"][s.name] - 1) < 0.12, s.name


def test_model_columns_are_valid_plans():
    """What triton_plan takes from the model on GPUs: kept columns a multiple of block_v
    (or all), chunks a multiple of block_v, and memory within the budget's floor."""
    for s in MODEL_SHAPES:
        for budget in (2**26, 2**28, s.tokens * s.vocab * 2):
            keep, chunk = _plans._model_columns(s.tokens, s.vocab, s.hidden, 2, budget, M.H100, 256, 4096, True)
            assert keep == s.vocab or keep % 256 == 0
            assert chunk % 256 == 0 and chunk >= 256
            keep0, _ = _plans._model_columns(s.tokens, s.vocab, s.hidden, 2, budget, M.H100, 256, 4096, False)
            assert keep0 == 0


def test_each_device_runs_one_column_rule(monkeypatch):
    """One planning pass per device: the interpreter's facts take the greedy rule alone, a GPU
    model's the cost model's alone (never a greedy plan that the model then overwrites)."""
    from logitless.planning import device

    calls = []
    for name in ("_model_columns", "_greedy_columns"):
        real = getattr(_plans, name)
        monkeypatch.setattr(_plans, name, lambda *a, _name=name, _real=real: calls.append(_name) or _real(*a))
    for facts, rule in ((device.facts(torch.device("cpu")), "_greedy_columns"), (device.INTERPRETER, "_greedy_columns"),
                        (H100, "_model_columns"), (dataclasses.replace(H100, model=M.MI300X), "_model_columns")):
        for keep in (False, True):
            calls.clear()
            _plans.triton_plan.uncached(4096, 128256, 4096, 2, 256 << 20, facts, keep_allowed=keep)
            assert calls == [rule], (facts.model.name, keep, calls)
    assert device.facts(torch.device("cpu")) is device.INTERPRETER and not device.INTERPRETER.gpu and H100.gpu


# --------------------------------------------------------------------------- the strategies


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("token_chunk", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grad_in_forward_matches_reference(reduction, token_chunk, dtype, monkeypatch):
    """Every option at once; chunks of 1 token, uneven chunks, one chunk. ("none"
    cannot use the strategy: the forced planner is ignored and the default runs.)"""
    from logitless.ops.linear_cross_entropy.api import BACKENDS

    calls = []
    triton = BACKENDS["triton"]  # the strategy is the Triton backend's (given by the op's table)
    real = triton.grad_in_forward
    monkeypatch.setattr(triton, "grad_in_forward", lambda *a, **k: calls.append(k) or real(*a, **k))
    with override(strategy=("grad_in_forward", token_chunk)):
        check_against_reference("triton", dtype, (29,), 40, 257, OPTIONS["all"], reduction, seed=11)
    assert len(calls) == (0 if reduction == "none" else 1)


@pytest.mark.parametrize("requires_grad", [(True, False), (False, True)])
def test_grad_in_forward_partial_grads(requires_grad):
    with override(strategy=("grad_in_forward", 8)):
        check_against_reference("triton", torch.float32, (3, 7), 24, 101, OPTIONS["plain"], "mean", seed=3,
                                requires_grad=requires_grad)


def test_grad_in_forward_scales_by_grad_output_and_is_repeatable():
    x, w, t, b, kw = make_inputs((23,), 24, 101, torch.float32, OPTIONS["z_loss"], seed=5)
    outs = []
    for _ in range(2):
        with override(strategy=("grad_in_forward", 5)):
            loss = logitless.linear_cross_entropy(x, w, t, backend="triton", **kw)
        outs.append((loss,) + torch.autograd.grad(loss * -2.5, (x, w)))
    for a, c in zip(outs[0], outs[1]):
        assert torch.equal(a, c)  # same plan -> bitwise identical
    with override(strategy=("partial", 0)):
        loss = logitless.linear_cross_entropy(x, w, t, backend="triton", **kw)
    ref = torch.autograd.grad(loss * -2.5, (x, w))
    for a, c in zip(outs[0][1:], ref):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_grad_in_forward_not_for_fp16_softcap():
    """fp16 cannot keep exp(z - m) with a soft-cap: the strategy is refused there (the
    call's plan, ``triton_backend.plan``); nor is it used where the caller does not allow it."""
    from logitless.ops.linear_cross_entropy.triton_backend import plan
    from logitless.options import CrossEntropyOptions as LossOptions

    x = torch.zeros(4, 8, dtype=torch.float16, device=DEVICE)
    w = torch.zeros(16, 8, dtype=torch.float16, device=DEVICE)

    def chunk(x, w, opts, allowed=True, need_grad=True):
        return plan(x, w, None, None, opts, budget=2**20, need_grad=need_grad, need_argmax=False,
                    grad_in_forward=allowed).grad_in_forward

    with override(strategy=("grad_in_forward", 2)):
        assert chunk(x, w, LossOptions(softcap=5.0)) == 0
        assert chunk(x, w, LossOptions(reduction="none")) == 0
        assert chunk(x, w, LossOptions()) == 2
        assert chunk(x, w, LossOptions(), allowed=False) == 0
        assert chunk(x, w, LossOptions(), need_grad=False) == 0
        assert chunk(x.float(), w.float(), LossOptions(softcap=5.0)) == 2


def test_grad_in_forward_all_ignored_gives_zero_grads():
    """"mean" over no token: NaN loss, zero gradients (as torch), also when the
    gradient is finished in the forward."""
    x, w, t, b, kw = make_inputs((9,), 24, 101, torch.float32, OPTIONS["plain"], seed=1)
    t = torch.full_like(t, -100)
    with override(strategy=("grad_in_forward", 4)):
        loss = logitless.linear_cross_entropy(x, w, t, backend="triton")
    dx, dw = torch.autograd.grad(loss, (x, w))
    assert torch.isnan(loss)
    assert torch.equal(dx, torch.zeros_like(dx)) and torch.equal(dw, torch.zeros_like(dw))


def test_grad_in_forward_backward_twice():
    """retain_graph: the second backward recomputes (the forward's gradients were
    consumed by the first) and gives the same gradients."""
    x, w, t, b, kw = make_inputs((17,), 24, 101, torch.float32, OPTIONS["label_smoothing"], seed=4)
    with override(strategy=("grad_in_forward", 6)):
        loss = logitless.linear_cross_entropy(x, w, t, backend="triton", reduction="sum", **kw)
    first = torch.autograd.grad(loss * 0.5, (x, w), retain_graph=True)
    second = torch.autograd.grad(loss * 0.5, (x, w))
    for a, c in zip(first, second):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocab", [50257, 151665, 100003, 128256])
def test_gpu_plans_keep_whole_tiles_at_odd_vocab(vocab):
    """At an odd V, cuBLAS ran the kept columns' GEMMs 8x slower (gpt2 at a logits-sized
    budget: 41 ms against 5 ms on the H100): GPU plans keep whole tiles, recompute the
    ragged tail, and never compute the gradient in the forward."""
    from logitless.planning import plans as _plans
    from logitless.planning import tiles as _tiles

    gpu = H100  # an H100 as the planner sees it, without one: its SM count, cost model and tiles
    with override(tiles=_tiles.CUDA_TILES[2]):
        n, h = 8192, 768
        for budget in (256 * 2**20, n * vocab * 2 + 2**30, 8 * 2**30):
            plan = _plans.triton_plan(n, vocab, h, 2, budget, gpu, keep_allowed=True)
            if vocab % 8:
                assert plan.keep_cols < vocab and plan.keep_cols % plan.block_v == 0, plan
            else:
                assert plan.keep_cols % plan.block_v == 0 or plan.keep_cols == vocab, plan
            strategy = _plans.lce_strategy(n, vocab, h, 2, budget, gpu)
            if vocab % 8:
                assert strategy.strategy != "grad_in_forward", strategy


def test_forward_split_model_few_row_blocks():
    """The 16-bit forward's tiles per program (``tiles.forward_blocks_per_split``): with few
    row blocks the WAVES rule gave each program one vocabulary tile (512 x 4096 x 128256 on
    an H100: 2.24x a GEMM; 16 tiles per program 1.35x); the model gives more, and is never
    predicted slower than the WAVES rule it replaces."""
    from logitless.planning.tiles import PROGRAM_STEPS, forward_blocks_per_split

    def cost(rb, vb, k, per):
        splits = math.ceil(vb / per)
        return math.ceil(rb * splits / 132) * (math.ceil(vb / splits) * k + PROGRAM_STEPS)

    assert forward_blocks_per_split(4, 501, 64, 132, 1) >= 8
    for n in (1, 512, 1024, 2048, 4096, 8192, 16384, 65536):
        for h in (768, 1024, 4096, 8192):
            for v in (32000, 50257, 128256, 262144):
                rb, vb, k = math.ceil(n / 128), math.ceil(v / 256), math.ceil(h / 64)
                waves = math.ceil(vb / max(1, min(vb, math.ceil(16 * 132 / rb))))
                got = forward_blocks_per_split(rb, vb, k, 132, waves)
                assert 1 <= got <= vb
                assert cost(rb, vb, k, got) <= cost(rb, vb, k, waves)


_KEPT_SHAPES = {(s.tokens, s.hidden, s.vocab): s.name for s in (*MODEL_SHAPES, *RL_SHAPES, *TOPK_SHAPES)}


@pytest.mark.parametrize("shape", sorted(_KEPT_SHAPES), ids=lambda s: _KEPT_SHAPES[s])
def test_kept_dz_chunks_keep_a_compiled_backward_within_the_budget(shape):
    """A backward that cannot write dz over the kept columns (the custom ops, torch.compile)
    holds the kept columns and one dz chunk (``plan.kept_dz_chunk`` columns, or all of them
    when 0, and the recomputed chunk's) and, with several chunks, the fp32 dx accumulator:
    within an H100's default budget (+1%: the kept maxima the model does not charge) at every
    model, RL and top-k shape, and one chunk where the budget holds dz whole (e.g. 4096 x
    128256: as in place). Its plan (``kept_owned=False``) keeps at most the eager plan's
    columns: at 8192 x 151936 the eager plan keeps them all and this one fewer (there the
    chunks of every column sat at the chunk floor, 1.056x the budget), and where the eager
    plan recomputes some, its recomputed dz lives in the spent kept buffer and it keeps more.
    Before the chunks, dz took a second buffer of the kept columns' size: 1.65-1.76x the budget."""
    from logitless.triton_lib import launch

    n, h, v = shape
    budget = int(0.03 * 79.1 * 2**30)
    plan = _plans.triton_plan(n, v, h, 2, budget, H100, keep_allowed=True, kept_owned=False)
    owned = _plans.triton_plan(n, v, h, 2, budget, H100, keep_allowed=True)
    assert plan.keep_cols <= owned.keep_cols  # (owned: its recomputed chunks reuse the kept buffer)
    if not plan.keep_cols:
        return
    chunks = launch.backward_chunks(plan, v, plan.keep_cols, plan.kept_dz_chunk)
    width = max(b - a for a, b in chunks)
    kept = n * plan.keep_cols * 2 + 4 * n * plan.keep_cols // plan.block_v
    used = kept + 2 * n * width + (4 * n * h if len(chunks) > 1 else 0)
    assert used <= budget * 1.01, (plan, chunks[:3], used / budget)
    if kept + 2 * n * plan.keep_cols <= budget:
        assert plan.kept_dz_chunk == 0, plan
