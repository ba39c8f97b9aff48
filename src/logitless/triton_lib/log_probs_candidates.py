"""The threshold pass of truncated log-probs on the Triton backend (``formulas.truncation``,
``ops/linear_log_probs/truncation.py``), from the forward kernel's tile code
(``tile_io.block_tile``: the same GEMM, 16-bit operands, fp32 accumulation). No logits
are written: each program keeps what it needs in registers.

    candidates_kernel   per (row block, vocabulary split): a running top-C of
                        a = softcap(z) / T per row (descending; C a power of two <= BLOCK_V),
                        the split's max m, s = sum exp(a - m), u = sum exp(a - m)(a - m)
                        (ENTROPY) and a at the token. HAS_UPPER: the candidates are taken
                        among a < hi (per row) only, m, s and u over a >= hi (the mass
                        search's last pass).
                        A tile none of whose rows has a value above its C-th candidate
                        skips the merge (one scalar branch).
    mass_kernel         per (row block, vocabulary split), for T per-row thresholds t_j:
                        the count of a >= t_j and W_j = sum exp(a - m) over a >= t_j, m
                        given per row (the top-p mass search: where the prefix mass
                        crosses top_p * Z1).

Outputs per split ((splits, N[, C or T]) buffers), merged by the caller in torch
(O(N * splits * C) work). Traffic: the GEMM's reads plus those small buffers. The merge
of a tile: tl.topk of the tile (C largest, descending), elementwise max with the running
candidates reversed (a bitonic sequence holding the C largest of both), tl.sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from logitless.triton_lib import launch
from logitless.triton_lib.log_probs_math import online_entropy_update
from logitless.triton_lib.tile_io import block_tile


@triton.jit
def candidates_kernel(
    x_ptr, w_ptr, b_ptr, token_ptr, hi_ptr, cand_ptr, part_max_ptr, part_sum_ptr, part_u_ptr, part_tgt_ptr,
    N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, blocks_per_split, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, HAS_UPPER: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    C: tl.constexpr,
):
    """Program (i, split): rows [i BLOCK_N, ...) over the split's vocabulary blocks;
    cand (splits, N, C) descending (-inf where fewer than C values), partials (splits, N)
    (HAS_UPPER: m, s, u of the values a >= hi)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    token = tl.load(token_ptr + offs_n, mask=row_ok, other=-1)
    token = tl.where((token >= 0) & (token < V), token, -1)
    if HAS_UPPER:
        hi = tl.load(hi_ptr + offs_n, mask=row_ok, other=float("inf"))
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    u = tl.zeros((BLOCK_N,), tl.float32)
    a_t = tl.zeros((BLOCK_N,), tl.float32)
    cand = tl.full((BLOCK_N, C), float("-inf"), tl.float32)
    floor = tl.full((BLOCK_N,), float("-inf"), tl.float32)  # the C-th candidate per row

    first_block = split * blocks_per_split
    num_blocks = tl.minimum(blocks_per_split, tl.cdiv(V, BLOCK_V) - first_block)
    for i in range(0, num_blocks):
        offs_v, col_ok, z = block_tile(
            x_ptr, w_ptr, b_ptr, pid_n, first_block + i, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh,
            softcap, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, False, BLOCK_N, BLOCK_V, BLOCK_H,
        )
        a = tl.where(col_ok[None, :], z * inv_temp, float("-inf"))
        a_t += tl.sum(tl.where(offs_v[None, :] == token[:, None], a, 0.0), 1)
        ac = a
        if HAS_UPPER:
            ac = tl.where(a < hi[:, None], a, float("-inf"))
            m, s, u, e, m_safe = online_entropy_update(tl.where(a >= hi[:, None], a, float("-inf")), m, s, u,
                                                       ENTROPY)
        else:
            m, s, u, e, m_safe = online_entropy_update(a, m, s, u, ENTROPY)
        if tl.sum((tl.max(ac, 1) > floor).to(tl.int32), 0) > 0:
            top = tl.topk(ac, C, dim=1)
            cand = tl.sort(tl.maximum(cand, tl.flip(top, 1)), dim=1, descending=True)
            floor = tl.min(cand, 1)

    out = split.to(tl.int64) * N + offs_n
    cols = tl.arange(0, C)
    tl.store(cand_ptr + out[:, None] * C + cols[None, :], cand, mask=row_ok[:, None])
    tl.store(part_max_ptr + out, m, mask=row_ok)
    tl.store(part_sum_ptr + out, s, mask=row_ok)
    tl.store(part_tgt_ptr + out, a_t, mask=row_ok)
    if ENTROPY:
        tl.store(part_u_ptr + out, u, mask=row_ok)


