"""Truncated sampling (top_k / top_p / min_p) in linear_log_probs and log_probs against
the float64 sort-based reference (vLLM's sampler, written plainly).

On the GPU when there is one; otherwise the Triton backend runs on the CPU interpreter
at small sizes (V prime, H not a multiple of 16).
"""

from __future__ import annotations

import math

import pytest
import torch

import logitless
from logitless.formulas import truncation
from logitless.ops.linear_log_probs.reference import truncated_keep_reference, truncated_log_probs_reference
from tests.conftest import DEVICE, exact_for_interpreter

BACKENDS = ["torch", "triton"]

CASES = {
    "top_k": dict(top_k=7),
    "top_k_1": dict(top_k=1),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "k_p": dict(top_k=12, top_p=0.7),
    "all": dict(top_k=20, top_p=0.9, min_p=0.02),
    "k_over_v": dict(top_k=10_000, top_p=0.95),
}


def _inputs(lead, h, v, seed, dtype=torch.float32, scale=3.0, bias=False, kept_tokens=0.6, trunc=None,
            temperature=1.0, softcap=None):
    """x, w, (bias), tokens: a share of the tokens drawn from the kept set (so that both
    finite and -inf outputs are tested)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * h ** -0.5 * scale
    b = torch.randn(v, generator=g, dtype=torch.float64) * 0.5 if bias else None
    tokens = torch.randint(0, v, lead, generator=g)
    if trunc is not None and tokens.numel():
        z = x.reshape(-1, h) @ w.T + (b if b is not None else 0)
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        keep = truncated_keep_reference(z / temperature, **trunc)
        pick = torch.multinomial(keep.double(), 1, generator=g)[:, 0].reshape(lead)
        use = torch.rand(lead, generator=g) < kept_tokens
        tokens = torch.where(use, pick, tokens)
    cast = lambda t: t.to(dtype).to(DEVICE) if t is not None else None  # noqa: E731
    return cast(x), cast(w), cast(b), tokens.to(DEVICE)


def _check(lp, ent, ref_lp, ref_ent, tol=1e-4):
    fin = torch.isfinite(ref_lp)
    assert torch.equal(torch.isfinite(lp), fin), (lp, ref_lp)
    assert (lp[~fin] == -math.inf).all()
    if fin.any():
        assert (lp[fin].double() - ref_lp[fin]).abs().max() <= tol
    if ent is not None:
        assert (ent.double() - ref_ent).abs().max() <= tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_alone_and_combined(backend, case):
    trunc = CASES[case]
    x, w, b, t = _inputs((9,), 21, 97, seed=len(case), trunc=trunc)
    lp, ent = logitless.linear_log_probs(x, w, t, entropy=True, backend=backend, **trunc)
    rl, re = truncated_log_probs_reference(x.cpu(), w.cpu(), t.cpu(), **trunc)
    _check(lp.cpu(), ent.cpu(), rl, re)


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature_softcap_bias_ignore(backend):
    trunc = dict(top_k=9, top_p=0.85, min_p=0.01)
    opts = dict(temperature=0.6, softcap=4.0)
    x, w, b, t = _inputs((2, 5), 23, 89, seed=3, bias=True, trunc=trunc, **opts)
    t[0, 1] = -100
    lp, ent = logitless.linear_log_probs(x, w, t, b, entropy=True, backend=backend, **opts, **trunc)
    assert lp.shape == t.shape and lp[0, 1] == 0 and ent[0, 1] == 0
    rl, re = truncated_log_probs_reference(x.cpu(), w.cpu(), t.cpu(), b.cpu(), **opts, **trunc)
    _check(lp.cpu(), ent.cpu(), rl, re)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_token_tensors(backend):
    lead = (3, 4)
    g = torch.Generator().manual_seed(5)
    top_k = torch.randint(0, 15, lead, generator=g)
    top_p = torch.rand(lead, generator=g, dtype=torch.float64) * 0.6 + 0.4
    top_p[0, 0] = 1.0
    min_p = torch.rand(lead, generator=g, dtype=torch.float64) * 0.1
    min_p[1, :2] = 0.0
    trunc = dict(top_k=top_k, top_p=top_p, min_p=min_p)
    x, w, b, t = _inputs(lead, 19, 101, seed=6, trunc=trunc, temperature=0.8)
    dev = {k: v.to(DEVICE) for k, v in trunc.items()}
    lp, ent = logitless.linear_log_probs(x, w, t, entropy=True, temperature=0.8, backend=backend, **dev)
    rl, re = truncated_log_probs_reference(x.cpu(), w.cpu(), t.cpu(), temperature=0.8, **trunc)
    _check(lp.cpu(), ent.cpu(), rl, re)
    # (N,) tensors give the same
    flat = {k: v.reshape(-1) for k, v in dev.items()}
    lp2 = logitless.linear_log_probs(x, w, t, temperature=0.8, backend=backend, **flat)
    assert torch.equal(lp2, lp)


@pytest.mark.parametrize("case", ["top_p_flat", "min_p_flat", "top_k_big"])
def test_fallback_more_candidates(case):
    """Kept sets larger than the first pass's candidates: the fallback passes."""
    trunc = {"top_p_flat": dict(top_p=0.97), "min_p_flat": dict(min_p=0.2),
             "top_k_big": dict(top_k=300, top_p=0.999)}[case]
    x, w, b, t = _inputs((4,), 17, 1009, seed=11, scale=0.3, trunc=trunc)
    lp, ent = logitless.linear_log_probs(x.double(), w.double(), t, entropy=True, backend="torch", **trunc)
    rl, re = truncated_log_probs_reference(x.cpu(), w.cpu(), t.cpu(), **trunc)
    _check(lp.cpu(), ent.cpu(), rl, re, tol=1e-10)
    keep = truncated_keep_reference(x.cpu().double() @ w.cpu().double().T, **trunc)
    assert keep.sum(1).min() > truncation.MIN_CANDIDATES  # (the case does need the fallback)


