"""Truncated sampling (min-p, top-k, top-p) as one per-row threshold (the spec, torch).

vLLM samples from a = softcap(z) / T after, in this order (a row at a time):

    min-p   keep p_j >= min_p * max_j p_j         <=> a_j >= max_j a_j + log(min_p)
    top-k   keep a_j >= the k-th largest a        (ties at the k-th value are kept)
    top-p   renormalise over the kept set K1; in descending order keep each token whose
            prefix mass before it is < top_p (the largest is always kept)

Each step keeps a prefix of the row in descending order, so the kept set is
K = {j : a_j >= tau} for one per-row threshold tau. Then

    log p_t = a_t - logsumexp_{j in K} a_j     (-inf when a_t < tau)
    H       = -sum_{j in K} p_j log p_j
    d/da_j  = [j in K] (d/da_j of the untruncated formulas with lse over K)

(the set is piecewise constant: no gradient through it). ``top_k`` 0 = off, ``top_p``
1 = off, ``min_p`` 0 = off, per row.

How tau is found without the logits (``resolve``): a pass over the vocabulary keeps
each row's C largest values (``merge_candidates``: a running top-C, C > k), the row max
and s = sum_j exp(a_j - max). From the descending candidates c_0 >= c_1 >= ... the kept
count r follows (min-p: count(c >= max + log min_p); top-k: count(c >= c_{k-1});
top-p: masses exp(c_i - max) / Z1 with Z1 the sum over K1, from the candidates when K1
lies inside them, s when K1 is the whole row). tau is the MIDPOINT (c_{r-1} + c_r) / 2
(-inf when r = V): a second computation of a (another GEMM, another tile shape) keeps
the same set unless two values lie within its rounding of each other (a float tie,
where vLLM's own order is arbitrary too). A row is resolved when r < C (c_r is known), C = V, or nothing
is truncated; otherwise the torch path runs its pass again with 4x the candidates (top-p over a flat row, a wide
min-p set). The Triton path instead (``ops/linear_log_probs/truncation.search_triton``):
min-p's tau = max + log min_p is exact; top-p first needs Z1 (``resolve(z1=)``), then a
mass search narrows [lo, hi) around the crossing (counts and masses above thresholds)
until fewer than C values lie in it, and ``crossing`` finds tau among the C largest
values below hi. ``kept_mass``, ``rebase`` and ``outputs_of`` give log p, H and lse from
the kept set's sums W = sum exp(a - max), U = sum exp(a - max)(a - max):
lse = max + log W, H = log W - U / W.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

Number = Union[int, float]

#: Candidates of the first pass: at least this many (and > the largest top-k).
MIN_CANDIDATES = 64


def syncs_allowed(device: torch.device) -> bool:
    """Whether the data-dependent steps of a truncated call may read the device (host
    syncs: the largest top_k, the rows a pass leaves): not while the current stream
    captures a CUDA graph (``torch.cuda.graph``). Then the threshold pass takes every
    column as a candidate at once (C = V: one pass, exact, no check of the rows left)."""
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def first_candidates(trunc: Truncation, v: int, device: torch.device, first_c: int = 0) -> int:
    """C of a threshold pass's first run over a row: more than the largest top_k (a host
    sync when it is a tensor), at least MIN_CANDIDATES and ``first_c``, at most V; every
    column (V) while a CUDA graph is captured (``syncs_allowed``)."""
    if not syncs_allowed(device):
        return v
    kmax = trunc.k_max if trunc.k_max is not None else int(trunc.top_k.max())
    return min(v, max(MIN_CANDIDATES, kmax + 1, first_c))


@dataclass(frozen=True)
class Truncation:
    """Per-token truncation parameters, flattened to (N,) on the tokens' device:
    top_k int64 (0 off), top_p float64 (1 off), min_p float64 (0 off). ``checked``: their
    values are known to be in range (``check`` made them from Python numbers it checked),
    so ``check_values`` need not run on them."""

    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    k_max: Optional[int] = None  # the largest top_k when known on the host (a Python number)
    checked: bool = False

    def rows(self, idx) -> Truncation:
        """These rows (an index tensor or a slice)."""
        return Truncation(self.top_k[idx], self.top_p[idx], self.min_p[idx], self.k_max, self.checked)


def _bound(v: float) -> str:
    """A range bound as a reader writes it: 2**62, not 4.61169e+18."""
    if v >= 2**20 and float(v).is_integer() and (int(v) & (int(v) - 1)) == 0:
        return f"2**{int(v).bit_length() - 1}"
    return f"{v:g}"


def _as_param(name: str, value, shape: torch.Size, device, dtype, lo: float, hi: float, lo_open: bool,
              off: float, hint: str) -> Optional[Tensor]:
    """(N,) tensor of the parameter, or None when it is off everywhere (a Python number)."""
    n = math.prod(shape)
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number or a tensor, got bool")
    if isinstance(value, numbers.Real):  # (Python and numpy numbers)
        v = float(value)
        ok = (lo < v if lo_open else lo <= v) and v <= hi and -math.inf < v < math.inf  # (NaN: False)
        if not ok:
            raise ValueError(f"{name} must be in {'(' if lo_open else '['}{_bound(lo)}, {_bound(hi)}] ({hint}), "
                             f"got {value}")
        if name == "top_k" and v != int(v):
            raise ValueError(f"top_k must be an integer >= 0 (0 or None: off), got {value}")
        if v == off:
            return None
        return torch.full((n,), v, dtype=dtype, device=device)
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a number, None or a tensor, got {type(value).__name__}")
    if value.shape != shape and value.shape != (n,):
        raise ValueError(f"{name} has shape {tuple(value.shape)}: give one value per token, "
                         f"shape {tuple(shape)} or ({n},)")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device}, the tokens on {device}: put them on one device")
    if name == "top_k" and value.is_floating_point():
        raise TypeError(f"top_k must be an integer tensor, got {value.dtype}")
    return value.reshape(n).to(dtype)


def _check_range(name: str, t: Tensor, lo: float, hi: float, lo_open: bool, hint: str) -> None:
    bad = (t <= lo) if lo_open else (t < lo)
    bad = bad | (t > hi) | torch.isnan(t)
    if bool(bad.any()):  # (host sync)
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{_bound(lo)}, {_bound(hi)}] ({hint}); "
                         f"got {t[bad].tolist()[:4]}")


def check_values(top_k: Tensor, top_p: Tensor, min_p: Tensor) -> None:
    """ValueError for per-token values out of range (``check``'s Truncation tensors, unless
    ``checked``: the values of Python numbers were checked once, by ``check``). The ops
    call it inside their implementations on the CPU (a host sync; under torch.compile
    too); on a GPU out-of-range values act as clamped (no host sync)."""
    if top_k.numel():
        _check_range("top_k", top_k, 0, float(2 ** 62), False, "0 or None: off")
        _check_range("top_p", top_p, 0.0, 1.0, True, "1: off")
        _check_range("min_p", min_p, 0.0, 1.0, False, "0: off")


def check(top_k, top_p, min_p, shape: torch.Size, device) -> Optional[Truncation]:
    """The checked per-token parameters, or None when no truncation is asked. Python
    numbers are range-checked here (``checked``); tensors' values by ``check_values``."""
    k = _as_param("top_k", top_k, shape, device, torch.int64, 0, float(2 ** 62), False, 0, "0 or None: off")
    p = _as_param("top_p", top_p, shape, device, torch.float64, 0.0, 1.0, True, 1.0, "1: off")
    mp = _as_param("min_p", min_p, shape, device, torch.float64, 0.0, 1.0, False, 0.0, "0: off")
    if k is None and p is None and mp is None:
        return None
    n = math.prod(shape)
    k_max = 0 if top_k is None else (int(top_k) if isinstance(top_k, numbers.Real) else None)
    return Truncation(
        top_k=k if k is not None else torch.zeros(n, dtype=torch.int64, device=device),
        top_p=p if p is not None else torch.ones(n, dtype=torch.float64, device=device),
        min_p=mp if mp is not None else torch.zeros(n, dtype=torch.float64, device=device),
        k_max=k_max,
        checked=not (isinstance(top_k, Tensor) or isinstance(top_p, Tensor) or isinstance(min_p, Tensor)),
    )


