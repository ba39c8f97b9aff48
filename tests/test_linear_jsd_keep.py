"""linear_jsd's "keep" strategy: the forward's chunks also write dz of the first columns
(every token, in x's dtype), the backward scales them by grad_output and runs their GEMMs,
recomputing only the other columns. Forced with ``override(strategy=("keep", tokens))``
(the kept columns then the budget's), against float64; and the cost model that picks it.

Runs on the GPU when there is one; otherwise the Triton backend runs on the CPU
interpreter (conftest.py), at small sizes.
"""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless.ops.linear_jsd import cost_model as jsd_cost_model
from logitless.ops.linear_jsd.api import BACKENDS
from logitless.ops.linear_jsd.planning import forced_keep_columns
from logitless.planning import cost_model
from logitless.planning.overrides import override
from tests.test_linear_jsd import OPTIONS, check, make_inputs


@pytest.fixture
def kept(monkeypatch):
    """The kept columns of each forward of the Triton backend, so a test knows the strategy ran."""
    seen = []
    triton = BACKENDS["triton"]
    real = triton.forward

    def spy(*args, **kw):
        out = real(*args, **kw)
        seen.append(args[8].keep_cols if out.kept is not None else 0)  # (args[8]: the Config)
        return out

    monkeypatch.setattr(triton, "forward", spy)
    return seen


