"""log_probs on logits against the float64 reference (TRL's selective_log_softmax +
entropy_from_logits), both backends; Triton on the CPU interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch

import logitless
from logitless.ops.log_probs.api import OPS
from logitless.ops.log_probs.contract import LpBackwardCall, LpCall, LpPlanned
from logitless.ops.log_probs.reference import log_probs_reference
from logitless.options import LogProbOptions
from tests.conftest import DEVICE, HAS_CUDA
from tests.helpers import assert_close_to_ref, max_err

BACKENDS = ["torch", "triton"]


def make(lead, vocab, dtype, seed, ignore=0.0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*lead, vocab, generator=g) * scale).to(dtype).to(DEVICE).requires_grad_()
    tokens = torch.randint(0, vocab, lead, generator=g)
    if ignore:
        tokens[torch.rand(lead, generator=g) < ignore] = -100
    return logits, tokens.to(DEVICE)


def check(backend, dtype, lead, vocab, seed, temperature=1.0, entropy=True, ignore=0.0, logits=None):
    if logits is None:
        logits, tokens = make(lead, vocab, dtype, seed, ignore)
    else:
        logits, tokens = logits
    out = logitless.log_probs(logits, tokens, temperature=temperature, entropy=entropy, backend=backend)
    ours = out if entropy else (out, None)
    ref = log_probs_reference(logits, tokens, temperature=temperature)
    same = log_probs_reference(logits, tokens, temperature=temperature, dtype=logits.dtype)
    stat = torch.float32 if dtype == torch.float32 else dtype
    assert ours[0].dtype == torch.float32 and ours[0].shape == tokens.shape
    assert_close_to_ref("logp", ours[0], same[0], ref[0], stat)
    if entropy:
        assert_close_to_ref("entropy", ours[1], same[1], ref[1], stat)
    g = torch.Generator().manual_seed(seed + 1)
    g_lp = torch.randn(tokens.shape, generator=g).to(DEVICE)
    g_h = torch.randn(tokens.shape, generator=g).to(DEVICE)

    def total(o):
        return (o[0] * g_lp).sum() + ((o[1] * g_h).sum() if entropy else 0)

    (gl,) = torch.autograd.grad(total(ours), (logits,))
    (gr,) = torch.autograd.grad(total(ref), (logits,))
    (gs,) = torch.autograd.grad(total(same), (logits,))
    assert gl.dtype == dtype
    assert_close_to_ref("dlogits", gl, gs, gr, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_against_reference(backend, dtype, temperature):
    check(backend, dtype, (3, 7), 131, seed=int(temperature * 10), temperature=temperature, ignore=0.2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_entropy_one_token_3d(backend):
    check(backend, torch.float32, (1,), 5, seed=1, temperature=0.5, entropy=False)
    check(backend, torch.float32, (2, 2, 3), 300, seed=2, temperature=0.9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_logits_read_in_place(backend):
    base, tokens = make((6,), 50, torch.float32, 3)
    view = base.detach().T.contiguous().T.requires_grad_()  # column-major (6, 50)
    check(backend, torch.float32, None, None, 3, temperature=0.8, logits=(view, tokens))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_and_masked_columns(backend):
    logits = torch.zeros(0, 7, device=DEVICE, requires_grad=True)
    lp, ent = logitless.log_probs(logits, torch.zeros(0, dtype=torch.long, device=DEVICE), entropy=True,
                                  backend=backend)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    # -inf logits (masked classes): p log p -> 0, finite gradients
    z = torch.randn(4, 9, device=DEVICE)
    z[:, 3:6] = float("-inf")
    z.requires_grad_()
    t = torch.tensor([0, 1, 2, 8], device=DEVICE)
    lp, ent = logitless.log_probs(z, t, entropy=True, temperature=0.6, backend=backend)
    ref = log_probs_reference(z.detach()[:, [0, 1, 2, 6, 7, 8]], torch.tensor([0, 1, 2, 5], device=DEVICE),
                              temperature=0.6)
    assert max_err(lp, ref[0]) < 1e-5 and max_err(ent, ref[1]) < 1e-5
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(z.grad).all() and torch.all(z.grad[:, 3:6] == 0)


def test_finite_differences_float64():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 10, -100, 4, 4])
    for temperature in (0.7, 2.3):
        assert torch.autograd.gradcheck(
            lambda z, temperature=temperature: logitless.log_probs(z, t, temperature=temperature, entropy=True,
                                                                   backend="torch"),
            (z,), eps=1e-6, atol=1e-7)


def test_errors():
    z, t = make((3,), 7, torch.float32, 0)
    for bad in (0.0, -0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            logitless.log_probs(z, t, temperature=bad)
    with pytest.raises(ValueError, match="tokens"):
        logitless.log_probs(z, t[:2])
    with pytest.raises(TypeError, match="tokens"):
        logitless.log_probs(z, t.float())
    with pytest.raises(TypeError, match="logits"):
        logitless.log_probs(z.long(), t)
    with pytest.raises(TypeError, match="entropy"):
        logitless.log_probs(z, t, entropy="yes")


@pytest.mark.skipif(HAS_CUDA, reason="the CPU check; on a GPU an out-of-range token gives NaN")
def test_token_out_of_range_cpu():
    z, t = make((3,), 7, torch.float32, 0)
    t[0] = -3
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="tokens contains"):
            logitless.log_probs(z, t, backend=backend)


@pytest.mark.skipif(not HAS_CUDA, reason="GPU behaviour: NaN for an out-of-range token")
def test_token_out_of_range_gpu_is_nan():
    z, t = make((3,), 7, torch.float32, 0)
    t[0] = 7
    lp, ent = logitless.log_probs(z, t, entropy=True)
    assert torch.isnan(lp[0]) and torch.isnan(ent[0]) and not torch.isnan(lp[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_repeatable(backend):
    z, t = make((9,), 77, torch.bfloat16, 4)
    runs = []
    for _ in range(2):
        lp, ent = logitless.log_probs(z, t, temperature=0.7, entropy=True, backend=backend)
        (g,) = torch.autograd.grad(lp.sum() - ent.sum(), (z,))
        runs.append((lp, ent, g))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(backend, dynamic):
    head = torch.nn.Linear(8, 29).to(DEVICE)
    mod = logitless.LogProbs(temperature=0.7, entropy=True, backend=backend)

    def f(h, t):
        lp, ent = mod(head(h), t)
        return lp.sum() - 0.1 * ent.sum()

    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    for n in (5, 8):
        h = torch.randn(n, 8, device=DEVICE)
        t = torch.randint(0, 29, (n,), device=DEVICE)
        eager = torch.autograd.grad(f(h, t), list(head.parameters()))
        comp = torch.autograd.grad(compiled(h, t), list(head.parameters()))
        for a, c in zip(eager, comp):
            assert max_err(a, c) <= 1e-5 * max(1.0, a.abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    z, t = make((6,), 37, torch.float32, 5)
    opts = LogProbOptions(temperature=0.7, entropy=True)
    call = LpCall(z, t, opts, backend, 2**20, top_k=None, top_p=None, min_p=None, checked=True, k_max=-1,
                  batch_invariant=False)
    torch.library.opcheck(OPS.forward_op, OPS.args(call))
    out = OPS.outputs_of(OPS.forward_op(*OPS.args(call)))
    bcall = LpBackwardCall(torch.randn_like(out.logp), torch.randn_like(out.entropy), z.detach(), t, None,
                           out.entropy.detach(), out.lse, out.tau, None, opts, backend, LpPlanned(2**20, False, False))
    torch.library.opcheck(OPS.backward_op, OPS.backward_args(bcall))
