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
where vLLM's own order is arbitrary too). A row is resolved when r < C (c_r is known) or
C = V; otherwise its pass runs again with 4x the candidates (the chunked fallback:
top-p over a flat row, a wide min-p set).
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


@dataclass(frozen=True)
class Truncation:
    """Per-token truncation parameters, flattened to (N,) on the tokens' device:
    top_k int64 (0 off), top_p float64 (1 off), min_p float64 (0 off)."""

    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    k_max: Optional[int] = None  # the largest top_k when known on the host (a Python number)

    def rows(self, idx) -> "Truncation":
        """These rows (an index tensor or a slice)."""
        return Truncation(self.top_k[idx], self.top_p[idx], self.min_p[idx], self.k_max)


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
        ok = (lo < v if lo_open else lo <= v) and v <= hi and math.isfinite(v)
        if not ok:
            raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}] ({hint}), got {value}")
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
    t = value.reshape(n).to(dtype)
    if n and value.device.type == "cpu":  # (on a GPU no host sync: out-of-range values act as clamped)
        bad = (t <= lo) if lo_open else (t < lo)
        bad = bad | (t > hi) | torch.isnan(t)
        if bool(bad.any()):
            raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}] ({hint}); "
                             f"got {value.reshape(-1)[bad].tolist()[:4]}")
    return t


def check(top_k, top_p, min_p, shape: torch.Size, device) -> Optional[Truncation]:
    """The checked per-token parameters, or None when no truncation is asked."""
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
    )


def merge_candidates(cand: Optional[Tensor], a: Tensor, c: int) -> Tensor:
    """Running top-c (descending) of the rows of ``cand`` (or None) and tile ``a``."""
    both = a if cand is None else torch.cat([cand, a], dim=1)
    return both.topk(min(c, both.shape[1]), dim=1).values


def resolve(cand: Tensor, row_max: Tensor, row_sum: Tensor, v: int, trunc: Truncation):
    """(tau, resolved) per row from the descending candidates ``cand`` (n, C), the row
    max and s = sum_j exp(a_j - max) over all V columns (module docstring)."""
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
    n_m = torch.where(trunc.min_p > 0, count(c64 >= m + log_mp[:, None]), full)
    # top-k (k >= V: off)
    k = trunc.top_k
    k_on = (k > 0) & (k < v)
    kth = c64.gather(1, (k.clamp(1, c) - 1)[:, None])
    n_k = torch.where(k_on, count(c64 >= kth), full)
    n1 = torch.minimum(n_m, n_k)
    # top-p over K1 (the first n1 of the row, renormalised)
    p = trunc.top_p
    p_on = p < 1
    w = torch.exp(c64 - m)
    in_k1 = idx[None, :] < n1[:, None]
    w = torch.where(in_k1, w, torch.zeros_like(w))
    z1 = torch.where(n1 <= c, w.sum(1), row_sum.double())
    before = (torch.cumsum(w, 1) - w) / z1[:, None]  # prefix mass before each candidate
    r_p = ((before < p[:, None]) & in_k1).sum(1).clamp_min(1)
    r_p = torch.where(((r_p >= c) & (n1 > c)) | (n1 == unknown), torch.full_like(r_p, unknown), r_p)
    last = c64.gather(1, (r_p.clamp(1, c) - 1)[:, None])
    r_p = torch.where(r_p == unknown, r_p, count(c64 >= last))  # ties at the last kept value stay
    r = torch.where(p_on, r_p, n1)
    resolved = (r < c) | (complete & (r <= v))
    i = r.clamp(1, c)
    lo = cand.gather(1, i.clamp(max=c - 1)[:, None])[:, 0]
    hi = cand.gather(1, (i - 1)[:, None])[:, 0]
    tau = torch.where(r < c, hi + (lo - hi) / 2, torch.full_like(hi, -math.inf))
    return tau, resolved
