"""Triton kernels of linear_jsd: both heads' logits tiles fused with dz (the backward)
and, for the two KL limits, with the row statistics (the forward).

For 0 < beta < 1 the forward needs no kernel of its own: cuBLAS writes both heads' fp32
logits for a chunk of tokens and ``triton_lib.jsd_rows`` reduces them to row statistics
(the mixture's divergence needs both lse first: a second sweep over full rows). The math
is in ``logitless.formulas.jsd`` (Triton twin ``triton_lib.jsd_math``); launch sizes in
``logitless.ops.linear_jsd.planning.linear_jsd_plan``.
"""

import triton
import triton.language as tl

from logitless.triton_lib.gemm import grouped_tile, logits_tile
from logitless.triton_lib.jsd_math import jsd_dz_tile, load_jsd_row_stats, stats_init, stats_update


@triton.jit
def jsd_dlogits_kernel(
    xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr,
    target_ptr, stats_ptr, g_ptr, dz_ptr,
    N, V, HS, HT, stride_xsn, stride_xsh, stride_wsv, stride_wsh,
    stride_xtn, stride_xth, stride_wtv, stride_wth, stride_dzn,
    v_start, v_end, inv_t, wp, hlw, log_beta, log_1mbeta, cap_s, cap_t, group_n,
    MODE: tl.constexpr, HAS_HARD: tl.constexpr, HAS_CAP_S: tl.constexpr, HAS_CAP_T: tl.constexpr,
    HAS_BIAS_S: tl.constexpr, HAS_BIAS_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, W_CHUNK: tl.constexpr = False,
):
    """dz = d loss / d student logits for columns [v_start, v_end), in dz's dtype.

    Per (BLOCK_N x BLOCK_V) tile: the student tile zs = x_s W_s^T (+ b_s) and the
    teacher tile zt = x_t W_t^T (+ b_t) (two fp32 GEMM tiles, H_s and H_t deep, each
    soft-capped), then ``jsd_dz_tile`` with the forward's row statistics. Traffic: the
    two GEMMs' reads plus one write of the dz chunk; no teacher tensor is stored.
    Programs go in ``grouped_tile`` order (``group_n`` row blocks at a time).
    W_CHUNK: ws_ptr and wt_ptr hold the weights' rows [v_start, v_end) only (fp32 at
    "high": rounded to TF32 into scratch buffers, ``launch.prerounded_dlogits_operands``);
    columns, biases and masks stay in global indices (False: the unchunked code).
    """
    if W_CHUNK:
        w_row0 = v_start
    else:
        w_row0 = 0
    pid_n, pid_v = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(v_end - v_start, BLOCK_V), group_n)
    n0 = pid_n * BLOCK_N
    c0 = v_start + pid_v * BLOCK_V
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_v = c0 + tl.arange(0, BLOCK_V)
    row_ok = offs_n < N
    col_ok = offs_v < v_end
    zs = logits_tile(xs_ptr, ws_ptr, bs_ptr, n0, c0, N, V, HS,
                      stride_xsn, stride_xsh, stride_wsv, stride_wsh, cap_s,
                      HAS_BIAS_S, HAS_CAP_S, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H, w_row0)
    zt = logits_tile(xt_ptr, wt_ptr, bt_ptr, n0, c0, N, V, HT,
                      stride_xtn, stride_xth, stride_wtv, stride_wth, cap_t,
                      HAS_BIAS_T, HAS_CAP_T, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H, w_row0)
    lse_s, lse_t, s_row, lse1, g, target = load_jsd_row_stats(stats_ptr, g_ptr, target_ptr, offs_n, row_ok, N)
    dz = jsd_dz_tile(zs, zt, offs_v, target, lse_s, lse_t, s_row, lse1, g,
                     inv_t, wp, hlw, log_beta, log_1mbeta, cap_s, MODE, HAS_HARD, HAS_CAP_S)
    dz_ptrs = dz_ptr + offs_n.to(tl.int64)[:, None] * stride_dzn + (offs_v - v_start)[None, :]
    tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def jsd_kl_forward_kernel(
    xs_ptr, ws_ptr, bs_ptr, xt_ptr, wt_ptr, bt_ptr, target_ptr, part_ptr, z_target_ptr,
    N, V, HS, HT, stride_xsn, stride_xsh, stride_wsv, stride_wsh,
    stride_xtn, stride_xth, stride_wtv, stride_wth,
    blocks_per_split, splits, group_n, inv_t, cap_s, cap_t,
    MODE: tl.constexpr, HAS_HARD: tl.constexpr, HAS_CAP_S: tl.constexpr, HAS_CAP_T: tl.constexpr,
    HAS_BIAS_S: tl.constexpr, HAS_BIAS_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Phase 1 of the row statistics for the KL limits (MODE 1: beta = 0, forward KL;
    MODE 2: beta = 1, reverse KL), straight from the hidden states: no logits in memory.

    Program (i, j) (``grouped_tile`` order, ``group_n`` row blocks at a time) takes tokens
    [i*BLOCK_N, (i+1)*BLOCK_N) and vocabulary blocks [j*blocks_per_split, (j+1)*
    blocks_per_split). Per block: the student tile zs = x_s W_s^T (+ b_s) and the teacher
    tile zt = x_t W_t^T (+ b_t) (two fp32 GEMM tiles, H_s and H_t deep, soft-capped), then
    ``jsd_math.stats_update``: online max and sum of exponentials of both heads at T, of
    the student at T = 1 (hard labels) and the one divergence sum the KL limits need
    (rescaled by the weighting head's max). Writes part[:, j, rows] in the layout of
    ``jsd_rows.jsd_partial_kernel`` (merged by ``jsd_rows.jsd_finish_kernel``) and, from
    the program whose split holds the row's target, the soft-capped target logit to
    z_target[row] (HAS_HARD). For 0 < beta < 1 this cannot work: the mixture
    log(beta q + (1 - beta) p) needs both lse before any column's term.

    Traffic: the GEMMs' (x once per split, both W once per group of row blocks) plus
    7 floats per token and split; no (N, V) tensor.
    """
    pid_n, split = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), splits, group_n)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    neg = float("-inf")
    m_s, s_s, m_t, s_t, m_1, s_1, w = stats_init(BLOCK_N)
    z_tg = tl.zeros((BLOCK_N,), tl.float32)
    target = tl.load(target_ptr + offs_n, mask=row_ok, other=-1)
    first_block = split * blocks_per_split
    num_blocks = tl.minimum(blocks_per_split, tl.cdiv(V, BLOCK_V) - first_block)
    for i in range(0, num_blocks):
        c0 = (first_block + i) * BLOCK_V
        offs_v = c0 + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (offs_v < V)[None, :]
        zs = logits_tile(xs_ptr, ws_ptr, bs_ptr, n0, c0, N, V, HS,
                         stride_xsn, stride_xsh, stride_wsv, stride_wsh, cap_s,
                         HAS_BIAS_S, HAS_CAP_S, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H)
        zt = logits_tile(xt_ptr, wt_ptr, bt_ptr, n0, c0, N, V, HT,
                         stride_xtn, stride_xth, stride_wtv, stride_wth, cap_t,
                         HAS_BIAS_T, HAS_CAP_T, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H)
        zs = tl.where(ok, zs, neg)
        zt = tl.where(ok, zt, neg)
        m_s, s_s, m_t, s_t, m_1, s_1, w = stats_update(zs, zs * inv_t, zt * inv_t, m_s, s_s, m_t, s_t, m_1, s_1, w,
                                                       MODE, HAS_HARD)
        if HAS_HARD:
            z_tg += tl.sum(tl.where(ok & (offs_v[None, :] == target[:, None]), zs, 0.0), 1)
    out = part_ptr + split.to(tl.int64) * N + offs_n
    plane = splits * N  # (int32: splits x N stays far below 2**31 / 7, splits shrinking as N grows)
    tl.store(out, m_s, mask=row_ok)
    tl.store(out + plane, s_s, mask=row_ok)
    tl.store(out + 2 * plane, m_t, mask=row_ok)
    tl.store(out + 3 * plane, s_t, mask=row_ok)
    tl.store(out + 6 * plane, w, mask=row_ok)
    if HAS_HARD:
        tl.store(out + 4 * plane, m_1, mask=row_ok)
        tl.store(out + 5 * plane, s_1, mask=row_ok)
        v_lo = first_block * BLOCK_V
        mine = row_ok & (target >= v_lo) & (target < tl.minimum(V, v_lo + blocks_per_split * BLOCK_V))
        tl.store(z_target_ptr + offs_n, z_tg, mask=mine)
