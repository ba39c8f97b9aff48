"""log_probs (from logits) with truncated sampling (top-k / top-p / min-p,
``formulas.truncation``) and/or ``batch_invariant=True``: plain torch ops on blocks of
rows, what every backend runs when its Config holds ``contract.Blocks`` (the same custom
ops as the untruncated path: fixed output shapes, so torch.compile(fullgraph=True)
traces them; the host syncs of the thresholds run inside). The forward also returns each
row's tau and kept-set lse; the backward is the untruncated op's d(logits) formula
(``formulas.log_probs.dlogits_``) on the kept columns, block by block, with no search.

Each block: a = logits / T in the compute dtype; tau per row from its candidates
(``formulas.truncation.resolve``, more candidates for the rows it leaves open); the
kept logits' logsumexp, log p at the token (-inf outside the kept set, with no
gradient there) and the truncated entropy. With ``batch_invariant`` the blocks have a
fixed number of rows (``Blocks.rows``, ``ROWS``; the last one padded), so a row's bits
do not depend on the batch. Memory: nothing is kept between forward and backward but the
inputs and O(rows) statistics; each pass holds a few fp32 (ROWS x V) tiles. Time: the
forward a few passes over the logits (the candidates' top-k), the backward one.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.log_probs import dlogits_, grad_coefficients
from logitless.formulas.truncation import Truncation, first_candidates, resolve
from logitless.options import LogProbOptions

from .contract import Blocks, LpForward

#: Rows per block (a fixed shape with batch_invariant=True): the backends' ``plan``.
ROWS = 64


def thresholds(a: Tensor, trunc: Truncation) -> Tensor:
    """tau (rows,) of scaled logits a (rows, V) (-inf: nothing truncated)."""
    n, v = a.shape
    c = first_candidates(trunc, v, a.device)
    m = a.max(1).values
    s = torch.exp(a - m[:, None]).sum(1)
    tau = torch.full((n,), -math.inf, dtype=a.dtype, device=a.device)
    open_ = torch.ones(n, dtype=torch.bool, device=a.device)
    while True:
        t, ok = resolve(a.topk(c, dim=1).values, m, s, v, trunc)
        tau = torch.where(open_ & ok, t, tau)
        open_ = open_ & ~ok
        if c >= v or not bool(open_.any()):  # (host sync: the fallback's check)
            return tau
        c = min(v, 4 * c)


def _block(z: Tensor, tokens: Tensor, trunc: Optional[Truncation], temperature: float, ignore_index: int,
           entropy: bool):
    a = z.to(compute_dtype(z.dtype)) / temperature
    v = a.shape[1]
    if trunc is not None:
        tau = thresholds(a, trunc)
        keep = a >= tau[:, None]
        masked = a.masked_fill(~keep, -math.inf)
    else:
        tau = torch.full((a.shape[0],), -math.inf, dtype=a.dtype, device=a.device)
        keep, masked = None, a
    lse = torch.logsumexp(masked, dim=1, keepdim=True)
    logp = masked - lse if keep is None else torch.where(keep, a - lse, torch.zeros_like(a))
    valid = tokens != ignore_index
    idx = torch.where(valid, tokens, 0).clamp(0, v - 1)[:, None]
    picked = logp.gather(1, idx)[:, 0]
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    if keep is not None:
        kept_t = keep.gather(1, idx)[:, 0]
        picked = torch.where(kept_t, picked, torch.full_like(picked, -math.inf))
    lp = torch.where(valid, picked, zero)
    bad = valid & ((tokens < 0) | (tokens >= v))
    lp = torch.where(bad, torch.full_like(lp, math.nan), lp)
    ent = None
    if entropy:
        p = torch.exp(logp) if keep is None else torch.exp(logp) * keep
        ent = -(torch.where(p > 0, p * logp, torch.zeros_like(p)) if keep is None else p * logp).sum(1)
        ent = torch.where(bad, torch.full_like(ent, math.nan), torch.where(valid, ent, zero))
    return lp, ent, lse[:, 0], tau


def forward(logits: Tensor, tokens: Tensor, trunc: Optional[Truncation], opts: LogProbOptions,
            blocks: Blocks) -> LpForward:
    """logp, entropy (None without ``opts.entropy``), lse (N,) the kept set's and tau (N,)
    its threshold (-inf: nothing truncated) of logits (N, V), tokens (N,) int64."""
    n = logits.shape[0]
    rows, temperature, ignore_index, entropy = blocks.rows, opts.temperature, opts.ignore_index, opts.entropy
    lps, ents, lses, taus = [], [], [], []
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        z, t = logits[n0:n1], tokens[n0:n1]
        tr = trunc.rows(slice(n0, n1)) if trunc is not None else None
        pad = rows - (n1 - n0) if blocks.padded else 0
        if pad:
            z = torch.cat([z, z.new_zeros(pad, z.shape[1])])
            t = torch.cat([t, t.new_full((pad,), ignore_index)])
            if tr is not None:
                tr = Truncation(torch.cat([tr.top_k, tr.top_k.new_zeros(pad)]),
                                torch.cat([tr.top_p, tr.top_p.new_ones(pad)]),
                                torch.cat([tr.min_p, tr.min_p.new_zeros(pad)]), tr.k_max, tr.checked)
        lp, ent, lse, tau = _block(z, t, tr, temperature, ignore_index, entropy)
        lps.append(lp[:n1 - n0])
        lses.append(lse[:n1 - n0])
        taus.append(tau[:n1 - n0])
        if entropy:
            ents.append(ent[:n1 - n0])
    return LpForward(torch.cat(lps), (torch.cat(ents) if entropy else None), torch.cat(lses), torch.cat(taus))


def backward(grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], logits: Tensor, tokens: Tensor,
             logp: Tensor, entropy_out: Optional[Tensor], lse: Tensor, tau: Tensor, opts: LogProbOptions,
             blocks: Blocks) -> Tensor:
    """d / d logits, ``blocks.rows`` rows at a time: ``dlogits_`` of the untruncated op over
    the kept columns (a >= tau; the others -inf, so p = 0 there) with the kept set's lse;
    log p = -inf outside the set is piecewise constant (no gradient from it)."""
    n, v = logits.shape
    rows = blocks.rows
    if grad_logp is not None:
        grad_logp = torch.where(torch.isinf(logp), torch.zeros_like(grad_logp), grad_logp)
    g_h = grad_entropy if opts.entropy else None
    coef = grad_coefficients(entropy_out if opts.entropy else None, tokens, grad_logp, g_h, v, opts, lse)
    out = torch.empty_like(logits)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        a = logits[n0:n1].to(lse.dtype) / opts.temperature
        a.masked_fill_(a < tau[n0:n1, None], -math.inf)
        out[n0:n1] = dlogits_(a, lse[n0:n1], coef[:, n0:n1], tokens[n0:n1], 0, opts)
    return out
