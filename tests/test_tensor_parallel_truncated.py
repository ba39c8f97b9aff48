"""Vocab-parallel linear_log_probs with truncated sampling (top_k / top_p / min_p) and
batch_invariant=True: 2 and 3 processes over gloo (NCCL with one GPU per rank when there
are enough GPUs).

Each rank holds a contiguous block of rows of the full head (uneven blocks, an empty
one, a padded vocabulary); the outputs (log p, entropy) and the gradients from both are
compared with the float64 sort-based reference on the full head, must be bitwise the same
on every rank, and -inf exactly outside the kept set. With ``batch_invariant=True`` a
row's outputs must be bitwise the same alone and inside other batches.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import logitless
from logitless.ops.common import invariant
from logitless.ops.linear_log_probs.reference import truncated_keep_reference, truncated_log_probs_reference
from tests._distributed import DIST_MARKS, TRITON_RANKS, blocks, cases_worker, same_on_every_rank, spawn
from tests.conftest import exact_for_interpreter

pytestmark = DIST_MARKS


def _head(seed, n, h, v_rows, v_real, trunc, *, scale=3.0, bias=False, temperature=1.0, softcap=None):
    """float64 x (n, h), the full weight (v_rows, h), bias, and tokens of which ~60% are
    drawn from the kept set (finite and -inf outputs both tested); the second ignored."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v_rows, h, generator=g, dtype=torch.float64) * h ** -0.5 * scale
    b = torch.randn(v_rows, generator=g, dtype=torch.float64) * 0.5 if bias else None
    t = torch.randint(0, v_real, (n,), generator=g)
    if n:
        z = x @ w[:v_real].T + (b[:v_real] if b is not None else 0)
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        keep = truncated_keep_reference(z / temperature, **_ref_trunc(trunc))
        pick = torch.multinomial(keep.double(), 1, generator=g)[:, 0]
        t = torch.where(torch.rand(n, generator=g) < 0.6, pick, t)
    if n > 2:
        t[1] = -100
    return x, w, b, t


def _maxdiff(a, b) -> float:
    return (a - b.detach()).abs().max().item() if a.numel() else 0.0


def _ref_trunc(trunc):
    return {k: v for k, v in trunc.items() if k in ("top_k", "top_p", "min_p")}


