"""linear_jsd against the float64 reference and finite differences, for every backend.

Runs on the GPU when there is one; otherwise the Triton backend runs on the CPU
interpreter (conftest.py), at small sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import logitless
from logitless.ops.linear_jsd.reference import linear_jsd_reference
from tests.conftest import DEVICE, HAS_CUDA
from tests.helpers import assert_close_to_ref
from tests.op_specs import SPECS

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]
TEMPERATURES = [0.5, 1.0, 2.0]

#: The options of the contract suite (tests/op_specs.py), reused by the op-specific tests.
OPTIONS = SPECS["linear_jsd"].options


def make_inputs(lead, hs, ht, vocab, dtype, opts, seed, device=DEVICE):
    """Fresh random inputs: (student_x, student_weight, teacher_x, teacher_weight,
    target, kwargs incl. biases). Student tensors require grad."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(*lead, hs, generator=g)
    ws = torch.randn(vocab, hs, generator=g) * hs**-0.5 * 2
    xt = torch.randn(*lead, ht, generator=g)
    wt = torch.randn(vocab, ht, generator=g) * ht**-0.5 * 2
    target = torch.randint(0, vocab, lead, generator=g)
    if opts.get("_ignore"):
        target[torch.rand(lead, generator=g) < opts["_ignore"]] = -100
    kw = {k: v for k, v in opts.items() if not k.startswith("_")}
    if opts.get("_bias"):
        kw["student_bias"] = (torch.randn(vocab, generator=g) * 0.5).to(dtype).to(device).requires_grad_()
        kw["teacher_bias"] = (torch.randn(vocab, generator=g) * 0.5).to(dtype).to(device)
    xs = xs.to(dtype).to(device).requires_grad_()
    ws = ws.to(dtype).to(device).requires_grad_()
    target = None if opts.get("_no_target") else target.to(device)
    return xs, ws, xt.to(dtype).to(device), wt.to(dtype).to(device), target, kw


def check(backend, dtype, lead, hs, ht, vocab, opts, reduction, seed, budget=None, **extra):
    xs, ws, xt, wt, target, kw = make_inputs(lead, hs, ht, vocab, dtype, opts, seed)
    kw.update(extra)
    loss = logitless.linear_jsd(xs, ws, xt, wt, target, reduction=reduction, backend=backend,
                                memory_budget=budget, **kw)
    ref = linear_jsd_reference(xs, ws, xt, wt, target, reduction=reduction, **kw)
    same = linear_jsd_reference(xs, ws, xt, wt, target, reduction=reduction, dtype=dtype, **kw)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close_to_ref("loss", loss, same, ref, dtype)
    grad_out = torch.randn(loss.shape, dtype=torch.float32, device=DEVICE) if reduction == "none" else None
    inputs = [t for t in (xs, ws, kw.get("student_bias")) if t is not None]
    ours = torch.autograd.grad(loss, inputs, grad_out)
    refs = torch.autograd.grad(ref, inputs, grad_out.double() if grad_out is not None else None)
    sames = torch.autograd.grad(same, inputs, grad_out.to(same.dtype) if grad_out is not None else None)
    for name, o, r, s in zip(["dx", "dW", "db"], ours, refs, sames):
        assert o.dtype == dtype
        assert_close_to_ref(name, o, s, r, dtype)


