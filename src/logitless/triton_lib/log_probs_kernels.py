"""Triton kernels of linear_log_probs, framework-free (triton + triton_lib only): the
PyTorch op (``ops/linear_log_probs``) and the JAX "triton" backend
(``jax/ops/linear_log_probs/triton.py``) launch these same kernels. The math is in
``logitless.formulas.log_probs`` (Triton twin ``triton_lib.log_probs_math``), the tile
of logits in ``triton_lib.gemm``, the kept/dz tile stores and loads in
``triton_lib.tile_io``, the launch sizes in ``planning.plans.triton_plan`` (shared with
linear_cross_entropy).
"""

import triton
import triton.language as tl

from logitless.triton_lib.ce_math import load_row_coefficients, store_partials
from logitless.triton_lib.gemm import grouped_tile
from logitless.triton_lib.log_probs_fields import fields_update
from logitless.triton_lib.log_probs_math import (
    logp_dz_tile,
    online_entropy_update,
    online_start,
    row_tokens,
    scaled_tile,
    split_blocks,
)
from logitless.triton_lib.tile_io import (
    kept_log,
    load_kept_tile,
    recomputed_tile,
    store_dz_tile,
    store_kept_dz,
    store_kept_tile,
)


@triton.jit
def logp_forward_kernel(
    x_ptr, w_ptr, b_ptr, token_ptr,
    part_max_ptr, part_sum_ptr, part_u_ptr, part_tgt_ptr, keep_ptr, keep_max_ptr,
    N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, stride_keep,
    blocks_per_split, keep_blocks, softcap, inv_temp, splits, group_n,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, KEEP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    FLATTEN: tl.constexpr = False, split0=0, W_CHUNK: tl.constexpr = False,
    tau_ptr=None, HAS_THRESHOLD: tl.constexpr = False,
    part_s2_ptr=None, part_zsum_ptr=None, part_best_ptr=None, part_arg_ptr=None, FIELDS: tl.constexpr = False,
):
    """Online statistics of a = softcap(x W^T + b) / T over one split of the vocabulary.

    Program (i, j) (``grouped_tile`` order) takes tokens [i*BLOCK_N, (i+1)*BLOCK_N) and
    vocabulary blocks [j*blocks_per_split, (j+1)*blocks_per_split) and writes per token
    the split's max m, s = sum exp(a - m), u = sum exp(a - m)(a - m) (ENTROPY) and a at
    the token (0 if elsewhere). The fp32 GEMM tile is divided by T in fp32 (x is never
    rounded after a division). Traffic: the GEMM's reads plus O(N * splits) partials.
    KEEP: for blocks below keep_blocks also store e = exp(a - m) in keep's dtype and m
    (per token and block), so that the backward needs no GEMM for them.
    W_CHUNK: the launch covers ``splits`` splits from ``split0`` on, w_ptr holding W from
    that split's first column on (``lce_kernels.forward_stats_kernel``'s).
    HAS_THRESHOLD: columns with a < tau (per token, tau_ptr) are left out (-inf), the
    token's a too (truncated sampling, ``formulas.truncation``).
    """
    pid_n, split = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), splits, group_n)
    if W_CHUNK:
        split += split0
        w_row0 = split0 * blocks_per_split * BLOCK_V
    else:
        w_row0 = 0
    offs_n, row_ok, token = row_tokens(token_ptr, pid_n, N, V, BLOCK_N)
    if HAS_THRESHOLD:
        tau = tl.load(tau_ptr + offs_n, mask=row_ok, other=float("-inf"))
    m, s, u, a_t = online_start(BLOCK_N)
    if FIELDS:
        s2 = tl.zeros((BLOCK_N,), tl.float32)
        zsum = tl.zeros((BLOCK_N,), tl.float32)
        best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        best_idx = tl.zeros((BLOCK_N,), tl.int32)

    first_block, num_blocks = split_blocks(split, blocks_per_split, V, BLOCK_V)
    for i in tl.range(0, num_blocks, flatten=FLATTEN):
        offs_v, col_ok, a = scaled_tile(
            x_ptr, w_ptr, b_ptr, pid_n, first_block + i, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh,
            softcap, inv_temp, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H, w_row0,
        )
        if HAS_THRESHOLD:
            a = tl.where(a >= tau[:, None], a, float("-inf"))
        # The token's logit before the online update, the fields before the kept store, no branch
        # around it (as ``lce_kernels.forward_stats_kernel``: ~600 B per thread spilled otherwise on
        # sm_90; the fields after the store spilled 6 VGPRs on gfx950).
        a_t += tl.sum(tl.where(offs_v[None, :] == token[:, None], a, 0.0), 1)
        m_prev = m
        m, s, u, e, m_safe = online_entropy_update(a, m, s, u, ENTROPY)
        if FIELDS:
            s2, zsum, best, best_idx = fields_update(a, m_prev, m_safe, e, offs_v, s2, zsum, best, best_idx, V,
                                                     BLOCK_V)
        if KEEP:
            store_kept_tile(keep_ptr, keep_max_ptr, e, m_safe, first_block + i, keep_blocks, pid_n, offs_n, offs_v,
                            row_ok, col_ok, N, stride_keep, USE_TMA, BLOCK_N, BLOCK_V)

    out = store_partials(part_max_ptr, part_sum_ptr, part_u_ptr, part_tgt_ptr, split, N, offs_n, row_ok, m, s, u,
                         a_t, ENTROPY)
    if FIELDS:
        tl.store(part_s2_ptr + out, s2, mask=row_ok)
        tl.store(part_zsum_ptr + out, zsum, mask=row_ok)
        tl.store(part_best_ptr + out, best, mask=row_ok)
        tl.store(part_arg_ptr + out, best_idx, mask=row_ok)


