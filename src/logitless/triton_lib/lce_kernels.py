"""Triton kernels of linear_cross_entropy, shared by the PyTorch op and the JAX "triton"
backend (framework-free: imports only triton and ``triton_lib``). One kernel per idea;
the math is in ``logitless.formulas.cross_entropy`` (Triton twin ``triton_lib.ce_math``),
the tile of logits each program computes in ``triton_lib.gemm``, the kept-column and dz
tile stores and loads in ``triton_lib.tile_io`` and the launch sizes in
``logitless.planning.plans`` (torch) and ``logitless.jax.planning`` (JAX).
"""

import triton
import triton.language as tl

from logitless.triton_lib.ce_math import (
    dz_tile,
    load_row_coefficients,
    online_lse_update,
    side_stats_update,
    store_partials,
)
from logitless.triton_lib.gemm import grouped_tile
from logitless.triton_lib.tile_io import (
    block_tile,
    kept_log,
    load_kept_tile,
    recomputed_tile,
    store_dz_tile,
    store_kept_dz,
    store_kept_tile,
)


@triton.jit
def forward_stats_kernel(
    x_ptr, w_ptr, b_ptr, cw_ptr, target_ptr,
    part_max_ptr, part_sum_ptr, part_tgt_ptr, part_smooth_ptr, part_best_ptr, part_arg_ptr,
    keep_ptr, keep_max_ptr,
    N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, stride_keep,
    blocks_per_split, keep_blocks, softcap, splits, group_n,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
    NEED_SMOOTH: tl.constexpr, NEED_ARGMAX: tl.constexpr, KEEP: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    FLATTEN: tl.constexpr = False, split0=0, W_CHUNK: tl.constexpr = False,
):
    """Online softmax statistics of rows of z over one split of the vocabulary.

    Program (i, j) (in ``grouped_tile`` order, ``group_n`` row blocks at a time) takes
    tokens [i*BLOCK_N, (i+1)*BLOCK_N) and vocabulary blocks [j*blocks_per_split,
    (j+1)*blocks_per_split) and writes, per token, the split's
    running max m, sum_c exp(z_c - m), the target logit (0 if the target is elsewhere),
    sum_c w_c z_c and the first argmax. Memory traffic: x once per split, W once per
    row block (the GEMM's), plus O(N * splits) fp32 partials; no (N, V) tensor.

    KEEP (the backward will want these columns): for vocabulary blocks below
    keep_blocks also store e = exp(z - m) in keep's dtype and m (the running max used,
    fp32, per token and block), from which the backward gets p = e * exp(m - lse)
    without recomputing the GEMM. Extra traffic: one write of the kept columns.

    FLATTEN: one software-pipelined loop over (vocabulary block, step of H), so the
    next tile's first loads are in flight during a tile's softmax epilogue.

    W_CHUNK (a chunk of the vocabulary per launch): the grid covers ``splits`` splits
    from split ``split0`` on and w_ptr holds W from that split's first column on (e.g.
    rounded to TF32 into a scratch buffer); columns, outputs and kept tiles stay in
    global indices. Without it split0 is unused (the code is the unchunked kernel's).
    """
    pid_n, split = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), splits, group_n)
    if W_CHUNK:
        split += split0
        w_row0 = split0 * blocks_per_split * BLOCK_V
    else:
        w_row0 = 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    target = tl.load(target_ptr + offs_n, mask=row_ok, other=-1)

    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    z_t = tl.zeros((BLOCK_N,), tl.float32)
    smooth = tl.zeros((BLOCK_N,), tl.float32)
    best = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK_N,), tl.int32)

    first_block = split * blocks_per_split
    num_blocks = tl.minimum(blocks_per_split, tl.cdiv(V, BLOCK_V) - first_block)
    for i in tl.range(0, num_blocks, flatten=FLATTEN):
        offs_v, col_ok, z = block_tile(
            x_ptr, w_ptr, b_ptr, pid_n, first_block + i, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh,
            softcap, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H, w_row0,
        )
        z = tl.where(col_ok[None, :], z, float("-inf"))
        # z's own statistics before the online update, and no branch around the kept store
        # (``tile_io.store_kept_tile`` masks it): z dies before e is made. With z alive across
        # a branched store, ptxas spilled ~700 B per thread at 128 x 256 in 8 warps (docs/design.md).
        tile_max = tl.max(z, 1)
        z_t += tl.sum(tl.where(offs_v[None, :] == target[:, None], z, 0.0), 1)
        smooth, best, best_idx = side_stats_update(
            z, tile_max, offs_v, smooth, best, best_idx, cw_ptr, V,
            NEED_SMOOTH, NEED_ARGMAX, HAS_CW, BLOCK_V)
        m, s, e, m_safe, _ = online_lse_update(z, m, s)
        if KEEP:
            store_kept_tile(keep_ptr, keep_max_ptr, e, m_safe, first_block + i, keep_blocks, pid_n, offs_n, offs_v,
                            row_ok, col_ok, N, stride_keep, USE_TMA, BLOCK_N, BLOCK_V)

    out = store_partials(part_max_ptr, part_sum_ptr, part_smooth_ptr, part_tgt_ptr, split, N, offs_n, row_ok, m, s,
                         smooth, z_t, NEED_SMOOTH)
    if NEED_ARGMAX:
        tl.store(part_best_ptr + out, best, mask=row_ok)
        tl.store(part_arg_ptr + out, best_idx, mask=row_ok)