def test_gradients_finite_differences():
    trunc = dict(top_k=6, top_p=0.9, min_p=0.01)
    x, w, b, t = _inputs((5,), 7, 31, seed=2, bias=True, trunc=trunc, kept_tokens=0.7, temperature=0.7,
                         softcap=3.0)
    x, w, b = (u.double().cpu().requires_grad_() for u in (x, w, b))
    t = t.cpu()
    g = torch.Generator().manual_seed(1)
    g_lp, g_h = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)

    def f(x, w, b):
        lp, ent = logitless.linear_log_probs(x, w, t, b, entropy=True, temperature=0.7, softcap=3.0,
                                             backend="torch", **trunc)
        return torch.where(torch.isinf(lp), torch.zeros_like(lp), lp), ent

    assert torch.autograd.gradcheck(f, (x, w, b), eps=1e-6, atol=1e-6)
    # and the same gradients as the float64 reference's autograd
    lp, ent = f(x, w, b)
    ours = torch.autograd.grad((lp * g_lp).sum() + (ent * g_h).sum(), (x, w, b))
    rl, re = truncated_log_probs_reference(x, w, t, b, temperature=0.7, softcap=3.0, **trunc)
    rl = torch.where(torch.isinf(rl), torch.zeros_like(rl), rl)
    theirs = torch.autograd.grad((rl * g_lp).sum() + (re * g_h).sum(), (x, w, b))
    for a, r in zip(ours, theirs):
        assert (a - r).abs().max() < 1e-10


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_fp32_against_reference(backend):
    trunc = dict(top_k=8, top_p=0.8)
    x, w, b, t = _inputs((6,), 21, 97, seed=8, bias=True, trunc=trunc, kept_tokens=0.7)
    x, w, b = (u.requires_grad_() for u in (x, w, b))
    lp, ent = logitless.linear_log_probs(x, w, t, b, entropy=True, backend=backend, **trunc)
    (torch.where(torch.isinf(lp), torch.zeros_like(lp), lp).sum() + ent.sum()).backward()
    xr, wr, br = (u.detach().cpu().double().requires_grad_() for u in (x, w, b))
    rl, re = truncated_log_probs_reference(xr, wr, t.cpu(), br, **trunc)
    (torch.where(torch.isinf(rl), torch.zeros_like(rl), rl).sum() + re.sum()).backward()
    for ours, ref in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert (ours.cpu().double() - ref).abs().max() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_odd_sizes(backend):
    trunc = dict(top_k=3, top_p=0.9)
    x, w, b, t = _inputs((1,), 5, 2, seed=1, trunc=trunc)  # one token, V = 2 (top_k >= V: off)
    lp = logitless.linear_log_probs(x, w, t, backend=backend, **trunc)
    rl, _ = truncated_log_probs_reference(x.cpu(), w.cpu(), t.cpu(), **trunc)
    _check(lp.cpu(), None, rl, None)
    x, w, b, t = _inputs((0,), 5, 13, seed=1)
    lp, ent = logitless.linear_log_probs(x.requires_grad_(), w, t, entropy=True, backend=backend, **trunc)
    assert lp.shape == (0,) and ent.shape == (0,)
    lp.sum().backward()
    assert x.grad.shape == x.shape


def test_off_values_are_the_default_path():
    x, w, b, t = _inputs((4,), 9, 29, seed=4)
    plain = logitless.linear_log_probs(x, w, t, backend="torch")
    off = logitless.linear_log_probs(x, w, t, backend="torch", top_k=0, top_p=1.0, min_p=0.0)
    assert torch.equal(plain, off)


def test_helion_backend_runs_its_fallback():
    """backend="helion" with truncation or batch_invariant: the Helion kernels take no
    threshold, so the call runs the backend Helion falls back to (the same bits)."""
    x, w, b, t = _inputs((6,), 16, 53, seed=6, trunc=dict(top_k=5))
    other = "triton" if DEVICE.type == "cuda" else "torch"
    for kw in (dict(top_k=5, top_p=0.9), dict(batch_invariant=True)):
        ours = logitless.linear_log_probs(x, w, t, entropy=True, backend="helion", **kw)
        ref = logitless.linear_log_probs(x, w, t, entropy=True, backend=other, **kw)
        for a, c in zip(ours, ref):
            assert torch.equal(a, c), kw


@pytest.mark.parametrize("kw, msg", [
    (dict(top_k=-1), "top_k"), (dict(top_k=1.5), "top_k"), (dict(top_p=0.0), r"top_p must be in \(0"),
    (dict(top_p=1.5), "top_p"), (dict(min_p=-0.1), "min_p"), (dict(min_p=1.1), "min_p"),
    (dict(top_p=float("nan")), "top_p"), (dict(top_k=torch.tensor([1, 2])), "shape"),
    (dict(min_p=torch.tensor([0.1, 0.2, 2.0])), "min_p"), (dict(top_k=torch.tensor([1.0, 2.0, 3.0])), "integer"),
])
def test_bad_values(kw, msg):
    x, w, b, t = _inputs((3,), 5, 7, seed=1)
    with pytest.raises((ValueError, TypeError), match=msg):
        logitless.linear_log_probs(x.cpu(), w.cpu(), t.cpu(), backend="torch", **kw)


