"""Gradient-in-forward strategy of linear_jsd's Triton backend (its ``grad_in_forward``
capability, ``contract.LjsdBackend``; ``cost_model``: "grad_in_forward", chosen by
``planning.linear_jsd_strategy`` in ``triton_backend.plan``: the Config's ``grad_in_forward``
chunk and its statistics' launches).

For reductions "mean" and "sum" each token's upstream gradient is grad_output times a
factor known before the forward (1 for "sum", 1 / #non-ignored tokens for "mean"; 0 at
ignored tokens). The forward already holds both heads' fp32 logits of a token chunk
[n0, n1) for the row statistics, so it finishes the gradient there:

    zs, zt  = x_s W_s^T (+ b_s), x_t W_t^T (+ b_t)   fp32, rows x V each (cuBLAS)
    stats   = row_stats(zs, zt)                      (split-row kernels, jsd_rows)
    dz      = jsd_backward_kernel(zs, zt, stats, g)  both chunks read once, dz written
                                                     once in the input dtype
    dx[n0:n1] = dz W_s                               (one GEMM, fp32 accumulation)
    dW_s     += dz^T x_s[n0:n1]                      (fp32 accumulator across chunks)
    db_s     += column sums of dz                    (fp32)

4 GEMMs in all (student and teacher logits, dx, dW: the floor) against the recompute
design's 6, plus bandwidth: both fp32 chunks are read three times (lse, divergence, dz).
Temporary memory: the chunk's two fp32 logits and its dz ((8 + itemsize) rows x V bytes)
plus the fp32 dW accumulator (4 V H_s bytes) when there is more than one chunk and the
weight is not fp32 already; the accumulator becomes the returned dW, so the budget counts
(4 - itemsize) V H_s of it (``cost_model.predict_jsd_grad_in_forward``).
The backward multiplies by grad_output (``scale_grads``):
dx is rounded twice when grad_output != 1 (dx of the forward in the input dtype, then
scaled); dW and db are scaled in fp32 and rounded once. No atomics; chunks run in a
fixed order: bitwise repeatable.
"""

from __future__ import annotations

import torch

from logitless.formulas.jsd import NUM_STATS
from logitless.options import JSDOptions
from logitless.triton_lib import launch
from logitless.triton_lib.jsd_epilogue import upstream
from logitless.triton_lib.jsd_rows import dz_rows, row_stats

from .contract import TritonConfig


def forward_with_grad(xs, ws, bs, xt, wt, bt, target, opts: JSDOptions, reduction: str, *, config: TritonConfig,
                      need_dx: bool, need_dw: bool, need_db: bool):
    """With ``config.grad_in_forward`` tokens per chunk: statistics (6, N) fp32 of every
    token, and (dx, dw, db) for grad_output = 1: dx in x's dtype; dw fp32 (in the weight's
    dtype when one chunk covers every token); db fp32; None where not needed.
    ``ops.common.grad_in_forward.scale_grads`` finishes them."""
    token_chunk = config.grad_in_forward
    n, h = xs.shape
    v = ws.shape[0]
    dev = xs.device
    g = upstream(None, target, opts.ignore_index, reduction)  # grad_output = 1: one launch (jsd_epilogue)
    chunks = [(n0, min(n, n0 + token_chunk)) for n0 in range(0, n, token_chunk)]
    one = len(chunks) == 1
    rows = min(token_chunk, n)
    stats = torch.empty(NUM_STATS, n, dtype=torch.float32, device=dev)
    zs = torch.empty(rows, v, dtype=torch.float32, device=dev)
    zt = torch.empty_like(zs)
    dz_buf = torch.empty(rows, v, dtype=xs.dtype, device=dev)
    dx = torch.empty_like(xs) if need_dx else None
    dw = None
    if need_dw:
        dw = torch.empty_like(ws) if (one or ws.dtype == torch.float32) else torch.zeros(
            v, h, dtype=torch.float32, device=dev)
        if not one and ws.dtype == torch.float32:
            dw.zero_()
    db = torch.zeros(v, dtype=torch.float32, device=dev) if need_db else None
    for n0, n1 in chunks:
        r = n1 - n0
        a, b, dz = zs[:r], zt[:r], dz_buf[:r]
        launch.logits_fp32(xs[n0:n1], ws, bs, a)
        launch.logits_fp32(xt[n0:n1], wt, bt, b)
        chunk_stats = stats[:, n0:n1]  # (written in place: rows n apart)
        tc = target[n0:n1]
        plan = config.stats if r == rows else config.tail_stats
        assert plan is not None  # (a Config with grad_in_forward plans its tail's statistics)
        row_stats(a, b, tc, chunk_stats, opts, plan)
        dz_rows(a, b, dz, tc, chunk_stats, g[n0:n1], opts, plan)
        if dx is not None:
            torch.mm(dz, ws, out=dx[n0:n1])
        if dw is not None:
            if one:
                torch.mm(dz.T, xs[n0:n1], out=dw)
            elif dw.is_cuda and dz.dtype != torch.float32:
                torch.addmm(dw, dz.T, xs[n0:n1], out_dtype=torch.float32, out=dw)
            elif dw.is_cuda:
                torch.addmm(dw, dz.T, xs[n0:n1], out=dw)
            else:  # the interpreter on CPU
                dw += dz.T.float() @ xs[n0:n1].float()
        if db is not None:
            db += dz.sum(dim=0, dtype=torch.float32)
    return stats, (dx, dw, db)