@triton.jit
def dlogits_kernel(
    x_ptr, w_ptr, b_ptr, cw_ptr, target_ptr, lse_ptr, coef_ptr, dz_ptr,
    N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, stride_dzn,
    v_start, v_end, softcap, group_n,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DZ_TMA: tl.constexpr = False, FLATTEN: tl.constexpr = False, W_CHUNK: tl.constexpr = False,
):
    """dz = d loss / d logits for columns [v_start, v_end), written in dz's dtype.

    Recomputes the tile of z (one GEMM tile) and applies, with p = exp(z - lse),
        dz_c = p_c * A - B * [c == t] - C * w_c   (times 1 - (z_c/s)^2 with a soft-cap)
    from the per-token coefficients coef = (A, B, C) of ``formulas.cross_entropy``. Traffic: the
    GEMM's reads plus one write of the (N, v_end - v_start) chunk. Programs go in
    ``grouped_tile`` order; DZ_TMA: dz_ptr is a tensor descriptor (a bulk store).
    With fewer programs than tiles each program loops over tiles (persistent);
    FLATTEN pipelines that loop with the loop over H. W_CHUNK: w_ptr holds W's rows
    [v_start, v_end) only (e.g. rounded to TF32 into a scratch buffer).
    """
    row_blocks = tl.cdiv(N, BLOCK_N)
    col_blocks = tl.cdiv(v_end - v_start, BLOCK_V)
    # One tile per program, or (persistent: fewer programs than tiles) a pipelined loop
    # over tiles, whose next loads are in flight during a tile's epilogue and store.
    for tile in tl.range(tl.program_id(0), row_blocks * col_blocks, tl.num_programs(0), flatten=FLATTEN):
        pid_n, pid_v, offs_n, offs_v, row_ok, col_ok, z = recomputed_tile(
            tile, x_ptr, w_ptr, b_ptr, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh,
            v_start, v_end, softcap, row_blocks, col_blocks, group_n,
            HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H, W_CHUNK,
        )
        lse, a, b, c, target = load_row_coefficients(lse_ptr, coef_ptr, target_ptr, offs_n, row_ok, N)
        p = tl.exp(z - lse[:, None])
        dz = dz_tile(p, z, offs_v, target, a, b, c, cw_ptr, V, softcap, HAS_SOFTCAP, HAS_CW, BLOCK_V)
        store_dz_tile(dz, dz_ptr, pid_n, pid_v, offs_n, offs_v, row_ok, col_ok, v_start, stride_dzn,
                      DZ_TMA, BLOCK_N, BLOCK_V)


@triton.jit
def kept_dlogits_kernel(
    keep_ptr, keep_max_ptr, dz_ptr, cw_ptr, target_ptr, lse_ptr, coef_ptr,
    N, V, block0, keep_cols, stride_keep, stride_dz, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr,
    IN_PLACE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, APPROX_LOG: tl.constexpr = False,
):
    """dz for the kept columns [block0 * BLOCK_V, keep_cols): e = exp(z - m) (keep) becomes
    dz (dz_ptr: keep itself, in place, block0 = 0, or a chunk buffer of those columns, row
    stride stride_dz).

    p = e * exp(m - lse); z = log(e) + m is needed only with a soft-cap. No GEMM: one
    read and one write of (N, keep_cols) elements. BLOCK_V must be the forward's.
    APPROX_LOG: ``tile_io.kept_log``'s.
    """
    e, m, offs_n, offs_v, row_ok, mask, at = load_kept_tile(keep_ptr, keep_max_ptr, N, block0, keep_cols,
                                                            stride_keep, IN_PLACE, BLOCK_N, BLOCK_V)
    lse, a, b, c, target = load_row_coefficients(lse_ptr, coef_ptr, target_ptr, offs_n, row_ok, N)
    p = e * tl.exp(m - lse)[:, None]
    z = p  # unused without a soft-cap
    if HAS_SOFTCAP:
        z = kept_log(e, APPROX_LOG) + m[:, None]
    dz = dz_tile(p, z, offs_v, target, a, b, c, cw_ptr, V, softcap, HAS_SOFTCAP, HAS_CW, BLOCK_V)
    store_kept_dz(dz_ptr, at, offs_n, offs_v, block0, stride_dz, mask, dz, IN_PLACE, BLOCK_V)