def test_resolve_midpoint_and_fallback_flag():
    """tau lies strictly between the last kept and the first dropped value; a row whose
    kept set reaches past the candidates is not resolved."""
    cand = torch.tensor([[5.0, 4.0, 4.0, 1.0], [3.0, 2.9, 2.8, 2.7]])
    m = cand[:, 0]
    s = torch.tensor([10.0, 100.0])
    tr = truncation.Truncation(torch.tensor([2, 0]), torch.tensor([1.0, 0.99], dtype=torch.float64),
                               torch.zeros(2, dtype=torch.float64))
    tau, ok = truncation.resolve(cand, m, s, 1000, tr)
    assert tau[0] == 2.5 and ok[0]  # top-2 keeps the tie at 4
    assert not ok[1]  # top-p 0.99 of a flat row: past the 4 candidates


# ---- log_probs (from logits) ----

@pytest.mark.parametrize("backend", BACKENDS)
def test_log_probs_from_logits(backend):
    trunc = dict(top_k=10, top_p=0.85, min_p=0.01)
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 4, 103, generator=g, dtype=torch.float64) * 3
    keep = truncated_keep_reference(logits.reshape(-1, 103) / 0.9, **trunc)
    t = torch.multinomial(keep.double(), 1, generator=g)[:, 0].reshape(3, 4)
    t[0, :2] = torch.randint(0, 103, (2,), generator=g)
    z = logits.float().to(DEVICE).requires_grad_()
    lp, ent = logitless.log_probs(z, t.to(DEVICE), temperature=0.9, entropy=True, backend=backend, **trunc)
    rl, re = truncated_log_probs_reference(None, None, t, logits=logits, temperature=0.9, **trunc)
    _check(lp.cpu(), ent.cpu(), rl, re)
    (torch.where(torch.isinf(lp), torch.zeros_like(lp), lp).sum() + ent.sum()).backward()
    zr = logits.clone().requires_grad_()
    rl, re = truncated_log_probs_reference(None, None, t, logits=zr, temperature=0.9, **trunc)
    (torch.where(torch.isinf(rl), torch.zeros_like(rl), rl).sum() + re.sum()).backward()
    assert (z.grad.cpu().double() - zr.grad).abs().max() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_inputs(backend):
    """16-bit inputs (the threshold pass's GEMM in the input dtype on Triton): the
    reference on the same bf16 values in float64."""
    trunc = dict(top_k=10, top_p=0.9, min_p=0.02)
    x, w, b, t = _inputs((2, 7), 32, 131, seed=12, trunc=trunc, dtype=torch.bfloat16)
    lp, ent = logitless.linear_log_probs(x, w, t, entropy=True, temperature=0.9, backend=backend, **trunc)
    rl, re = truncated_log_probs_reference(x.cpu().double(), w.cpu().double(), t.cpu(), temperature=0.9, **trunc)
    _check(lp.cpu(), ent.cpu(), rl, re, tol=2e-4)


@pytest.mark.parametrize("budget", [None, 6_000])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_triton_kept_and_recomputed_columns(budget, softcap):
    """The Triton backward with the forward's kept columns (e = 0 outside the set), with
    some recomputed (a small budget), and with a soft-cap (nothing kept)."""
    trunc = dict(top_k=9, min_p=0.01)
    x, w, b, t = _inputs((13,), 24, 211, seed=21, bias=True, trunc=trunc, kept_tokens=0.8, softcap=softcap)
    x, w, b = (u.requires_grad_() for u in (x, w, b))
    lp, ent = logitless.linear_log_probs(x, w, t, b, entropy=True, softcap=softcap, backend="triton",
                                         memory_budget=budget, **trunc)
    g = torch.Generator().manual_seed(3)
    g1, g2 = torch.randn(13, generator=g).to(DEVICE), torch.randn(13, generator=g).to(DEVICE)
    (torch.where(torch.isinf(lp), torch.zeros_like(lp), lp) * g1 + ent * g2).sum().backward()
    xr, wr, br = (u.detach().cpu().double().requires_grad_() for u in (x, w, b))
    rl, re = truncated_log_probs_reference(xr, wr, t.cpu(), br, softcap=softcap, **trunc)
    _check(lp.detach().cpu(), ent.detach().cpu(), rl.detach(), re.detach())
    gr = g1.cpu().double(), g2.cpu().double()
    (torch.where(torch.isinf(rl), torch.zeros_like(rl), rl) * gr[0] + re * gr[1]).sum().backward()
    for ours, ref in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert (ours.cpu().double() - ref).abs().max() < 1e-4


# ---- the Triton threshold pass: candidates kernel, routes ----

def _counted(monkeypatch, targets):
    """Counts of the calls of the functions ``targets`` ({name: (module, attribute)}),
    each patched to count itself."""
    calls = dict.fromkeys(targets, 0)

    def counted(name, f):
        def g(*a, **k):
            calls[name] += 1
            return f(*a, **k)
        return g

    for name, (module, attr) in targets.items():
        monkeypatch.setattr(module, attr, counted(name, getattr(module, attr)))
    return calls