def _check_case(rank, device, rows, case):
    pg = dist.group.WORLD
    dtype = case.get("dtype", torch.float32)
    n, h = case.get("n", 9), case.get("h", 21)
    v_rows = sum(rows)
    v_real = case.get("vocab_size") or v_rows
    trunc = case["trunc"]
    opts = {k: case[k] for k in ("temperature", "softcap") if k in case}
    x, w, b, t = _head(case.get("seed", 0), n, h, v_rows, v_real, trunc, bias=case.get("bias", False),
                       scale=case.get("scale", 3.0), **opts)
    if case.get("per_token"):  # per-token tensors, some rows off
        g = torch.Generator().manual_seed(3)
        trunc = dict(top_k=torch.randint(0, 12, (n,), generator=g),
                     top_p=torch.where(torch.rand(n, generator=g) < 0.3, 1.0, 0.85).double(),
                     min_p=torch.where(torch.rand(n, generator=g) < 0.5, 0.0, 0.03).double())
    mine = blocks(rows, rank)
    cast = dict(dtype=dtype, device=device)
    xl = x.to(**cast).clone().requires_grad_()
    wl = w[mine].to(**cast).clone().requires_grad_()
    bl = b[mine].to(**cast).clone().requires_grad_() if b is not None else None
    tdev = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in trunc.items()}
    logp, ent = logitless.linear_log_probs(xl, wl, t.to(device), bl, entropy=True, backend=case.get("backend", "torch"),
                                           process_group=pg, vocab_size=case.get("vocab_size"),
                                           partial_dx=case.get("partial_dx", False), **opts, **tdev)
    real = slice(0, v_real)
    xr = x.clone().requires_grad_()
    wr = w[real].clone().requires_grad_()
    br = b[real].clone().requires_grad_() if b is not None else None
    rl, re = truncated_log_probs_reference(xr, wr, t, br, **opts, **_ref_trunc(trunc))
    name = case["name"]
    same_on_every_rank(f"{name}: logp", logp.detach())
    same_on_every_rank(f"{name}: entropy", ent.detach())
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    lp, en = logp.detach().cpu().double(), ent.detach().cpu().double()
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lp), fin), (name, lp, rl)
    assert (lp[~fin] == -math.inf).all(), name
    assert _maxdiff(lp[fin], rl[fin]) <= tol, (name, _maxdiff(lp[fin], rl[fin]))
    assert _maxdiff(en, re) <= tol, (name, _maxdiff(en, re))
    if n == 0:
        return
    g = torch.Generator().manual_seed(5)
    up_lp = torch.randn(n, generator=g, dtype=torch.float64)
    up_h = torch.randn(n, generator=g, dtype=torch.float64)
    (torch.where(torch.isfinite(logp), logp, 0) * up_lp.to(**cast)).sum().add(
        (ent * up_h.to(**cast)).sum()).backward()
    (torch.where(fin, rl, 0) * up_lp).sum().add((re * up_h).sum()).backward()
    dx = xl.grad
    if case.get("partial_dx"):
        dx = dx.double()
        dist.all_reduce(dx)
    else:
        same_on_every_rank(f"{name}: dx", dx)
    gtol = 1e-9 if dtype == torch.float64 else 2e-4
    assert (dx.cpu().double() - xr.grad).abs().max() <= gtol * max(1.0, xr.grad.abs().max().item()), name
    n_real = max(0, min(mine.stop, v_real) - mine.start)
    if n_real:
        ref_dw = wr.grad[mine.start:mine.start + n_real]
        assert (wl.grad[:n_real].cpu().double() - ref_dw).abs().max() <= gtol * max(1.0, ref_dw.abs().max().item())
        if b is not None:
            ref_db = br.grad[mine.start:mine.start + n_real]
            assert (bl.grad[:n_real].cpu().double() - ref_db).abs().max() <= gtol * max(1.0, ref_db.abs().max().item())
    assert torch.all(wl.grad[n_real:] == 0), f"{name}: padding rows got a gradient"


#: V = 151 > 64 candidates: flat top-p rows need the second pass (more candidates, one
#: collective per pass on every rank alike).
CASES = [
    dict(name="top-k", trunc=dict(top_k=7)),
    dict(name="top-k-1", trunc=dict(top_k=1)),
    dict(name="top-p-flat", trunc=dict(top_p=0.95), scale=0.5),
    dict(name="min-p", trunc=dict(min_p=0.05)),
    dict(name="k-p-min-p", trunc=dict(top_k=20, top_p=0.9, min_p=0.02), bias=True),
    dict(name="k-over-v", trunc=dict(top_k=10_000, top_p=0.95)),
    dict(name="every-option", trunc=dict(top_k=12, top_p=0.7), temperature=0.7, softcap=4.0, bias=True),
    dict(name="per-token", trunc=dict(top_k=0), per_token=True, temperature=0.8),
    dict(name="partial-dx-fp64", trunc=dict(top_p=0.8), dtype=torch.float64, partial_dx=True),
    dict(name="one-token", trunc=dict(top_p=0.5), n=1),
    dict(name="empty", trunc=dict(top_k=3), n=0),
]


def test_truncated_world3_uneven():
    """V = 151 over 3 ranks (50, 51, 50): every case; with an empty rank (80, 0, 71): a few."""
    spawn(cases_worker, 3, _check_case, [[50, 51, 50], [80, 0, 71]], CASES, ("top-p-flat", "k-p-min-p", "per-token"))


def test_truncated_world2_padded_vocab():
    """Megatron-style padding: 160 rows (80 + 80) of which 151 are classes."""
    cases = [dict(c, vocab_size=151) for c in CASES if c["name"] in ("top-p-flat", "every-option", "min-p")]
    spawn(cases_worker, 2, _check_case, [[80, 80]], cases)