@triton.jit
def logp_dlogits_kernel(
    x_ptr, w_ptr, b_ptr, token_ptr, lse_ptr, coef_ptr, dz_ptr,
    N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, stride_dzn,
    v_start, v_end, softcap, inv_temp, group_n,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DZ_TMA: tl.constexpr = False, FLATTEN: tl.constexpr = False, W_CHUNK: tl.constexpr = False,
    tau_ptr=None, HAS_THRESHOLD: tl.constexpr = False,
):
    """dz for columns [v_start, v_end), recomputing the GEMM tile: log p = a - lse,
    dz = p (A + C log p) - B [j == t] (times the soft-cap factor). Traffic: the GEMM's
    reads plus one write of the chunk. Persistent when there are fewer programs than tiles.
    W_CHUNK: w_ptr holds W's rows [v_start, v_end) only (e.g. rounded to TF32).
    HAS_THRESHOLD: dz = 0 where a < tau (per token, tau_ptr; lse and A, B, C are those
    of the truncated rows)."""
    row_blocks = tl.cdiv(N, BLOCK_N)
    col_blocks = tl.cdiv(v_end - v_start, BLOCK_V)
    for tile in tl.range(tl.program_id(0), row_blocks * col_blocks, tl.num_programs(0), flatten=FLATTEN):
        pid_n, pid_v, offs_n, offs_v, row_ok, col_ok, z = recomputed_tile(
            tile, x_ptr, w_ptr, b_ptr, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh,
            v_start, v_end, softcap, row_blocks, col_blocks, group_n,
            HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H, W_CHUNK,
        )
        lse, ca, cb, cc, token = load_row_coefficients(lse_ptr, coef_ptr, token_ptr, offs_n, row_ok, N)
        logp = z * inv_temp - lse[:, None]
        p = tl.exp(logp)
        dz = logp_dz_tile(p, logp, lse, offs_v, token, ca, cb, cc, softcap, 1.0 / inv_temp, HAS_SOFTCAP, ENTROPY)
        if HAS_THRESHOLD:
            tau = tl.load(tau_ptr + offs_n, mask=row_ok, other=float("-inf"))
            dz = tl.where(z * inv_temp >= tau[:, None], dz, 0.0)
        store_dz_tile(dz, dz_ptr, pid_n, pid_v, offs_n, offs_v, row_ok, col_ok, v_start, stride_dzn,
                      DZ_TMA, BLOCK_N, BLOCK_V)


@triton.jit
def logp_kept_dlogits_kernel(
    keep_ptr, keep_max_ptr, dz_ptr, token_ptr, lse_ptr, coef_ptr,
    N, block0, keep_cols, stride_keep, stride_dz, softcap, temperature,
    HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr,
    IN_PLACE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, APPROX_LOG: tl.constexpr = False,
):
    """dz for the kept columns: e = exp(a - m) becomes dz (dz_ptr: keep itself, in place,
    or a chunk buffer of the launch's columns [block0 * BLOCK_V, keep_cols)). p = e exp(m - lse);
    log p = log e + m - lse only with entropy / a soft-cap (the planner keeps no columns
    where e could underflow and a soft-cap needs z = T (log p + lse)). No GEMM:
    one read and one write per kept element. BLOCK_V must be the forward's. APPROX_LOG: ``tile_io.kept_log``'s."""
    e, m, offs_n, offs_v, row_ok, mask, at = load_kept_tile(keep_ptr, keep_max_ptr, N, block0, keep_cols,
                                                            stride_keep, IN_PLACE, BLOCK_N, BLOCK_V)
    lse, ca, cb, cc, token = load_row_coefficients(lse_ptr, coef_ptr, token_ptr, offs_n, row_ok, N)
    p = e * tl.exp(m - lse)[:, None]
    logp = p  # unused without entropy or a soft-cap
    if ENTROPY or HAS_SOFTCAP:
        logp = kept_log(e, APPROX_LOG) + (m - lse)[:, None]
    dz = logp_dz_tile(p, logp, lse, offs_v, token, ca, cb, cc, softcap, temperature, HAS_SOFTCAP, ENTROPY)
    store_kept_dz(dz_ptr, at, offs_n, offs_v, block0, stride_dz, mask, dz, IN_PLACE, BLOCK_V)
