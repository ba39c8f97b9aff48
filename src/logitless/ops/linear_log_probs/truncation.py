"""linear_log_probs with truncated sampling (top-k / top-p / min-p) and/or
``batch_invariant=True``: one autograd.Function over the backends' forward and backward.

Truncation (math: ``formulas.truncation``): a THRESHOLD pass finds each token's tau from
the hidden states (``thresholds``: chunked GEMMs, torch's or, on the Triton backend, the
forward kernel's tile code; a running top-C per row; no (tokens x vocab) tensor beyond
one chunk within the budget), then the backend's usual forward and backward run with
that per-token tau (``tau=``: columns a < tau drop out of the statistics and of dz).
GEMM passes: the threshold pass (1; rows whose kept set their candidates do not settle
run again with 4x as many: top-p over a flat row, a wide min-p set) plus those of the
default op (Triton: 3 when the budget keeps the columns, which it does not with a
soft-cap, nor under batch_invariant). Host syncs: the largest top_k,
and per pass the check of the rows left.

Batch invariance: the forward's rows go through the backends in blocks of a fixed size
(``invariant_rows``: it depends on the backend and device only), the last block padded
with zero rows, so every GEMM, plan and reduction of a row has the same shape whatever
the batch, and a row's bits do not depend on its position (row results of a GEMM of one
shape do not depend on the row's place in it). The per-token outputs (log p, entropy)
are invariant; the backward is the default one over the whole batch with those
outputs' statistics (gradients are deterministic run to run, not batch-invariant:
blocked, dW would be one V x H term per block, 3.1-3.7 GB and 1.22x the default f+b on
an H100, ``rl-invariant-H100-2026-11-25.md``). Cost: up to one block of padding rows;
no kept columns for the backward (one recomputed GEMM more than the default path).

torch.compile: this path is an autograd.Function over eager code (not custom ops).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import apply_softcap, compute_dtype
from logitless.formulas.log_probs import online_update, scaled_logits_
from logitless.formulas.truncation import MIN_CANDIDATES, Truncation, merge_candidates, resolve
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.dispatch import load_backend
from logitless.ops.common.invariant import blocks as _blocks
from logitless.ops.common.invariant import invariant_rows
from logitless.ops.common.invariant import pad_rows
from logitless.ops.common.torch_tiles import linear_torch_plan
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import LogProbOptions

def _tile(x_c: Tensor, w_v: Tensor, b_v: Optional[Tensor], opts: LogProbOptions) -> Tensor:
    z = x_c @ w_v.T
    if b_v is not None:
        z += b_v
    return scaled_logits_(apply_softcap(z, opts.softcap, inplace=True), opts)


def _candidates(x_c: Tensor, weight: Tensor, bias: Optional[Tensor], opts: LogProbOptions, c: int,
                vocab_chunk: int, tile_of=None):
    """(top-c descending, row max, sum exp(a - max)) of x_c's rows over all columns;
    ``tile_of(x_c, v0, v1)``: the tile of a (default: a torch GEMM in x_c's dtype)."""
    cd = compute_dtype(x_c.dtype)
    v = weight.shape[0]
    cand = None
    m = torch.full((x_c.shape[0],), -math.inf, dtype=cd, device=x_c.device)
    s = torch.zeros_like(m)
    for v0 in range(0, v, vocab_chunk):
        v1 = min(v, v0 + vocab_chunk)
        if tile_of is not None:
            a = tile_of(x_c, v0, v1)
        else:
            a = _tile(x_c, weight[v0:v1].to(cd), bias[v0:v1].to(cd) if bias is not None else None, opts)
        cand = merge_candidates(cand, a, c)
        m, s, _ = online_update(a, m, s, None)
    return cand, m, s


def _triton_tiles(x: Tensor, weight: Tensor, bias: Optional[Tensor], opts: LogProbOptions, budget: int):
    """(tile_of, vocab chunk) of the Triton backend: the forward kernel's tile code."""
    from logitless.triton_lib.log_probs_threshold import scaled_logits

    from . import triton_backend

    n, h = x.shape
    plan = triton_backend.plan(x, weight, bias, opts, budget=budget, need_grad=False, cute=False).forward

    def tile_of(x_c, v0, v1):
        return scaled_logits(x_c, weight, bias, opts.softcap, opts.temperature, v0, v1, plan)

    return tile_of, plan.block_v


def thresholds(x: Tensor, weight: Tensor, bias: Optional[Tensor], opts: LogProbOptions, trunc: Truncation,
               budget: int, impl: str = "torch") -> Tensor:
    """Per-token tau (N,) in the compute dtype (-inf: nothing truncated). ``impl``
    "triton": the tiles of a from the forward kernel's tile code (its GEMM: 16-bit
    operands, fp32 accumulation), else torch GEMMs in the compute dtype."""
    n = x.shape[0]
    v = weight.shape[0]
    cd = compute_dtype(x.dtype)
    cs = torch.finfo(cd).bits // 8
    tau = torch.full((n,), -math.inf, dtype=cd, device=x.device)
    if n == 0:
        return tau
    plan = linear_torch_plan(x, v, budget, tiles=3, accumulators=0)
    tile_of, vocab_chunk = None, plan.vocab_chunk
    if impl == "triton":
        tile_of, block_v = _triton_tiles(x, weight, bias, opts, budget)
        vocab_chunk = max(block_v, plan.vocab_chunk // block_v * block_v)
    # (host syncs: the largest top_k when it is a tensor, and once per pass the rows left)
    kmax = trunc.k_max if trunc.k_max is not None else int(trunc.top_k.max())
    c = min(v, max(MIN_CANDIDATES, kmax + 1))
    rows = None  # the first pass: every row, in order
    while True:
        # rows per step: the tile, the candidates and their merge within the budget
        step = plan.token_chunk if rows is None else max(
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
            t, ok = resolve(cand[:k], m[:k], s[:k], v, trunc.rows(idx))
            tau[idx] = torch.where(ok, t, tau[idx])
            oks.append(ok)
        ok = torch.cat(oks)
        if c >= v or bool(ok.all()):
            return tau
        rows = (torch.arange(n, device=x.device) if rows is None else rows)[~ok]
        c = min(v, 4 * c)


class _TruncatedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, tokens, trunc_args, opts, impl, budget, block):
        trunc = Truncation(*trunc_args[:3], k_max=trunc_args[3]) if trunc_args is not None else None
        n, v = x.shape[0], weight.shape[0]
        check_targets_in_range(tokens, v, opts.ignore_index, name="tokens")
        backend = load_backend(__package__, impl)
        sd = compute_dtype(x.dtype)
        with no_autocast(x.device):
            blocks = _blocks(n, block)
            # not blocked: the backend may keep columns for the backward (as the default op);
            # blocked (batch_invariant), never: a plan that keeps may tile differently, and the
            # plan must not follow the number of blocks
            # (a soft-cap with a threshold keeps nothing: ``triton_backend.forward``'s tau)
            keep = not block and any(ctx.needs_input_grad[:3]) and (trunc is None or opts.softcap is None)
            kept = None
            logp = x.new_empty(n, dtype=sd)
            ent = x.new_empty(n, dtype=sd) if opts.entropy else None
            lse = x.new_empty(n, dtype=sd)
            taus = x.new_empty(n, dtype=sd) if trunc is not None else None
            for n0, n1, pad in blocks:
                xb, tb = _padded(x, tokens, n0, n1, pad, opts.ignore_index)
                tau = None
                if trunc is not None:
                    tr = _padded_trunc(trunc, n0, n1, pad)
                    tau = thresholds(xb, weight, bias, opts, tr, budget, impl)
                    taus[n0:n1] = tau[:n1 - n0]
                if xb.shape[0] == 0:
                    continue
                plan = backend.plan(xb, weight, bias, opts, budget=budget, need_grad=keep, cute=False)
                (lp, en, ls), kept = backend.forward(xb, weight, bias, tb, opts, plan=plan, budget=budget,
                                                     outputs=True, tau=tau)
                kept = (kept, plan) if kept is not None else None
                logp[n0:n1] = lp[:n1 - n0].to(sd)
                lse[n0:n1] = ls[:n1 - n0].to(sd)
                if ent is not None:
                    ent[n0:n1] = en[:n1 - n0].to(sd)
        ctx.save_for_backward(x, weight, bias, tokens, lse, ent, taus, logp)
        ctx.args = (opts, impl, budget, block, bias is not None)
        ctx.kept = kept  # (consumed by the first backward, as the custom op's)
        if ent is None:
            ent = x.new_empty(0, dtype=sd)
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_h):
        x, weight, bias, tokens, lse, ent, taus, logp = ctx.saved_tensors
        opts, impl, budget, block, has_bias = ctx.args
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        n, v = x.shape[0], weight.shape[0]
        backend = load_backend(__package__, impl)
        sd = compute_dtype(x.dtype)
        if g_lp is not None:  # logp = -inf outside the kept set: piecewise constant there
            g_lp = torch.where(torch.isinf(logp), torch.zeros_like(g_lp), g_lp)
        dx = torch.zeros_like(x) if need_dx else None
        dw = db = None
        with no_autocast(x.device):
            # one block (the whole batch) under batch_invariant too: the module docstring
            for n0, n1, pad in _blocks(n, None):
                xb, tb = _padded(x, tokens, n0, n1, pad, opts.ignore_index)
                if xb.shape[0] == 0:
                    continue
                gl = _pad_vec(g_lp, n0, n1, pad) if g_lp is not None else None
                gh = _pad_vec(g_h, n0, n1, pad) if (g_h is not None and opts.entropy) else None
                en = _pad_vec(ent, n0, n1, pad) if ent is not None else None
                ls = _pad_vec(lse, n0, n1, pad)
                tau = _pad_vec(taus, n0, n1, pad, -math.inf) if taus is not None else None
                coef = backend.grad_coefficients(en, tb, gl, gh, v, opts, ls)
                if ctx.kept is not None:  # the forward's buffers and its plan (one block)
                    extra = dict(kept=ctx.kept[0], plan=ctx.kept[1])
                    ctx.kept = None
                else:
                    extra = dict(plan=backend.plan(xb, weight, bias, opts, budget=budget, need_grad=False,
                                                   cute=False))
                bx, bw, bb = backend.backward(xb, weight, bias, tb, opts, ls, coef, need_dx=need_dx,
                                              need_dw=need_dw, need_db=need_db and has_bias, budget=budget,
                                              tau=tau, **extra)
                if need_dx:
                    dx[n0:n1] = bx[:n1 - n0]
                # several blocks: dW and db summed in fp32 (16-bit inputs), cast once
                if need_dw:
                    dw = bw if dw is None else (dw.float() if dw.dtype != sd else dw).add_(bw)
                if need_db and has_bias:
                    db = bb if db is None else (db.float() if db.dtype != sd else db).add_(bb)
        if need_dw:
            dw = torch.zeros_like(weight) if dw is None else dw.to(weight.dtype)
        if need_db and has_bias:
            db = torch.zeros_like(bias) if db is None else db.to(bias.dtype)
        return dx, dw, db, None, None, None, None, None, None


def _padded(x: Tensor, tokens: Tensor, n0: int, n1: int, pad: int, ignore_index: int):
    return pad_rows(x, n0, n1, pad), pad_rows(tokens, n0, n1, pad, ignore_index)


def _pad_vec(t: Tensor, n0: int, n1: int, pad: int, fill: float = 0.0) -> Tensor:
    return pad_rows(t, n0, n1, pad, fill)


def _padded_trunc(trunc: Truncation, n0: int, n1: int, pad: int) -> Truncation:
    return Truncation(_pad_vec(trunc.top_k, n0, n1, pad), _pad_vec(trunc.top_p, n0, n1, pad, 1.0),
                      _pad_vec(trunc.min_p, n0, n1, pad), trunc.k_max)


def linear_log_probs_truncated(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor,
                               trunc: Optional[Truncation], opts: LogProbOptions, impl: str, budget: int,
                               batch_invariant: bool):
    """(logp, entropy or an empty tensor) of x (N, H), tokens (N,) int64."""
    block = invariant_rows(impl, x.device) if batch_invariant else None
    args = (trunc.top_k, trunc.top_p, trunc.min_p, trunc.k_max) if trunc is not None else None
    return _TruncatedLogProbs.apply(x, weight, bias, tokens, args, opts, impl, budget, block)
