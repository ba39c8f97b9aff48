"""Row statistics of the distillation loss from full rows of student and teacher logits
(``formulas.jsd``), shared by the jsd op (logits the caller holds) and linear_jsd (fp32
logit chunks written by cuBLAS), and the scalar arguments every JSD kernel takes.
"""

import math

import triton
import triton.language as tl

from logitless.triton_lib import launch
from logitless.triton_lib.ce_math import softcap_tile
from logitless.triton_lib.jsd_math import (
    jsd_dz_tile,
    load_jsd_row_stats,
    log_mixture,
    plogratio,
    stats_init,
    stats_update,
)
from logitless.triton_lib.launch import cdiv


def scalar_args(opts) -> dict:
    """The float and constexpr arguments every JSD kernel takes (``jsd_math``)."""
    beta = opts.beta
    mode = 1 if beta == 0.0 else 2 if beta == 1.0 else 0
    mid = mode == 0
    return dict(
        inv_t=1.0 / opts.temperature,
        log_beta=math.log(beta) if mid else 0.0,
        log_1mbeta=math.log1p(-beta) if mid else 0.0,
        cap_s=float(opts.student_softcap or 1.0),
        cap_t=float(opts.teacher_softcap or 1.0),
        MODE=mode,
        HAS_HARD=opts.hard_label_weight != 0.0,
        HAS_CAP_S=opts.student_softcap is not None,
        HAS_CAP_T=opts.teacher_softcap is not None,
    )


@triton.jit
def load_capped(rows, offs_v, stride_v, row_ok, V, other, cap, HAS_CAP: tl.constexpr):
    """A (BLOCK_N, BLOCK_V) tile in fp32, soft-capped, ``other`` outside the matrix."""
    col_ok = offs_v < V
    z = tl.load(rows + offs_v.to(tl.int64)[None, :] * stride_v,
                mask=row_ok[:, None] & col_ok[None, :], other=other).to(tl.float32)
    if HAS_CAP:
        z = tl.where(col_ok[None, :], softcap_tile(z, cap), other)
    return z