def _calls(monkeypatch):
    """Counts of the Triton threshold pass's launches and of the forward with tau."""
    from logitless.ops.linear_log_probs import triton_backend
    from logitless.triton_lib import log_probs_candidates as LC

    return _counted(monkeypatch, dict(candidates=(LC, "candidates"), masses=(LC, "masses"),
                                      forward=(triton_backend, "forward")))


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_candidates_kernel_against_topk(splits):
    """The kernel's running top-C per split, merged, is torch.topk of a (and the upper
    bound hi restricts it to a < hi); its max, sum and token logit are a's."""
    from dataclasses import replace

    from logitless.ops.linear_log_probs import triton_backend
    from logitless.ops.linear_log_probs.truncation import _merged_candidates
    from logitless.options import LogProbOptions
    from logitless.triton_lib import log_probs_candidates as LC

    x, w, b, t = _inputs((7,), 19, 523, seed=31, bias=True)
    opts = LogProbOptions(temperature=0.7, softcap=5.0)
    plan = triton_backend.linear(x, w, b, opts, budget=2 ** 30, need_grad=False, cute=False).forward
    plan = replace(plan, vocab_splits=splits)
    a = 5.0 * torch.tanh((x.double() @ w.double().T + b.double()) / 5.0) / 0.7
    cand, m, s, u, a_t = _merged_candidates(LC.candidates(x, w, b, t, plan, 5.0, 0.7, 64, True, splits=splits), 64)
    ref = a.topk(64, dim=1).values
    assert (cand.double() - ref).abs().max() < 1e-5
    assert (m.double() - a.max(1).values).abs().max() < 1e-5
    assert (s - torch.exp(a - a.max(1, keepdim=True).values).sum(1)).abs().max() < 1e-3
    assert (a_t.double() - a.gather(1, t[:, None])[:, 0]).abs().max() < 1e-5
    hi = ((ref[:, 10] + ref[:, 11]) / 2).float()
    cand2, m2, s2, u2, _ = _merged_candidates(LC.candidates(x, w, b, t, plan, 5.0, 0.7, 64, True, hi=hi,
                                                            splits=splits), 64)
    ref2 = torch.where(a < hi.double()[:, None], a, -math.inf).topk(64, dim=1).values
    assert (cand2.double() - ref2).abs().max() < 1e-5
    above = torch.where(a >= hi.double()[:, None], a, -math.inf)  # (its max, sum, u: of a >= hi)
    e = torch.exp(above - above.max(1, keepdim=True).values)
    assert (m2.double() - above.max(1).values).abs().max() < 1e-5
    assert (s2 - e.sum(1)).abs().max() < 1e-4
    ref_u = torch.where(e > 0, e * (above - above.max(1, keepdim=True).values), torch.zeros_like(e)).sum(1)
    assert (u2 - ref_u).abs().max() < 1e-4
    # the mass kernel: counts and masses above given thresholds
    thr = ((ref[:, 0::2] + ref[:, 1::2]) / 2).float()  # (between values: no float ties)
    cnt, mass = LC.masses(x, w, b, plan, 5.0, 0.7, m, thr)
    ge = a[:, None, :] >= thr.double()[:, :, None]
    assert torch.equal(cnt.sum(0).long(), ge.sum(2))
    e = torch.exp(a - m.double()[:, None])[:, None, :]
    assert (mass.double().sum(0) - (e * ge).sum(2)).abs().max() < 1e-4


@pytest.mark.parametrize("c, splits, upper, indices", [(4, 1, False, False), (8, 2, True, False),
                                                       (16, 1, False, False), (8, 2, False, True),
                                                       (16, 1, True, True)])