def _triton_worker(rank, world, device):
    for case in (dict(name="triton-k-p", backend="triton", trunc=dict(top_k=9, top_p=0.9), h=16, bias=True,
                      temperature=0.7),
                 dict(name="triton-flat-top-p", backend="triton", trunc=dict(top_p=0.95), h=16, scale=0.5,
                      softcap=3.0)):
        _check_case(rank, device, [76, 75], case)


@TRITON_RANKS
def test_truncated_triton_backend():
    spawn(_triton_worker, 2)


def _invariant_worker(rank, world, device, backend, trunc):
    """batch_invariant=True: rows 0-2 alone, first in a small batch, reversed in a batch,
    and inside a batch larger than one block, bitwise the same; and close to the reference."""
    pg = dist.group.WORLD
    rows = [40, 33] if world == 2 else [30, 0, 43]
    from logitless.ops.linear_log_probs.api import BACKENDS as LLP

    block = invariant.rows(LLP.kind(backend), device)
    n = block + 9
    x, w, b, t = _head(11, n, 24, sum(rows), sum(rows), trunc, bias=True)
    if backend == "triton":
        x, w, b = exact_for_interpreter(x, w, b)
    mine = blocks(rows, rank)
    x, wl, bl = x.float().to(device), w[mine].float().to(device), b[mine].float().to(device)
    t = t.to(device)
    orders = [[0], [1], [2], [0, 1, 2, 3, 4], [4, 3, 2, 1, 0], list(range(3, n)) + [2, 0, 1]]
    seen = {}
    for order in orders:
        idx = torch.tensor(order, device=device)
        lp, en = logitless.linear_log_probs(x[idx], wl, t[idx], bl, entropy=True, temperature=0.9, backend=backend,
                                            process_group=pg, batch_invariant=True, **trunc)
        for pos, row in enumerate(order):
            if row < 3:
                got = (lp[pos], en[pos])
                if row in seen:
                    for a, c in zip(seen[row], got):
                        assert torch.equal(a.view(torch.int32), c.view(torch.int32)), (row, order[:4], a, c)
                else:
                    seen[row] = got
    assert set(seen) == {0, 1, 2}
    for row, (lp, en) in seen.items():
        same_on_every_rank(f"row {row}", torch.stack([lp, en]))
    rl, re = truncated_log_probs_reference(x[:3].double().cpu(), w.double(), t[:3].cpu(), b.double(), temperature=0.9,
                                           **trunc)
    got_lp = torch.stack([seen[r][0] for r in range(3)]).double().cpu()
    got_h = torch.stack([seen[r][1] for r in range(3)]).double().cpu()
    fin = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(got_lp), fin)
    assert (got_lp[fin] - rl[fin]).abs().max() <= 1e-4 if fin.any() else True
    assert (got_h - re).abs().max() <= 1e-4


@pytest.mark.parametrize("trunc", [{}, {"top_k": 5, "top_p": 0.9}])
def test_batch_invariant_world2(trunc):
    spawn(_invariant_worker, 2, "torch", trunc)


def test_batch_invariant_world3_empty_rank():
    spawn(_invariant_worker, 3, "torch", {"min_p": 0.05})


@TRITON_RANKS
def test_batch_invariant_triton():
    spawn(_invariant_worker, 2, "triton", {"top_k": 5})


def _ordered_worker(rank, world, device):
    """``sum_in_rank_order`` adds in rank order (((t0 + t1) + t2): 1e16 - 1e16 + 1 = 1, where
    another order gives 0 or 2), bitwise the same on every rank; ``gather_rows`` puts the
    ranks' columns side by side in rank order."""
    from logitless.distributed import gather_rows, sum_in_rank_order

    vals = [1e16, -1e16, 1.0]
    t = torch.full((5,), vals[rank], dtype=torch.float64, device=device)
    out = sum_in_rank_order(t, dist.group.WORLD)
    assert torch.equal(out, torch.ones(5, dtype=torch.float64, device=device)), out
    same_on_every_rank("sum", out)
    cols = torch.full((2, 2), float(rank), device=device)
    got = gather_rows(cols, dist.group.WORLD)
    assert got.shape == (2, 2 * world)
    assert torch.equal(got[0], torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0], device=device))


def test_sum_in_rank_order_and_gather_rows():
    spawn(_ordered_worker, 3)