def merge_candidates(cand: Optional[Tensor], a: Tensor, c: int) -> Tensor:
    """Running top-c (descending) of the rows of ``cand`` (or None) and tile ``a``."""
    both = a if cand is None else torch.cat([cand, a], dim=1)
    return both.topk(min(c, both.shape[1]), dim=1).values


def resolve(cand: Tensor, row_max: Tensor, row_sum: Tensor, v: int, trunc: Truncation,
            z1: Optional[Tensor] = None):
    """(tau, resolved) per row from the descending candidates ``cand`` (n, C), the row
    max and s = sum_j exp(a_j - max) over all V columns (module docstring). ``z1`` (n,):
    the kept mass of min-p and top-k, sum over K1 of exp(a - max), where known from
    elsewhere (NaN where not: the mass search's first pass); a row that keeps all V
    columns is resolved with tau = -inf."""
    n, c = cand.shape
    complete = c >= v
    unknown = v + 1  # a count not known from the candidates (>= C)
    c64 = cand.double()
    m = row_max.double()[:, None]
    idx = torch.arange(c, device=cand.device)

    def count(ge: Tensor) -> Tensor:
        cnt = ge.sum(1)
        return cnt if complete else torch.where(cnt < c, cnt, torch.full_like(cnt, unknown))

    full = torch.full((n,), v, dtype=torch.int64, device=cand.device)
    # min-p
    log_mp = torch.where(trunc.min_p > 0, trunc.min_p.clamp_min(1e-300).log(), torch.full_like(trunc.min_p,
                                                                                               -math.inf))
    off = torch.full_like(full, v + 2)  # (a step that is off: neither its count nor unknown)
    n_m = torch.where(trunc.min_p > 0, count(c64 >= m + log_mp[:, None]), off)
    # top-k (k >= V: off)
    k = trunc.top_k
    k_on = (k > 0) & (k < v)
    kth = c64.gather(1, (k.clamp(1, c) - 1)[:, None])
    n_k = torch.where(k_on, count(c64 >= kth), off)
    n1 = torch.minimum(n_m, n_k)
    n1 = torch.where(n1 == v + 2, full, n1)  # (both off: K1 is the whole row)
    # top-p over K1 (the first n1 of the row, renormalised)
    p = trunc.top_p
    p_on = p < 1
    w = torch.exp(c64 - m)
    in_k1 = idx[None, :] < n1[:, None]
    w = torch.where(in_k1, w, torch.zeros_like(w))
    z1_known = torch.zeros(n, dtype=torch.bool, device=cand.device) if z1 is None else ~torch.isnan(z1)
    z1 = torch.where(n1 <= c, w.sum(1), torch.where(z1_known, z1.double(), row_sum.double())
                     if z1 is not None else row_sum.double())
    before = (torch.cumsum(w, 1) - w) / z1[:, None]  # prefix mass before each candidate
    r_p = ((before < p[:, None]) & in_k1).sum(1).clamp_min(1)
    r_p = torch.where(((r_p >= c) & (n1 > c)) | ((n1 == unknown) & ~z1_known), torch.full_like(r_p, unknown),
                      r_p)
    last = c64.gather(1, (r_p.clamp(1, c) - 1)[:, None])
    r_p = torch.where(r_p == unknown, r_p, count(c64 >= last))  # ties at the last kept value stay
    r = torch.where(p_on, r_p, n1)
    everything = (trunc.min_p <= 0) & ~k_on & ~p_on  # (the row keeps all V columns)
    r = torch.where(everything, full, r)
    resolved = (r < c) | (complete & (r <= v)) | everything
    i = r.clamp(1, c)
    lo = cand.gather(1, i.clamp(max=c - 1)[:, None])[:, 0]
    hi = cand.gather(1, (i - 1)[:, None])[:, 0]
    tau = torch.where(r < c, hi + (lo - hi) / 2, torch.full_like(hi, -math.inf))
    return tau, resolved


