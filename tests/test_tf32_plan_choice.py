"""fp32 at matmul precision "high": the planner chooses between operands rounded to TF32
beforehand (scratch buffers, ``TritonPlan.w_chunk > 0``) and rounded in the kernels'
registers (``w_chunk == 0``) with the cost model (``plans.tf32_choice``,
``cost_model.predict_tf32``), per shape and budget (issue 23 item 2).

Checked without a GPU, on the planner as it sees an H100 (132 SMs, the H100
``DeviceModel``, the shipped tile tables): the choice at the precision suite's shapes
(in-kernel where the pre-rounded plan's scratch costs kept columns at 2048 x 2048 x 32000,
pre-rounded at 4096 x 4096 x 128256), forward and backward of one call taking the same
path, the choice being the cheaper prediction, the fitted constants reproducing the H100
measurements they were fitted to, ``override(tf32_preround=...)`` still forcing a path,
memoised plans keyed by it, and the tuner's pre-rounded tiles under a key of their own.
Correctness of both paths vs float64 and bitwise equality between them:
tests/test_tf32_prerounded.py and tests/test_precision.py (both paths forced there).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import logitless
from logitless import tune as tuner
from logitless.options import DEFAULT_MEMORY_BUDGET
from logitless.planning import cost_model as _cost_model
from logitless.planning import plans as _plans
from logitless.planning import tiles as _tiles
from logitless.planning import tuned as _tuned
from logitless.planning.overrides import override
from logitless.triton_lib import launch
from tests.planning_seams import H100
from tests.test_precision import _inputs, matmul_precision

_GPU = H100  # an H100 as the planner sees one (tests.planning_seams)
#: The precision suite's shapes (tokens, hidden, vocab) and their TF32 GEMM on the H100.
SUITE = {"2048x2048x32000": (2048, 2048, 32000, 0.721), "4096x2048x128256": (4096, 2048, 128256, 5.988),
         "llama3.1-8b": (4096, 4096, 128256, 11.66)}
#: Measured on the H100, 2026-11-23 (ms; precision-issue23-H100-2026-11-23.md and
#: probe-tf32-H100-2026-11-23.log, in git history): (shape, budget MiB, pre-rounded?, with backward?).
MEASURED = {
    ("2048x2048x32000", 256, True, False): 1.319, ("2048x2048x32000", 256, True, True): 5.537,
    ("2048x2048x32000", 256, False, False): 1.666, ("2048x2048x32000", 256, False, True): 3.544,
    ("4096x2048x128256", 256, True, False): 6.700, ("4096x2048x128256", 256, True, True): 36.562,
    ("4096x2048x128256", 256, False, False): 12.693, ("4096x2048x128256", 256, False, True): 39.263,
    ("llama3.1-8b", 256, True, False): 12.761, ("llama3.1-8b", 256, True, True): 59.537,
    ("llama3.1-8b", 256, False, False): 25.118, ("llama3.1-8b", 256, False, True): 76.444,
    ("llama3.1-8b", 4096, True, False): 12.597, ("llama3.1-8b", 4096, True, True): 46.316,
    ("llama3.1-8b", 4096, False, False): 25.143, ("llama3.1-8b", 4096, False, True): 56.133,
}


@pytest.fixture
def h100(monkeypatch):
    """The planner as it sees an H100 (``_GPU``), with the shipped tile tables (no tuned cache)."""
    monkeypatch.setenv("LOGITLESS_TUNED", "0")


def _plan(n, v, h, budget, **kw):
    return _plans.triton_plan(n, v, h, 4, budget, _GPU, prerounded=True, **kw)


def test_choice_at_the_suite_shapes(h100):
    """Default budget: in-kernel for forward+backward at 2048 x 2048 x 32000 (the logits,
    262 MB, nearly fit the 256 MiB budget: the in-kernel plan keeps every column, the
    pre-rounded one gives ~10k of them to its scratch: measured 1.64x vs 2.56x three
    GEMMs), pre-rounded at 4096 x 4096 x 128256 and 4096 x 2048 x 128256 (measured 1.70x
    vs 2.19x, 2.04x vs 2.19x), and pre-rounded for every forward alone (1.09-1.83x vs
    2.12-2.31x one GEMM). The plan that runs is the chosen one."""
    budget = DEFAULT_MEMORY_BUDGET
    small = _plans.tf32_choice(2048, 32000, 2048, budget, _GPU, grad=True)
    assert not small.prerounded, (small.pre, small.in_kernel)
    assert small.in_kernel_plan.keep_cols == 32000 and small.pre_plan.keep_cols < 32000
    plan = _plan(2048, 32000, 2048, budget, keep_allowed=True)
    assert plan == small.in_kernel_plan and plan.w_chunk == 0
    assert (plan.block_n, plan.block_v, plan.block_h, plan.num_warps) == _tiles.CUDA_TILES[4][:4]
    for n, h, v in ((4096, 4096, 128256), (4096, 2048, 128256)):
        big = _plans.tf32_choice(n, v, h, budget, _GPU, grad=True)
        assert big.prerounded, (big.pre, big.in_kernel)
        plan = _plan(n, v, h, budget, keep_allowed=True)
        assert plan == big.pre_plan and plan.w_chunk > 0
    for n, h, v, _ in SUITE.values():
        fwd = _plans.tf32_choice(n, v, h, budget, _GPU, grad=False)
        assert fwd.prerounded, (n, h, v, fwd.pre, fwd.in_kernel)
        assert _plan(n, v, h, budget).w_chunk > 0


def test_choice_is_the_cheaper_prediction(h100):
    """On a grid of shapes and budgets: each path's price is ``predict_tf32`` of its own
    plan (the plans the two forced overrides give), and the choice is the cheaper one
    (ties: pre-rounded)."""
    for n, h, v in ((2048, 2048, 32000), (4096, 4096, 128256), (512, 4096, 151936), (8192, 1536, 50257),
                    (300, 64, 1000)):
        for budget in (16 << 20, 256 << 20, 1 << 30, 8 << 30):
            for grad in (False, True):
                c = _plans.tf32_choice(n, v, h, budget, _GPU, grad=grad)
                with override(tf32_preround=True):
                    assert _plan(n, v, h, budget, keep_allowed=grad) == c.pre_plan
                assert _plans.triton_plan(n, v, h, 4, budget, _GPU, keep_allowed=grad) == c.in_kernel_plan
                assert c.pre_plan.w_chunk > 0 and c.in_kernel_plan.w_chunk == 0
                for pre, plan, price in ((True, c.pre_plan, c.pre), (False, c.in_kernel_plan, c.in_kernel)):
                    want = _cost_model.predict_tf32(
                        _cost_model.H100, n, h, v, prerounded=pre, keep_cols=plan.keep_cols,
                        vocab_chunk=plan.vocab_chunk, w_chunk=plan.w_chunk, block_v=plan.block_v, grad=grad)
                    assert price == want
                    assert price.time_s > 0 and price.fwd_s <= price.time_s
                assert c.prerounded == (c.pre.time_s <= c.in_kernel.time_s)
                assert c.plan == (c.pre_plan if c.prerounded else c.in_kernel_plan)


@pytest.mark.parametrize("name", list(SUITE))
def test_choice_monotone_in_the_budget(h100, name):
    """Budgets from 16 MiB to 16 GiB: the chosen path's predicted time never rises by
    more than 2% as the budget grows (each path's plan keeps more columns), and the choice
    switches at most once, from in-kernel (small budgets: scratch costs kept columns and
    W is rounded in many chunks) to pre-rounded (large ones). Forward alone and with a
    backward."""
    n, h, v, _ = SUITE[name]
    for grad in (False, True):
        times, paths = [], []
        for k in range(24, 35):
            c = _plans.tf32_choice(n, v, h, 1 << k, _GPU, grad=grad)
            times.append(min(c.pre.time_s, c.in_kernel.time_s))
            paths.append(c.prerounded)
        assert all(b <= a * 1.02 for a, b in zip(times, times[1:])), (grad, times)
        switches = sum(a != b for a, b in zip(paths, paths[1:]))
        assert switches <= 1 and (switches == 0 or not paths[0]), (grad, paths)
        assert paths[-1], (grad, paths)  # the whole of W and every column fit: pre-rounded


def test_fitted_constants_reproduce_the_h100_measurements(h100):
    """The fp32 terms of the H100 DeviceModel (``tf32_*``, ``round_bw``) were fitted to
    these 16 measurements (3 shapes, 2 budgets, both paths, forward and forward+backward):
    every prediction within 15% of its measurement, and the measured winner of each
    pair predicted."""
    dev = _cost_model.H100
    pred = {}
    for (name, mib, pre, grad), ms in MEASURED.items():
        n, h, v, _ = SUITE[name]
        with override(tf32_preround=pre):  # as the backends call it (launch.tf32_prerounded)
            p = _plans.triton_plan(n, v, h, 4, mib << 20, _GPU, keep_allowed=grad, prerounded=pre)
        assert (p.w_chunk > 0) == pre
        c = _cost_model.predict_tf32(dev, n, h, v, prerounded=pre, keep_cols=p.keep_cols,
                                     vocab_chunk=p.vocab_chunk, w_chunk=p.w_chunk, block_v=p.block_v, grad=grad)
        pred[(name, mib, pre, grad)] = c.ms
        assert abs(math.log(c.ms / ms)) < math.log(1.15), (name, mib, pre, grad, c.ms, ms)
    for (name, mib, pre, grad), ms in MEASURED.items():
        if pre:
            other = MEASURED[(name, mib, False, grad)]
            assert (ms < other) == (pred[(name, mib, True, grad)] < pred[(name, mib, False, grad)]), (name, mib, grad)


@pytest.mark.parametrize("n,h,v", [(2048, 2048, 32000), (4096, 4096, 128256), (1, 64, 1000), (777, 1000, 50257)])
@pytest.mark.parametrize("budget", [1 << 20, 64 << 20, 256 << 20, 4 << 30])
def test_forward_and_backward_take_the_same_path(h100, n, h, v, budget):
    """A call's plan (``LinearPlan``) holds the forward's plan and the backward's for when
    no kept column is there (``keep_allowed=False, backward=True``): both must be on the
    same path, and the backward's plan keeps nothing itself (the backends' ``plan``
    returns this plan: the forward, the fake and the backward use it)."""

    fwd = _plan(n, v, h, budget, keep_allowed=True)
    bwd = _plan(n, v, h, budget, keep_allowed=False, backward=True)
    assert (fwd.w_chunk > 0) == (bwd.w_chunk > 0), (fwd, bwd)
    assert bwd.keep_cols == 0
    assert (fwd.w_chunk > 0) == _plans.tf32_choice(n, v, h, budget, _GPU, grad=True).prerounded
    p = _plans.linear_plan(n, v, h, 4, budget, _GPU, keep_allowed=True, prerounded=True)
    assert (p.forward, p.backward, p.keeps) == (fwd, bwd, fwd.keep_cols > 0)


def test_overrides_force_a_path_and_key_the_memo(h100):
    """``override(tf32_preround=True)`` forces the pre-rounded plan where the planner
    would take the in-kernel one (and ``False`` the reverse), also after the default plan
    was memoised (the memo is keyed by the override); a DeviceModel that makes the
    pre-rounded kernels slow flips the choice (keyed by the model too)."""
    gpu = _GPU

    def plan(n, v, h, budget, gpu=gpu, **kw):
        return _plans.triton_plan(n, v, h, 4, budget, gpu, prerounded=True, **kw)

    args = (2048, 32000, 2048, DEFAULT_MEMORY_BUDGET)
    first = plan(*args, keep_allowed=True)
    assert first.w_chunk == 0 and plan(*args, keep_allowed=True) is first  # chosen: in-kernel; memoised
    with override(tf32_preround=True):
        assert plan(*args, keep_allowed=True).w_chunk > 0
    assert plan(*args, keep_allowed=True) is first
    big = (4096, 128256, 4096, DEFAULT_MEMORY_BUDGET)
    assert plan(*big, keep_allowed=True).w_chunk > 0  # chosen: pre-rounded
    with override(tf32_preround=False), matmul_precision("high"):
        assert not launch.tf32_prerounded(torch.float32)  # the backends pass prerounded=False
        assert _plans.triton_plan(*big[:3], 4, big[3], gpu, keep_allowed=True).w_chunk == 0
    slow = dataclasses.replace(_cost_model.H100, tf32_fwd_prerounded=3.0, tf32_fwd_prerounded_narrow=3.0,
                               tf32_dlogits_prerounded=3.0)
    slow_gpu = dataclasses.replace(gpu, model=slow)
    assert plan(*big, gpu=slow_gpu, keep_allowed=True).w_chunk == 0
    assert not _plans.tf32_choice(*big, slow_gpu, grad=True).prerounded
    assert plan(*big, keep_allowed=True).w_chunk > 0
    with matmul_precision("high"):
        assert launch.tf32_prerounded(torch.float32)  # the default: the plan decides
        with override(tf32_preround=True):
            assert launch.tf32_prerounded(torch.float32)


def test_default_path_runs_and_matches_both_forced_paths():
    """On the interpreter (or a GPU), fp32 at "high" with the default choice gives the loss
    and gradients of both forced paths bitwise, whichever path the planner took (same
    tiles), at a budget where kept columns and recomputed chunks both occur."""
    x, w, t, _ = _inputs(37, 40, 131, torch.float32, seed=5)
    out = {}
    with matmul_precision("high"):
        for pre in (None, True, False):
            with override(tf32_preround=pre, tiles=_tiles.INTERPRETER_TILES):
                loss = logitless.linear_cross_entropy(x, w, t, backend="triton", memory_budget=60_000)
                out[pre] = (loss,) + torch.autograd.grad(loss, (x, w))
    for a, b in zip(out[None], out[True]):
        assert torch.equal(a, b)
    for a, b in zip(out[None], out[False]):
        assert torch.equal(a, b)


def test_tuned_tiles_keep_to_their_path(tmp_path, monkeypatch):
    """A tuned cache with "32-bit" tiles (in-kernel rounding / 3xTF32) and pre-rounded
    tiles under ``tuned.PREROUNDED_CLASS``: each path's plan takes its own entry, never
    the other's; forward-only pre-rounded plans keep the table's wide tiles (the tuner
    times forward+backward); the tuner at "high" times each path forced and writes it
    under its key, at "highest" only "32-bit"."""
    monkeypatch.setenv("LOGITLESS_CACHE_DIR", str(tmp_path))
    in_kernel, pre = (64, 128, 32, 4, 3), (128, 64, 32, 4, 4)
    assert _tuned.config_key(4, 4096, 4096, 128256, prerounded=True) == "32-bit-tf32-prerounded/n8k-hbig"
    assert _tuned.config_key(2, 4096, 4096, 128256, prerounded=True) == "16-bit/n8k-hbig"
    seen = []

    def measure(shape, tiles, dtype, device, reps, **forced):
        seen.append((tiles, forced.get("tf32_preround")))
        return 1.0 if tiles in (in_kernel, pre) else 2.0

    monkeypatch.setattr(tuner, "measure", measure)
    with matmul_precision("highest"):
        res = tuner.tune([(64, 40, 257)], dtypes=(torch.float32,), candidates=[in_kernel, pre], device="cpu",
                         verbose=False, write=False)
    assert list(res) == ["32-bit/n1k-h2k"] and {f for _, f in seen} == {None}
    seen.clear()
    with matmul_precision("high"):
        res = tuner.tune([(4096, 4096, 128256)], dtypes=(torch.float32,), device="cpu", verbose=False,
                         candidates=None, write=False)
    assert set(res) == {"32-bit-tf32-prerounded/n8k-hbig", "32-bit/n8k-hbig"}
    assert {t for t, f in seen if f is True} == set(tuner.CANDIDATES_PREROUNDED)
    assert {t for t, f in seen if f is False} == set(tuner.CANDIDATES[4])

    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"configs": {"32-bit/*": {"tiles": list(in_kernel)},
                                            "32-bit-tf32-prerounded/*": {"tiles": list(pre)}}}))
    monkeypatch.setattr(_tuned, "cache_path", lambda device: path)
    monkeypatch.delenv("LOGITLESS_TUNED", raising=False)
    _tuned.clear()
    try:
        assert _tuned.tiles_for(_GPU, 4, 4096, 4096, 128256) == in_kernel
        assert _tuned.tiles_for(_GPU, 4, 4096, 4096, 128256, prerounded=True) == pre
        for forced, keep, want in ((True, True, pre), (True, False, _tiles.CUDA_TILES_TF32[False]),
                                   (False, True, in_kernel), (False, False, in_kernel)):
            with override(tf32_preround=forced):
                p = _plans.triton_plan(4096, 128256, 4096, 4, DEFAULT_MEMORY_BUDGET, _GPU, keep_allowed=keep,
                                       prerounded=forced)
            assert (p.block_n, p.block_v, p.block_h, p.num_warps, p.num_stages) == want, (forced, keep, p)
        # the planner's choice prices each path with its own tiles
        c = _plans.tf32_choice(4096, 128256, 4096, DEFAULT_MEMORY_BUDGET, _GPU, grad=True)
        assert c.pre_plan.block_v == pre[1] and c.in_kernel_plan.block_v == in_kernel[1]
    finally:
        _tuned.clear()