def _budget(n, v, rows, keep_cols, itemsize):
    """The budget whose forced keep plan keeps ``keep_cols`` columns beside chunks of ``rows``."""
    return 8 * rows * v + itemsize * n * keep_cols


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("option", ["plain", "ignore", "bias", "softcaps", "hard", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_column_kept_matches_float64(kept, beta, option, reduction):
    """Every column kept (dx, dW from the kept dz alone), chunks of 8 of 21 tokens (the
    last ragged), each divergence mode, options alone and combined, a temperature."""
    opts = dict(OPTIONS[option], beta=beta, temperature=1.7)
    with override(strategy=("keep", 8)):
        check("triton", torch.bfloat16, (3, 7), 24, 40, 101, opts, reduction, seed=int(beta * 10) + 7)
    assert kept == [101]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep_cols", [8, 40, 96])
def test_partial_keep_matches_float64(kept, dtype, keep_cols):
    """Part of a prime vocabulary kept (whole multiples of 8), the rest recomputed in
    chunks by the fused dz kernel into the same dx accumulator and dW rows."""
    n, v = 21, 101
    budget = _budget(n, v, 5, keep_cols, dtype.itemsize)
    assert forced_keep_columns(n, v, dtype.itemsize, budget, 5) == keep_cols
    with override(strategy=("keep", 5)):
        check("triton", dtype, (n,), 19, 16, v, dict(OPTIONS["all"], beta=0.3), "mean", seed=keep_cols,
              budget=budget)
    assert kept == [keep_cols]


def test_no_room_to_keep_recomputes(kept):
    """A budget that holds only the forward's chunk keeps nothing: the recompute plan."""
    with override(strategy=("keep", 5)):
        check("triton", torch.bfloat16, (21,), 19, 16, 67, dict(OPTIONS["all"], beta=0.5), "sum", seed=3,
              budget=_budget(21, 67, 5, 7, 2))
    assert kept == [0]


def test_grad_output_and_a_second_backward(kept):
    """The kept dz is for grad_output = 1: the backward scales it (here by 0.37). A second
    backward (retain_graph=True) finds the columns spent and recomputes every column."""
    xs, ws, xt, wt, t, kw = make_inputs((17,), 12, 20, 53, torch.float32, dict(OPTIONS["all"], beta=0.5), seed=5)
    with override(strategy=("keep", 4)):
        loss = logitless.linear_jsd(xs, ws, xt, wt, t, backend="triton", **kw)
    assert kept == [53]
    first = torch.autograd.grad(loss * 0.37, (xs, ws, kw["student_bias"]), retain_graph=True)
    second = torch.autograd.grad(loss * 0.37, (xs, ws, kw["student_bias"]))
    ref = logitless.linear_jsd(xs, ws, xt, wt, t, backend="torch", **kw)
    for a, b, e in zip(first, second, torch.autograd.grad(ref * 0.37, (xs, ws, kw["student_bias"]))):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(b, e, rtol=1e-4, atol=1e-6)


def test_only_with_a_reduced_loss_and_a_backward(kept):
    """reduction="none" or no gradient wanted: the forward keeps nothing."""
    xs, ws, xt, wt, t, kw = make_inputs((9,), 8, 8, 31, torch.float32, {}, seed=2)
    with override(strategy=("keep", 4)):
        loss = logitless.linear_jsd(xs, ws, xt, wt, t, backend="triton", reduction="none")
        loss.sum().backward()
        with torch.no_grad():
            logitless.linear_jsd(xs, ws, xt, wt, t, backend="triton")
    assert kept == [0, 0]


def test_a_strategy_of_the_forward_op(kept):
    """The forward custom op's ``keep`` argument allows the strategy (compiled too: not
    only eager as gradient-in-forward); the fake gives the kept buffer's exact shape (rows
    padded to 8 elements; opcheck), the backward op uses it."""
    from logitless.ops.common.contract import Needs
    from logitless.ops.linear_jsd.api import OPS
    from logitless.ops.linear_jsd.contract import LjsdCall
    from logitless.options import JSDOptions, VocabParallelOptions

    xs, ws, xt, wt, t, kw = make_inputs((9,), 16, 12, 37, torch.float32, {"_bias": True}, seed=4)
    bs, bt = kw["student_bias"], kw["teacher_bias"]
    call = LjsdCall(xs, ws, bs, xt, wt, bt, t, JSDOptions(), "sum", 1 << 20, "triton", grad_in_forward=False,
                    need=Needs(True, True, True), tp=VocabParallelOptions(), keep=True)
    with override(strategy=("keep", 4)):
        torch.library.opcheck(OPS.forward_op, OPS.args(call),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        out = OPS.outputs_of(OPS.forward_op(*OPS.args(call)))
    assert out.keep.shape == (9, 40) and out.gx.shape == (0,)
    grads = torch.autograd.grad(out.loss * 0.5, (xs, ws, bs))
    ref = logitless.linear_jsd(xs, ws, xt, wt, t, student_bias=bs, teacher_bias=bt, reduction="sum",
                               backend="torch")
    for a, e in zip(grads, torch.autograd.grad(ref * 0.5, (xs, ws, bs))):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


def test_bitwise_repeatable(kept):
    xs, ws, xt, wt, t, kw = make_inputs((23,), 16, 24, 61, torch.bfloat16, dict(OPTIONS["all"], beta=0.5), seed=8)
    outs = []
    for _ in range(2):
        with override(strategy=("keep", 8)):
            loss = logitless.linear_jsd(xs, ws, xt, wt, t, backend="triton", memory_budget=_budget(23, 61, 8, 32, 2),
                                        **kw)
        outs.append((loss, *torch.autograd.grad(loss, (xs, ws, kw["student_bias"]))))
    assert kept == [32, 32]
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_the_cost_model_keeps_at_the_default_budget():
    """llama 8B <- 70B and same-size heads at 4096 tokens, an H100's default budget (3%:
    2.4 GiB): every column kept (4 GEMMs), predicted well under the recompute plan and
    the gradient-in-forward one; at 1 GiB part of the columns, at 128 MiB none (the
    forward's chunks would be too few rows: each one reads both weights)."""
    default = int(0.03 * 79.1 * (1 << 30))
    for hs, ht, v in [(4096, 8192, 128256), (2048, 2048, 151936)]:
        recompute = jsd_cost_model.choose_jsd(4096, hs, ht, v, 2, default, device_model=cost_model.H100,
                                              grad_in_forward=False)
        without = jsd_cost_model.choose_jsd(4096, hs, ht, v, 2, default, device_model=cost_model.H100)
        c = jsd_cost_model.choose_jsd(4096, hs, ht, v, 2, default, device_model=cost_model.H100, keep=True)
        assert c.strategy == "keep" and c.keep_cols == v and c.memory <= default
        assert recompute.strategy == "recompute" and c.time_s < 0.8 * recompute.time_s
        assert c.time_s < without.time_s
    part = jsd_cost_model.choose_jsd(4096, 4096, 8192, 128256, 2, 1 << 30, device_model=cost_model.H100, keep=True)
    assert part.strategy == "keep" and 0 < part.keep_cols < 128256 and part.memory <= 1 << 30
    assert jsd_cost_model.choose_jsd(4096, 4096, 8192, 128256, 2, 128 << 20, device_model=cost_model.H100,
                                     keep=True).strategy == "recompute"


def test_the_choice_never_slower_with_more_budget():
    last = None
    for mib in [32, 64, 128, 256, 512, 1024, 2048, 4096]:
        c = jsd_cost_model.choose_jsd(4096, 4096, 8192, 128256, 2, mib << 20, device_model=cost_model.H100,
                                      keep=True)
        assert last is None or c.time_s <= last.time_s
        last = c


def test_odd_vocabulary_keeps_whole_tiles():
    """cuBLAS' slow odd-K path: a vocabulary not a multiple of 8 never keeps every column."""
    assert all(k % 128 == 0 for k in jsd_cost_model.keep_column_counts(50257, 8))
    assert jsd_cost_model.keep_column_counts(128256, 8)[-1] == 128256
