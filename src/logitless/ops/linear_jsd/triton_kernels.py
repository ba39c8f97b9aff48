"""Triton kernel of linear_jsd's backward: both heads' logits tiles fused with dz.

The forward needs no kernel of its own: cuBLAS writes both heads' fp32 logits for a
chunk of tokens and ``triton_lib.jsd_rows.jsd_forward_kernel`` reduces them to row
statistics. The math is in ``logitless.formulas.jsd`` (Triton twin ``_triton_jsd_math``);
launch sizes in ``logitless.planning.plans.linear_jsd_plan``.
"""

import triton
import triton.language as tl

from logitless.triton_lib.gemm import grouped_tile, logits_tile
from logitless.triton_lib.jsd_math import jsd_dz_tile, load_jsd_row_stats


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
