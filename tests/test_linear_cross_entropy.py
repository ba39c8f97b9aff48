"""linear_cross_entropy against the float64 reference, for every backend and option.

Runs on the GPU when there is one; otherwise the Triton backend runs on the CPU
interpreter (conftest.py), at small sizes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

import logitless
from logitless.formulas.cross_entropy import TokenStats, token_loss
from logitless.ops.linear_cross_entropy.reference import linear_cross_entropy_reference
from logitless.options import CrossEntropyOptions as LossOptions
from tests.conftest import DEVICE, HAS_CUDA
from tests.helpers import assert_close_to_ref
from tests.op_specs import SPECS
from tests.planning_seams import described, reshaped

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

#: The options of the contract suite (tests/op_specs.py), reused by the op-specific tests.
OPTIONS = SPECS["linear_cross_entropy"].options


def make_inputs(lead, hidden, vocab, dtype, opts, seed, requires_grad=(True, True)):
    """Fresh random inputs; returns (x, weight, target, bias, kwargs for the op)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5 * 2).to(dtype)
    target = torch.randint(0, vocab, lead, generator=g)
    if opts.get("_ignore"):
        target[torch.rand(lead, generator=g) < opts["_ignore"]] = -100
    bias = (torch.randn(vocab, generator=g) * 0.5).to(dtype) if opts.get("_bias") else None
    kw = {k: v for k, v in opts.items() if not k.startswith("_")}
    if opts.get("_class_weight"):
        kw["class_weight"] = (torch.rand(vocab, generator=g) + 0.5).to(DEVICE)
    x = x.to(DEVICE).requires_grad_(requires_grad[0])
    w = w.to(DEVICE).requires_grad_(requires_grad[1])
    if bias is not None:
        bias = bias.to(DEVICE).requires_grad_(True)
    return x, w, target.to(DEVICE), bias, kw


def torch_same_dtype(x, w, target, bias, **kw):
    """What a user would write in plain torch, in the inputs' dtype (logits materialised)."""
    return linear_cross_entropy_reference(x, w, target, bias, dtype=x.dtype, **kw)[0]


def check_against_reference(backend, dtype, lead, hidden, vocab, opts, reduction, seed,
                            requires_grad=(True, True), budget=None):
    x, w, target, bias, kw = make_inputs(lead, hidden, vocab, dtype, opts, seed, requires_grad)
    loss, stats = logitless.linear_cross_entropy(
        x, w, target, bias, reduction=reduction, backend=backend, return_stats=True,
        memory_budget=budget, **kw,
    )
    ref, ref_lse, ref_correct = linear_cross_entropy_reference(
        x, w, target, bias, reduction=reduction, **kw)
    same = torch_same_dtype(x, w, target, bias, reduction=reduction, **kw)
    assert_close_to_ref("loss", loss, same, ref, dtype)
    assert loss.dtype == torch.float32
    assert_close_to_ref("lse", stats.lse, None, ref_lse, torch.float32 if dtype == torch.float32 else dtype)
    valid_targets = target[..., 1:] if kw.get("shift") else target
    if dtype == torch.float32:  # 16-bit ties/near-ties may legitimately flip the argmax
        assert torch.equal(stats.correct.cpu(), ref_correct.cpu())
        z = x.detach().double() @ w.detach().double().T + (0.0 if bias is None else bias.detach().double())
        if kw.get("softcap") is not None:
            z = kw["softcap"] * torch.tanh(z / kw["softcap"])
        z = z[..., :-1, :] if kw.get("shift") else z
        ref_argmax = torch.where(valid_targets != -100, z.argmax(dim=-1), -1)
        assert stats.argmax.dtype == torch.int64 and torch.equal(stats.argmax.cpu(), ref_argmax.cpu())
    assert stats.num_tokens.item() == (valid_targets != -100).sum().item()

    grad_out = torch.randn(loss.shape, dtype=torch.float32, device=DEVICE) if reduction == "none" else None
    inputs = [t for t in (x, w, bias) if t is not None and t.requires_grad]
    ours = torch.autograd.grad(loss, inputs, grad_out)
    refs = torch.autograd.grad(ref, inputs, grad_out.double() if grad_out is not None else None)
    sames = torch.autograd.grad(same, inputs, grad_out.to(same.dtype) if grad_out is not None else None)
    for name, o, r, s in zip(["dx", "dW", "db"], ours, refs, sames):
        assert o.dtype == dtype
        assert_close_to_ref(name, o, s, r, dtype)


