"""linear_topk_kl beyond the op contract (tests/op_specs.py: every option against float64 on
both backends, odd sizes, empty, bad inputs, opcheck, no logits-sized allocation): every
direction and tail with every option in float64, the Triton kernels with several ids per
tile and split, a top-k that holds nearly all of the student's mass, finite differences of
the new gradients, the ids' order and dtypes, what a bad id gives without the CPU check,
torch.compile(fullgraph) and the module form.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import logitless
from logitless.ops.linear_topk_kl import custom_op
from logitless.ops.linear_topk_kl.reference import linear_topk_kl_reference
from tests.conftest import DEVICE
from tests.helpers import assert_close_to_ref

DIRECTIONS = ("forward", "reverse")
TAILS = ("bucket", "renormalize", "none")


def _inputs(n=11, h=12, v=37, k=5, dtype=torch.float64, seed=0, bias=False, ignore=True, spread=2.5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * h ** -0.5 * 2
    b = torch.randn(v, generator=g, dtype=torch.float64) * 0.5 if bias else None
    lp, ids = torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * spread, -1).topk(k, -1)
    order = torch.rand(n, k, generator=g).argsort(-1)
    ids, lp = ids.gather(-1, order), lp.gather(-1, order)
    t = torch.randint(0, v, (n,), generator=g)
    if ignore and n > 2:
        t[1] = -100
    to = dict(dtype=dtype, device=DEVICE)
    x, w = x.to(**to).requires_grad_(), w.to(**to).requires_grad_()
    b = b.to(**to).requires_grad_() if b is not None else None
    return x, w, b, ids.to(DEVICE), lp.to(DEVICE), t.to(DEVICE)


def _check(x, w, b, ids, lp, t, dtype, backend, reduction="mean", memory_budget=None, **kw):
    """Loss and gradients against float64 (the torch-in-dtype yardstick of the contract)."""
    out = logitless.linear_topk_kl(x, w, ids, lp, t, bias=b, backend=backend, reduction=reduction,
                                   memory_budget=memory_budget, **kw)
    ref = linear_topk_kl_reference(x, w, ids, lp, t, b, reduction=reduction, **kw)
    same = linear_topk_kl_reference(x, w, ids, lp, t, b, reduction=reduction, dtype=dtype, **kw)
    assert_close_to_ref("loss", out, same, ref, dtype)
    inputs = [i for i in (x, w, b) if i is not None]
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ours = torch.autograd.grad(out, inputs, g.to(out.dtype))
    refs = torch.autograd.grad(ref, inputs, g)
    sames = torch.autograd.grad(same, inputs, g.to(same.dtype))
    for i, (o, r, s) in enumerate(zip(ours, refs, sames)):
        assert_close_to_ref(f"grad {i}", o, s, r, dtype)
    return out


@pytest.mark.parametrize("direction,tail", list(itertools.product(DIRECTIONS, TAILS)))
def test_float64_every_option(direction, tail):
    """The torch backend in float64: the reference to fp64 rounding, each option alone and
    all of them, every reduction."""
    variants = [dict(), dict(temperature=0.6), dict(softcap=3.0), dict(hard_label_weight=0.4),
                dict(temperature=1.7, softcap=5.0, hard_label_weight=0.25, shift=True)]
    for i, (opts, reduction) in enumerate(itertools.product(variants, ("mean", "sum", "none"))):
        x, w, b, ids, lp, t = _inputs(seed=i, bias=i % 2 == 1)
        if opts.get("shift"):
            x, ids, lp, t = x.detach().reshape(1, 11, 12).requires_grad_(), ids[None], lp[None], t[None]
        _check(x, w, b, ids, lp, t, torch.float64, "torch", reduction, direction=direction, tail=tail, **opts)


@pytest.mark.parametrize("direction,tail", list(itertools.product(DIRECTIONS, TAILS)))
def test_triton_every_option(direction, tail):
    """The Triton kernels (the interpreter's 16 x 32 tiles on a CPU): many ids per tile
    (K = 23 of V = 67: the pointer walk's loop), several vocabulary splits, a budget that
    keeps part of the columns and recomputes the rest, every option."""
    x, w, b, ids, lp, t = _inputs(n=21, h=20, v=67, k=23, dtype=torch.float32, seed=3, bias=True)
    _check(x, w, b, ids, lp, t, torch.float32, "triton", "none", direction=direction, tail=tail, temperature=0.8,
           softcap=6.0, hard_label_weight=0.3, memory_budget=3_000)


def _peaked(dtype, backend_k=5, v=64, tail_q=5e-8, tail_p=1e-9):
    """A student whose K ids hold all but ``tail_q`` of its mass (logits L at the ids, 0
    elsewhere: the head is the identity) and a teacher whose ids hold all but ``tail_p``
    (float64 log-probs)."""
    k = backend_k
    big = math.log((v - k) * (1 - tail_q) / (k * tail_q))
    ids = torch.stack([torch.randperm(v, generator=torch.Generator().manual_seed(i))[:k] for i in range(6)])
    z = torch.zeros(6, v, dtype=torch.float64).scatter_(1, ids, big)
    z[:, 0] += 0.01 * torch.arange(6)  # rows differ a little
    w = torch.eye(v, dtype=torch.float64)
    lp = torch.full((6, k), math.log((1 - tail_p) / k), dtype=torch.float64)
    lp[:, 0] += 1e-3
    lp[:, 1] = torch.log((1 - tail_p) - lp[:, 0].exp() - (k - 2) * lp[:, 2].exp())
    return (z.to(dtype).to(DEVICE).requires_grad_(), w.to(dtype).to(DEVICE).requires_grad_(), ids.to(DEVICE),
            lp.to(DEVICE))


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("torch", torch.float32),
                                           ("triton", torch.float32)])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_near_full_mass(backend, dtype, direction):
    """Q within 1e-7 of 1 (5e-8 left: 1 - Q in fp32 rounds to 0) and P = 1 - 1e-9: the
    bucket's loss and gradients are finite and as exact as the inputs allow (float64: to
    fp64 rounding; fp32: as the fp32 logits way)."""
    x, w, ids, lp = _peaked(dtype)
    q = torch.softmax(x.detach().double().float(), -1).gather(1, ids).sum(1)  # Q in fp32 rounds to 1
    assert torch.all(torch.log1p(-q) == -math.inf)  # so log(1 - Q) from Q is -inf
    loss = logitless.linear_topk_kl(x, w, ids, lp, direction=direction, reduction="none", backend=backend)
    ref = linear_topk_kl_reference(x, w, ids, lp, direction=direction, reduction="none")
    assert torch.isfinite(loss).all()
    # The tail bin's own term, exactly: the bucket's loss minus the truncated one.
    tail = loss - logitless.linear_topk_kl(x, w, ids, lp, direction=direction, tail="none", reduction="none",
                                           backend=backend)
    ref_tail = ref - linear_topk_kl_reference(x, w, ids, lp, direction=direction, tail="none", reduction="none")
    expected = (1e-9 * math.log(1e-9 / 5e-8)) if direction == "forward" else 5e-8 * math.log(5e-8 / 1e-9)
    torch.testing.assert_close(ref_tail, torch.full_like(ref_tail, expected), rtol=2e-3, atol=0)
    if dtype == torch.float64:
        torch.testing.assert_close(loss, ref, rtol=1e-9, atol=1e-13)  # (log q of logits ~18: 4e-15 each)
        torch.testing.assert_close(tail, ref_tail, rtol=1e-6, atol=0)
    else:  # the fp32 logits (about 18 at the ids) carry ~1e-6 of rounding into each log q
        same = linear_topk_kl_reference(x, w, ids, lp, direction=direction, reduction="none", dtype=dtype)
        assert_close_to_ref("loss", loss, same, ref, dtype)
    (gx,) = torch.autograd.grad(loss.sum(), x)
    (rx,) = torch.autograd.grad(ref.sum(), x)
    assert torch.isfinite(gx).all()
    torch.testing.assert_close(gx.double(), rx.double(), rtol=1e-6 if dtype == torch.float64 else 1e-3,
                               atol=1e-12 if dtype == torch.float64 else 1e-6)


def test_triton_retry_pass_is_bitwise_the_fast_one(monkeypatch):
    """The forward's fast pass compares each tile with a few unrolled id slots; programs with
    a tile holding more are recomputed by the retry pass (every id, a loop). One slot (almost
    every program retried) and eight (none): the same bits, loss and gradients."""
    from logitless.ops.linear_topk_kl import triton_backend

    x, w, b, ids, lp, t = _inputs(n=21, h=20, v=67, k=9, dtype=torch.float32, seed=9, bias=True)
    results = []
    for slots in (1, 8):
        monkeypatch.setattr(triton_backend, "id_slots", lambda *shape, slots=slots: slots)
        loss = logitless.linear_topk_kl(x, w, ids, lp, t, bias=b, reduction="none", backend="triton",
                                        hard_label_weight=0.2, memory_budget=3_000)
        results.append((loss, *torch.autograd.grad(loss.sum(), (x, w, b))))
    for a, c in zip(*results):
        assert torch.equal(a, c)


@pytest.mark.parametrize("direction,tail", list(itertools.product(DIRECTIONS, TAILS)))
def test_finite_differences(direction, tail):
    """The new gradients (dense on the tail's columns, sparse at the ids, the hard labels
    at T != 1, the soft-cap) against finite differences in float64."""
    x, w, b, ids, lp, t = _inputs(n=4, h=5, v=11, k=3, seed=7, bias=True)
    kw = dict(direction=direction, tail=tail, temperature=0.7, softcap=3.0, hard_label_weight=0.3, backend="torch")

    def fn(x, w, b):
        return logitless.linear_topk_kl(x, w, ids, lp, t, bias=b, reduction="none", **kw)

    assert torch.autograd.gradcheck(fn, (x, w, b), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_ids_order_and_dtypes():
    """The order of a token's ids is immaterial (bitwise: they are sorted first); int32 ids
    and float64 / bf16 log-probs are taken as given."""
    x, w, b, ids, lp, t = _inputs(dtype=torch.float32, seed=2, bias=True)
    base = logitless.linear_topk_kl(x, w, ids, lp, t, bias=b, reduction="none", backend="torch")
    perm = torch.rand(ids.shape, generator=torch.Generator().manual_seed(4)).argsort(-1).to(DEVICE)
    shuffled = logitless.linear_topk_kl(x, w, ids.gather(-1, perm), lp.gather(-1, perm), t, bias=b,
                                        reduction="none", backend="torch")
    assert torch.equal(base, shuffled)
    as_int32 = logitless.linear_topk_kl(x, w, ids.int(), lp, t, bias=b, reduction="none", backend="torch")
    assert torch.equal(base, as_int32)
    low = lp.to(torch.bfloat16)
    rounded = logitless.linear_topk_kl(x, w, ids, low, t, bias=b, reduction="none", backend="torch")
    torch.testing.assert_close(rounded, logitless.linear_topk_kl(x, w, ids, low.double(), t, bias=b,
                                                                 reduction="none", backend="torch"))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_id_without_the_check_is_nan(monkeypatch, backend):
    """What a GPU gives (no host sync, no check): an id outside [0, V) makes its token's loss
    and gradient NaN; the other tokens are unchanged."""
    monkeypatch.setattr(custom_op, "check_teacher", lambda ids, lp, v: None)
    x, w, b, ids, lp, t = _inputs(dtype=torch.float32, seed=5)
    good = logitless.linear_topk_kl(x, w, ids, lp, t, reduction="none", backend=backend)
    for bad in (37, 1000, -3):
        wrong = ids.clone()
        wrong[4, 2] = bad
        out = logitless.linear_topk_kl(x, w, wrong, lp, t, reduction="none", backend=backend)
        assert torch.isnan(out[4]) and torch.equal(torch.cat([out[:4], out[5:]]), torch.cat([good[:4], good[5:]]))
        (gx,) = torch.autograd.grad(out.nansum(), x)
        assert torch.isnan(gx[4]).all() and torch.isfinite(torch.cat([gx[:4], gx[5:]])).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compile_fullgraph(backend):
    """torch.compile(fullgraph=True): no graph break, the eager results (loss and gradients)."""
    x, w, b, ids, lp, t = _inputs(dtype=torch.float32, seed=6, bias=True)

    def step(x, w, b):
        return logitless.linear_topk_kl(x, w, ids, lp, t, bias=b, direction="reverse", temperature=0.9,
                                        hard_label_weight=0.2, memory_budget=6_000, backend=backend)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=backend == "torch")
    eager = step(x, w, b)
    comp = compiled(x, w, b)
    torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-7)
    for a, c in zip(torch.autograd.grad(eager, (x, w, b)), torch.autograd.grad(comp, (x, w, b))):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-7)


def test_module_form():
    x, w, b, ids, lp, t = _inputs(dtype=torch.float32, seed=8, bias=True)
    loss_fn = logitless.LinearTopKKLLoss(direction="reverse", tail="renormalize", temperature=0.8,
                                         backend="torch")
    expected = logitless.linear_topk_kl(x, w, ids, lp, t, bias=b, direction="reverse", tail="renormalize",
                                        temperature=0.8, backend="torch")
    assert torch.equal(loss_fn(x, w, ids, lp, t, b), expected)
    with pytest.raises(ValueError, match="tail must be one of"):
        logitless.LinearTopKKLLoss(tail="clamped")