@triton.jit
def mixture_sums(rows_s, rows_t, cols, v_lo, v_hi, stride_sv, stride_tv, row_ok, lse_s, lse_t, cap_s, cap_t,
                 inv_t, log_beta, log_1mbeta, MODE: tl.constexpr, HAS_CAP_S: tl.constexpr,
                 HAS_CAP_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """(S, K) = (sum p (lp - lm), sum q (lq - lm)) over the columns [v_lo, v_hi) of both
    heads' rows, lse_s and lse_t known: the mixture's sweep (0 < beta < 1)."""
    acc_s = tl.zeros((BLOCK_N,), tl.float32)
    acc_k = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        a = load_capped(rows_s, v0 + cols, stride_sv, row_ok, v_hi, float("-inf"), cap_s, HAS_CAP_S)
        b = load_capped(rows_t, v0 + cols, stride_tv, row_ok, v_hi, float("-inf"), cap_t, HAS_CAP_T)
        lp = a * inv_t - lse_s[:, None]
        lq = b * inv_t - lse_t[:, None]
        p = tl.exp(lp)
        q = tl.exp(lq)
        lm = log_mixture(lp, lq, p, q, log_beta, log_1mbeta, MODE)
        acc_s += tl.sum(plogratio(p, lp, lm), 1)
        acc_k += tl.sum(plogratio(q, lq, lm), 1)
    return acc_s, acc_k


@triton.jit
def _kl_limits(w_s, w_t, s_s, s_t, lse_s, lse_t, MODE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(S, K) of the KL limits from the online sums w = sum e^(a - m) (a - m): MODE 1
    (forward KL) K = w_t / s_t - lse_t + lse_s, MODE 2 (reverse KL) S = w_s / s_s - lse_s
    + lse_t; the other one (both for the mixture, MODE 0) 0."""
    acc_s = tl.zeros((BLOCK_N,), tl.float32)
    acc_k = tl.zeros((BLOCK_N,), tl.float32)
    if MODE == 1:
        acc_k = w_t / s_t - lse_t + lse_s
    if MODE == 2:
        acc_s = w_s / s_s - lse_s + lse_t
    return acc_s, acc_k


@triton.jit
def _store_divergence(stats_ptr, stride_stat, offs_n, row_ok, lse_s, lse_t, acc_s, acc_k):
    """Rows 0-3 of the (6, N) statistics (``stride_stat`` apart): lse_s, lse_t, S, K."""
    tl.store(stats_ptr + offs_n, lse_s, mask=row_ok)
    tl.store(stats_ptr + stride_stat + offs_n, lse_t, mask=row_ok)
    tl.store(stats_ptr + 2 * stride_stat + offs_n, acc_s, mask=row_ok)
    tl.store(stats_ptr + 3 * stride_stat + offs_n, acc_k, mask=row_ok)


@triton.jit
def jsd_forward_kernel(
    zs_ptr, zt_ptr, target_ptr, stats_ptr,
    N, V, stride_sn, stride_sv, stride_tn, stride_tv, stride_stat,
    inv_t, log_beta, log_1mbeta, cap_s, cap_t,
    MODE: tl.constexpr, HAS_HARD: tl.constexpr, HAS_CAP_S: tl.constexpr, HAS_CAP_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Row statistics (6, N; rows ``stride_stat`` apart) of ``formulas.jsd``: lse(zs/T), lse(zt/T), S = sum p (lp - lm),
    K = sum q (lq - lm), lse(zs) and zs[target] (the last two only with HAS_HARD).

    Program i owns rows [i*BLOCK_N, (i+1)*BLOCK_N). Sweep 1 over the vocabulary: online
    log-sum-exps (fp32); for the KL limits (MODE 1, 2) also the one divergence sum,
    rescaled online like the sum of exponentials. Sweep 2 (0 < beta < 1 only): S and K,
    which need both lse. Traffic: both logits read once (KL) or twice; 6 floats per row.
    """
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    rows_s = zs_ptr + offs_n.to(tl.int64)[:, None] * stride_sn
    rows_t = zt_ptr + offs_n.to(tl.int64)[:, None] * stride_tn
    cols = tl.arange(0, BLOCK_V)
    neg = float("-inf")

    m_s, s_s, m_t, s_t, m_1, s_1, w = stats_init(BLOCK_N)  # w, KL limits: sum e^(x - m) (b - a), x the weighting head
    for v0 in range(0, V, BLOCK_V):
        zs = load_capped(rows_s, v0 + cols, stride_sv, row_ok, V, neg, cap_s, HAS_CAP_S)
        a = zs * inv_t
        b = load_capped(rows_t, v0 + cols, stride_tv, row_ok, V, neg, cap_t, HAS_CAP_T) * inv_t
        m_s, s_s, m_t, s_t, m_1, s_1, w = stats_update(zs, a, b, m_s, s_s, m_t, s_t, m_1, s_1, w, MODE, HAS_HARD)
    lse_s = tl.where(m_s == neg, 0.0, m_s) + tl.log(s_s)
    lse_t = tl.where(m_t == neg, 0.0, m_t) + tl.log(s_t)

    if MODE != 0:
        acc_s, acc_k = _kl_limits(w, w, s_s, s_t, lse_s, lse_t, MODE, BLOCK_N)
    else:  # the mixture is not an online quantity: a second sweep with both lse known
        acc_s, acc_k = mixture_sums(rows_s, rows_t, cols, 0, V, stride_sv, stride_tv, row_ok, lse_s, lse_t,
                                    cap_s, cap_t, inv_t, log_beta, log_1mbeta, MODE, HAS_CAP_S, HAS_CAP_T,
                                    BLOCK_N, BLOCK_V)

    _store_divergence(stats_ptr, stride_stat, offs_n, row_ok, lse_s, lse_t, acc_s, acc_k)
    _store_hard_label(stats_ptr, stride_stat, offs_n, row_ok, m_1, s_1,
                      target_ptr, zs_ptr, stride_sn, stride_sv, V, cap_s, HAS_HARD, HAS_CAP_S, BLOCK_N)


@triton.jit
def jsd_backward_kernel(
    zs_ptr, zt_ptr, dz_ptr, target_ptr, stats_ptr, g_ptr,
    N, V, stride_sn, stride_sv, stride_tn, stride_tv, stride_dn, stride_dv, stride_stat,
    inv_t, wp, hlw, log_beta, log_1mbeta, cap_s, cap_t,
    MODE: tl.constexpr, HAS_HARD: tl.constexpr, HAS_CAP_S: tl.constexpr, HAS_CAP_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """dz = d loss / d student logits for one BLOCK_N x BLOCK_V tile, in dz's dtype,
    from the forward's statistics (rows ``stride_stat`` apart) and the per-token upstream gradient g
    (``jsd_math.jsd_dz_tile``). Traffic: both tiles read once, dz written once."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    zs = load_capped(zs_ptr + rows * stride_sn, offs_v, stride_sv, row_ok, V, 0.0, cap_s, HAS_CAP_S)
    zt = load_capped(zt_ptr + rows * stride_tn, offs_v, stride_tv, row_ok, V, 0.0, cap_t, HAS_CAP_T)
    lse_s, lse_t, s_row, lse1, g, target = load_jsd_row_stats(stats_ptr, g_ptr, target_ptr, offs_n, row_ok,
                                                              stride_stat)
    dz = jsd_dz_tile(zs, zt, offs_v, target, lse_s, lse_t, s_row, lse1, g,
                     inv_t, wp, hlw, log_beta, log_1mbeta, cap_s, MODE, HAS_HARD, HAS_CAP_S)
    mask = row_ok[:, None] & (offs_v < V)[None, :]
    tl.store(dz_ptr + rows * stride_dn + offs_v.to(tl.int64)[None, :] * stride_dv,
             dz.to(dz_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- split rows
#
# The same statistics with each row split over ``splits`` programs (grid row blocks x
# splits), for few rows of a long vocabulary (linear_jsd's chunks of ~200 rows of 128k+
# columns, where one program per row block left the device latency-bound): phase 1
# writes per split the online-mergeable partials (max, sum-exp of both heads, of the
# student at T = 1, and the KL limits' rescaled sum), phase 2 (0 < beta < 1 only) merges
# them into both lse and sums S and K over its columns, phase 3 merges the splits into
# the (6, N) statistics. Partials are (PARTS, splits, N) fp32 (a few KB per row chunk).
# Summation order differs from ``jsd_forward_kernel`` (per split, then across splits, in
# split order): the same fp32 accuracy, deterministic, not bitwise the same numbers.

#: Partials per (split, row) of phase 1: m_s, s_s, m_t, s_t, m_1, s_1, w.
PARTS = 7


@triton.jit
def _split_rows(zs_ptr, zt_ptr, N, stride_sn, stride_tn, BLOCK_N: tl.constexpr):
    """The row set-up of program (i, j) of a split phase (grid row blocks x splits):
    (j, the number of splits, row offsets, row mask, both heads' row pointers)."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    splits = tl.num_programs(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    rows_s = zs_ptr + offs_n.to(tl.int64)[:, None] * stride_sn
    rows_t = zt_ptr + offs_n.to(tl.int64)[:, None] * stride_tn
    return pid_v, splits, offs_n, row_ok, rows_s, rows_t


@triton.jit
def _split_columns(pid_v, V, BLOCK_V: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr):
    """Columns [v_lo, v_hi) of split pid_v (BLOCKS_PER_SPLIT blocks of BLOCK_V)."""
    v_lo = pid_v * BLOCKS_PER_SPLIT * BLOCK_V
    v_hi = tl.minimum(V, v_lo + BLOCKS_PER_SPLIT * BLOCK_V)
    return v_lo, v_hi


@triton.jit
def jsd_partial_kernel(
    zs_ptr, zt_ptr, part_ptr,
    N, V, stride_sn, stride_sv, stride_tn, stride_tv,
    inv_t, cap_s, cap_t,
    MODE: tl.constexpr, HAS_HARD: tl.constexpr, HAS_CAP_S: tl.constexpr, HAS_CAP_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
):
    """Phase 1, program (i, j): rows of block i, columns of split j. Writes the online
    partials (m_s, s_s, m_t, s_t, m_1, s_1, w) of ``jsd_forward_kernel``'s first sweep
    to part[:, j, rows] (w: the KL limits' sum, rescaled by the weighting head's max).
    Traffic: both logits' columns of the split read once."""
    pid_v, splits, offs_n, row_ok, rows_s, rows_t = _split_rows(zs_ptr, zt_ptr, N, stride_sn, stride_tn, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    neg = float("-inf")
    v_lo, v_hi = _split_columns(pid_v, V, BLOCK_V, BLOCKS_PER_SPLIT)

    m_s, s_s, m_t, s_t, m_1, s_1, w = stats_init(BLOCK_N)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        zs = load_capped(rows_s, v0 + cols, stride_sv, row_ok, v_hi, neg, cap_s, HAS_CAP_S)
        a = zs * inv_t
        b = load_capped(rows_t, v0 + cols, stride_tv, row_ok, v_hi, neg, cap_t, HAS_CAP_T) * inv_t
        m_s, s_s, m_t, s_t, m_1, s_1, w = stats_update(zs, a, b, m_s, s_s, m_t, s_t, m_1, s_1, w, MODE, HAS_HARD)
    out = part_ptr + pid_v * N + offs_n
    plane = splits * N
    tl.store(out, m_s, mask=row_ok)
    tl.store(out + plane, s_s, mask=row_ok)
    tl.store(out + 2 * plane, m_t, mask=row_ok)
    tl.store(out + 3 * plane, s_t, mask=row_ok)
    if HAS_HARD:
        tl.store(out + 4 * plane, m_1, mask=row_ok)
        tl.store(out + 5 * plane, s_1, mask=row_ok)
    if MODE != 0:
        tl.store(out + 6 * plane, w, mask=row_ok)


@triton.jit
def _merge_splits(part_ptr, q_m, q_s, q_w, offs_n, row_ok, N, splits, WITH_W: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Merge the splits' (max, sum) of partial row q_m, q_s (and a sum q_w rescaled by the
    same max): returns (m, s, w), as one online sweep over all columns would."""
    plane = splits * N
    base = part_ptr + offs_n
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    for j in range(0, splits):
        m = tl.maximum(m, tl.load(base + q_m * plane + j * N, mask=row_ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.zeros((BLOCK_N,), tl.float32)
    w = tl.zeros((BLOCK_N,), tl.float32)
    for j in range(0, splits):
        f = tl.exp(tl.load(base + q_m * plane + j * N, mask=row_ok, other=float("-inf")) - m_safe)
        s += tl.load(base + q_s * plane + j * N, mask=row_ok, other=0.0) * f
        if WITH_W:
            w += tl.load(base + q_w * plane + j * N, mask=row_ok, other=0.0) * f
    return m, s, w


@triton.jit
def _store_hard_label(stats_ptr, stride_stat, offs_n, row_ok, m_1, s_1,
                      target_ptr, zs_ptr, stride_sn, stride_sv, V, cap_s,
                      HAS_HARD: tl.constexpr, HAS_CAP_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows 4 and 5 of the (6, N) statistics (rows ``stride_stat`` apart): with a hard label
    the student's lse at temperature 1 (from its max ``m_1`` and sum ``s_1``) and its
    (soft-capped) target logit read from the student's logits ``zs`` (0 at ignored or
    out-of-range targets); zeros without one. Rows 0-3 (both heads' lse, the divergence
    sums) are stored by the kernels before their hard-label statistics are merged."""
    lse1 = tl.zeros((BLOCK_N,), tl.float32)
    z_t = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_HARD:
        lse1 = _lse(m_1, s_1)
        target = tl.load(target_ptr + offs_n, mask=row_ok, other=-1)
        t_ok = row_ok & (target >= 0) & (target < V)
        z_t = tl.load(zs_ptr + offs_n.to(tl.int64) * stride_sn + target.to(tl.int64) * stride_sv,
                      mask=t_ok, other=0.0).to(tl.float32)
        if HAS_CAP_S:
            z_t = tl.where(t_ok, softcap_tile(z_t, cap_s), 0.0)
    tl.store(stats_ptr + 4 * stride_stat + offs_n, lse1, mask=row_ok)
    tl.store(stats_ptr + 5 * stride_stat + offs_n, z_t, mask=row_ok)


@triton.jit
def _lse(m, s):
    return tl.where(m == float("-inf"), 0.0, m) + tl.log(s)


@triton.jit
def jsd_divergence_kernel(
    zs_ptr, zt_ptr, part_ptr, sk_ptr,
    N, V, stride_sn, stride_sv, stride_tn, stride_tv,
    inv_t, log_beta, log_1mbeta, cap_s, cap_t,
    MODE: tl.constexpr, HAS_CAP_S: tl.constexpr, HAS_CAP_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
):
    """Phase 2 (0 < beta < 1), program (i, j): both lse from the merged phase-1 partials,
    then S and K summed over split j's columns into sk[:, j, rows] (2, splits, N).
    Traffic: the split's columns of both logits read a second time."""
    pid_v, splits, offs_n, row_ok, rows_s, rows_t = _split_rows(zs_ptr, zt_ptr, N, stride_sn, stride_tn, BLOCK_N)
    cols = tl.arange(0, BLOCK_V)
    m_s, s_s, _ = _merge_splits(part_ptr, 0, 1, 0, offs_n, row_ok, N, splits, False, BLOCK_N)
    m_t, s_t, _ = _merge_splits(part_ptr, 2, 3, 0, offs_n, row_ok, N, splits, False, BLOCK_N)
    lse_s = _lse(m_s, s_s)
    lse_t = _lse(m_t, s_t)
    v_lo, v_hi = _split_columns(pid_v, V, BLOCK_V, BLOCKS_PER_SPLIT)
    acc_s, acc_k = mixture_sums(rows_s, rows_t, cols, v_lo, v_hi, stride_sv, stride_tv, row_ok, lse_s, lse_t,
                                cap_s, cap_t, inv_t, log_beta, log_1mbeta, MODE, HAS_CAP_S, HAS_CAP_T,
                                BLOCK_N, BLOCK_V)
    tl.store(sk_ptr + pid_v * N + offs_n, acc_s, mask=row_ok)
    tl.store(sk_ptr + (splits + pid_v) * N + offs_n, acc_k, mask=row_ok)


@triton.jit
def jsd_finish_kernel(
    zs_ptr, target_ptr, part_ptr, sk_ptr, stats_ptr,
    N, V, splits, stride_sn, stride_sv, stride_stat, cap_s,
    MODE: tl.constexpr, HAS_HARD: tl.constexpr, HAS_CAP_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Phase 3: the (6, N) statistics of ``jsd_forward_kernel`` (rows ``stride_stat``
    apart) from the splits' partials (S and K summed in split order; the KL limits' sums merged online)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    m_s, s_s, w_s = _merge_splits(part_ptr, 0, 1, 6, offs_n, row_ok, N, splits, MODE == 2, BLOCK_N)
    m_t, s_t, w_t = _merge_splits(part_ptr, 2, 3, 6, offs_n, row_ok, N, splits, MODE == 1, BLOCK_N)
    lse_s = _lse(m_s, s_s)
    lse_t = _lse(m_t, s_t)
    acc_s, acc_k = _kl_limits(w_s, w_t, s_s, s_t, lse_s, lse_t, MODE, BLOCK_N)
    if MODE == 0:
        for j in range(0, splits):
            acc_s += tl.load(sk_ptr + j * N + offs_n, mask=row_ok, other=0.0)
            acc_k += tl.load(sk_ptr + (splits + j) * N + offs_n, mask=row_ok, other=0.0)
    _store_divergence(stats_ptr, stride_stat, offs_n, row_ok, lse_s, lse_t, acc_s, acc_k)
    m_1 = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s_1 = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_HARD:
        m_1, s_1, _ = _merge_splits(part_ptr, 4, 5, 0, offs_n, row_ok, N, splits, False, BLOCK_N)
    _store_hard_label(stats_ptr, stride_stat, offs_n, row_ok, m_1, s_1,
                      target_ptr, zs_ptr, stride_sn, stride_sv, V, cap_s, HAS_HARD, HAS_CAP_S, BLOCK_N)


def dz_rows(zs, zt, dz, target, stats, g, opts, plan) -> None:
    """dz (rows, C) in its dtype (any row stride) = d loss / d student logits of columns
    [0, C) of the fp32 logits zs, zt (rows, V >= C), from their rows' statistics (6,
    rows; any row stride) and upstream gradient g (rows,): ``jsd_backward_kernel`` in
    ``plan``'s tiles (a ``planning.logits.JSDStatsPlan``). Both chunks' columns read once."""
    r, c = dz.shape
    launch.run_kernel(
        jsd_backward_kernel, (cdiv(r, plan.block_n), cdiv(c, plan.block_v)),
        zs, zt, dz, target, stats, g, r, c, zs.stride(0), zs.stride(1), zt.stride(0), zt.stride(1),
        dz.stride(0), dz.stride(1), stats.stride(0), wp=opts.weights[1], hlw=opts.hard_label_weight,
        **scalar_args(opts), BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, num_warps=plan.num_warps,
    )


def row_stats(zs, zt, target, stats, opts, plan) -> None:
    """stats (6, N) fp32 (rows may be strided, e.g. columns of a larger statistics
    tensor; columns contiguous) of the logits zs, zt (N, V; any strides) with ``plan`` (a
    ``planning.logits.JSDStatsPlan``): one program per row block when ``plan.splits`` is
    1 (``jsd_forward_kernel``), else the three split phases above."""
    import torch

    n, v = zs.shape
    assert stats.stride(1) == 1
    sargs = scalar_args(opts)
    strides = (zs.stride(0), zs.stride(1), zt.stride(0), zt.stride(1))
    row_blocks = cdiv(n, plan.block_n)
    if plan.splits == 1:
        launch.run_kernel(
            jsd_forward_kernel, (row_blocks,),
            zs, zt, target, stats, n, v, *strides, stats.stride(0), **sargs,
            BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, num_warps=plan.num_warps)
        return
    splits = plan.splits
    part = torch.empty(PARTS, splits, n, dtype=torch.float32, device=zs.device)
    mode, hard = sargs["MODE"], sargs["HAS_HARD"]
    caps = dict(HAS_CAP_S=sargs["HAS_CAP_S"], HAS_CAP_T=sargs["HAS_CAP_T"])
    tiles = dict(BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, BLOCKS_PER_SPLIT=plan.blocks_per_split,
                 num_warps=plan.num_warps)
    launch.run_kernel(
        jsd_partial_kernel, (row_blocks, splits),
        zs, zt, part, n, v, *strides, sargs["inv_t"], sargs["cap_s"], sargs["cap_t"],
        MODE=mode, HAS_HARD=hard, **caps, **tiles)
    sk = part  # unused by the KL limits' phase 3
    if mode == 0:
        sk = torch.empty(2, splits, n, dtype=torch.float32, device=zs.device)
        launch.run_kernel(
            jsd_divergence_kernel, (row_blocks, splits),
            zs, zt, part, sk, n, v, *strides, sargs["inv_t"], sargs["log_beta"], sargs["log_1mbeta"],
            sargs["cap_s"], sargs["cap_t"], MODE=mode, **caps, **tiles)
    _finish(zs, zs.stride(0), zs.stride(1), sargs["HAS_CAP_S"], target, part, sk, stats, sargs, n, v, splits)


def _finish(zs, stride_sn, stride_sv, cap_target, target, part, sk, stats, sargs, n, v, splits) -> None:
    """Phase 3's launch: the (6, N) statistics from the splits' partials; the target logit
    read at zs[n * stride_sn + target * stride_sv] (soft-capped there if ``cap_target``)."""
    fin_block = min(128, 1 << (n - 1).bit_length())  # (triton.next_power_of_2, n >= 1)
    launch.run_kernel(
        jsd_finish_kernel, (cdiv(n, fin_block),),
        zs, target, part, sk, stats, n, v, splits, stride_sn, stride_sv, stats.stride(0), sargs["cap_s"],
        MODE=sargs["MODE"], HAS_HARD=sargs["HAS_HARD"], HAS_CAP_S=cap_target, BLOCK_N=fin_block, num_warps=4)


def divergence_sums(zs, zt, lse_s, lse_t, opts, plan):
    """(2, N) fp32: S and K (any beta; lm of the module's formulas) of the logits zs, zt
    (N, V; any strides) with GIVEN row log-sum-exps lse_s = lse(a), lse_t = lse(b) of
    full rows that these columns are a part of (vocabulary parallelism: the merged lse's
    of all ranks; a -inf lse, a row of -inf logits, is taken as 0). Phase 2 of the
    split statistics (``jsd_divergence_kernel``) fed a one-split partial (m = lse, s = 1;
    the other splits empty), so its merge gives back exactly those lse's; the splits' sums
    are then added in split order (no atomics). Traffic: both logits read once."""
    import torch

    n, v = zs.shape
    sargs = scalar_args(opts)
    splits = plan.splits
    part = torch.zeros(4, splits, n, dtype=torch.float32, device=zs.device)
    part[0::2] = float("-inf")
    part[0, 0], part[1, 0], part[2, 0], part[3, 0] = lse_s, 1.0, lse_t, 1.0
    sk = torch.empty(2, splits, n, dtype=torch.float32, device=zs.device)
    launch.run_kernel(
        jsd_divergence_kernel, (cdiv(n, plan.block_n), splits),
        zs, zt, part, sk, n, v, zs.stride(0), zs.stride(1), zt.stride(0), zt.stride(1),
        sargs["inv_t"], sargs["log_beta"], sargs["log_1mbeta"], sargs["cap_s"], sargs["cap_t"],
        MODE=sargs["MODE"], HAS_CAP_S=sargs["HAS_CAP_S"], HAS_CAP_T=sargs["HAS_CAP_T"],
        BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, BLOCKS_PER_SPLIT=plan.blocks_per_split,
        num_warps=plan.num_warps)
    return sk.sum(dim=1)


def finish_kl_partials(part, z_target, target, stats, opts, vocab: int) -> None:
    """Phase 3 for partials written straight from the hidden states (the KL limits,
    ``triton_lib.linear_jsd_kernels.jsd_kl_forward_kernel``): part (PARTS, splits, N) in
    ``jsd_partial_kernel``'s layout, z_target (N,) the soft-capped target logits (read
    only where the target is in [0, vocab))."""
    sargs = scalar_args(opts)
    assert sargs["MODE"] != 0 and stats.stride(1) == 1
    n = part.shape[2]
    _finish(z_target, 1, 0, False, target, part, part, stats, sargs, n, vocab, part.shape[1])
