"""jsd (logits held) against the float64 reference, for every backend and option.

Runs on the GPU when there is one; otherwise the Triton backend runs on the CPU
interpreter (conftest.py), at small sizes. The divergence's formulas and TRL's
convention are also tested in test_linear_jsd.py.
"""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless.ops.jsd.reference import jsd_reference
from tests.conftest import DEVICE, HAS_CUDA
from tests.helpers import assert_close_to_ref
from tests.op_specs import SPECS
from tests.test_linear_jsd import BETAS, TEMPERATURES, trl_generalized_jsd_loss

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

#: The options of the contract suite (tests/op_specs.py), reused by the op-specific tests.
OPTIONS = SPECS["jsd"].options


def make_inputs(lead, vocab, dtype, opts, seed, teacher_dtype=None, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    zs = (torch.randn(*lead, vocab, generator=g) * 2).to(dtype).to(device).requires_grad_()
    zt = (torch.randn(*lead, vocab, generator=g) * 2).to(teacher_dtype or dtype).to(device)
    target = torch.randint(0, vocab, lead, generator=g)
    if opts.get("_ignore"):
        target[torch.rand(lead, generator=g) < opts["_ignore"]] = -100
    target = None if opts.get("_no_target") else target.to(device)
    return zs, zt, target, {k: v for k, v in opts.items() if not k.startswith("_")}


def check(backend, dtype, lead, vocab, opts, reduction, seed, teacher_dtype=None, **extra):
    zs, zt, target, kw = make_inputs(lead, vocab, dtype, opts, seed, teacher_dtype)
    kw.update(extra)
    loss = logitless.jsd(zs, zt, target, reduction=reduction, backend=backend, **kw)
    ref = jsd_reference(zs, zt, target, reduction=reduction, **kw)
    same = jsd_reference(zs, zt, target, reduction=reduction, dtype=dtype, **kw)
    assert loss.dtype == torch.float32
    assert_close_to_ref("loss", loss, same, ref, dtype)
    go = torch.randn(loss.shape, device=DEVICE) if reduction == "none" else None
    (ours,) = torch.autograd.grad(loss, zs, go)
    (r,) = torch.autograd.grad(ref, zs, go.double() if go is not None else None)
    (s,) = torch.autograd.grad(same, zs, go.to(same.dtype) if go is not None else None)
    assert ours.dtype == dtype and ours.shape == zs.shape
    assert_close_to_ref("dz", ours, s, r, dtype)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float64_torch_backend_matches_reference(beta, temperature, reduction):
    zs, zt, target, kw = make_inputs((3, 5), 23, torch.float64, OPTIONS["all"], seed=1, device="cpu")
    kw.update(beta=beta, temperature=temperature)
    loss = logitless.jsd(zs, zt, target, reduction=reduction, backend="torch", memory_budget=3000, **kw)
    ref = jsd_reference(zs, zt, target, reduction=reduction, **kw)
    torch.testing.assert_close(loss, ref, rtol=1e-11, atol=1e-12)
    go = torch.randn(loss.shape, dtype=torch.float64) if reduction == "none" else None
    torch.testing.assert_close(torch.autograd.grad(loss, zs, go)[0], torch.autograd.grad(ref, zs, go)[0],
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("beta", BETAS)
def test_finite_differences(beta):
    zs, zt, target, kw = make_inputs((7,), 9, torch.float64, OPTIONS["all"], seed=2, device="cpu")
    kw["beta"] = beta
    assert torch.autograd.gradcheck(
        lambda z: logitless.jsd(z, zt, target, reduction="sum", backend="torch", **kw), (zs,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("beta", BETAS)
def test_equals_trl_3d_sum(beta):
    zs, zt, target, _ = make_inputs((2, 4), 31, torch.float64, {"_ignore": 0.3}, seed=3, device="cpu")
    trl = trl_generalized_jsd_loss(zs, zt, target, beta=beta, temperature=0.5, reduction="sum")
    ours = logitless.jsd(zs, zt, target, beta=beta, temperature=0.5, reduction="sum", backend="torch")
    torch.testing.assert_close(ours, trl, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_betas_all_options(backend, beta, reduction):
    check(backend, torch.bfloat16, (29,), 67, OPTIONS["all"], reduction, seed=4, beta=beta,
          temperature=TEMPERATURES[int(beta * 10) % 3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_in_another_dtype(backend):
    check(backend, torch.bfloat16, (13,), 97, OPTIONS["all"], "mean", seed=5, teacher_dtype=torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_logits(backend):
    """Transposed and sliced views are read through their strides."""
    g = torch.Generator().manual_seed(7)
    base_s = torch.randn(40, 12, generator=g).to(DEVICE).requires_grad_()
    base_t = torch.randn(80, 12, generator=g).to(DEVICE)
    zs, zt = base_s.T, base_t.T[:, ::2][:, :40]
    loss = logitless.jsd(zs, zt, backend=backend)
    ref = jsd_reference(zs, zt)
    assert_close_to_ref("loss", loss, None, ref, torch.float32)
    assert_close_to_ref("dz", torch.autograd.grad(loss, base_s)[0], None,
                        torch.autograd.grad(ref, base_s)[0], torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_repeatable_and_nan(backend):
    zs, zt, target, kw = make_inputs((20,), 77, torch.bfloat16, OPTIONS["all"], seed=8)
    a = logitless.jsd(zs, zt, target, backend=backend, reduction="none", **kw)
    b = logitless.jsd(zs, zt, target, backend=backend, reduction="none", **kw)
    assert torch.equal(a, b)
    assert torch.equal(torch.autograd.grad(a.sum(), zs)[0], torch.autograd.grad(b.sum(), zs)[0])
    zt = zt.clone()
    zt[3, 5] = float("nan")
    loss = logitless.jsd(zs, zt, target, backend=backend, reduction="none", **kw)
    valid = target != -100
    assert torch.isnan(loss[3]) == bool(valid[3])
    others = torch.arange(20, device=DEVICE) != 3
    assert not torch.isnan(loss[others]).any()


@pytest.mark.parametrize("beta", [1e-6, 0.5, 1 - 1e-6])
def test_mixture_where_probabilities_underflow(beta):
    """The Triton mixture lm = log(beta q + (1 - beta) p) from the probabilities
    (``triton_lib.jsd_math.log_mixture``) where p, q or both underflow in fp32 (both
    below e^-103 at columns 60-99; one subnormal, times an extreme beta, at 100-129 and
    40-59): loss and dz finite and equal to float64, as where nothing underflows."""
    g = torch.Generator().manual_seed(21)
    zs = torch.randn(6, 150, generator=g) * 2
    zt = torch.randn(6, 150, generator=g) * 2
    zs[:, 40:100] = -120 + torch.randn(6, 60, generator=g)
    zt[:, 60:130] = -95 + torch.randn(6, 70, generator=g)
    zs[1, 5] = -88.0  # p subnormal after the lse shift; (1 - beta) p below FLT_MIN for beta near 1
    zs = zs.to(DEVICE).requires_grad_()
    zt = zt.to(DEVICE)
    loss = logitless.jsd(zs, zt, beta=beta, reduction="none", backend="triton")
    ref = jsd_reference(zs, zt, beta=beta, reduction="none")
    assert torch.isfinite(loss).all()
    assert_close_to_ref("loss", loss, None, ref, torch.float32)
    go = torch.randn(loss.shape, device=DEVICE)
    (ours,) = torch.autograd.grad(loss, zs, go)
    (r,) = torch.autograd.grad(ref, zs, go.double())
    assert torch.isfinite(ours).all()
    assert_close_to_ref("dz", ours, None, r, torch.float32)


def test_module_matches_function():
    zs, zt, target, kw = make_inputs((2, 6), 40, torch.float32, OPTIONS["all"], seed=9)
    mod = logitless.JSDLoss(backend="torch", **kw)
    assert torch.equal(mod(zs, zt, target), logitless.jsd(zs, zt, target, backend="torch", **kw))


def test_compile_fullgraph():
    zs, zt, target, kw = make_inputs((6,), 19, torch.float32, OPTIONS["all"], seed=10, device="cpu")

    def f(zs, zt, target):
        return logitless.jsd(zs, zt, target, backend="torch", **kw)

    eager = f(zs, zt, target)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(zs, zt, target)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(torch.autograd.grad(compiled, zs)[0], torch.autograd.grad(eager, zs)[0])


@pytest.mark.skipif(not HAS_CUDA, reason="host syncs only exist with a GPU")
def test_no_host_sync_on_gpu():
    zs, zt, target, kw = make_inputs((2, 50), 5000, torch.bfloat16, OPTIONS["all"], seed=11)
    logitless.jsd(zs, zt, target, **kw).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logitless.jsd(zs, zt, target, **kw).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not HAS_CUDA, reason="too slow for the Triton CPU interpreter")
def test_cuda_large_vocab():
    for dtype in DTYPES:
        check("triton", dtype, (64,), 128256, OPTIONS["all"], "mean", seed=12)