# ----------------------------------------------------------------- the math, float64


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float64_torch_backend_matches_reference(beta, temperature, reduction):
    """Loss and student gradients equal the definition (float64) for every beta, T and
    reduction, with ignored tokens, differing hidden sizes, biases, soft-caps, hard labels."""
    opts = dict(OPTIONS["all"], beta=beta, temperature=temperature)
    xs, ws, xt, wt, target, kw = make_inputs((2, 7), 10, 13, 29, torch.float64, opts, seed=1, device="cpu")
    loss = logitless.linear_jsd(xs, ws, xt, wt, target, reduction=reduction, backend="torch",
                                memory_budget=4000, **kw)
    ref = linear_jsd_reference(xs, ws, xt, wt, target, reduction=reduction, **kw)
    torch.testing.assert_close(loss, ref, rtol=1e-11, atol=1e-12)
    inputs = (xs, ws, kw["student_bias"])
    go = torch.randn(loss.shape, dtype=torch.float64) if reduction == "none" else None
    for o, r in zip(torch.autograd.grad(loss, inputs, go), torch.autograd.grad(ref, inputs, go)):
        torch.testing.assert_close(o, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("option", ["plain", "all"])
def test_finite_differences(beta, option):
    """Student gradients (x, weight, bias) of the torch backend against finite differences."""
    opts = dict(OPTIONS[option], beta=beta)
    opts.setdefault("temperature", 0.7)
    opts["_bias"] = True
    xs, ws, xt, wt, target, kw = make_inputs((6,), 5, 7, 11, torch.float64, opts, seed=2, device="cpu")
    bs = kw.pop("student_bias")

    def f(xs, ws, bs):
        return logitless.linear_jsd(xs, ws, xt, wt, target, student_bias=bs, backend="torch",
                                    reduction="sum", **kw)

    assert torch.autograd.gradcheck(f, (xs, ws, bs), eps=1e-6, atol=1e-7)


def test_helion_gradient_is_rejected():
    """The gradient (1 - beta)/T (p - m) of Helion's example disagrees with finite
    differences; ours does not (so the finite-difference test can fail)."""
    beta, t = 0.5, 1.0
    zs = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    zt = torch.randn(4, 9, dtype=torch.float64)
    loss = logitless.jsd(zs, zt, beta=beta, temperature=t, reduction="sum", backend="torch")
    (ours,) = torch.autograd.grad(loss, zs)
    eps = 1e-6
    fd = torch.zeros_like(zs)
    for i in range(zs.numel()):
        d = torch.zeros_like(zs).view(-1)
        d[i] = eps
        d = d.view_as(zs)
        fd.view(-1)[i] = (logitless.jsd(zs + d, zt, beta=beta, reduction="sum", backend="torch")
                          - logitless.jsd(zs - d, zt, beta=beta, reduction="sum", backend="torch")) / (2 * eps)
    p, q = F.softmax(zs.detach() / t, -1), F.softmax(zt / t, -1)
    helion = (1 - beta) / t * (p - (beta * q + (1 - beta) * p))
    assert (ours - fd).abs().max() < 1e-8
    assert (helion - fd).abs().max() > 1e-3


def trl_generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5,
                             temperature=1.0, reduction="batchmean"):
    """TRL's GKDTrainer.generalized_jsd_loss, rewritten here from its definition."""
    student_log_probs = F.log_softmax(student_logits / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta_t = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture = torch.logsumexp(torch.stack([student_log_probs + torch.log(1 - beta_t),
                                               teacher_log_probs + torch.log(beta_t)]), dim=0)
        kl_teacher = F.kl_div(mixture, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture, student_log_probs, reduction="none", log_target=True)
        jsd = beta_t * kl_teacher + (1 - beta_t) * kl_student
    if labels is not None:
        mask = labels != -100
        jsd = jsd[mask]
    if reduction == "batchmean":
        return jsd.sum() / mask.sum() if labels is not None else jsd.sum() / jsd.size(0)
    if reduction == "sum":
        return jsd.sum()
    return jsd


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_equals_trl_generalized_jsd(beta, temperature):
    """Same number as TRL's formula (batchmean over non-ignored tokens), from logits and
    from hidden states (the logits being x @ W.T)."""
    g = torch.Generator().manual_seed(3)
    xs, ws = torch.randn(12, 8, generator=g, dtype=torch.float64), torch.randn(37, 8, generator=g, dtype=torch.float64)
    xt, wt = torch.randn(12, 6, generator=g, dtype=torch.float64), torch.randn(37, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 37, (12,), generator=g)
    labels[[2, 5]] = -100
    trl = trl_generalized_jsd_loss(xs @ ws.T, xt @ wt.T, labels, beta=beta, temperature=temperature)
    ours_logits = logitless.jsd(xs @ ws.T, xt @ wt.T, labels, beta=beta, temperature=temperature, backend="torch")
    ours_linear = logitless.linear_jsd(xs, ws, xt, wt, labels, beta=beta, temperature=temperature, backend="torch")
    torch.testing.assert_close(ours_logits, trl, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(ours_linear, trl, rtol=1e-12, atol=1e-13)
    no_labels = trl_generalized_jsd_loss(xs @ ws.T, xt @ wt.T, beta=beta, temperature=temperature)
    torch.testing.assert_close(logitless.linear_jsd(xs, ws, xt, wt, beta=beta, temperature=temperature,
                                                    backend="torch"), no_labels, rtol=1e-12, atol=1e-13)


def test_exact_kl_limits():
    """beta = 0 and 1 are the two KLs exactly (the mixture form tends to 0 there)."""
    zs, zt = torch.randn(5, 17, dtype=torch.float64), torch.randn(5, 17, dtype=torch.float64)
    lp, lq = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    fwd = (lq.exp() * (lq - lp)).sum(-1)
    rev = (lp.exp() * (lp - lq)).sum(-1)
    torch.testing.assert_close(logitless.jsd(zs, zt, beta=0.0, reduction="none", backend="torch"), fwd)
    torch.testing.assert_close(logitless.jsd(zs, zt, beta=1.0, reduction="none", backend="torch"), rev)
    assert logitless.jsd(zs, zt, beta=1e-9, reduction="sum", backend="torch") < 1e-6


def test_hard_label_term_is_student_ce_at_temperature_one():
    zs, zt = torch.randn(6, 11, dtype=torch.float64), torch.randn(6, 11, dtype=torch.float64)
    t = torch.randint(0, 11, (6,))
    t[1] = -100
    both = logitless.jsd(zs, zt, t, hard_label_weight=0.25, temperature=2.0, backend="torch")
    soft = logitless.jsd(zs, zt, t, temperature=2.0, backend="torch")
    torch.testing.assert_close(both - soft, 0.25 * F.cross_entropy(zs, t))


# ----------------------------------------------------------------- backends and dtypes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", BETAS)
def test_betas_all_options(backend, beta):
    for dtype in (torch.float32, torch.bfloat16):
        check(backend, dtype, (29,), 16, 32, 67, OPTIONS["all"], "mean", seed=4, beta=beta,
              temperature=TEMPERATURES[int(beta * 10) % 3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_budget_many_chunks(backend):
    """Budgets that split the forward into many token chunks and the backward into many
    vocabulary chunks give the same result."""
    check(backend, torch.float32, (37,), 24, 16, 211, OPTIONS["all"], "none", seed=13, budget=2048)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_repeatable(backend):
    xs, ws, xt, wt, target, kw = make_inputs((40,), 24, 16, 131, torch.bfloat16, OPTIONS["all"], seed=2)
    runs = []
    for _ in range(2):
        loss = logitless.linear_jsd(xs, ws, xt, wt, target, backend=backend, memory_budget=3000, **kw)
        runs.append((loss, *torch.autograd.grad(loss, (xs, ws, kw["student_bias"]))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("aligned", [True, False], ids=["tma", "pointers"])
def test_grouped_program_order_is_bitwise_neutral(aligned):
    """The dlogits kernel's grouped program order (``plans.KERNEL_OPTIONS["group"]``)
    changes when tiles run, not what they compute: equal to the plain order bit for bit,
    with several row blocks, a ragged last group and several vocabulary chunks."""
    from logitless.ops.linear_jsd import planning as _ljsd_planning

    n, v = (600, 1500) if HAS_CUDA else (70, 131)
    hs, ht = ((136, 264) if aligned else (100, 60)) if HAS_CUDA else ((24, 16) if aligned else (17, 9))
    xs, ws, xt, wt, target, kw = make_inputs((n,), hs, ht, v, torch.bfloat16, OPTIONS["all"], seed=4)
    budget = 4 * n * hs + 2 * n * 64  # the dx accumulator and narrow chunks

    from logitless.planning import memo as _memo

    real = _ljsd_planning.kernel_options

    def run(group):
        def options(*args):  # the schedule forced (a test-only patch of the planner: memo cleared)
            return dict(real(*args), group_n=2 if group else 0)

        _memo.clear()
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(_ljsd_planning, "kernel_options", options)
                plan = _ljsd_planning.linear_jsd_plan(n, v, hs, 2, budget, xs.device)
                assert plan.tiles.group_n == (2 if group else 0) and plan.vocab_chunk < v
                loss = logitless.linear_jsd(xs, ws, xt, wt, target, backend="triton", memory_budget=budget, **kw)
        finally:
            _memo.clear()
        return (loss, *torch.autograd.grad(loss, (xs, ws, kw["student_bias"])))

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_input_gives_nan(backend):
    xs, ws, xt, wt, target, _ = make_inputs((6,), 16, 16, 40, torch.float32, {}, seed=6)
    with torch.no_grad():
        xt[2, 3] = float("nan")
    loss = logitless.linear_jsd(xs, ws, xt, wt, target, reduction="none", backend=backend)
    assert torch.isnan(loss[2]) and not torch.isnan(loss[[0, 1, 3, 4, 5]]).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_student_weight(backend):
    xs, ws, xt, wt, target, _ = make_inputs((9,), 16, 16, 40, torch.float32, {}, seed=7)
    ws = ws.detach()
    loss = logitless.linear_jsd(xs, ws, xt, wt, target, backend=backend)
    ref = linear_jsd_reference(xs, ws, xt, wt, target)
    (dx,), (rdx,) = torch.autograd.grad(loss, (xs,)), torch.autograd.grad(ref, (xs,))
    assert_close_to_ref("dx", dx, None, rdx, torch.float32)


def test_module_matches_function():
    xs, ws, xt, wt, target, kw = make_inputs((2, 6), 16, 8, 40, torch.float32, OPTIONS["all"], seed=8)
    fn_kw = {k: v for k, v in kw.items() if not k.endswith("_bias")}
    mod = logitless.LinearJSDLoss(backend="torch", **fn_kw)
    a = mod(xs, ws, xt, wt, target, kw["student_bias"], kw["teacher_bias"])
    b = logitless.linear_jsd(xs, ws, xt, wt, target, backend="torch", **kw)
    assert torch.equal(a, b)
    assert "beta=0.3" in repr(mod)


@pytest.mark.parametrize("module", [False, True])
def test_teacher_is_a_constant_by_default(module):
    """An ordinary teacher head (weight and bias nn.Parameters, hidden states computed with
    grad enabled): the loss equals the one of detached teacher tensors, bitwise, and only
    the student gets gradients (the float64 reference with a constant teacher)."""
    from logitless.ops.linear_jsd.reference import linear_jsd_reference

    xs, ws, xt, wt, target, _ = make_inputs((2, 5), 8, 6, 11, torch.float64, {}, seed=9, device="cpu")
    head = torch.nn.Linear(6, 11, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(wt)
    body = torch.nn.Linear(6, 6, dtype=torch.float64)
    teacher_x = body(xt)  # requires grad: the teacher's forward ran with grad enabled
    assert teacher_x.requires_grad and head.weight.requires_grad and head.bias.requires_grad
    xs.requires_grad_()
    ws.requires_grad_()
    kw = dict(beta=0.3, temperature=1.3, backend="torch")
    if module:
        loss = logitless.LinearJSDLoss(**kw)(xs, ws, teacher_x, head.weight, target, None, head.bias)
    else:
        loss = logitless.linear_jsd(xs, ws, teacher_x, head.weight, target, teacher_bias=head.bias, **kw)
    plain = logitless.linear_jsd(xs, ws, teacher_x.detach(), head.weight.detach(), target,
                                 teacher_bias=head.bias.detach(), **kw)
    assert torch.equal(loss, plain)
    loss.backward()
    assert head.weight.grad is None and head.bias.grad is None and body.weight.grad is None
    xr, wr = xs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
    ref = linear_jsd_reference(xr, wr, teacher_x.detach(), head.weight.detach(), target,
                               teacher_bias=head.bias.detach(), beta=0.3, temperature=1.3)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ws.grad, wr.grad, rtol=1e-10, atol=1e-12)


def test_teacher_grad_opt_in_refuses_what_it_cannot_compute():
    xs, ws, xt, wt, target, _ = make_inputs((4,), 8, 8, 10, torch.float32, {}, seed=9, device="cpu")
    with pytest.raises(NotImplementedError, match="teacher_weight requires grad"):
        logitless.linear_jsd(xs, ws, xt, wt.clone().requires_grad_(), target, teacher_grad=True)
    with pytest.raises(NotImplementedError, match="teacher_bias requires grad"):
        logitless.LinearJSDLoss(teacher_grad=True)(xs, ws, xt, wt, target, None, torch.zeros(10, requires_grad=True))
    # nothing to compute: constant teacher tensors, or grad disabled
    a = logitless.linear_jsd(xs, ws, xt, wt, target, teacher_grad=True)
    with torch.no_grad():
        b = logitless.linear_jsd(xs, ws, xt, wt.clone().requires_grad_(), target, teacher_grad=True)
    assert torch.equal(a, b) and torch.isfinite(a)


def test_out_of_range_target_with_hard_labels_raises_on_cpu():
    xs, ws, xt, wt, target, _ = make_inputs((4,), 8, 8, 10, torch.float32, {}, seed=9, device="cpu")
    target[1] = 10
    with pytest.raises(ValueError, match="outside"):
        logitless.linear_jsd(xs, ws, xt, wt, target, hard_label_weight=0.5)
    logitless.linear_jsd(xs, ws, xt, wt, target)  # without hard labels the value is never used


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compile_fullgraph_torch_backend(reduction):
    xs, ws, xt, wt, target, kw = make_inputs((2, 6), 8, 12, 23, torch.float32, OPTIONS["all"], seed=11, device="cpu")

    def step(xs, ws, xt, wt, target, bs, bt):
        kw2 = {k: v for k, v in kw.items() if not k.endswith("_bias")}
        return logitless.linear_jsd(xs, ws, xt, wt, target, student_bias=bs, teacher_bias=bt,
                                    reduction=reduction, backend="torch", **kw2).sum()

    args = (xs, ws, xt, wt, target, kw["student_bias"], kw["teacher_bias"])
    eager = step(*args)
    ge = torch.autograd.grad(eager, (xs, ws))
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    gc = torch.autograd.grad(compiled, (xs, ws))
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compile_inductor_backward(backend):
    """Inductor (not aot_eager) drops defaulted custom-op arguments from its calls: the
    backward's fake must read need_dx & co. by name (it read them by position once, and
    dx came back empty under torch.compile)."""
    device = "cpu" if backend == "torch" else DEVICE  # triton: CUDA, or the CPU interpreter
    xs, ws, xt, wt, target, _ = make_inputs((8,), 16, 16, 40, torch.float32, {}, seed=21, device=device)
    f = lambda *a: logitless.linear_jsd(*a, backend=backend)
    ge = torch.autograd.grad(f(xs, ws, xt, wt, target), (xs, ws))
    torch._dynamo.reset()
    gc = torch.autograd.grad(torch.compile(f, fullgraph=True)(xs, ws, xt, wt, target), (xs, ws))
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_autocast_casts_like_linear():
    """Under autocast, fp32 tensors are cast to the autocast dtype (as F.linear), the loss
    stays fp32 and fp32 parameters get fp32 gradients; outside it mixed dtypes raise."""
    xs, ws, xt, wt, target, _ = make_inputs((6,), 16, 8, 30, torch.float32, {}, seed=12, device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = logitless.linear_jsd(xs, ws, xt.bfloat16(), wt, target, backend="torch")
    assert loss.dtype == torch.float32
    dx, dw = torch.autograd.grad(loss, (xs, ws))
    assert dx.dtype == torch.float32 and dw.dtype == torch.float32
    ref = linear_jsd_reference(xs.bfloat16(), ws.bfloat16(), xt.bfloat16(), wt.bfloat16(), target)
    assert abs(loss.item() - ref.item()) < 1e-4 * max(1.0, abs(ref.item()))
    with pytest.raises(TypeError, match="one dtype"):
        logitless.linear_jsd(xs, ws, xt.bfloat16(), wt, target)


# ----------------------------------------------------------------- GPU only


@pytest.mark.skipif(not HAS_CUDA, reason="host syncs only exist with a GPU")
@pytest.mark.parametrize("budget", [None, 200_000])
def test_no_host_sync_on_gpu(budget):
    xs, ws, xt, wt, target, kw = make_inputs((2, 50), 64, 96, 1000, torch.bfloat16, OPTIONS["all"], seed=14)
    logitless.linear_jsd(xs, ws, xt, wt, target, memory_budget=budget, **kw).backward()  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logitless.linear_jsd(xs, ws, xt, wt, target, memory_budget=budget, **kw).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not HAS_CUDA, reason="too slow for the Triton CPU interpreter")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_larger_vocab(dtype):
    check("triton", dtype, (300,), 136, 256, 50257, OPTIONS["all"], "mean", seed=5)


@pytest.mark.skipif(not HAS_CUDA, reason="a GPU-sized case")
def test_cuda_compile_fullgraph_triton():
    xs, ws, xt, wt, target, _ = make_inputs((4, 64), 128, 256, 4096, torch.bfloat16, {}, seed=15)
    f = torch.compile(lambda *a: logitless.linear_jsd(*a), fullgraph=True)
    torch.testing.assert_close(f(xs, ws, xt, wt, target), logitless.linear_jsd(xs, ws, xt, wt, target))


def test_bench_distill_cpu_smoke(tmp_path):
    """The distill suite runs end to end on the CPU (tiny case) and writes its files; the
    logitless row agrees with the suite's own float64 reference."""
    import json

    from logitless_bench import cli

    rc = cli.main(["--suite", "distill", "--cpu", "--quick", "--methods", "logitless,torch-eager",
                   "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "latest-distill-cpu.json").read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert rows["logitless"]["status"] == "ok" and rows["torch-eager"]["status"] == "ok"
    assert rows["logitless"]["loss_abs_err"] < 1e-5 and rows["logitless"]["dw_rel_err"] < 1e-5
    assert (tmp_path / "latest-distill-cpu.md").read_text().count("| cpu-tiny |") == 2


def test_compile_inductor_fullgraph_shift_and_hard_labels():
    """The default torch.compile backend (inductor) around the custom ops, 3-D inputs."""
    xs, ws, xt, wt, target, _ = make_inputs((2, 6), 8, 12, 23, torch.float32, {"_ignore": 0.2}, seed=16, device="cpu")

    def step(xs, ws, xt, wt, target):
        return logitless.linear_jsd(xs, ws, xt, wt, target, beta=0.3, temperature=1.5, hard_label_weight=0.2,
                                    shift=True, backend="torch")

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(xs, ws, xt, wt, target)
    eager = step(xs, ws, xt, wt, target)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(torch.autograd.grad(compiled, (xs, ws)), torch.autograd.grad(eager, (xs, ws))):
        torch.testing.assert_close(a, b)
