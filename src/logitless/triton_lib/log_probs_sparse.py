"""The sparse backward of truncated log-probs (``ops/linear_log_probs/truncation.py``)
for the rows whose kept set lies inside their candidates (top-k <= C - 1, with or without
top-p / min-p on top; peaked top-p): dz is 0 outside the kept set, so no GEMM recomputes
the logits (the other rows take the dense backward, whose dW / db the dW kernel adds to:
``ADD``). From the candidates' values a and columns (the candidates kernel's, IDX):

    dz_j      per kept candidate, the dense epilogue's formula (``formulas.log_probs.
              dlogits_``: p_j (A + C log p_j) - B [j == t], times the soft-cap's factor)
              from the saved lse and the (3, N) coefficients: O(N x C) torch work.
    dx        ``sparse_dx_kernel``: dx[n] = sum_j dz[n, j] W[col[n, j]], the kept
              candidates in ascending column order (a fixed order: it does not depend on
              the split plan), BLOCK_J at a time, fp32.
    dW, db    ``sparse_dw_kernel``: the (column, row) pairs sorted by column (a stable
              sort: rows ascending within a column), one program per (vocabulary row,
              H block) summing dz * x[row] over its segment in that order, zeros where
              the segment is empty. No float atomics: deterministic.

Traffic: N x K rows of W and of x gathered (K kept per row), dW written once.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from logitless.triton_lib.fast_launch import public_launch

BLOCK_J = 16
BLOCK_H = 1024


@triton.jit
def sparse_dx_kernel(dz_ptr, col_ptr, cnt_ptr, w_ptr, dx_ptr, H, K, stride_wv, stride_wh, stride_dxn,
                     BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (n, h block): dx[n, hs] = sum over the row's cnt[n] first (column, dz)
    pairs of dz W[column, hs], fp32, BLOCK_J pairs a step (a fixed-shape tree each)."""
    n = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    cnt = tl.load(cnt_ptr + n)
    row = n.to(tl.int64) * K
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j0 in range(0, cnt, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        j_ok = offs_j < cnt
        col = tl.load(col_ptr + row + offs_j, mask=j_ok, other=0)
        dz = tl.load(dz_ptr + row + offs_j, mask=j_ok, other=0.0)
        w = tl.load(w_ptr + col.to(tl.int64)[:, None] * stride_wv + offs_h[None, :] * stride_wh,
                    mask=j_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(dz[:, None] * w, 0)
    tl.store(dx_ptr + n.to(tl.int64) * stride_dxn + offs_h, acc.to(dx_ptr.dtype.element_ty), mask=h_ok)


@triton.jit
def sparse_dw_kernel(dz_ptr, row_ptr, start_ptr, x_ptr, dw_ptr, db_ptr, H, stride_xn, stride_xh, stride_dwv,
                     HAS_DB: tl.constexpr, ADD: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (v, h block): dW[v, hs] = sum of dz x[row, hs] over the pairs
    [start[v], start[v + 1]) of the column-sorted lists, BLOCK_J a step; db[v] (h block 0)
    the sum of their dz. ADD: onto dW's and db's values (the dense rows' part), in fp32."""
    v = tl.program_id(0)
    hb = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    s0 = tl.load(start_ptr + v)
    s1 = tl.load(start_ptr + v + 1)
    row = dw_ptr + v.to(tl.int64) * stride_dwv + offs_h
    if ADD:
        acc = tl.load(row, mask=h_ok, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_H,), tl.float32)
    acc_b = tl.zeros((BLOCK_J,), tl.float32)
    for j0 in range(s0, s1, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        j_ok = offs_j < s1
        r = tl.load(row_ptr + offs_j, mask=j_ok, other=0)
        dz = tl.load(dz_ptr + offs_j, mask=j_ok, other=0.0)
        xt = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_xn + offs_h[None, :] * stride_xh,
                     mask=j_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(dz[:, None] * xt, 0)
        if HAS_DB:
            acc_b += dz
    tl.store(row, acc.to(dw_ptr.dtype.element_ty), mask=h_ok)
    if HAS_DB:
        if hb == 0:
            b = tl.sum(acc_b, 0)
            if ADD:
                b += tl.load(db_ptr + v).to(tl.float32)
            tl.store(db_ptr + v, b.to(db_ptr.dtype.element_ty))


def sparse_dlogits(cand: Tensor, cols: Tensor, tau: Tensor, tokens: Tensor, lse: Tensor, coef: Tensor,
                   softcap: Optional[float], temperature: float, entropy: bool, v: int):
    """(dz, col, cnt): per row (N, C), d / d (pre-cap) z at the kept candidates
    (cand >= tau, finite) in ascending column order first, cnt (N,) of them; the rest of
    the row dz = 0, col = v."""
    a = cand.float()
    keep = (a >= tau.float()[:, None]) & (a > -math.inf)
    logp = a - lse.float()[:, None]
    p = torch.exp(torch.where(keep, logp, torch.full_like(logp, -math.inf)))
    ca, cb, cc = coef.float()
    dz = p * (ca[:, None] + cc[:, None] * torch.where(keep, logp, torch.zeros_like(logp))) if entropy else \
        p * ca[:, None]
    dz = torch.where(p == 0, torch.zeros_like(dz), dz)
    dz = dz - torch.where(keep & (cols.long() == tokens[:, None]), cb[:, None], torch.zeros_like(dz))
    if softcap is not None:
        capped = torch.where(keep, a, torch.zeros_like(a)) * (temperature / softcap)
        dz = dz * (1.0 - capped * capped)
    key = torch.where(keep, cols.long(), torch.full_like(cols, v, dtype=torch.int64))
    key, order = torch.sort(key, dim=1, stable=True)
    return dz.gather(1, order).contiguous(), key, keep.sum(1).to(torch.int32)


def sparse_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], dz: Tensor, col: Tensor, cnt: Tensor, *,
                    need_dx: bool, need_dw: bool, need_db: bool, dw: Optional[Tensor] = None,
                    db: Optional[Tensor] = None):
    """(dx, dW, db) (each None when not needed) of the (dz, col, cnt) of ``sparse_dlogits``;
    ``dw``, ``db`` (row-major, the dense rows' part): summed onto, in place."""
    n, k = dz.shape
    v, h = weight.shape
    add = dw is not None or db is not None
    assert not add or ((dw is not None) == need_dw and (db is not None) == need_db)
    if need_dx:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # (row-major whatever x's strides)
        if n:
            public_launch(sparse_dx_kernel, (n, triton.cdiv(h, BLOCK_H)),
                dz, col.to(torch.int32).contiguous(), cnt, weight, dx, h, k, weight.stride(0), weight.stride(1),
                dx.stride(0), BLOCK_J=BLOCK_J, BLOCK_H=BLOCK_H, num_warps=4)
    else:
        dx = None
    if need_dw or need_db:
        flat, perm = torch.sort(col.reshape(-1), stable=True)  # (rows ascending within a column)
        rows = torch.div(perm, k, rounding_mode="floor").to(torch.int32)
        dzs = dz.reshape(-1)[perm].contiguous()
        starts = torch.searchsorted(flat, torch.arange(v + 1, device=dz.device, dtype=flat.dtype)).to(torch.int32)
        if dw is None:
            dw = torch.empty((v, h if need_dw else 0), dtype=weight.dtype, device=x.device)
        if need_db and db is None:
            db = torch.empty(v, dtype=bias.dtype, device=x.device)
        if v:
            public_launch(sparse_dw_kernel, (v, max(1, triton.cdiv(dw.shape[1], BLOCK_H))),
                dzs, rows, starts, x, dw, db if need_db else dzs, dw.shape[1], x.stride(0), x.stride(1),
                dw.stride(0), HAS_DB=need_db, ADD=add, BLOCK_J=BLOCK_J, BLOCK_H=BLOCK_H, num_warps=4)
        dw = dw if need_dw else None
    return dx, dw, db