@triton.jit
def mass_kernel(
    x_ptr, w_ptr, b_ptr, m_ptr, thr_ptr, cnt_ptr, mass_ptr,
    N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, blocks_per_split, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    T: tl.constexpr,
):
    """Program (i, split): per row and threshold t_j (thr (N, T) fp32), the count of
    a >= t_j (cnt (splits, N, T) int32) and sum exp(a - m) (mass) over the split, m (N,)
    given."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    cols = tl.arange(0, T)
    m = tl.load(m_ptr + offs_n, mask=row_ok, other=0.0)
    thr = tl.load(thr_ptr + offs_n.to(tl.int64)[:, None] * T + cols[None, :], mask=row_ok[:, None],
                  other=float("inf"))
    cnt = tl.zeros((BLOCK_N, T), tl.int32)
    mass = tl.zeros((BLOCK_N, T), tl.float32)

    first_block = split * blocks_per_split
    num_blocks = tl.minimum(blocks_per_split, tl.cdiv(V, BLOCK_V) - first_block)
    for i in range(0, num_blocks):
        offs_v, col_ok, z = block_tile(
            x_ptr, w_ptr, b_ptr, pid_n, first_block + i, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh,
            softcap, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, False, BLOCK_N, BLOCK_V, BLOCK_H,
        )
        a = tl.where(col_ok[None, :], z * inv_temp, float("-inf"))
        e = tl.exp(a - m[:, None])
        for j in range(0, T):  # (a loop, not unrolled: T tile reductions would spill)
            sel = cols[None, :] == j
            t_j = tl.max(tl.where(sel, thr, float("-inf")), 1)
            ge = a >= t_j[:, None]
            cnt += tl.where(sel, tl.sum(ge.to(tl.int32), 1)[:, None], 0)
            mass += tl.where(sel, tl.sum(tl.where(ge, e, 0.0), 1)[:, None], 0.0)

    out = (split.to(tl.int64) * N + offs_n)[:, None] * T + cols[None, :]
    tl.store(cnt_ptr + out, cnt, mask=row_ok[:, None])
    tl.store(mass_ptr + out, mass, mask=row_ok[:, None])


def _common(x, weight, bias, plan, softcap, temperature, block_v):
    n, h = x.shape
    v = weight.shape[0]
    splits = plan.vocab_splits
    blocks = triton.cdiv(v, block_v)
    splits = min(splits, blocks)
    per_split = triton.cdiv(blocks, splits)
    splits = triton.cdiv(blocks, per_split)
    grid = (triton.cdiv(n, plan.block_n), splits)
    args = (n, v, h, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), per_split,
            float(softcap or 1.0), 1.0 / temperature)
    flags = dict(HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
                 DOT_PRECISION=launch.dot_precision(x.dtype), BLOCK_N=plan.block_n, BLOCK_V=block_v,
                 BLOCK_H=plan.block_h, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return n, splits, grid, args, flags


def candidates(x, weight, bias, tokens, plan, softcap, temperature: float, c: int, entropy: bool, hi=None):
    """Per split: (cand (splits, n, c) descending, max, sum, u or None, a at the token),
    fp32, of x's rows under the forward ``plan``'s tiles and splits (block_v raised to c
    when c is larger). ``hi`` (n,) fp32: candidates among a < hi only, the max, sum and
    u over a >= hi."""
    block_v = max(plan.block_v, c)
    n, splits, grid, args, flags = _common(x, weight, bias, plan, softcap, temperature, block_v)
    cand = torch.empty(splits, n, c, dtype=torch.float32, device=x.device)
    parts = launch.partials(4, splits, n, x.device)
    if n:
        launch.launch_kernel(
            candidates_kernel, grid, x, weight, bias if bias is not None else x, tokens,
            hi if hi is not None else x, cand, *parts, *args,
            ENTROPY=entropy, HAS_UPPER=hi is not None, C=c, **flags,
        )
    return cand, parts[0], parts[1], (parts[2] if entropy else None), parts[3]


def masses(x, weight, bias, plan, softcap, temperature: float, m, thr):
    """Per split: (count int32, mass), each (splits, n, T), of a >= thr (n, T) fp32 per
    row, masses exp(a - m) with m (n,) fp32 given."""
    t = thr.shape[1]
    n, splits, grid, args, flags = _common(x, weight, bias, plan, softcap, temperature, plan.block_v)
    cnt = torch.empty(splits, n, t, dtype=torch.int32, device=x.device)
    mass = torch.empty(splits, n, t, dtype=torch.float32, device=x.device)
    if n:
        launch.launch_kernel(
            mass_kernel, grid, x, weight, bias if bias is not None else x,
            m.to(torch.float32).contiguous(), thr.to(torch.float32).contiguous(), cnt, mass, *args, T=t, **flags,
        )
    return cnt, mass
