"""The threshold pass of truncated log-probs on the Triton backend (``formulas.truncation``,
``ops/linear_log_probs/truncation.py``), from the forward kernel's tile code
(``log_probs_math.scaled_tile``: the same GEMM, 16-bit operands, fp32 accumulation). No
logits are written: each program keeps what it needs in registers.

    candidates_kernel   per (row block, vocabulary split): the C largest values per row
                        of a = softcap(z) / T (unordered; C a power of two <= BLOCK_V),
                        the split's max m, s = sum exp(a - m), u = sum exp(a - m)(a - m)
                        (ENTROPY) and a at the token. HAS_UPPER: the candidates are taken
                        among a < hi (per row) only, m, s and u over a >= hi (the mass
                        search's last pass). A per-row filter against the exact C-th
                        candidate: most tiles of a long split insert nothing; a value
                        that enters replaces the row's smallest candidate (no sort).
    mass_kernel         per (row block, vocabulary split), for T per-row thresholds t_j:
                        the count of a >= t_j and W_j = sum exp(a - m) over a >= t_j, m
                        given per row (the top-p mass search: where the prefix mass
                        crosses top_p * Z1).

Outputs per split ((splits, N[, C or T]) buffers), merged by the caller in torch
(O(N * splits * C) work). Traffic: the GEMM's reads plus those small buffers.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from logitless.triton_lib import launch
from logitless.triton_lib.ce_math import store_partials
from logitless.triton_lib.log_probs_math import (
    online_entropy_update,
    online_start,
    row_tokens,
    scaled_tile,
    split_blocks,
)


@triton.jit
def _insert_largest(rem, cand, floor, BLOCK_V: tl.constexpr, C: tl.constexpr):
    """One step of the per-row filter: each row's largest value left in ``rem`` leaves it
    (one column: tied values one step each) and replaces the row's smallest candidate
    (``floor``) when larger. The candidates stay the C largest values seen (a multiset,
    unordered); a row with nothing left (-inf) changes nothing. Returns (rem, cand, hit,
    col): hit the slot each row's value entered (all False: none), col the tile column it
    left; the new floor is tl.min(cand, 1)."""
    cols = tl.arange(0, BLOCK_V)
    slots = tl.arange(0, C)
    v = tl.max(rem, 1)
    col = tl.min(tl.where(rem == v[:, None], cols[None, :], BLOCK_V), 1)
    rem = tl.where(cols[None, :] == col[:, None], float("-inf"), rem)
    slot = tl.min(tl.where(cand == floor[:, None], slots[None, :], C), 1)
    hit = (slots[None, :] == slot[:, None]) & (v > floor)[:, None]
    cand = tl.where(hit, v[:, None], cand)
    return rem, cand, hit, col


@triton.jit
def candidates_kernel(
    x_ptr, w_ptr, b_ptr, token_ptr, hi_ptr, cand_ptr, idx_ptr, part_max_ptr, part_sum_ptr, part_u_ptr, part_tgt_ptr,
    N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, blocks_per_split, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, HAS_UPPER: tl.constexpr,
    IDX: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, C: tl.constexpr,
):
    """Program (i, split): rows [i BLOCK_N, ...) over the split's vocabulary blocks;
    cand (splits, N, C) the split's C largest values per row, unordered (-inf where fewer
    than C values), partials (splits, N) (HAS_UPPER: m, s, u of the values a >= hi).

    The filter: only values above a row's C-th candidate (``floor``, exact at every
    step) can enter. A tile where some row has more than C of them (the first tiles)
    merges at once: its tl.topk, descending, against the candidates sorted ascending
    (the elementwise max holds the C largest of both). Otherwise each row's values above
    its floor enter one at a time, largest first (``_insert_largest``), as many steps as
    the row with the most (0 when none: most tiles of a long split).
    IDX: also each candidate's column (idx (splits, N, C) int32, -1 where none; the
    sparse backward's); every tile then goes by insertion, min(most, C) steps (the tile's
    C largest are all that can enter), as no tl.topk carries the columns."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n, row_ok, token = row_tokens(token_ptr, pid_n, N, V, BLOCK_N)
    if HAS_UPPER:
        hi = tl.load(hi_ptr + offs_n, mask=row_ok, other=float("inf"))
    m, s, u, a_t = online_start(BLOCK_N)
    cand = tl.full((BLOCK_N, C), float("-inf"), tl.float32)
    floor = tl.full((BLOCK_N,), float("-inf"), tl.float32)  # the C-th candidate per row
    if IDX:
        cidx = tl.full((BLOCK_N, C), -1, tl.int32)

    first_block, num_blocks = split_blocks(split, blocks_per_split, V, BLOCK_V)
    for i in range(0, num_blocks):
        offs_v, _col_ok, a = scaled_tile(
            x_ptr, w_ptr, b_ptr, pid_n, first_block + i, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh,
            softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H,
        )
        a_t += tl.sum(tl.where(offs_v[None, :] == token[:, None], a, 0.0), 1)
        ac = a
        if HAS_UPPER:  # (the sums first: then a and ac are not both live)
            m, s, u, e, m_safe = online_entropy_update(tl.where(a >= hi[:, None], a, float("-inf")), m, s, u,
                                                       ENTROPY)
            ac = tl.where(a < hi[:, None], a, float("-inf"))
        else:
            m, s, u, e, m_safe = online_entropy_update(a, m, s, u, ENTROPY)
        most = tl.max(tl.sum((ac > floor[:, None]).to(tl.int32), 1), 0)
        if IDX:
            if most > 0:
                rem = tl.where(ac > floor[:, None], ac, float("-inf"))
                col0 = (first_block + i) * BLOCK_V
                for _ in range(0, tl.minimum(most, C)):  # (the value entering takes its column along)
                    rem, cand, hit, col = _insert_largest(rem, cand, floor, BLOCK_V, C)
                    cidx = tl.where(hit, (col0 + col)[:, None], cidx)
                    floor = tl.min(cand, 1)
        elif most > C:
            cand = tl.maximum(tl.sort(cand, dim=1), tl.topk(ac, C, dim=1))
            floor = tl.min(cand, 1)
        elif most > 0:
            rem = tl.where(ac > floor[:, None], ac, float("-inf"))
            for _ in range(0, most):
                rem, cand, _hit, _col = _insert_largest(rem, cand, floor, BLOCK_V, C)
                floor = tl.min(cand, 1)

    out = store_partials(part_max_ptr, part_sum_ptr, part_u_ptr, part_tgt_ptr, split, N, offs_n, row_ok, m, s, u,
                         a_t, ENTROPY)
    slots = tl.arange(0, C)
    tl.store(cand_ptr + out[:, None] * C + slots[None, :], cand, mask=row_ok[:, None])
    if IDX:
        tl.store(idx_ptr + out[:, None] * C + slots[None, :], cidx, mask=row_ok[:, None])


