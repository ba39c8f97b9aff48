"""linear_log_probs with truncated sampling (top-k / top-p / min-p) and/or
``batch_invariant=True``: Configs of the same backends (``contract.Truncated``, decided in
their ``plan`` by ``decide``), run by the same custom ops (``custom_op``) through
``forward`` and ``backward`` here.

One plan per call, from the call's arguments: the backend's ``plan`` decides the blocks, the
threshold passes' plans (Triton: ``TritonConfig.search``, the search kernels' tiles; the
chunked pass's steps, ``thresholds``), whether the Triton search may run, the sparse
backward's width and whether the forward keeps columns. What follows the data is decided
in the forward and crosses to the backward as tensors: the search's C (from the largest
top_k, read in the forward, a host sync, when the caller did not give it:
``contract.search_candidates``), which rows the search settles (the rows it leaves take
the chunked pass and a forward under the Config's plan, not one of their own), and which
rows the sparse backward takes (``inside``; the dense rest runs the backend's backward
under the Config).

Truncation (math: ``formulas.truncation``): a THRESHOLD pass finds each token's tau from
the hidden states. Triton backend (``search_triton``, top_k < MAX_CANDIDATES): the
candidates kernel (a running top-C per row, the row's max, sum and token logit; no
logits), then per row: the kept set inside the candidates, or min-p's exact tau, or a
top-p mass search; each route also gives the row's log p, entropy and lse, so no forward
follows (GEMM passes of the forward: 1, 2, 2 + the narrowings). Otherwise (torch, a
larger top_k, rows the search leaves: ties past the candidates) ``thresholds``: chunked
GEMMs (torch's or the forward kernel's tile code) with a running top-C per row, rows not
settled run again with 4x as many, then the backend's forward with that per-token tau
(``tau=``: columns a < tau drop out of the statistics and of dz; over the rows the search
left only, but under batch_invariant). The backward: for the rows whose kept set
``search_triton`` found inside their first candidates (their columns kept by the kernel
when gradients are needed), the sparse one (``triton_lib.log_probs_sparse``: no GEMM),
onto the default op's with tau over the other rows (Triton: 3 GEMMs; 2 when every row is
dense and the forward ran and kept columns, which it does not with a soft-cap nor under
batch_invariant). Host syncs: the largest top_k, and per pass the check of the rows left.

Batch invariance: the forward's rows go through the backends in blocks of a fixed size
(``invariant_rows``: it depends on the backend and device only), the last block padded
with zero rows, so every GEMM, plan and reduction of a row has the same shape whatever
the batch, and a row's bits do not depend on its position (row results of a GEMM of one
shape do not depend on the row's place in it). The per-token outputs (log p, entropy)
are invariant; the backward is the default one over the whole batch with those
outputs' statistics (gradients are deterministic run to run, not batch-invariant:
blocked, dW would be one V x H term per block, 3.1-3.7 GB and 1.22x the default f+b on
an H100). Cost: up to one block of padding rows;
no kept columns for the backward (one recomputed GEMM more than the default path).

A vocab-parallel head: the backend is ``vocab_parallel.ShardedBackend`` (the same
contract over this rank's rows, statistics merged over the group; thresholds by the
chunked pass with the ranks' candidates gathered), never ``search_triton``.

torch.compile: the op's custom ops (``custom_op``) with fixed output shapes: the
data-dependent steps (host syncs, row subsets, the fallback's rows) run
inside them. What the backward needs crosses as tensors of fixed shapes: tau (N,), the
candidates and their columns (N, W), W = min(V, C) padded to C = MAX_CANDIDATES when the
largest per-token top_k is not read on the host (compiled calls: ``k_max`` -1; eager
calls read it before the op, as the forward always did), and an (N,) mask of the rows
inside their candidates (the dense rows' list is rebuilt in the backward); kept columns
as the default op's (only where the fake can tell: not under a per-token top_k on Triton
while compiled).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.log_probs import online_update
from logitless.formulas.truncation import (
    Truncation,
    check_values,
    crossing,
    first_candidates,
    kept_mass,
    merge_candidates,
    merge_parts,
    outputs_of,
    rebase,
    resolve,
    syncs_allowed,
)
from logitless.ops.common.glue import grad_outputs
from logitless.ops.common.invariant import pad_rows
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import LogProbOptions
from logitless.planning.plans import TorchPlan
from logitless.planning.tiles import TritonPlan

from .contract import TritonConfig, search_candidates
from .torch_backend import scaled_tile


def _candidates(x_c: Tensor, weight: Tensor, bias: Optional[Tensor], opts: LogProbOptions, c: int,
                vocab_chunk: int, tile_of=None):
    """(top-c descending, row max, sum exp(a - max)) of x_c's rows over all columns;
    ``tile_of(x_c, v0, v1)``: the tile of a (default: a torch GEMM in x_c's dtype)."""
    cd = compute_dtype(x_c.dtype)
    v = weight.shape[0]
    cand = x_c.new_empty((x_c.shape[0], 0), dtype=cd)  # (no columns: none; a rank without classes)
    m = torch.full((x_c.shape[0],), -math.inf, dtype=cd, device=x_c.device)
    s = torch.zeros_like(m)
    for v0 in range(0, v, vocab_chunk):
        v1 = min(v, v0 + vocab_chunk)
        if tile_of is not None:
            a = tile_of(x_c, v0, v1)
        else:
            a = scaled_tile(x_c, weight[v0:v1].to(cd), bias[v0:v1].to(cd) if bias is not None else None, opts)
        cand = merge_candidates(cand, a, c)
        m, s, _ = online_update(a, m, s, None)
    return cand, m, s


def thresholds(x: Tensor, weight: Tensor, bias: Optional[Tensor], opts: LogProbOptions, trunc: Truncation,
               budget: int, steps: TorchPlan, tiles: Optional[TritonPlan] = None, *,
               vocab_size: Optional[int] = None, merge=None, first_c: Optional[int] = None) -> Tensor:
    """Per-token tau (N,) in the compute dtype (-inf: nothing truncated), in steps of the
    Config's ``steps`` (its ``thresholds``). ``tiles`` (the Triton Config's ``search``
    forward): the tiles of a from the forward kernel's tile code (its GEMM: 16-bit operands,
    fp32 accumulation), else torch GEMMs in the compute dtype.
    A vocab-parallel head (``vocab_parallel.ShardedBackend``): ``weight`` holds this
    rank's columns of a ``vocab_size`` vocabulary, ``merge(cand, max, sum, C)`` gives the
    full rows' (top-min(C, V) candidates, max, sum) from this rank's, and ``steps`` is
    sized for the largest rank's columns (the same on every rank: one collective per step).
    ``first_c``: the first pass's candidates (after a pass that settled other rows)."""
    n = x.shape[0]
    v = weight.shape[0] if vocab_size is None else vocab_size
    cd = compute_dtype(x.dtype)
    cs = torch.finfo(cd).bits // 8
    tau = torch.full((n,), -math.inf, dtype=cd, device=x.device)
    if n == 0:
        return tau
    plan = steps
    tile_of, vocab_chunk = None, plan.vocab_chunk
    if tiles is not None and weight.shape[0]:  # (the forward kernel's tile code)
        from logitless.triton_lib.log_probs_threshold import scaled_logits

        def tile_of(x_c, v0, v1):
            return scaled_logits(x_c, weight, bias, opts.softcap, opts.temperature, v0, v1, tiles)

        vocab_chunk = max(tiles.block_v, plan.vocab_chunk // tiles.block_v * tiles.block_v)
    # (host syncs: the largest top_k when it is a tensor, and once per pass the rows left;
    # none while capturing a CUDA graph: one pass with every column a candidate)
    whole = not syncs_allowed(x.device)
    c = first_candidates(trunc, v, x.device, first_c or 0)
    rows = None  # the first pass: every row, in order
    while True:
        # rows per step: the tile, the candidates and their merge within the budget
        step = plan.token_chunk if rows is None and not whole else max(
            1, min(plan.token_chunk, budget // (cs * 3 * (c + plan.vocab_chunk))))
        total = n if rows is None else rows.numel()
        oks = []
        for r0 in range(0, total, step):
            idx = slice(r0, min(n, r0 + step)) if rows is None else rows[r0:r0 + step]
            x_c = x[idx] if tile_of is not None else x[idx].to(cd)
            k = x_c.shape[0]
            if k < step and (total > step or rows is not None):  # one shape (batch invariance)
                x_c = torch.cat([x_c, x_c.new_zeros(step - k, x_c.shape[1])])
            cand, m, s = _candidates(x_c, weight, bias, opts, c, vocab_chunk, tile_of)
            if merge is not None:
                cand, m, s = merge(cand, m, s, c)
            t, ok = resolve(cand[:k], m[:k], s[:k], v, trunc.rows(idx))
            tau[idx] = torch.where(ok, t, tau[idx])
            oks.append(ok)
        ok = torch.cat(oks)
        if c >= v or bool(ok.all()):
            return tau
        rows = (torch.arange(n, device=x.device) if rows is None else rows)[~ok]
        c = min(v, 4 * c)


def _rows(t: Tensor, idx: Tensor) -> Tensor:
    """t[idx] for sorted row indices (``nonzero``'s), t itself when they are all its rows
    (no copy of x: its bytes would sit outside the memory budget)."""
    return t if idx.numel() == t.shape[0] else t[idx]


def _put(ours: Optional[Tensor], rows_values: Optional[Tensor], rows: Tensor) -> Optional[Tensor]:
    """``ours`` with its ``rows`` replaced by ``rows_values`` (one value per row)."""
    if ours is None:
        return None
    assert rows_values is not None  # (the same outputs on both sides: an entropy with an entropy)
    ours = ours.clone()
    ours[rows] = rows_values.to(ours.dtype)
    return ours


def _padded(x: Tensor, tokens: Tensor, n0: int, n1: int, pad: int, ignore_index: int):
    return pad_rows(x, n0, n1, pad), pad_rows(tokens, n0, n1, pad, ignore_index)


def _padded_trunc(trunc: Truncation, n0: int, n1: int, pad: int) -> Truncation:
    return Truncation(pad_rows(trunc.top_k, n0, n1, pad), pad_rows(trunc.top_p, n0, n1, pad, 1.0),
                      pad_rows(trunc.min_p, n0, n1, pad), trunc.k_max, trunc.checked)


#: The Triton threshold pass: thresholds per mass pass, mass passes before the rows left go
#: to the chunked fallback, and the first bracket's depth below the row max when min-p does
#: not bound it (candidates at most: ``contract.MAX_CANDIDATES``).
MASS_THRESHOLDS = 32
MAX_MASS_PASSES = 6
_DEPTH = 24.0
#: The first top-p bracket's margin below its mass bound, and the half-width of the
#: grid around the interpolated crossing (a fraction of the bracket).
_MARGIN = 0.1
_WINDOW = 1 / 16


def _merged_candidates(parts, c: int):
    """(cand (n, c) descending, m, s, u, a at the token[, columns (n, c)]) of the
    kernel's per-split outputs (with the candidates' columns when it gave them)."""
    cand, pm, ps, pu, pt = parts[:5]  # (the kernel's candidates are unordered)
    splits, n, _ = cand.shape
    top = cand.permute(1, 0, 2).reshape(n, splits * c).topk(c, dim=1)
    m, s, u = merge_parts(pm, ps, pu)
    if len(parts) == 5:
        return top.values, m, s, u, pt.sum(0)
    cols = parts[5].permute(1, 0, 2).reshape(n, splits * c).gather(1, top.indices)
    return top.values, m, s, u, pt.sum(0), cols


def search_triton(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, opts: LogProbOptions,
                  trunc: Truncation, config: TritonConfig, c: int, invariant: bool = False, indices: bool = False):
    """The Triton threshold pass without logits (``triton_lib.log_probs_candidates``):
    (tau, outputs, left) with outputs = (logp, entropy or None, lse) of every row but
    those that need the chunked fallback (ties past the candidates, or past
    MAX_MASS_PASSES; the caller finds their tau and runs the forward with it), ``left``
    their indices (else None). GEMM passes per row: the kept set inside the C candidates:
    1; min-p alone with a larger set (tau = max + log min_p exact): 2, the second the
    forward kernel with tau (its outputs; exact min-p needs the max first, so no one-pass
    form without storing the values near it); top-p past the candidates:
    the mass passes (on the rows still searching) narrowing a bracket that holds the
    crossing until it holds < C values, then the candidates below its top: 2 + the
    narrowings. Host syncs: a few per pass (the rows left). Vocabulary splits of the
    candidates and mass passes: ``splits_for`` the rows of each pass; ``invariant``: of all of x
    (a row's bits then do not depend on how many rows a later pass runs on). ``indices``:
    a fourth item, ``sparse``: (cand, columns, inside) of the first pass, inside (n,) the
    rows whose kept set (a >= the returned tau) lies in their candidates. ``config``: the
    Triton Config (its ``search`` plan, the kernels' tiles); ``c``: candidates per row
    (``contract.search_candidates``)."""
    from logitless.triton_lib import log_probs_candidates as LC

    from . import triton_backend

    n, v = x.shape[0], weight.shape[0]
    sd = compute_dtype(x.dtype)
    lplan, plan, mplan = config.search, config.candidate_tiles, config.mass_tiles
    assert lplan is not None  # (a Config whose search runs has its plan: ``triton_backend.truncated_config``)
    ent_on = opts.entropy
    sc, temp = opts.softcap, opts.temperature
    tokens = tokens.contiguous()
    splits = LC.splits_for(n, v, plan, c, x.device)

    def splits_of(rows_of_pass: Tensor) -> int:
        return splits if invariant else LC.splits_for(rows_of_pass.numel(), v, plan, c, x.device)

    first = _merged_candidates(LC.candidates(x, weight, bias, tokens, plan, sc, temp, c, ent_on, splits=splits,
                                             indices=indices), c)
    cand, m, s, u, a_t = first[:5]
    cc = min(c, v)
    cand = cand[:, :cc]
    tau, ok = resolve(cand, m, s, v, trunc)
    w_c, u_c = kept_mass(cand, m, tau)
    all_in = tau == -math.inf
    w = torch.where(all_in, s, w_c)
    uu = torch.where(all_in, u, u_c) if ent_on else None
    tau = tau.float()
    # the kept set inside the candidates: a finite tau (r < C), or every column a candidate
    sparse = (cand, first[5][:, :cc], ok & (~all_in | (v <= cc))) if indices else None
    if bool(ok.all()):  # (host sync: the rows left)
        outs = outputs_of(m, w, uu, a_t, tau, tokens, v, opts.ignore_index, sd)
        return (tau, outs, None, sparse) if indices else (tau, outs, None)
    # rows left: tau known (min-p alone) or a top-p crossing to find (mass search)
    rows = (~ok).nonzero()[:, 0]
    tr = trunc.rows(rows)
    mr = m[rows]
    p_on = tr.top_p < 1
    mp_on = tr.min_p > 0
    log_mp = torch.where(mp_on, tr.min_p.clamp_min(1e-300).log(), torch.full_like(tr.min_p, -math.inf))
    tau1 = (mr.double() + log_mp).float()  # min-p's exact threshold (-inf: off)
    fallback = ~p_on & ~mp_on  # (ties at the k-th value past the candidates)
    t = MASS_THRESHOLDS
    # top-p alone: the mass below t is < V exp(t - max), so W(t) >= top_p * Z wherever
    # V exp(t - max) <= (1 - top_p) Z: the crossing lies above that t (less a margin)
    lo_p = mr + (((1 - tr.top_p) * s[rows].double()).clamp_min(1e-300) / v).log().float() - _MARGIN
    lo = torch.where(mp_on, tau1, torch.maximum(mr - _DEPTH, lo_p))
    hi = torch.maximum(cand[rows, cc - 1], lo)
    steps = torch.arange(t, device=x.device, dtype=torch.float64) / (t - 1)
    thr = lo.double()[:, None] + (hi - lo).double()[:, None] * steps[None, :]
    thr = torch.where(p_on[:, None], thr, tau1.double()[:, None]).float()
    thr[:, 0] = torch.where(p_on, lo, tau1)
    top_t = torch.full_like(lo, math.inf)  # the bracket's top: +inf on the first pass
    zeros = torch.zeros(rows.numel(), dtype=torch.float64, device=x.device)
    w_top, n_top = zeros, zeros.long()
    z1 = torch.where(mp_on, torch.full_like(zeros, math.nan), s[rows])
    w_k = zeros.clone()
    u_k = zeros.clone()
    tau_r = tau[rows].clone()
    done = ~p_on & mp_on
    active = p_on.clone()
    xs = _rows(x, rows)
    min_p_outs = None
    if bool(done.any()):  # (host sync) min-p alone: the forward over a >= tau1 gives the outputs
        # (x's plan for these rows too: a row's bits do not depend on how many rows go)
        drows = done.nonzero()[:, 0]
        min_p_outs, _ = triton_backend.forward(_rows(xs, drows), weight, bias, tokens[rows[drows]], opts, plan=lplan,
                                               outputs=True, tau=tau1[drows].contiguous())
        tau_r[drows] = tau1[drows]
    first = True
    for _ in range(MAX_MASS_PASSES if bool(active.any()) else 0):  # (host sync)
        arows = active.nonzero()[:, 0]  # (the rows still searching only)
        cnt_a, mass_a = LC.masses(_rows(xs, arows), weight, bias, mplan, sc, temp, mr[arows], thr[arows],
                                  splits=splits_of(arows))
        cnt = torch.zeros(rows.numel(), t, dtype=torch.int64, device=x.device)
        mass = torch.zeros(rows.numel(), t, dtype=torch.float64, device=x.device)
        cnt[arows], mass[arows] = cnt_a.sum(0).long(), mass_a.double().sum(0)
        if first:
            first = False
            # Z1 of a wide min-p set; then the crossing may lie inside the candidates
            z1 = torch.where(mp_on & p_on, mass[:, 0], z1)
            t2, ok2 = resolve(cand[rows], mr, s[rows], v, tr, z1=z1)
            ok2 = ok2 & p_on
            w2, u2 = kept_mass(cand[rows], mr, t2)
            tau_r = torch.where(ok2, t2.float(), tau_r)
            w_k = torch.where(ok2, w2, w_k)
            u_k = torch.where(ok2, u2, u_k)
            active = active & ~ok2
        target = tr.top_p * z1
        # the bracket [t_j, t_{j+1}) holding the crossing: the largest j with W_j >= target
        ge = mass >= target[:, None]
        j = ge.sum(1) - 1  # (W is non-increasing in j)
        ext_t = torch.cat([thr.double(), top_t.double()[:, None]], 1)
        ext_w = torch.cat([mass, w_top[:, None]], 1)
        ext_n = torch.cat([cnt, n_top[:, None]], 1)
        below = j < 0  # the crossing below t_0: the next bracket [t_0 - depth, t_0)
        jj = j.clamp_min(0)
        new_lo = torch.where(below, ext_t[:, 0] - _DEPTH, ext_t.gather(1, jj[:, None])[:, 0])
        up = torch.where(below, torch.zeros_like(jj), jj + 1)[:, None]
        new_hi = ext_t.gather(1, up)[:, 0]
        inside = torch.where(below, torch.full_like(j, v + 1), ext_n.gather(1, jj[:, None])[:, 0]
                             - ext_n.gather(1, up)[:, 0])
        w_top = torch.where(active, ext_w.gather(1, up)[:, 0], w_top)
        n_top = torch.where(active, ext_n.gather(1, up)[:, 0], n_top)
        top_t = torch.where(active, new_hi.float(), top_t)
        stuck = active & ~torch.isfinite(new_hi)  # (ties at the C-th candidate)
        fallback = fallback | stuck
        active = active & ~stuck
        settled = active & (inside < cc) & torch.isfinite(new_hi)
        if bool(settled.any()):  # (host sync) the exact crossing from the values below the bracket's top
            srows = settled.nonzero()[:, 0]
            cand2, m_hi, s_hi, u_hi, _ = _merged_candidates(
                LC.candidates(_rows(xs, srows), weight, bias, tokens[rows[srows]], plan, sc, temp, c, ent_on,
                              hi=top_t[srows].contiguous(), splits=splits_of(srows)), c)
            w3, u3 = rebase(m_hi, s_hi, u_hi, mr[srows])  # the sums over a >= the bracket's top
            t3, w3, u3 = crossing(cand2[:, :cc], mr[srows], w3, u3, target[srows])
            tau_r[srows] = t3.float()
            w_k[srows] = w3
            u_k[srows] = u3
            active = active & ~settled
        if not bool(active.any()):
            break
        # the next thresholds: t_0 the bracket's bottom, the others a grid of +-_WINDOW of the
        # bracket around the crossing that linear interpolation of W predicts (where W is
        # smooth, the next bracket then holds ~1/(T * 8 _WINDOW) of this one's values, not 1/T;
        # a crossing outside the window costs one more pass); below t_0: a uniform grid
        width = new_hi - new_lo
        w_lo = ext_w.gather(1, jj[:, None])[:, 0]
        f = ((w_lo - target) / (w_lo - w_top).clamp_min(1e-300)).clamp(0, 1)
        q0, q1 = (f - _WINDOW).clamp(0, 1), (f + _WINDOW).clamp(0, 1)
        grid = torch.arange(t - 1, device=x.device, dtype=torch.float64) / (t - 2)
        q = torch.cat([torch.zeros_like(f)[:, None], q0[:, None] + (q1 - q0)[:, None] * grid[None, :]], 1)
        uniform = (torch.arange(t, device=x.device, dtype=torch.float64) / t)[None, :].expand_as(q)
        q = torch.where(below[:, None], uniform, q)
        nxt = new_lo[:, None] + width[:, None] * q
        thr = torch.where(active[:, None], nxt, thr.double()).float()
    left = active | fallback
    tau[rows] = tau_r
    w[rows] = w_k
    if uu is not None:  # (the entropy)
        uu[rows] = u_k
    outs = outputs_of(m, w, uu, a_t, tau, tokens, v, opts.ignore_index, sd)
    if min_p_outs is not None:
        for o, f in zip(outs, min_p_outs):
            if o is not None:
                o[rows[drows]] = f.to(o.dtype)
    left_rows = rows[left] if bool(left.any()) else None
    return (tau, outs, left_rows, sparse) if indices else (tau, outs, left_rows)



# --------------------------------------------------------------------------- the op's steps


def _pieces(n: int, block: int):
    """(n0, n1, padding rows) of the row blocks; one block of n rows when ``block`` is 0."""
    if not block:
        return [(0, n, 0)]
    return [(n0, min(n, n0 + block), max(0, n0 + block - n)) for n0 in range(0, n, block)]


def forward(impl, x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, trunc: Optional[Truncation],
            opts: LogProbOptions, config, budget: int, sharded=None):
    """The truncated / batch-invariant forward under the call's Config (``config.trunc``):
    (logp, entropy or None, lse, tau ((0,) without truncation), (sparse, inside), kept
    or None); the candidates: (2, N, W) int32, their fp32 bits and their columns. ``impl``:
    the backend, or over a vocab-parallel head ``sharded``
    (``vocab_parallel.ShardedBackend``: forward and thresholds merged over the group).

    Per block (one without batch invariance): the thresholds (Triton search or chunked
    pass), then the forward with them. Which rows the search settles is the data's (the
    rows it leaves take the chunked pass and a forward under the Config's plan); ``inside``
    (which rows the sparse backward takes) crosses to the backward as a tensor."""
    n = x.shape[0]
    dec = config.trunc
    block = dec.block
    backend = sharded if sharded is not None else impl
    v = sharded.vocab_size if sharded is not None else weight.shape[0]
    check_targets_in_range(tokens, v, opts.ignore_index, name="tokens")
    if trunc is not None and not trunc.checked and x.device.type == "cpu":
        check_values(trunc.top_k, trunc.top_p, trunc.min_p)
    sd = compute_dtype(x.dtype)
    tiles = config.search.forward if getattr(config, "search", None) is not None else None
    # C of the Triton search (0: the chunked pass), from the largest top_k the forward knows
    candidates = search_candidates(dec.search, trunc.k_max if trunc is not None else None)
    kept = None
    # the sparse backward's (candidates, columns, inside) per block (every row's kept set inside its candidates)
    sparse_blocks: Optional[list[tuple[Tensor, ...]]] = [] if dec.width else None
    logp = x.new_empty(n, dtype=sd)
    ent = x.new_empty(n, dtype=sd) if opts.entropy else None
    lse = x.new_empty(n, dtype=sd)
    taus = x.new_empty(n, dtype=sd) if trunc is not None else x.new_empty(0, dtype=sd)
    for n0, n1, pad in _pieces(n, block):
        xb, tb = (x, tokens) if not block else _padded(x, tokens, n0, n1, pad, opts.ignore_index)
        tau = outs = left = None
        if trunc is not None:
            tr = trunc if not block else _padded_trunc(trunc, n0, n1, pad)
            if sharded is not None:  # (the chunked pass, merged over the group)
                tau = sharded.thresholds(xb, weight, bias, opts, tr, budget, config)
            elif xb.shape[0] and candidates and syncs_allowed(x.device):  # (the search syncs with the host)
                tau, outs, left, *sp = search_triton(xb, weight, bias, tb, opts, tr, config, candidates,
                                                     invariant=bool(block), indices=sparse_blocks is not None)
                if sparse_blocks is not None and sp[0] is not None:
                    sparse_blocks.append(tuple(t[:n1 - n0] for t in sp[0]))
                else:
                    sparse_blocks = None
                if left is not None:  # (the chunked fallback for these rows)
                    tau[left] = thresholds(xb[left], weight, bias, opts, tr.rows(left), budget, config.thresholds,
                                           tiles)
            else:
                tau = thresholds(xb, weight, bias, opts, tr, budget, config.thresholds, tiles)
                sparse_blocks = None if xb.shape[0] else sparse_blocks
            taus[n0:n1] = tau[:n1 - n0]
        if xb.shape[0] == 0:
            continue
        if outs is not None and left is None:  # every row's outputs from the threshold pass
            lp, en, ls = outs
        elif outs is not None and not block:  # the forward over the fallback's rows only, under the Config's plan
            assert tau is not None and left is not None  # (the search's: its thresholds, the rows it left)
            fl, _ = backend.forward(xb[left], weight, bias, tb[left], opts, config, tau=tau[left], keep=False)
            lp, en, ls = (_put(o, f, left) for o, f in zip(outs, fl))
        else:
            (lp, en, ls), kept = backend.forward(xb, weight, bias, tb, opts, config, tau=tau)
            if outs is not None:  # the threshold pass's outputs, but for the fallback's rows
                assert left is not None  # (else every row's outputs came from it: above)
                lp, en, ls = (_put(o, f[left] if f is not None else None, left) for o, f in zip(outs, (lp, en, ls)))
        logp[n0:n1] = lp[:n1 - n0].to(sd)
        lse[n0:n1] = ls[:n1 - n0].to(sd)
        if ent is not None:
            ent[n0:n1] = en[:n1 - n0].to(sd)
    if not dec.width:
        cand, cols, inside = x.new_empty((0, 0), dtype=torch.float32), tokens.new_empty((0, 0), dtype=torch.int32), \
            tokens.new_empty(0, dtype=torch.bool)
    elif sparse_blocks:  # padded to the fixed width: the padding is never kept (-inf), its column V
        cand, cols, inside = (torch.cat(parts) for parts in zip(*sparse_blocks))
        if cand.shape[1] < dec.width:
            cand = F.pad(cand, (0, dec.width - cand.shape[1]), value=-math.inf)
            cols = F.pad(cols, (0, dec.width - cols.shape[1]), value=v)
    else:  # (no candidates: every row takes the dense backward)
        cand = x.new_empty((n, dec.width), dtype=torch.float32)
        cols = tokens.new_empty((n, dec.width), dtype=torch.int32)
        inside = tokens.new_zeros(n, dtype=torch.bool)
    # (one tensor for the candidates and their columns: the candidates' fp32 bits, the columns)
    sparse = torch.stack([cand.contiguous().view(torch.int32), cols.to(torch.int32)])
    return logp, ent, lse, taus, (sparse, inside), kept


def backward(impl, grad_logp: Optional[Tensor], grad_entropy: Optional[Tensor], x: Tensor, weight: Tensor,
             bias: Optional[Tensor], tokens: Tensor, lse: Tensor, entropy_out: Optional[Tensor], logp: Tensor,
             tau: Tensor, sparse: Tensor, inside: Tensor, kept, opts: LogProbOptions, config, need_dx: bool,
             need_dw: bool, need_db: bool, num_classes: int):
    """dx, dw, db (size 0 where not needed) under the forward's Config: the sparse backward
    for the rows ``inside`` their candidates (when any), the backend's (with tau) for the
    others, over the whole batch (also under batch invariance: ``contract.TritonConfig``'s
    ``backward``); turns the kept columns (when any) into dz (``ops.common.kept.Kept``). ``impl``: the backend or
    ``vocab_parallel.ShardedBackend``."""
    n = x.shape[0]
    need_db = need_db and bias is not None
    ent = entropy_out if opts.entropy else None
    taus = tau if tau.numel() or n == 0 else None
    v = num_classes
    g_lp, g_h = grad_logp, grad_entropy
    if g_lp is None:  # (zeros for an unused output)
        g_lp = torch.zeros_like(lse)
    if g_h is None and opts.entropy:
        g_h = torch.zeros_like(lse)
    g_lp = torch.where(torch.isinf(logp), torch.zeros_like(g_lp), g_lp)  # logp = -inf outside the kept set
    if inside.numel() and syncs_allowed(x.device) and bool(inside.any()):  # (host sync) kept sets inside the
        # candidates: no GEMM there (while capturing a CUDA graph every row takes the dense backward)
        dense = (~inside).nonzero()[:, 0]
        cand, cols = sparse[0].view(torch.float32), sparse[1]
        dx, dw, db = _sparse_backward(impl, x, weight, bias, tokens, lse, ent, taus, g_lp, g_h, v, cand, cols,
                                      dense, opts, config, need_dx, need_dw, need_db)
        return grad_outputs(x, dx, dw, db, need_dx, need_dw, need_db)
    dx = dw = db = None
    if n:
        coef = impl.grad_coefficients(ent, tokens, g_lp, g_h if opts.entropy else None, v, opts, lse)
        dx, dw, db = impl.backward(x, weight, bias, tokens, opts, lse, coef, config, kept=kept, need_dx=need_dx,
                                   need_dw=need_dw, need_db=need_db, tau=taus)
        if need_dx and not (dx.dtype == x.dtype and x.is_contiguous()):
            dx = torch.zeros_like(x).copy_(dx)
    if need_dx and dx is None:
        dx = torch.zeros_like(x)
    if need_dw:
        dw = torch.zeros_like(weight) if dw is None else dw.to(weight.dtype)
    if need_db and bias is not None:  # (need_db: a bias)
        db = torch.zeros_like(bias) if db is None else db.to(bias.dtype)
    return grad_outputs(x, dx, dw, db, need_dx, need_dw, need_db)


def _sparse_backward(backend, x, weight, bias, tokens, lse, ent, taus, g_lp, g_h, v, cand, cols, dense, opts,
                     config, need_dx, need_dw, need_db):
    """(dx, dW, db): the sparse backward (``triton_lib.log_probs_sparse``) of the rows
    whose kept set lies in their candidates, onto the dense backward of the others
    (``dense``, indices: the backend's over those rows only, under the call's Config, tau
    as the forward's)."""
    from logitless.triton_lib import log_probs_sparse as LS

    coef = backend.grad_coefficients(ent, tokens, g_lp, g_h if opts.entropy else None, v, opts, lse)
    tau = taus.index_fill(0, dense, math.inf)  # (the dense rows: nothing kept here)
    dz, col, cnt = LS.sparse_dlogits(cand, cols, tau, tokens, lse, coef, opts.softcap, opts.temperature,
                                     opts.entropy, v)
    bx = bw = bb = None
    if dense.numel():
        bx, bw, bb = backend.backward(x[dense], weight, bias, tokens[dense], opts, lse[dense],
                                      coef[:, dense].contiguous(), config, kept=None, need_dx=need_dx,
                                      need_dw=need_dw, need_db=need_db, tau=taus[dense])
    dx, dw, db = LS.sparse_backward(x, weight, bias, dz, col, cnt, need_dx=need_dx, need_dw=need_dw,
                                    need_db=need_db, dw=bw.contiguous() if bw is not None else None,
                                    db=bb.contiguous() if bb is not None else None)
    if bx is not None:
        dx[dense] = bx.to(dx.dtype)
    return (dx, dw.to(weight.dtype) if dw is not None else None, db.to(bias.dtype) if db is not None else None)
