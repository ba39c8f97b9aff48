"""The planner-regret probe (``benchmarks/probe_regret.py``) and the cost-model refit
(``benchmarks/fit_cost_model.py``): the candidates the probe times fit the budget and
start with the planner's choice; forcing a candidate runs exactly that plan and gives
the float64 reference's loss and gradients (keep, partial, gradient-in-forward, at odd
sizes); its buffers stay within the budget; the refit recovers known constants."""

import dataclasses
import importlib.util
import json
import math
import os
import sys

import pytest
import torch

import logitless
from logitless.ops.linear_cross_entropy.reference import linear_cross_entropy_reference
from logitless.planning import cost_model as cm
from logitless.planning import device
from logitless.planning import plans as _plans

from .conftest import DEVICE, HAS_CUDA
from .helpers import assert_close_to_ref
from .planning_seams import on_device

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")
ANCHORS = {
    "llama3.1-8b": (4096, 4096, 128256),
    "qwen3-8b": (4096, 4096, 151936),
    "gemma3-4b": (4096, 2560, 262144),
    "gpt-oss-120b": (4096, 2880, 201088),
    "deepseek-v3": (8192, 7168, 128256),
    "llama3.1-8b-16k": (16384, 4096, 128256),
    "llama3.2-1b": (4096, 2048, 128256),
    "gemma3-4b-8k": (8192, 2560, 262144),
}


def _load(name):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def probe():
    return _load("probe_regret")


@pytest.fixture(scope="module")
def fitter():
    return _load("fit_cost_model")


@pytest.mark.parametrize("shape", list(ANCHORS))
def test_selection_fits_the_budget_and_starts_with_the_choice(probe, shape):
    n, h, v = ANCHORS[shape]
    budget = 256 << 20
    sel = probe.select_candidates(n, h, v, 2, budget, device_model=cm.H100, block_v=256, min_chunk=4096,
                                  grad_in_forward=True)
    chosen = cm.choose(n, h, v, 2, budget, device_model=cm.H100, block_v=256, min_chunk=4096)
    floor = cm.minimum(n, h, v, 2, device_model=cm.H100, block_v=256, min_chunk=4096)
    limit = max(budget, floor.memory)
    assert sel[0][0] == chosen and sel[0][1] == "chosen"
    labels = [c.label for c, _, _ in sel]
    assert len(labels) == len(set(labels))
    fitting = [c for c, _, fits in sel if fits]
    over = [c for c, role, fits in sel if not fits]
    assert 1 <= len(fitting) <= 7
    assert all(c.memory <= limit for c in fitting)
    assert all(c.memory > limit for c in over) and len(over) <= 2
    assert not over or len(fitting) < 3
    # the choice is the fastest predicted of the shipped family's plans that fit
    family = {c.label for c in cm.candidates(n, h, v, 2, device_model=cm.H100)}
    assert all(chosen.time_s <= c.time_s for c in fitting if c.label in family)
    # and the wider chunks the probe adds are the family's with DeviceModel.wide_chunks = 2
    wide = {c.label for c in cm.candidates(n, h, v, 2, device_model=dataclasses.replace(cm.H100, wide_chunks=2))}
    assert {c.label for c in fitting + over} <= wide
    if len(fitting) >= 3:  # several chunk widths or kept-column counts are compared
        assert len({(c.keep_cols, c.vocab_chunk, c.strategy) for c in fitting}) == len(fitting)