@triton.jit
def mass_kernel(
    x_ptr, w_ptr, b_ptr, m_ptr, thr_ptr, cnt_ptr, mass_ptr,
    N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, blocks_per_split, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, T: tl.constexpr,
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

    first_block, num_blocks = split_blocks(split, blocks_per_split, V, BLOCK_V)
    for i in range(0, num_blocks):
        offs_v, _col_ok, a = scaled_tile(
            x_ptr, w_ptr, b_ptr, pid_n, first_block + i, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh,
            softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H,
        )
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


#: Rows per program of the candidates kernel on AMD GPUs: its (rows x C) candidates and the
#: tile spill VGPRs at the forward plan's 128 rows (gfx942: 42, gfx950: 49 spilled with
#: bf16, C = 64, 4 warps; none at 64 rows: ``benchmarks/check_gpu_compile.py``).
ROCM_CANDIDATE_ROWS = 64
#: The mass kernel's widest vocabulary tile on NVIDIA GPUs: its T-threshold loop keeps a and
#: exp(a - m) live beside the GEMM's tile; at the forward's 128 x 256 it ran 3.5x a GEMM on
#: an H100 (qwen3-8b-8k, T = 32), at 128 x 128 2.5x (64 x 256: 2.7x; 4 warps: 2.5-6.8x).
MASS_BLOCK_V = 128


def candidate_tiles(plan, device):
    """The candidates kernel's tiles: the forward ``plan``'s, with its rows per program for
    ``device`` (planned once per call: the Triton Config holds them)."""
    from logitless.planning import device as _device

    if _device.facts(device).arch is not None and plan.block_n > ROCM_CANDIDATE_ROWS:
        return replace(plan, block_n=ROCM_CANDIDATE_ROWS)
    return plan


def mass_tiles(plan, device):
    """The mass kernel's tiles: the forward ``plan``'s, its vocabulary tile at most
    ``MASS_BLOCK_V`` on NVIDIA GPUs (planned once per call: the Triton Config holds them)."""
    from logitless.planning import device as _device

    if _device.facts(device).arch is not None or plan.block_v <= MASS_BLOCK_V:
        return plan
    return replace(plan, block_v=MASS_BLOCK_V)


def splits_for(n: int, v: int, tiles, c: int, device) -> int:
    """Vocabulary splits of the threshold pass for n rows under the candidates kernel's
    ``tiles`` (``candidate_tiles``): the fewest that fill the GPU in one wave (row blocks x
    splits <= SMs, at least one). Long splits let the filter skip most tiles (a value
    enters a row's top-C of t tiles with probability ~C / t on flat rows); the forward's
    plan splits for many waves (~18 tiles per split on qwen3-8b-8k). A function of n: the
    callers take it from the whole batch (a block under batch invariance), not from the
    rows a later pass runs on."""
    from logitless.planning.plans import num_sms

    blocks = launch.cdiv(v, max(tiles.block_v, c))
    return max(1, min(blocks, num_sms(device) // max(1, launch.cdiv(n, tiles.block_n))))


def _common(x, weight, bias, plan, softcap, temperature, block_v, splits):
    n, h = x.shape
    v = weight.shape[0]
    blocks = launch.cdiv(v, block_v)
    splits = min(splits, blocks)
    per_split = launch.cdiv(blocks, splits)
    splits = launch.cdiv(blocks, per_split)
    grid = (launch.cdiv(n, plan.block_n), splits)
    # (tensor descriptors where the plan and the rows allow, as the forward's: a pipelined GEMM)
    x_op, w_op, use_tma = launch.operands(x, weight, replace(plan, block_v=block_v))
    args = (n, v, h, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), per_split,
            float(softcap or 1.0), 1.0 / temperature)
    flags = dict(HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
                 DOT_PRECISION=launch.dot_precision(x.dtype), USE_TMA=use_tma, BLOCK_N=plan.block_n, BLOCK_V=block_v,
                 BLOCK_H=plan.block_h, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return n, splits, grid, (x_op, w_op), args, flags


def candidates(x, weight, bias, tokens, plan, softcap, temperature: float, c: int, entropy: bool, hi=None,
               splits=None, indices: bool = False):
    """Per split: (cand (splits, n, c) unordered, max, sum, u or None, a at the token),
    fp32, of x's rows under the candidates kernel's tiles ``plan`` (``candidate_tiles``;
    block_v raised to c when c is larger), ``splits`` vocabulary splits (None:
    ``splits_for`` these rows). ``hi`` (n,) fp32: candidates among a < hi only, the max,
    sum and u over a >= hi. ``indices``: a sixth item, the candidates' columns (splits, n,
    c) int32 (-1: none)."""
    block_v = max(plan.block_v, c)
    if splits is None:
        splits = splits_for(x.shape[0], weight.shape[0], plan, c, x.device)
    n, splits, grid, ops, args, flags = _common(x, weight, bias, plan, softcap, temperature, block_v, splits)
    cand = torch.empty(splits, n, c, dtype=torch.float32, device=x.device)
    idx = torch.empty(splits, n, c, dtype=torch.int32, device=x.device) if indices else None
    parts = launch.partials(4, splits, n, x.device)
    if n:
        launch.run_kernel(
            candidates_kernel, grid, *ops, bias if bias is not None else x, tokens,
            hi if hi is not None else x, cand, idx if indices else cand, *parts, *args,
            ENTROPY=entropy, HAS_UPPER=hi is not None, IDX=indices, C=c, **flags,
        )
    out = (cand, parts[0], parts[1], (parts[2] if entropy else None), parts[3])
    return out + (idx,) if indices else out


def masses(x, weight, bias, plan, softcap, temperature: float, m, thr, splits=None):
    """Per split: (count int32, mass), each (splits, n, T), of a >= thr (n, T) fp32 per
    row, masses exp(a - m) with m (n,) fp32 given, under the mass kernel's tiles ``plan``
    (``mass_tiles``); ``splits`` as ``candidates``'."""
    t = thr.shape[1]
    if splits is None:
        splits = plan.vocab_splits
    block_v = plan.block_v
    n, splits, grid, ops, args, flags = _common(x, weight, bias, plan, softcap, temperature, block_v, splits)
    cnt = torch.empty(splits, n, t, dtype=torch.int32, device=x.device)
    mass = torch.empty(splits, n, t, dtype=torch.float32, device=x.device)
    if n:
        launch.run_kernel(
            mass_kernel, grid, *ops, bias if bias is not None else x,
            m.to(torch.float32).contiguous(), thr.to(torch.float32).contiguous(), cnt, mass, *args, T=t, **flags,
        )
    return cnt, mass