#: Budgets (by itemsize) for 29 tokens, H=40, V=257 that make the Triton plan keep all,
#: part or none of the logits for the backward (checked by the next test).
BUDGETS = {"keep-all": {2: None, 4: None}, "keep-part": {2: 12_000, 4: 25_000},
           "recompute": {2: 2_000, 4: 2_000}}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("mode", list(BUDGETS))
def test_reductions_all_options(backend, reduction, mode):
    """Every option at once, at budgets that keep all, part or none of the logits."""
    for dtype in DTYPES:
        budget = BUDGETS[mode][torch.finfo(dtype).bits // 8]
        check_against_reference(backend, dtype, (29,), 40, 257, OPTIONS["all"], reduction, seed=7,
                                budget=budget)


def test_plan_budgets_select_keep_modes():
    """The three budgets above do select the three modes of the Triton plan."""
    from logitless.planning.plans import triton_plan

    cpu = torch.device("cpu")
    for itemsize in (2, 4):
        plans = [triton_plan(29, 257, 40, itemsize, BUDGETS[m][itemsize] or 1 << 28, cpu, keep_allowed=True)
                 for m in BUDGETS]
        assert plans[0].keep_cols == 257
        assert 0 < plans[1].keep_cols < 257
        assert plans[2].keep_cols == 0


def test_gpt2_vocab_torch_backend():
    """V = 50257 (prime-free but odd; GPT-2's), chunked over the vocabulary."""
    check_against_reference("torch", torch.float32, (9,), 32, 50257, OPTIONS["all"], "mean", seed=5,
                            budget=1 << 20)


@pytest.mark.skipif(not HAS_CUDA, reason="V=50257 is too slow for the Triton CPU interpreter")
def test_gpt2_vocab_triton():
    for dtype in DTYPES:
        check_against_reference("triton", dtype, (300,), 136, 50257, OPTIONS["all"], "mean", seed=5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("frozen", ["x", "weight"])
def test_frozen_inputs(backend, frozen):
    rg = (frozen != "x", frozen != "weight")
    for dtype in (torch.float32, torch.bfloat16):
        check_against_reference(backend, dtype, (4, 6), 24, 101, OPTIONS["ignore"], "mean", seed=11,
                                requires_grad=rg)


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_budget_many_chunks(backend):
    """A budget so small that both passes run in many chunks: same result."""
    check_against_reference(backend, torch.float32, (37,), 24, 211, OPTIONS["all"], "none", seed=13,
                            budget=2048)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_repeatable(backend):
    x, w, target, bias, kw = make_inputs((40,), 24, 131, torch.bfloat16, OPTIONS["all"], seed=2)
    runs = []
    for _ in range(2):
        loss = logitless.linear_cross_entropy(x, w, target, bias, backend=backend, memory_budget=3000, **kw)
        runs.append((loss, *torch.autograd.grad(loss, (x, w, bias))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_twice_and_int32_targets(backend):
    x, w, target, bias, kw = make_inputs((20,), 16, 50, torch.float32, {}, seed=4)
    loss = logitless.linear_cross_entropy(x, w, target.int(), backend=backend)
    g1 = torch.autograd.grad(loss, (x, w), retain_graph=True)
    # A second backward of the same graph recomputes what the first consumed in place.
    g2 = torch.autograd.grad(loss, (x, w))
    ref = logitless.linear_cross_entropy(x, w, target, backend=backend)
    assert torch.equal(loss, ref)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_module_matches_function():
    x, w, target, bias, kw = make_inputs((2, 9), 16, 70, torch.float32, OPTIONS["all"], seed=6)
    mod = logitless.LinearCrossEntropyLoss(**kw)
    assert torch.equal(mod(x, w, target, bias), logitless.linear_cross_entropy(x, w, target, bias, **kw))
    assert "shift=True" in repr(mod)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_input_gives_nan(backend):
    x, w, target, _, _ = make_inputs((6,), 16, 40, torch.float32, {}, seed=8)
    x = x.detach().clone()
    x[2, 3] = float("nan")
    loss = logitless.linear_cross_entropy(x, w, target, backend=backend, reduction="none")
    assert torch.isnan(loss[2]) and not torch.isnan(loss[[0, 1, 3, 4, 5]]).any()
    x[2, 3] = float("inf")
    assert torch.isnan(logitless.linear_cross_entropy(x, w, target, backend=backend))


def test_out_of_range_target_gives_nan_in_the_math():
    """Where no check runs (GPU), the token's loss is NaN, never a finite value."""
    stats = TokenStats(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.0]), None, None)
    loss, _ = token_loss(stats, torch.tensor([3, 40]), 40, None, LossOptions())
    assert loss[0] == 0.5 and torch.isnan(loss[1])


@pytest.mark.skipif(not HAS_CUDA, reason="the NaN path for bad targets is the GPU path")
def test_out_of_range_target_gives_nan_on_gpu():
    x, w, target, _, _ = make_inputs((6,), 16, 40, torch.bfloat16, {}, seed=10)
    target[3] = 40
    loss = logitless.linear_cross_entropy(x, w, target, reduction="none")
    assert torch.isnan(loss[3]) and not torch.isnan(loss[[0, 1, 2, 4, 5]]).any()
    assert torch.isnan(logitless.linear_cross_entropy(x, w, target))


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given without CUDA and without the interpreter")
def test_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="needs CUDA"):
        logitless.linear_cross_entropy(x, w, t, backend="triton")


def test_tma_and_pointer_paths_are_both_exercised():
    """Aligned rows (H=24 here) take the tensor-descriptor loads, odd H=17 the pointer
    loads: the option tests above run both paths."""
    from logitless.planning.plans import triton_plan
    from logitless.triton_lib.launch import operands as _operands

    plan = triton_plan(8, 101, 24, 2, 1 << 20, torch.device("cpu"))
    assert _operands(torch.randn(8, 24).bfloat16(), torch.randn(101, 24).bfloat16(), plan)[2]
    assert not _operands(torch.randn(8, 17).bfloat16(), torch.randn(101, 17).bfloat16(), plan)[2]


@pytest.mark.skipif(not HAS_CUDA, reason="host syncs only exist with a GPU")
@pytest.mark.parametrize("mode", list(BUDGETS))
def test_no_host_sync_on_gpu(mode):
    """Forward and backward never wait for the GPU (torch raises on a synchronising call)."""
    x, w, target, bias, kw = make_inputs((2, 50), 64, 1000, torch.bfloat16, OPTIONS["all"], seed=14)
    budget = {"keep-all": None, "keep-part": 160_000, "recompute": 2_000}[mode]
    logitless.linear_cross_entropy(x, w, target, bias, memory_budget=budget, **kw).backward()  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, stats = logitless.linear_cross_entropy(x, w, target, bias, memory_budget=budget,
                                                     return_stats=True, **kw)
        loss.backward()
        stats.accuracy  # noqa: B018 (a property that must not sync)
    finally:
        torch.cuda.set_sync_debug_mode("default")


#: Scheduling options of the fused GEMM kernels (``plans.KERNEL_OPTIONS``): each alone
#: and all together, with groups of 2 row blocks (and a ragged last group).
KERNEL_VARIANTS = {
    "group": dict(group=True),
    "flatten": dict(flatten=True),
    "persistent": dict(dlogits_programs=1),
    "all": dict(group=True, flatten=True, dlogits_programs=2),
}


@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
@pytest.mark.parametrize("aligned", [True, False], ids=["tma", "pointers"])
def test_kernel_scheduling_options_are_bitwise_neutral(variant, aligned):
    """Program order, grouping, flattened pipelines, persistent programs and bulk stores
    change when tiles run, never what a tile computes: loss, stats and gradients must
    equal the plain schedule's bit for bit, with kept and recomputed columns (one kept
    tile, then chunks of two tiles and a ragged one), at odd N and V."""
    from logitless.planning import plans as _plans
    from logitless.planning import tiles as _tiles

    n, v = (300, 1500) if HAS_CUDA else (70, 257)
    hidden = (136 if aligned else 100) if HAS_CUDA else (24 if aligned else 17)
    x, w, target, bias, kw = make_inputs((n,), hidden, v, torch.bfloat16, OPTIONS["all"], seed=11)

    def one_kept_tile(p):  # one kept tile, chunks of two tiles
        return dataclasses.replace(p, keep_cols=p.block_v if p.keep_cols else 0, vocab_chunk=2 * p.block_v)

    plain_schedule = dict(group=False, flatten=False, dlogits_programs=0)

    def run(**schedule):
        o = dict(plain_schedule, **schedule)

        def reshape(p):  # the schedule forced (as plans.kernel_options would set it), one kept tile
            programs = o["dlogits_programs"] if triton.cdiv(n, p.block_n) >= _tiles.PERSISTENT_MIN_ROW_BLOCKS else 0
            return dataclasses.replace(one_kept_tile(p), group_n=2 if o["group"] else 0, flatten=o["flatten"],
                                       dlogits_programs=programs)

        with reshaped(reshape):
            loss, stats = logitless.linear_cross_entropy(
                x, w, target, bias, reduction="sum", backend="triton", return_stats=True, **kw)
            plan = _plans.triton_plan(n, v, hidden, 2, 1 << 30, x.device, keep_allowed=True)
        return plan, [loss, stats.lse, stats.correct, *torch.autograd.grad(loss, (x, w, bias))]

    _, plain = run()
    plan, variant_run = run(**KERNEL_VARIANTS[variant])
    assert plan.group_n == (2 if "group" in KERNEL_VARIANTS[variant] else 0)
    assert triton.cdiv(n, plan.block_n) > 2 and v - plan.keep_cols > 2 * plan.vocab_chunk
    for a, b in zip(plain, variant_run):
        assert torch.equal(a, b)


def test_group_rows_minimises_the_l2_working_set():
    """G row blocks x (SMs / G) column tiles resident at once read G*block_n rows of x and
    (SMs/G)*block_v rows of W per step: the rule picks the G of the smallest sum."""
    from logitless.planning import plans as _plans

    sms132 = described(sms=132)
    for bn, bv in [(128, 256), (128, 128), (256, 128)]:
        g = _plans.group_rows(bn, bv, sms132)
        work = [G * bn + 132 / G * bv for G in range(1, 133)]
        assert work[g - 1] <= min(work) * 1.01, (bn, bv, g)
    assert _plans.group_rows(128, 256, sms132) == 16  # the H100's measured best (PERFORMANCE.md)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("budget", [None, 2000], ids=["keep", "recompute"])
def test_stats_lse_is_differentiable(backend, budget):
    """stats.lse carries its gradient (softmax, through the soft-cap) into x, weight and
    bias, alone and together with the loss's, against float64."""
    x, w, target, bias, kw = make_inputs((3, 11), 24, 101, torch.float32, OPTIONS["all"], seed=21)
    g = torch.Generator().manual_seed(5)
    r = torch.randn(3, 10, generator=g).to(DEVICE)  # shift: 10 positions
    loss, stats = logitless.linear_cross_entropy(x, w, target, bias, backend=backend, return_stats=True,
                                                 memory_budget=budget, **kw)
    ref, ref_lse, _ = linear_cross_entropy_reference(x, w, target, bias, **kw)
    logits = x.double() @ w.double().T + bias.double()
    ref_lse = torch.logsumexp(kw["softcap"] * torch.tanh(logits[..., :-1, :] / kw["softcap"]), dim=-1)
    for combine in (lambda lo, ls: (ls * r).sum(), lambda lo, ls: lo + (ls * r).sum()):
        ours = torch.autograd.grad(combine(loss, stats.lse), (x, w, bias), retain_graph=True)
        refs = torch.autograd.grad(combine(ref, ref_lse), (x, w, bias), retain_graph=True)
        for name, o, e in zip(("dx", "dW", "db"), ours, refs):
            assert_close_to_ref(name, o, None, e, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stats_argmax_ties_take_the_first_index_across_chunks(backend):
    """Equal maxima in different column chunks (a budget of a few columns): the first
    index wins, as torch.argmax; -1 at ignored tokens; shift drops the last position."""
    h, v = 8, 203
    g = torch.Generator().manual_seed(3)
    w = torch.randn(v, h, generator=g).clamp(-3.0, 3.0)
    w[150] = w[7] = w[190] = 4.0  # three equal rows above all others: equal maximal logits
    x = torch.rand(2, 5, h, generator=g) + 0.1  # positive
    target = torch.randint(0, v, (2, 5), generator=g)
    target[0, 2] = -100
    for budget in (None, 1 << 12):
        _, st = logitless.linear_cross_entropy(x.to(DEVICE), w.to(DEVICE), target.to(DEVICE), backend=backend,
                                               return_stats=True, memory_budget=budget)
        expect = torch.where(target != -100, 7, -1)
        assert torch.equal(st.argmax.cpu(), expect)
        _, st = logitless.linear_cross_entropy(x.to(DEVICE), w.to(DEVICE), target.to(DEVICE), backend=backend,
                                               return_stats=True, memory_budget=budget, shift=True)
        assert st.argmax.shape == (2, 4) and torch.equal(st.argmax.cpu(), torch.where(target[:, 1:] != -100, 7, -1))


@pytest.mark.skipif(HAS_CUDA, reason="Triton's CPU interpreter (numpy) only")
def test_interpreter_launches_give_the_user_no_numpy_warnings():
    """The kernels compute exp(-inf), log(0) and inf * 0 in masked lanes on purpose; on
    Triton's interpreter numpy warned about each (RuntimeWarning), which reached the user.
    The launches silence numpy's floating-point warnings for themselves only."""
    import warnings

    import numpy as np

    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(100, 32, requires_grad=True)
    t = torch.randint(0, 100, (16,))
    t[3] = -100
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # (pyproject's filterwarnings ignores them for the other tests)
        logitless.linear_cross_entropy(x, w, t, backend="triton", softcap=5.0, z_loss=1e-3).backward()
        logitless.linear_log_probs(x.detach(), w.detach(), t.clamp(min=0), backend="triton", top_k=5, entropy=True)
        logits = torch.randn(16, 100, requires_grad=True)
        logitless.cross_entropy(logits, t, backend="triton").backward()  # the ops on given logits too
        logp = logitless.log_probs(logits, t.clamp(min=0), backend="triton", entropy=True)
        (logp[0].sum() + logp[1].sum()).backward()
        logitless.jsd(logits, torch.randn(16, 100), t, backend="triton").backward()
    assert not [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    with warnings.catch_warnings(record=True) as caught:  # the user's own numpy is left as it was
        warnings.simplefilter("always")
        np.log(np.zeros(1))
    assert [c for c in caught if issubclass(c.category, RuntimeWarning)]