def test_triton_candidates_filter_ties(c, splits, upper, indices):
    """The per-row filter with a small C over many tiles (63 per row: whole-tile merges
    while more than C values of a tile pass a row's floor, then values entering one at a
    time), every value of a row three times (W's rows in groups of three: ties at and
    around the C-th value): the candidates are bitwise torch.topk of the kernel's own a,
    multiplicities included; with an upper bound, of a < hi. With the columns (the
    sparse backward's): each is a distinct column holding its candidate's value."""
    from logitless.ops.linear_log_probs import triton_backend
    from logitless.ops.linear_log_probs.truncation import _merged_candidates
    from logitless.options import LogProbOptions
    from logitless.triton_lib import log_probs_candidates as LC
    from logitless.triton_lib.log_probs_threshold import scaled_logits

    v = 2001  # (not a multiple of the tile: -inf columns in the last one)
    x, w, b, t = _inputs((37,), 19, v // 3, seed=53, bias=True)
    x, w, b = exact_for_interpreter(x, w, b)  # (equal W rows: equal logits on any CPU)
    g = torch.Generator().manual_seed(5)
    perm = torch.randperm(v, generator=g).to(DEVICE)
    w, b = w.repeat(3, 1)[perm].contiguous(), b.repeat(3)[perm].contiguous()
    opts = LogProbOptions(temperature=0.7)
    plan = triton_backend.linear(x, w, b, opts, budget=2 ** 30, need_grad=False, cute=False).forward
    assert plan.block_v >= c and math.ceil(v / plan.block_v) >= 8 * splits
    a = scaled_logits(x, w, b, None, 0.7, 0, v, plan).float()
    ref_a = a
    hi = None
    if upper:  # (a bound between two of the row's values: the 3rd and 4th distinct ones)
        d = a.topk(12, dim=1).values
        hi = ((d[:, 8] + d[:, 9]) / 2).contiguous()
        ref_a = torch.where(a < hi[:, None], a, torch.full_like(a, -math.inf))
    cand, m, s, u, a_t, *cols = _merged_candidates(LC.candidates(x, w, b, t, plan, None, 0.7, c, False, hi=hi,
                                                                 splits=splits, indices=indices), c)
    ref = ref_a.topk(c, dim=1).values
    assert torch.equal(cand, ref)
    if indices:
        cols = cols[0].long()
        assert torch.equal(ref_a.gather(1, cols), cand)
        assert (cols.sort(1).values.diff(dim=1) > 0).all()  # (distinct columns)
    assert (ref[:, -1:] == ref_a).sum(1).min() >= 3  # (ties at the C-th value in every row)
    if not upper:
        assert torch.equal(m, a.max(1).values)
        assert torch.equal(a_t, a.gather(1, t[:, None])[:, 0])


ROUTES = {
    # (truncation, scale of W, V): the launches each route takes
    "in_candidates": (dict(top_k=7, top_p=0.9), 3.0, 1031),
    "min_p_wide": (dict(min_p=0.3), 0.3, 1009),
    "top_p_search": (dict(top_p=0.9), 0.3, 2003),
    "min_p_wide_top_p": (dict(min_p=0.2, top_p=0.6), 0.3, 1013),
    "min_p_wide_top_p_inside": (dict(min_p=0.02, top_p=0.5), 3.0, 1013),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_triton_routes(route, monkeypatch):
    """Each route of the Triton threshold pass gives the float64 reference's log-probs
    and entropy in the launches it should take (a forward only for min-p alone, with its
    exact tau)."""
    from logitless.ops.linear_log_probs import truncation as tr_op

    trunc, scale, v = ROUTES[route]
    x, w, b, t = _inputs((5,), 13, v, seed=41, scale=scale, trunc=trunc, temperature=0.9)
    monkeypatch.setattr(tr_op, "MASS_THRESHOLDS", 8)  # (more narrowings, a faster interpreter)
    calls = _calls(monkeypatch)
    lp, ent = logitless.linear_log_probs(x, w, t, entropy=True, temperature=0.9, backend="triton", **trunc)
    rl, re = truncated_log_probs_reference(x.cpu(), w.cpu(), t.cpu(), temperature=0.9, **trunc)
    _check(lp.cpu(), ent.cpu(), rl, re)
    keep = truncated_keep_reference(x.cpu().double() @ w.cpu().double().T / 0.9, **trunc).sum(1)
    assert calls["forward"] == (route == "min_p_wide")
    if route == "in_candidates":
        assert calls == dict(candidates=1, masses=0, forward=0) and keep.max() < 64
    elif route == "min_p_wide":  # (the second pass: the forward with tau = max + log min_p)
        assert calls == dict(candidates=1, masses=0, forward=1) and keep.min() > 64
    elif route == "top_p_search":
        assert calls["masses"] >= 2 and calls["candidates"] >= 2 and keep.min() > 64
    elif route == "min_p_wide_top_p":
        assert calls["masses"] >= 1 and calls["candidates"] >= 2 and keep.min() > 64
    else:  # the crossing inside the candidates once the min-p set's mass is known
        assert calls == dict(candidates=1, masses=1, forward=0)


def test_triton_search_gradients(monkeypatch):
    """The backward after the mass search (tau from it, lse from its sums)."""
    trunc = dict(top_p=0.8, min_p=0.1)
    x, w, b, t = _inputs((6,), 13, 1021, seed=43, scale=0.3, bias=True, trunc=trunc, kept_tokens=0.9)
    x, w, b = (u.requires_grad_() for u in (x, w, b))
    calls = _calls(monkeypatch)
    lp, ent = logitless.linear_log_probs(x, w, t, b, entropy=True, backend="triton", **trunc)
    assert calls["masses"] >= 1 and calls["forward"] == 0
    (torch.where(torch.isinf(lp), torch.zeros_like(lp), lp).sum() + ent.sum()).backward()
    xr, wr, br = (u.detach().cpu().double().requires_grad_() for u in (x, w, b))
    rl, re = truncated_log_probs_reference(xr, wr, t.cpu(), br, **trunc)
    _check(lp.detach().cpu(), ent.detach().cpu(), rl.detach(), re.detach())
    (torch.where(torch.isinf(rl), torch.zeros_like(rl), rl).sum() + re.sum()).backward()
    for ours, ref in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        assert (ours.cpu().double() - ref).abs().max() < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_wide_min_p_then_top_p_inside(backend):
    """min-p keeps more than the candidates, top-p then ends inside them: K1's mass is
    not the row's (it was taken as the row's when top-k was off)."""
    trunc = dict(min_p=0.02, top_p=0.5)
    x, w, b, t = _inputs((5,), 13, 1013, seed=41, scale=3.0, trunc=trunc, temperature=0.9)
    lp, ent = logitless.linear_log_probs(x, w, t, entropy=True, temperature=0.9, backend=backend, **trunc)
    rl, re = truncated_log_probs_reference(x.cpu(), w.cpu(), t.cpu(), temperature=0.9, **trunc)
    _check(lp.cpu(), ent.cpu(), rl, re)
    mp = truncated_keep_reference(x.cpu().double() @ w.cpu().double().T / 0.9, min_p=0.02).sum(1)
    assert mp.max() > truncation.MIN_CANDIDATES


def test_triton_search_batch_invariant(monkeypatch):
    """batch_invariant=True through the mass search and min-p's bounded pass: a row's
    outputs are bitwise the same alone, in a small batch, inside a batch of more than one
    block and at its end (the search of a row follows from the row alone)."""
    from logitless.ops.common import invariant
    from logitless.ops.linear_log_probs import truncation as tr_op
    from tests.test_batch_invariant import _rows_equal

    monkeypatch.setattr(tr_op, "MASS_THRESHOLDS", 8)
    from logitless.ops.linear_log_probs.api import BACKENDS as LLP

    n = invariant.rows(LLP.kind("triton"), torch.device(DEVICE)) + 8
    x, w, b, t = _inputs((n,), 13, 257, seed=47, scale=0.3)
    x, w = exact_for_interpreter(x, w)  # (a CPU BLAS's bits may follow a row's place in the tile)
    g = torch.Generator().manual_seed(2)
    top_p = (torch.rand(n, generator=g, dtype=torch.float64) * 0.3 + 0.6).to(DEVICE)
    min_p = torch.zeros(n, dtype=torch.float64).to(DEVICE)
    min_p[1], min_p[2], top_p[2] = 0.05, 0.3, 1.0  # row 1: min-p under top-p; row 2: min-p alone

    def fn(idx):
        return logitless.linear_log_probs(x[idx], w, t[idx], entropy=True, backend="triton", batch_invariant=True,
                                          top_p=top_p[idx], min_p=min_p[idx])

    _rows_equal(fn, "triton")


def _sparse_calls(monkeypatch):
    """Counts of the sparse backward's and the dense backward's launches."""
    from logitless.ops.linear_log_probs import triton_backend
    from logitless.triton_lib import log_probs_sparse as LS

    return _counted(monkeypatch, dict(sparse=(LS, "sparse_backward"), dense=(triton_backend, "backward")))


SPARSE = {
    # (truncation, options, V, W's rows repeated, bias): every row's kept set inside its candidates
    "top_k_softcap": (dict(top_k=7), dict(temperature=0.7, softcap=4.0), 523, 1, True),
    "k_p": (dict(top_k=20, top_p=0.8), dict(temperature=1.2), 401, 1, False),
    "k_min_p": (dict(top_k=5, min_p=0.05), dict(), 301, 1, True),
    "peaked_top_p": (dict(top_p=0.8), dict(temperature=0.4), 1031, 1, False),
    "per_token_k": (dict(top_k=(1, 30)), dict(temperature=0.8, softcap=3.0), 389, 1, True),
    "ties_at_kth": (dict(top_k=7), dict(), 262, 2, True),  # (each value twice: 8 kept)
    "ties_past_c": (dict(top_k=3), dict(), 263, 1, True),  # (80 tied largest: the dense fallback)
    "mixed_top_p": (dict(top_p=0.8), dict(temperature=0.5), 1031, 1, True),  # (flat rows: dense, the rest sparse)
}


def _sparse_inputs(case, n):
    """x, w, b, tokens (60% drawn from the kept set, one ignored), trunc, opts."""
    trunc, opts, v, rep, has_bias = SPARSE[case]
    if case == "per_token_k":
        trunc = dict(top_k=torch.randint(*trunc["top_k"], (n,), generator=torch.Generator().manual_seed(3)))
    x, w, b, _ = _inputs((n,), 15, v // rep, seed=59, scale=3.0, bias=has_bias)
    x, w, b = x.cpu().double(), w.cpu().double(), b.cpu().double() if b is not None else None
    if rep > 1 or case == "ties_past_c":  # (equal W rows: equal logits on any CPU)
        x, w, b = exact_for_interpreter(x, w, b)
    if case == "mixed_top_p":
        x[::3] *= 0.02  # (flat rows: top-p keeps hundreds, the mass search)
    w, b = w.repeat(rep, 1), (b.repeat(rep) if b is not None else None)
    if case == "ties_past_c":
        w[:80], b[:80] = w[0], 20.0
    z = x @ w.T + (b if b is not None else 0)
    if opts.get("softcap"):
        z = opts["softcap"] * torch.tanh(z / opts["softcap"])
    keep = truncated_keep_reference(z / opts.get("temperature", 1.0), **trunc)
    g = torch.Generator().manual_seed(4)
    t = torch.where(torch.rand(n, generator=g) < 0.6, torch.multinomial(keep.double(), 1, generator=g)[:, 0],
                    torch.randint(0, w.shape[0], (n,), generator=g))
    t[2] = -100
    cast = lambda u: u.float().contiguous().to(DEVICE) if u is not None else None  # noqa: E731
    return cast(x), cast(w), cast(b), t.to(DEVICE), trunc, opts


@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("case", list(SPARSE))
def test_triton_sparse_backward(case, entropy, monkeypatch):
    """The backward from the candidates' columns (no GEMM) against the float64
    reference's autograd, with upstream gradients on log p and entropy, ignored tokens,
    tokens outside the kept set; a directional finite difference of the reference; the
    forward's outputs bitwise those without gradients (the kernel keeping columns)."""
    from logitless.ops.linear_log_probs import truncation as tr_op

    monkeypatch.setattr(tr_op, "MASS_THRESHOLDS", 8)  # (a faster interpreter)
    n = 9
    x, w, b, t, trunc, opts = _sparse_inputs(case, n)
    dev = {k: (u.to(DEVICE) if isinstance(u, torch.Tensor) else u) for k, u in trunc.items()}
    calls = _sparse_calls(monkeypatch)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    bg = b.clone().requires_grad_() if b is not None else None
    out = logitless.linear_log_probs(xg, wg, t, bg, entropy=entropy, backend="triton", **opts, **dev)
    lp, ent = out if entropy else (out, None)
    plain = logitless.linear_log_probs(x, w, t, b, entropy=entropy, backend="triton", **opts, **dev)
    assert torch.equal(lp, plain[0] if entropy else plain)
    gen = torch.Generator().manual_seed(7)
    g_lp = torch.randn(n, generator=gen, dtype=torch.float64)
    g_h = torch.randn(n, generator=gen, dtype=torch.float64)
    loss = (torch.where(torch.isinf(lp), torch.zeros_like(lp), lp) * g_lp.to(DEVICE).float()).sum()
    if entropy:
        loss = loss + (ent * g_h.to(DEVICE).float()).sum()
    ins = (xg, wg) + ((bg,) if bg is not None else ())
    ours = torch.autograd.grad(loss, ins)
    assert calls == dict(sparse=int(case != "ties_past_c"), dense=int(case in ("ties_past_c", "mixed_top_p")))
    ref_in = tuple(u.detach().cpu().double().requires_grad_() for u in ins)

    def ref_loss(xr, wr, br=None):
        rl, re = truncated_log_probs_reference(xr, wr, t.cpu(), br, **opts, **trunc)
        f = (torch.where(torch.isinf(rl), torch.zeros_like(rl), rl) * g_lp).sum()
        return f + (re * g_h).sum() if entropy else f

    theirs = torch.autograd.grad(ref_loss(*ref_in), ref_in)
    rl, _ = truncated_log_probs_reference(*(u.detach() for u in ref_in[:2]), t.cpu(),
                                          ref_in[2].detach() if bg is not None else None, **opts, **trunc)
    assert torch.isinf(rl).any() and torch.isfinite(rl[rl != 0]).any()  # (tokens in and out of the set)
    for a, r in zip(ours, theirs):
        assert (a.cpu().double() - r).abs().max() < 1e-4
    # a directional finite difference of the reference (the kept sets do not change; with
    # ties, along x only: W's equal rows stay equal)
    d = tuple(torch.randn(u.shape, generator=gen, dtype=torch.float64) * (i == 0 or "ties" not in case)
              for i, u in enumerate(ref_in))
    eps = 1e-6
    with torch.no_grad():
        fd = (ref_loss(*(u + eps * e for u, e in zip(ref_in, d)))
              - ref_loss(*(u - eps * e for u, e in zip(ref_in, d)))) / (2 * eps)
    ours_d = sum((a.cpu().double() * e).sum() for a, e in zip(ours, d))
    assert abs(ours_d - fd) < 1e-3 * max(1.0, abs(fd))


@pytest.mark.parametrize("mixed", [False, True])
def test_triton_sparse_backward_empty_and_partial_grads(mixed, monkeypatch):
    """An empty batch gives zero gradients; only some inputs needing gradients (dx alone,
    dW alone, db alone) gives the same ones as all; ``mixed``: some rows through the
    dense backward (flat rows, top-p past the candidates), dW and db summed onto."""
    from logitless.ops.linear_log_probs import truncation as tr_op

    monkeypatch.setattr(tr_op, "MASS_THRESHOLDS", 8)
    x, w, b, t = _inputs((6,), 15, 211 if not mixed else 1031, seed=61, bias=True)
    trunc = dict(top_p=0.8, temperature=0.5) if mixed else dict(top_k=4, temperature=0.8)
    if mixed:
        x[::3] *= 0.02
    calls = _sparse_calls(monkeypatch)
    wg = w.clone().requires_grad_()
    lp = logitless.linear_log_probs(x[:0].clone().requires_grad_(), wg, t[:0], b, backend="triton", top_k=4)
    (dw,) = torch.autograd.grad(lp.sum(), (wg,), allow_unused=True)
    assert dw is None or (dw == 0).all()
    full = [u.clone().requires_grad_() for u in (x, w, b)]
    lp = logitless.linear_log_probs(*full[:2], t, full[2], backend="triton", **trunc)
    all_g = torch.autograd.grad(torch.where(torch.isinf(lp), 0.0, lp).sum(), full)
    for i in range(3):
        one = [u.clone().requires_grad_(j == i) for j, u in enumerate((x, w, b))]
        lp = logitless.linear_log_probs(*one[:2], t, one[2], backend="triton", **trunc)
        (g,) = torch.autograd.grad(torch.where(torch.isinf(lp), 0.0, lp).sum(), (one[i],))
        assert torch.equal(g, all_g[i]) if not mixed else (g - all_g[i]).abs().max() < 1e-6
    assert calls == dict(sparse=4, dense=4 * mixed)


def test_triton_sparse_backward_strided_weight(monkeypatch):
    """W as a transposed view ((H, V) storage, a tied embedding's layout): the sparse
    backward's gradients are those of the contiguous W, and dW comes back row-major."""
    x, w, b, t = _inputs((5,), 15, 211, seed=67, bias=True)
    calls = _sparse_calls(monkeypatch)
    grads = []
    strided = w.T.contiguous().T
    assert strided.stride() == (1, 211)
    for wv in (w, strided):
        xg, wg = x.clone().requires_grad_(), wv.detach().requires_grad_()
        lp = logitless.linear_log_probs(xg, wg, t, b, backend="triton", top_k=6, temperature=0.9)
        grads.append(torch.autograd.grad(torch.where(torch.isinf(lp), 0.0, lp).sum(), (xg, wg)))
    for a, r in zip(*grads):
        assert torch.equal(a, r)
    assert calls == dict(sparse=2, dense=0)


def test_triton_fallback_rows_forward_alone(monkeypatch):
    """Rows the search leaves (a tie of 80 values past the candidates) run the chunked pass
    and a forward over themselves only; the other rows keep the search's outputs. Against
    the float64 reference, log p, entropy and gradients."""
    from logitless.ops.linear_log_probs import triton_backend

    x, w, b, t, _, _ = _sparse_inputs("ties_past_c", 8)
    top_k = torch.tensor([3, 0, 3, 0, 0, 5, 0, 0])  # (0: off, every column kept)
    t = t.clamp_min(0)
    rows, forward = [], triton_backend.forward
    monkeypatch.setattr(triton_backend, "forward", lambda x, *a, **k: rows.append(x.shape[0]) or forward(x, *a, **k))
    xg, wg, bg = (u.clone().requires_grad_() for u in (x, w, b))
    lp, ent = logitless.linear_log_probs(xg, wg, t, bg, entropy=True, backend="triton", top_k=top_k.to(DEVICE))
    assert rows == [3]
    ref = [u.detach().cpu().double().requires_grad_() for u in (x, w, b)]
    rl, re = truncated_log_probs_reference(ref[0], ref[1], t.cpu(), ref[2], top_k=top_k)
    _check(lp.detach().cpu(), ent.detach().cpu(), rl.detach(), re.detach())
    ours = torch.autograd.grad(torch.where(torch.isinf(lp), 0.0, lp).sum() + ent.sum(), (xg, wg, bg))
    theirs = torch.autograd.grad(torch.where(torch.isinf(rl), 0.0, rl).sum() + re.sum(), ref)
    for a, r in zip(ours, theirs):
        assert (a.cpu().double() - r).abs().max() < 1e-4


def test_mass_search_narrows_flat_rows_in_two_passes(monkeypatch):
    """The search's own steps (torch stand-ins for the candidates and mass kernels over
    logits held here): on flat rows (152k columns, z ~ N(0, 1), T = 0.7, top-p 0.95: ~87k
    kept) the first bracket from the mass bound and the grid around the interpolated
    crossing settle every row after two mass passes (three with a uniform grid from
    max - 24), and the kept sets are the float64 reference's up to float ties (a prefix
    mass within 1e-7 of top_p)."""
    from logitless.ops.linear_log_probs import truncation as tr_op
    from logitless.options import LogProbOptions
    from logitless.triton_lib import log_probs_candidates as LC

    g = torch.Generator().manual_seed(0)
    n, h, v, temp, top_p = 6, 32, 151936, 0.7, 0.95
    x = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * h**-0.5
    t = torch.randint(0, v, (n,), generator=g)
    a_all = (x.double() @ w.double().T).float() / temp
    passes = []

    def rows_of(xs):  # (the rows the search passes: subsets of x's)
        return (xs[:, None, :] == x[None]).all(2).float().argmax(1)

    def candidates(xs, weight, bias, tokens, plan, sc, tt, c, ent, hi=None, splits=None, indices=False):
        a = a_all[rows_of(xs)]
        sel = a >= hi[:, None] if hi is not None else torch.ones_like(a, dtype=torch.bool)
        m = torch.where(sel, a, -math.inf).amax(1)
        e = torch.where(sel, (a - m[:, None]).exp(), 0.0)
        top = torch.where(sel, -math.inf, a).topk(c, 1) if hi is not None else a.topk(c, 1)
        out = (top.values[None], m[None], e.sum(1)[None], (e * (a - m[:, None])).sum(1)[None],
               a.gather(1, tokens[:, None])[:, 0][None])
        return out + (top.indices.int()[None],) if indices else out

    def masses(xs, weight, bias, plan, sc, tt, m, thr, splits=None):
        passes.append(xs.shape[0])
        a = a_all[rows_of(xs)].double()
        ge = a[:, None, :] >= thr.double()[:, :, None]
        e = (a - m.double()[:, None]).exp()[:, None, :]
        return ge.sum(2).int()[None], torch.where(ge, e, 0.0).sum(2).float()[None]

    monkeypatch.setattr(LC, "candidates", candidates)
    monkeypatch.setattr(LC, "masses", masses)
    monkeypatch.setattr(LC, "splits_for", lambda *args, **kw: 1)
    trunc = truncation.Truncation(torch.zeros(n, dtype=torch.long), torch.full((n,), top_p, dtype=torch.float64),
                                  torch.zeros(n, dtype=torch.float64), 0)
    from logitless.ops.linear_log_probs import triton_backend

    opts = LogProbOptions(temperature=temp, entropy=True)
    lplan = triton_backend.linear(x, w, None, opts, budget=256 << 20, need_grad=False, cute=False)
    config = triton_backend.TritonConfig(search=lplan, candidate_tiles=lplan.forward, mass_tiles=lplan.forward)
    tau, _, left = tr_op.search_triton(x, w, None, t, opts, trunc, config, 64)
    assert left is None and passes == [n, n]
    srt = a_all.double().sort(1, descending=True).values
    p = srt.softmax(1)
    before = p.cumsum(1) - p
    kept = (before < top_p).sum(1)
    ours = (a_all >= tau[:, None]).sum(1)
    assert kept.min() > 50_000
    for i in range(n):  # equal, or the prefix mass at the differing tokens within rounding of top_p
        lo_k, hi_k = sorted((int(ours[i]), int(kept[i])))
        assert (before[i, lo_k:hi_k] - top_p).abs().max().item() < 1e-7 if hi_k > lo_k else True