def merge_parts(part_max: Tensor, part_sum: Tensor, part_u: Optional[Tensor]):
    """(m, s, u or None) of a row from per-split (splits, n) partials (as
    ``log_probs.merge_splits``, without finishing): m the max (the input dtype), s and u
    float64, relative to m."""
    m = part_max.max(dim=0).values
    m_safe = torch.where(m == -math.inf, torch.zeros_like(m), m)
    d = part_max.double() - m_safe.double()[None]
    scale = torch.exp(d)
    s = (part_sum.double() * scale).sum(0)
    u = None
    if part_u is not None:
        corr = torch.where(part_sum > 0, d * part_sum.double(), torch.zeros_like(d))
        u = (scale * (part_u.double() + corr)).sum(0)
    return m, s, u


def rebase(m_part: Tensor, s_part: Tensor, u_part: Optional[Tensor], m: Tensor):
    """(W, U) float64 relative to m of a part's (max, s, u): W = s e^(m_part - m),
    U = e^(m_part - m) (u + (m_part - m) s); 0 for an empty part."""
    d = m_part.double() - m.double()
    empty = (m_part == -math.inf) | (s_part <= 0)
    d = torch.where(empty, torch.zeros_like(d), d)
    scale = torch.exp(d)
    w = torch.where(empty, torch.zeros_like(d), s_part.double() * scale)
    if u_part is None:
        return w, torch.zeros_like(w)
    u = torch.where(empty, torch.zeros_like(d), scale * (u_part.double() + d * s_part.double()))
    return w, u