#: (tokens, hidden, vocab, budget bytes): odd N, H not a multiple of 16, V prime; a
#: budget where keep and gradient-in-forward fit beside partial plans.
CASES = {
    "cpu": [(32, 16, 200, 16000), (37, 17, 211, 37 * 211 * 2 // 3)],
    "cuda": [(300, 136, 5000, 300 * 5000 * 2 // 2), (257, 100, 4099, 257 * 4099 * 2 + 8 * 4099 * 100)],
}


@pytest.mark.parametrize("case", range(2))
def test_forced_candidates_run_their_plan_and_match_float64(probe, case):
    """Every candidate the probe would time, forced: the plan the backend uses is the
    candidate's; loss and gradients against float64 (|ours - ref| <= |torch bf16 - ref|
    + tol); the plan's temporaries within its memory model (and, on a GPU, the measured
    peak within the budget the planner used)."""
    n, h, v, budget = CASES["cuda" if HAS_CUDA else "cpu"][case]
    pa = probe.planner_args(n, h, v, 2, DEVICE)
    sel = probe.select_candidates(n, h, v, 2, budget, device_model=cm.H100, **pa)
    strategies = {c.strategy for c, _, _ in sel}
    assert "partial" in strategies and len(sel) >= 3
    g = torch.Generator().manual_seed(100 + case)
    x64 = torch.randn(n, h, generator=g, dtype=torch.float64)
    w64 = torch.randn(v, h, generator=g, dtype=torch.float64) * h**-0.5 * 2
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    xr, wr = x64.clone().requires_grad_(True), w64.clone().requires_grad_(True)
    ref = linear_cross_entropy_reference(xr, wr, t, dtype=torch.float64)[0]
    ref_grads = torch.autograd.grad(ref, (xr, wr))
    xb, wb = x64.bfloat16().requires_grad_(True), w64.bfloat16().requires_grad_(True)
    same = linear_cross_entropy_reference(xb, wb, t, dtype=torch.bfloat16)[0]
    same_grads = torch.autograd.grad(same, (xb, wb))
    x = x64.bfloat16().to(DEVICE).requires_grad_(True)
    w = w64.bfloat16().to(DEVICE).requires_grad_(True)
    td = t.to(DEVICE)
    floor = cm.minimum(n, h, v, 2, device_model=cm.H100, block_v=pa["block_v"], min_chunk=pa["min_chunk"])
    for c, _role, fits in sel:
        kw = probe.force(c, v, pa["block_v"])
        if HAS_CUDA:  # once untracked: cuBLAS workspaces, Triton compiles
            with probe.forcing(kw):
                torch.autograd.grad(logitless.linear_cross_entropy(x, w, td, memory_budget=budget, backend="triton"),
                                    (x, w))
        with probe.forcing(kw):
            plan = _plans.triton_plan(n, v, h, 2, budget, DEVICE, keep_allowed=True)
            if HAS_CUDA:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            loss = logitless.linear_cross_entropy(x, w, td, memory_budget=budget, backend="triton")
            dx, dw = torch.autograd.grad(loss, (x, w))
        if c.strategy == "partial":
            assert (plan.keep_cols, plan.vocab_chunk) == (c.keep_cols, c.vocab_chunk), c.label
        elif c.strategy == "keep":
            assert plan.keep_cols == v, c.label
        else:
            assert _plans.lce_strategy(n, v, h, 2, budget, DEVICE) is not None
        assert_close_to_ref(f"{c.label} loss", loss.detach().cpu(), same.detach(), ref.detach(), torch.bfloat16)
        assert_close_to_ref(f"{c.label} dx", dx.cpu(), same_grads[0], ref_grads[0], torch.bfloat16)
        assert_close_to_ref(f"{c.label} dW", dw.cpu(), same_grads[1], ref_grads[1], torch.bfloat16)
        # buffers: the model's count plus row padding (16 bytes) and fp32 tile maxima
        real = probe.plan_bytes(plan, n, h, v, 2, c.strategy, c.token_chunk)
        pad = 16 * n + 4 * n * math.ceil(v / pa["block_v"])
        assert real <= c.memory + pad, (c.label, real, c.memory)
        if fits:
            assert c.memory <= max(budget, floor.memory), c.label
        if HAS_CUDA:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base - dx.nbytes - dw.nbytes
            # + the op's O(N + V) vectors and the GEMMs' workspace
            assert peak <= c.memory + pad + 64 * (n + v) + (8 << 20), (c.label, peak, c.memory)


def test_force_keeps_the_planner_choice_when_it_is_the_candidate(probe):
    """Forcing the planner's own choice changes nothing: same plan as no override."""
    n, h, v = (300, 136, 5000) if HAS_CUDA else (32, 16, 200)
    budget = n * v  # half the logits
    pa = probe.planner_args(n, h, v, 2, DEVICE)
    plain = _plans.triton_plan(n, v, h, 2, budget, DEVICE, keep_allowed=True)
    c = cm.Candidate("partial", keep_cols=plain.keep_cols, vocab_chunk=plain.vocab_chunk)
    with probe.forcing(probe.force(c, v, pa["block_v"])):
        forced = _plans.triton_plan(n, v, h, 2, budget, DEVICE, keep_allowed=True)
    assert forced == dataclasses.replace(plain)


def _synthetic(fitter, true_dev):
    """Probe-like rows and shapes timed by a known device model."""
    rows, shapes = [], []
    for name, (n, h, v) in ANCHORS.items():
        for c in cm.candidates(n, h, v, 2, device_model=cm.H100)[::7]:
            if c.strategy == "forward":
                continue
            r = dict(shape=name, n=n, h=h, v=v, itemsize=2, ok=True, strategy=c.strategy, keep_cols=c.keep_cols,
                     vocab_chunk=c.vocab_chunk, token_chunk=c.token_chunk, label=c.label)
            t = fitter.predict(true_dev, r)
            r.update(fb_ms=t.time_s * 1e3, fwd_ms=t.fwd_s * 1e3)
            rows.append(r)
        shapes.append(dict(shape=name, n=n, h=h, v=v, budget=256 << 20,
                           gemm_ms=cm.gemm_s(true_dev, n, v, h, 2) * 1e3))
    return rows, shapes


def test_fit_recovers_known_constants(fitter, tmp_path):
    true_dev = dataclasses.replace(cm.H100, gemm_flops_16=0.9 * cm.H100.gemm_flops_16, fused_forward=1.2,
                                   acc_bw=0.7 * cm.H100.acc_bw, keep_store_bw=1.25 * cm.H100.keep_store_bw)
    rows, shapes = _synthetic(fitter, true_dev)
    pts = fitter.points(rows, shapes)
    assert len(pts) > 40
    before = max(abs(e) for e in fitter.errors(cm.H100, pts))
    new = fitter.fit(cm.H100, pts, ridge=1e-6)
    after = max(abs(e) for e in fitter.errors(new, pts))
    assert before > 0.05 and after < 0.01, (before, after)
    assert new.gemm_flops_16 == pytest.approx(true_dev.gemm_flops_16, rel=0.02)
    assert new.fused_forward == pytest.approx(1.2, rel=0.03)
    # the printed line is the one-line data change: it rebuilds the fitted model
    line = fitter.one_line(new)
    ns = {"DeviceModel": cm.DeviceModel}
    exec(line, ns)
    for f in fitter.FIELDS:
        assert getattr(ns["H100"], f) == pytest.approx(getattr(new, f), rel=5e-3), f
    # the command line: reads probe JSON, writes the report
    path = tmp_path / "regret.json"
    path.write_text(json.dumps(dict(device_model="H100", rows=rows, shapes=shapes)))
    report = fitter.main([str(path), "--ridge", "1e-6", "--json-out", str(tmp_path / "fit.json")])
    assert report["stats"]["all"]["after"]["max"] < 0.01
    assert json.loads((tmp_path / "fit.json").read_text())["line"] == report["line"]


def test_fit_keeps_unconstrained_constants(fitter):
    """Points that do not depend on a constant leave it at its shipped value (ridge)."""
    true_dev = dataclasses.replace(cm.H100, gemm_flops_16=0.8 * cm.H100.gemm_flops_16)
    rows, shapes = _synthetic(fitter, true_dev)
    pts = [p for p in fitter.points(rows, shapes) if p[0] == "gemm"]
    new = fitter.fit(cm.H100, pts)
    assert new.gemm_flops_16 == pytest.approx(true_dev.gemm_flops_16, rel=0.05)
    assert new.kept_pass_bw == pytest.approx(cm.H100.kept_pass_bw, rel=1e-3)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the probe's --smoke mode runs the Triton kernels on CPU tensors: needs Triton's "
                           "interpreter (the suite's CPU mode); on a GPU: bash benchmarks/gpu/suite.sh models")
def test_probe_smoke_writes_regret(probe, tmp_path):
    summaries, rows = probe.main(["--smoke", "--shapes", "smoke-c", "--rounds", "1", "--no-profile",
                                  "--out", str(tmp_path)])
    s = summaries[0]
    assert s["all_same"] and s["within_budget"] is True
    assert s["regret_pct"] >= 0 and s["best_ms"] <= s["chosen_ms"]
    assert {r["strategy"] for r in rows} >= {"keep", "partial", "grad_in_forward"}
    data = json.loads((tmp_path / "regret.json").read_text())
    assert data["rows"] and data["shapes"][0]["chosen"] == s["chosen"]
    assert (tmp_path / "regret.md").read_text().count("| smoke-c |") == len(rows) + 1


# --------------------------------------------------------------------------- wide chunks


def test_shipped_models_allow_two_chunk_doublings_measured_on_the_h100():
    """The shipped models allow chunks up to 4x the L2 rule's width (wide_chunks = 2): the
    regret probe (probe-regret-H100-2026-11-23) measured 8192-16384-column chunks 2-11%
    faster than 4096 at 256 MiB on 7 of 9 shapes. Nothing wider than that enters the family
    (but, beside kept columns, their whole remainder as one chunk),
    the re-read and wave constants stay the physical ones, and at the two shapes with the
    largest measured regret (gemma3-4b, gpt-oss-120b) the planner now takes 16384 columns."""
    from logitless_bench.shapes import MODEL_SHAPES

    for name in cm.ROCM_ARCH_CLASSES.values():  # not measured: the L2 rule's chunks alone
        assert cm.DEVICE_MODELS[name].wide_chunks == 0
    for dev in (d for k, d in cm.DEVICE_MODELS.items() if k not in cm.ROCM_ARCH_CLASSES.values()):
        assert dev.wide_chunks == 2 and dev.l2_reread == 2.0 and dev.gemm_wave == 1.0
        for s in MODEL_SHAPES:
            rule = 4096
            while 2 * s.tokens * rule * 2 <= 0.6 * dev.l2_bytes:
                rule *= 2
            for c in cm.candidates(s.tokens, s.hidden, s.vocab, 2, device_model=dev):
                padded = -(-s.vocab // 256) * 256
                if c.strategy == "partial":  # (or beside kept columns, the remainder in one chunk)
                    assert c.vocab_chunk <= 4 * rule or c.vocab_chunk == padded - c.keep_cols, (s, c)
    for n, h, v in [(4096, 2560, 262144), (4096, 2880, 201088)]:
        assert cm.choose(n, h, v, 2, 256 << 20, device_model=cm.H100).vocab_chunk == 16384


@pytest.mark.parametrize("wide", [1, 2, 3])
def test_wide_chunks_keep_the_planner_monotone_and_within_budget(wide):
    """With wider chunks in the family the choice still never gets slower as the budget
    grows, fits the budget (or is the floor), and the family grows only by widths that
    are doublings past the L2 rule."""
    from logitless_bench.shapes import MODEL_SHAPES

    dev = dataclasses.replace(cm.H100, wide_chunks=wide)
    for s in MODEL_SHAPES:
        n, h, v = s.tokens, s.hidden, s.vocab
        base = {c.label for c in cm.candidates(n, h, v, 2, device_model=dataclasses.replace(cm.H100, wide_chunks=0))}
        more = [c for c in cm.candidates(n, h, v, 2, device_model=dev) if c.label not in base]
        widths = {c.vocab_chunk for c in more}
        assert len(widths) <= wide and all(w % 4096 == 0 and 2 * n * w > 0.6 * dev.l2_bytes for w in widths)
        floor = cm.minimum(n, h, v, 2, device_model=dev)
        prev = math.inf
        for b in sorted([2**e for e in range(20, 34)] + [n * v * 2, floor.memory]):
            c = cm.choose(n, h, v, 2, b, device_model=dev)
            assert c.time_s <= prev * (1 + 1e-12) and c.memory <= max(b, floor.memory), (s.name, b, c.label)
            prev = c.time_s


@pytest.mark.skipif(not HAS_CUDA, reason="the cost model plans columns on GPUs only (the CPU interpreter uses the "
                                          "greedy rule); the interpreter case is the forced-candidate test above")
def test_wide_chunk_plan_on_the_gpu_is_exact_and_within_budget():
    """This GPU described with the H100's model and wide_chunks=2 at 4096 x 512 x 65536, 256 MiB: the
    planner takes a chunk past the L2 rule; loss and gradients equal the shipped plan's
    up to bf16 rounding and the reference's tolerance; peak memory within the budget."""
    n, h, v, budget = 4096, 512, 65536, 256 << 20
    wide = dataclasses.replace(cm.H100, wide_chunks=2)
    g = torch.Generator().manual_seed(7)
    x64 = torch.randn(n, h, generator=g, dtype=torch.float64)
    w64 = torch.randn(v, h, generator=g, dtype=torch.float64) * h**-0.5 * 2
    t = torch.randint(0, v, (n,), generator=g)
    xr, wr = x64.cuda().requires_grad_(True), w64.cuda().requires_grad_(True)
    ref = linear_cross_entropy_reference(xr, wr, t.cuda(), dtype=torch.float64)[0]
    ref_grads = torch.autograd.grad(ref, (xr, wr))
    xb, wb = x64.bfloat16().cuda().requires_grad_(True), w64.bfloat16().cuda().requires_grad_(True)
    same = linear_cross_entropy_reference(xb, wb, t.cuda(), dtype=torch.bfloat16)[0]
    same_grads = torch.autograd.grad(same, (xb, wb))
    x, w, td = xb.detach().requires_grad_(True), wb.detach().requires_grad_(True), t.cuda()
    with on_device(dataclasses.replace(device.facts(x.device), model=wide)):
        plan = _plans.triton_plan(n, v, h, 2, budget, x.device, keep_allowed=True)
        torch.autograd.grad(logitless.linear_cross_entropy(x, w, td, memory_budget=budget), (x, w))  # warm
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = logitless.linear_cross_entropy(x, w, td, memory_budget=budget)
        dx, dw = torch.autograd.grad(loss, (x, w))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base - dx.nbytes - dw.nbytes
    shipped = dataclasses.replace(device.facts(x.device), model=dataclasses.replace(cm.H100, wide_chunks=0))
    narrow = _plans.triton_plan(n, v, h, 2, budget, shipped, keep_allowed=True)
    assert narrow.vocab_chunk == 4096 and plan.vocab_chunk > 4096, (narrow, plan)  # past the L2 rule
    assert peak <= budget, (peak, budget)
    for name, ours, s_, r in (("loss", loss, same, ref), ("dx", dx, same_grads[0], ref_grads[0]),
                              ("dW", dw, same_grads[1], ref_grads[1])):
        assert_close_to_ref(f"wide {name}", ours.detach().cpu(), s_.detach().cpu(), r.detach().cpu(), torch.bfloat16)
