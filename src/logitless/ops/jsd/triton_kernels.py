"""Triton kernels of jsd on logits the caller holds. One kernel per idea; the math is in
``logitless.formulas.jsd`` (Triton twin: ``_triton_jsd_math``), launch sizes in ``_plans``.

Shapes: student logits zs and teacher logits zt (N, V), each addressed through its own
(row stride, column stride) and dtype. Offsets are 64-bit. Both kernels are
bandwidth-bound: the forward reads both rows once (beta 0 or 1) or twice (the mixture),
the backward reads both once and writes dz once; the rest is O(N).
"""

import triton
import triton.language as tl

from logitless.triton_lib.jsd_math import jsd_dz_tile, load_jsd_row_stats
from logitless.triton_lib.jsd_rows import load_capped


@triton.jit
def jsd_backward_kernel(
    zs_ptr, zt_ptr, dz_ptr, target_ptr, stats_ptr, g_ptr,
    N, V, stride_sn, stride_sv, stride_tn, stride_tv, stride_dn, stride_dv,
    inv_t, wp, hlw, log_beta, log_1mbeta, cap_s, cap_t,
    MODE: tl.constexpr, HAS_HARD: tl.constexpr, HAS_CAP_S: tl.constexpr, HAS_CAP_T: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """dz = d loss / d student logits for one BLOCK_N x BLOCK_V tile, in dz's dtype,
    from the forward's statistics and the per-token upstream gradient g
    (``_triton_jsd_math.jsd_dz_tile``). Traffic: both tiles read once, dz written once."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    zs = load_capped(zs_ptr + rows * stride_sn, offs_v, stride_sv, row_ok, V, 0.0, cap_s, HAS_CAP_S)
    zt = load_capped(zt_ptr + rows * stride_tn, offs_v, stride_tv, row_ok, V, 0.0, cap_t, HAS_CAP_T)
    lse_s, lse_t, s_row, lse1, g, target = load_jsd_row_stats(stats_ptr, g_ptr, target_ptr, offs_n, row_ok, N)
    dz = jsd_dz_tile(zs, zt, offs_v, target, lse_s, lse_t, s_row, lse1, g,
                     inv_t, wp, hlw, log_beta, log_1mbeta, cap_s, MODE, HAS_HARD, HAS_CAP_S)
    mask = row_ok[:, None] & (offs_v < V)[None, :]
    tl.store(dz_ptr + rows * stride_dn + offs_v.to(tl.int64)[None, :] * stride_dv,
             dz.to(dz_ptr.dtype.element_ty), mask=mask)