def kept_mass(cand: Tensor, row_max: Tensor, tau: Tensor):
    """(W, U) float64: sum over the candidates >= tau of exp(c - max) and exp(c - max)(c - max)."""
    d = cand.double() - row_max.double()[:, None]
    keep = cand >= tau[:, None]
    e = torch.where(keep, torch.exp(d), torch.zeros_like(d))
    u = torch.where(e > 0, e * d, torch.zeros_like(d))
    return e.sum(1), u.sum(1)


def crossing(cand: Tensor, row_max: Tensor, w_top: Tensor, u_top: Tensor, target: Tensor):
    """Top-p's end inside ``cand`` (n, C descending): the values below an upper bound hi,
    all those of the bracket [lo, hi) and at least one below lo (or -inf); ``w_top``,
    ``u_top``: the mass sums of a >= hi; ``target`` = top_p * Z1. Returns (tau, W, U) of
    the kept set {a >= tau}: the tokens whose prefix mass before them is < target, ties at
    the last kept value kept, tau the midpoint below it."""
    n, c = cand.shape
    d = cand.double() - row_max.double()[:, None]
    e = torch.where(cand > -math.inf, torch.exp(d), torch.zeros_like(d))
    before = w_top.double()[:, None] + torch.cumsum(e, 1) - e
    r = ((before < target.double()[:, None]) & (cand > -math.inf)).sum(1).clamp(1, c)
    last = cand.gather(1, (r - 1)[:, None])
    r = (cand >= last).sum(1)
    hi = cand.gather(1, (r - 1)[:, None])[:, 0]
    lo = cand.gather(1, r.clamp(max=c - 1)[:, None])[:, 0]
    tau = torch.where(r < c, hi + (lo - hi) / 2, hi)
    keep = cand >= tau[:, None]
    w = w_top.double() + torch.where(keep, e, torch.zeros_like(e)).sum(1)
    u = u_top.double() + torch.where(keep & (e > 0), e * d, torch.zeros_like(d)).sum(1)
    return tau, w, u


def outputs_of(row_max: Tensor, w: Tensor, u: Optional[Tensor], a_t: Tensor, tau: Tensor, tokens: Tensor,
               v: int, ignore_index: int, dtype: torch.dtype):
    """(logp, H or None, lse) in ``dtype`` from the kept set's sums W = sum exp(a - max),
    U = sum exp(a - max)(a - max) over a >= tau and the token's a: log p = a_t - lse
    (-inf when a_t < tau), H = log W - U / W; 0 at ignored tokens, NaN at out-of-range ones
    (as ``log_probs.token_outputs``)."""
    m = row_max.double()
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    lse = m + torch.log(w)
    a64 = a_t.double()
    logp = torch.where(a_t >= tau, a64 - lse, torch.full_like(lse, -math.inf))
    ent = torch.log(w) - u / w if u is not None else None
    valid = tokens != ignore_index
    bad = valid & ((tokens < 0) | (tokens >= v))

    def clean(t: Tensor) -> Tensor:
        t = torch.where(valid, t, torch.zeros_like(t))
        return torch.where(bad, torch.full_like(t, math.nan), t).to(dtype)

    return clean(logp), (clean(ent) if ent is not None else None), lse.to(dtype)
