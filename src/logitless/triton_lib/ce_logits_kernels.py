"""Triton kernels of cross_entropy on logits the caller holds. One kernel per idea; the
math is in ``logitless.formulas.cross_entropy`` and the launch sizes in ``logitless.planning.plans``.

Shapes: logits z (N, V) addressed through (row stride, column stride), any strides, so
a transposed or sliced (N, V) view is read in place. Offsets are 64-bit: N * stride
may exceed 2**31. Both kernels are bandwidth-bound: the forward reads z once, the
backward reads z once and writes dz once; everything else is O(N).
"""

import triton
import triton.language as tl

from logitless.triton_lib.ce_math import (
    dz_tile,
    load_row_coefficients,
    logits_tile,
    online_lse_update,
    side_stats_update,
    softcap_tile,
    target_rows,
)


@triton.jit
def ce_forward_kernel(
    z_ptr, target_ptr, cw_ptr, lse_ptr, tgt_ptr, smooth_ptr, argmax_ptr,
    N, V, stride_n, stride_v, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
    NEED_SMOOTH: tl.constexpr, NEED_ARGMAX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per-row statistics of z in one streaming pass (fp32 arithmetic).

    Program i owns rows [i*BLOCK_N, (i+1)*BLOCK_N) and walks the vocabulary in
    BLOCK_V-wide steps, keeping per row: the running max m and sum_c exp(z_c - m)
    (online softmax), the target logit z_t (loaded directly; 0 when out of range),
    sum_c w_c z_c (NEED_SMOOTH) and the first index of the maximum
    (NEED_ARGMAX). z is soft-capped on the fly (HAS_SOFTCAP). Writes lse = m + log(sum)
    and the other statistics: O(N) outputs. Traffic: N x V logits read once.

    Rows whose logits are all -inf so far keep a shift of 0 (no inf - inf); NaN
    anywhere in a row makes its sum, hence its lse, NaN.
    """
    offs_n, row_ok, rows, cols, t_ok, z_t = target_rows(z_ptr, target_ptr, N, V, stride_n, stride_v, BLOCK_N, BLOCK_V)
    if HAS_SOFTCAP:
        z_t = tl.where(t_ok, softcap_tile(z_t, softcap), 0.0)

    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    smooth = tl.zeros((BLOCK_N,), tl.float32)
    best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK_N,), tl.int32)
    # Software prefetch: the next step's load is issued before this step's arithmetic,
    # so that memory and the (fp32) arithmetic overlap. Columns past V read -inf.
    z_next = tl.load(rows + cols[None, :] * stride_v,
                     mask=row_ok[:, None] & (cols < V)[None, :], other=float("-inf"))
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + cols
        col_ok = offs_v < V
        z = z_next.to(tl.float32)
        nxt = offs_v + BLOCK_V
        z_next = tl.load(rows + nxt[None, :] * stride_v,
                         mask=row_ok[:, None] & (nxt < V)[None, :], other=float("-inf"))
        if HAS_SOFTCAP:
            z = tl.where(col_ok[None, :], softcap_tile(z, softcap), float("-inf"))
        m, s, _, _, tile_max = online_lse_update(z, m, s)
        smooth, best, best_idx = side_stats_update(
            z, tile_max, offs_v, smooth, best, best_idx, cw_ptr, V,
            NEED_SMOOTH, NEED_ARGMAX, HAS_CW, BLOCK_V)

    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tl.store(lse_ptr + offs_n, m_safe + tl.log(s), mask=row_ok)
    tl.store(tgt_ptr + offs_n, z_t, mask=row_ok)
    if NEED_SMOOTH:
        tl.store(smooth_ptr + offs_n, smooth, mask=row_ok)
    if NEED_ARGMAX:
        tl.store(argmax_ptr + offs_n, best_idx.to(tl.int64), mask=row_ok)


@triton.jit
def ce_backward_kernel(
    z_ptr, dz_ptr, target_ptr, cw_ptr, lse_ptr, coef_ptr,
    N, V, stride_zn, stride_zv, stride_dn, stride_dv, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """dz = d loss / d logits for one BLOCK_N x BLOCK_V tile, in dz's dtype.

    Recomputes p = exp(z - lse) from the saved lse and applies, with coef = (A, B, C)
    a (3, N) fp32 tensor from ``formulas.cross_entropy.grad_coefficients``,
        dz_c = p_c * A - B * [c == t] - C * w_c   (times 1 - (z_c/s)^2 with a soft-cap,
                                                   z_c the capped logit)
    Traffic: the tile of z read once, the tile of dz written once, O(BLOCK_N) stats.
    dz may be z itself (inplace_backward): each element is read, then overwritten, by
    the one program that owns it.
    """
    z, offs_n, offs_v, row_ok, mask, rows, cols = logits_tile(z_ptr, N, V, stride_zn, stride_zv, softcap,
                                                              HAS_SOFTCAP, BLOCK_N, BLOCK_V)
    lse, a, b, c, target = load_row_coefficients(lse_ptr, coef_ptr, target_ptr, offs_n, row_ok, N)
    p = tl.exp(z - lse[:, None])
    dz = dz_tile(p, z, offs_v, target, a, b, c, cw_ptr, V, softcap, HAS_SOFTCAP, HAS_CW, BLOCK_V)
    tl.store(dz_ptr + rows * stride_dn + cols * stride_dv, dz.to(dz_ptr.dtype.element_ty), mask=mask)
