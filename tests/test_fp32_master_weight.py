"""An fp32 master weight under autocast (linear_cross_entropy): the op takes the fp32 weight,
runs on its 16-bit copy and returns the weight's gradient in fp32; the Triton backend's
gradient-in-forward strategy then needs no fp32 dW accumulator beside it (the accumulator
is the gradient, unrounded, with no 16-bit dW and no cast after it).

Checked: gradients against float64 and against torch's own autocast route at the same
dtype; every strategy other than gradient-in-forward bitwise equal to the route before
(autocast's cast of the weight, a 16-bit dW, autograd's cast back to fp32); the
gradient-in-forward strategy's dW the fp32 accumulator that route rounded to 16 bits; one
plan per call, the cast route's; nothing changes without autocast, for a frozen weight, or
under no_grad.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import logitless
from logitless.ops.linear_cross_entropy.api import BACKENDS
from logitless.planning.overrides import override
from tests.conftest import DEVICE

N, H, V = 37, 40, 131


def _inputs(seed, n=N):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g).bfloat16().to(DEVICE)
    w = (torch.randn(V, H, generator=g) * H ** -0.5 * 2).to(DEVICE)
    b = (torch.randn(V, generator=g) * 0.5).to(DEVICE)
    t = torch.randint(0, V, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -100
    return x, w, b, t.to(DEVICE)


def _strategy(force):
    return override(strategy=force) if force else contextlib.nullcontext()


def _autocast(enabled=True):
    return torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=enabled)


def _master_route(x, w, b, t, backend, force, **kw):
    """The new route: the fp32 weight under autocast."""
    xs, ws, bs = (a.detach().clone().requires_grad_() for a in (x, w, b))
    with _strategy(force), _autocast():
        loss = logitless.linear_cross_entropy(xs, ws, t, bs, backend=backend, **kw)
    loss.backward()
    return loss, xs.grad, ws.grad, bs.grad


def _cast_route(x, w, b, t, backend, force, **kw):
    """The route before: the weight cast to bf16 outside the op (as autocast did), its
    16-bit gradient cast back to fp32 by autograd."""
    xs, ws, bs = (a.detach().clone().requires_grad_() for a in (x, w, b))
    with _strategy(force):
        loss = logitless.linear_cross_entropy(xs, ws.bfloat16(), t, bs.bfloat16(), backend=backend, **kw)
    loss.backward()
    return loss, xs.grad, ws.grad, bs.grad


BACKEND_CASES = [("torch", None), ("triton", None), ("triton", ("keep", 0)), ("triton", ("partial", 0))]
GIF_CASES = [("triton", ("grad_in_forward", 16)), ("triton", ("grad_in_forward", 64))]  # 3 chunks; one chunk


@pytest.mark.parametrize("backend,force", BACKEND_CASES + GIF_CASES)
@pytest.mark.parametrize("opts", [{}, dict(label_smoothing=0.1, softcap=6.0, z_loss=1e-3, reduction="sum")])
def test_gradients_fp32_and_against_float64(backend, force, opts):
    """The weight's gradient comes back fp32, x's and the bias' in their dtypes; each within
    torch's own error at the same dtype (autocast's bf16 logits, fp32 loss) plus a bf16 ulp."""
    x, w, b, t = _inputs(1)
    loss, dx, dw, db = _master_route(x, w, b, t, backend, force, **opts)
    assert dw.dtype == torch.float32 and dx.dtype == torch.bfloat16 and db.dtype == torch.float32
    xr, wr, br = (a.detach().double().requires_grad_() for a in (x, w.bfloat16(), b.bfloat16()))
    z = xr @ wr.T + br
    if opts.get("softcap"):
        z = opts["softcap"] * torch.tanh(z / opts["softcap"])
    red = opts.get("reduction", "mean")
    ref = F.cross_entropy(z, t, reduction=red, label_smoothing=opts.get("label_smoothing", 0.0))
    if opts.get("z_loss"):
        valid = t != -100
        zl = opts["z_loss"] * (torch.logsumexp(z, -1)[valid] ** 2).sum()
        ref = ref + (zl if red == "sum" else zl / valid.sum())
    ref_grads = torch.autograd.grad(ref, (xr, wr, br))
    xt, wt, bt = (a.detach().clone().requires_grad_() for a in (x, w, b))
    with _autocast():
        z_t = F.linear(xt, wt, bt).float()
        if opts.get("softcap"):
            z_t = opts["softcap"] * torch.tanh(z_t / opts["softcap"])
        loss_t = F.cross_entropy(z_t, t, reduction=red, label_smoothing=opts.get("label_smoothing", 0.0))
        if opts.get("z_loss"):
            valid = t != -100
            zl = opts["z_loss"] * (torch.logsumexp(z_t, -1)[valid] ** 2).sum()
            loss_t = loss_t + (zl if red == "sum" else zl / valid.sum())
    torch_grads = torch.autograd.grad(loss_t, (xt, wt, bt))
    assert abs(loss.double() - ref).item() <= abs(loss_t.double() - ref).item() + 1e-5 * max(1.0, abs(ref.item()))
    for ours, theirs, want in zip((dx, dw, db), torch_grads, ref_grads):
        scale = want.abs().max().item()
        bound = (theirs.double() - want).abs().max().item() + 2 ** -7 * scale + 1e-6
        assert (ours.double() - want).abs().max().item() <= bound


@pytest.mark.parametrize("backend,force", BACKEND_CASES)
def test_other_strategies_bitwise_as_the_cast_route(backend, force):
    """Where the gradient is not computed in the forward, the master route is the route
    before, bit for bit: the same 16-bit kernels, dW rounded to bf16 once, then fp32."""
    x, w, b, t = _inputs(2)
    new = _master_route(x, w, b, t, backend, force, memory_budget=N * V * 2 // 3)
    old = _cast_route(x, w, b, t, backend, force, memory_budget=N * V * 2 // 3)
    for a, c in zip(new, old):
        assert a.dtype == c.dtype and torch.equal(a, c)


@pytest.mark.parametrize("backend,force", GIF_CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grad_in_forward_returns_the_fp32_accumulator(backend, force, reduction):
    """Gradient-in-forward: dW is the fp32 accumulator itself. Over several token chunks the
    route before rounded that same accumulator to bf16 (then autograd cast it back):
    rounding ours gives its bits. With one chunk that route wrote dW by one bf16 GEMM
    (rounded inside it): within half a bf16 ulp of ours."""
    x, w, b, t = _inputs(3)
    new = _master_route(x, w, b, t, backend, force, reduction=reduction)
    old = _cast_route(x, w, b, t, backend, force, reduction=reduction)
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1]) and torch.equal(new[3], old[3])
    if force[1] < N:
        assert torch.equal(new[2].bfloat16(), old[2].bfloat16())
    else:
        # (cuBLAS may sum in another order for an fp32 output: a few fp32 ulps of the largest)
        bound = old[2].abs() * 2.0 ** -8 + old[2].abs().max() * 2.0 ** -16
        assert ((new[2] - old[2]).abs() <= bound).all()
    assert not torch.equal(new[2], old[2])  # (finer than bf16: the accumulator, not its rounding)


@pytest.mark.parametrize("budget", [None, 2000, N * V * 2 // 3, 4 * N * V * 2])
def test_the_plan_is_the_cast_routes_and_made_once(monkeypatch, budget):
    """The Triton backend plans once per call, on the weight's 16-bit copy: the master
    route's Config is the cast route's (its fp32 dW accumulator stays counted in the
    budget: it is alive from the forward on, where the cast route's dW appears in the
    backward only). The backward never plans."""
    seen = []
    real = BACKENDS["triton"].plan

    def plan(*args, **kwargs):
        seen.append((args[1].dtype, real(*args, **kwargs)))
        return seen[-1][1]

    monkeypatch.setattr(BACKENDS["triton"], "plan", plan)
    x, w, b, t = _inputs(4)
    _master_route(x, w, b, t, "triton", None, memory_budget=budget)
    _cast_route(x, w, b, t, "triton", None, memory_budget=budget)
    assert len(seen) == 2 and seen[0][0] == seen[1][0] == torch.bfloat16
    assert seen[0][1] == seen[1][1]


@pytest.mark.parametrize("case", ["no_autocast", "frozen", "no_grad"])
def test_unchanged_outside_the_case(case):
    """Without autocast an fp32 weight beside bf16 x is refused as before; a frozen fp32
    weight and no_grad take autocast's cast (nothing to return in fp32)."""
    x, w, b, t = _inputs(5)
    if case == "no_autocast":
        with pytest.raises(TypeError, match="autocast"):
            logitless.linear_cross_entropy(x, w, t, backend="triton")
        return
    ws = w.detach().clone().requires_grad_(case != "frozen")
    xs = x.detach().clone().requires_grad_()
    ctx = torch.no_grad() if case == "no_grad" else contextlib.nullcontext()
    with ctx, _autocast():
        loss = logitless.linear_cross_entropy(xs, ws, t, backend="triton")
    with torch.no_grad():
        ref = logitless.linear_cross_entropy(x, w.bfloat16(), t, backend="triton")
    assert torch.equal(loss.detach(), ref)
    if case == "frozen":
        loss.backward()
        assert ws.grad is None and xs.grad is not None
