"""Triton kernels of linear_topk_kl (top-k distillation), framework-free (triton +
triton_lib only). The math is ``logitless.formulas.topk_kl``'s; the tile of logits, the
program order and the kept/dz tile stores and loads are the fused linear ops' own
(``gemm``, ``tile_io``, ``ce_math``); the backward's chunk loop is ``launch.chunked_backward``.

Each token's teacher ids come ascending (N, K) int32, with a table of where each
vocabulary block's ids start (``id_blocks_kernel``: N x (V / BLOCK_V + 1) int32): a forward
tile reads two entries per row and compares itself with only the ids that fall in it (a
few unrolled slots: about K * BLOCK_V / V ids per row and tile, 0.2 at K = 100 of 128k;
tiles with more go to a retry pass), instead of all K per element, with no chain of
dependent loads and no loop in the epilogue.

    id_blocks_kernel        the table
    topk_forward_kernel     the fused GEMM + online log-sum-exp of the columns OUTSIDE the
                            ids (masked in the tile: exact however much mass the ids hold),
                            z at the ids (written where they are found: each by one
                            program), z at the target and, at T != 1 with hard labels, the
                            log-sum-exp of z; kept columns of exp(a - m) (0 at the ids)
    topk_dlogits_kernel     the dense dz of a recomputed chunk (c_r exp(a - lse_tail) +
                            c_q exp(z - lse1) - c_b [j = t], soft-cap factor)
    topk_kept_dlogits_kernel  the same from the kept columns, in place
    topk_patch_kernel       a dz chunk's values at the ids overwritten by ``sparse``
                            (distinct ids per row: no collisions, no atomics)
"""

import triton
import triton.language as tl

from logitless.triton_lib.ce_math import online_lse_update, store_partials
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

#: An id past every column (the pointer walk's sentinel).
_PAST = tl.constexpr(2147483647)


@triton.jit
def id_blocks_kernel(ids_ptr, table_ptr, K, NB, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, BINS: tl.constexpr):
    """table[n, b] = the number of row n's ids below b * BLOCK_V, b in [0, NB]: with ids
    ascending, the ids in vocabulary block b are ids[n, table[n, b]:table[n, b + 1]].
    Program n: row n, its K <= BLOCK_K ids counted into BINS > NB + 1 bins by the first
    entry they are below (a histogram), the table their running sum."""
    n = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.load(ids_ptr + n * K + offs_k, mask=offs_k < K, other=_PAST)
    first = tl.minimum(tl.where(ids < 0, 0, ids // BLOCK_V + 1), BINS - 1)  # (padding: the last bin, unread)
    table = tl.cumsum(tl.histogram(first, BINS), 0)
    offs_b = tl.arange(0, BINS)
    tl.store(table_ptr + n * (NB + 1) + offs_b, table, mask=offs_b <= NB)


@triton.jit
def topk_forward_kernel(
    x_ptr, w_ptr, b_ptr, target_ptr, ids_ptr, table_ptr, z_ids_ptr, flags_ptr,
    part_max_ptr, part_sum_ptr, part_tgt_ptr, part_max1_ptr, part_sum1_ptr,
    keep_ptr, keep_max_ptr,
    N, V, H, K, stride_xn, stride_xh, stride_wv, stride_wh, stride_keep,
    blocks_per_split, keep_blocks, softcap, inv_temp, splits, group_n, total_splits,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_HARD: tl.constexpr, HARD_T: tl.constexpr,
    KEEP: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, SLOTS: tl.constexpr,
    FLATTEN: tl.constexpr = False, split0=0, W_CHUNK: tl.constexpr = False,
):
    """Program (i, j) (``grouped_tile`` order) over tokens [i*BLOCK_N, (i+1)*BLOCK_N) and
    vocabulary split j writes per token the split's running max and sum of exp(a - m) over
    its columns outside the ids (a = z / T), z at the target (HAS_HARD), the max and sum of
    exp(z - m1) over all its columns (HARD_T), and z at each id it holds into z_ids (N, K)
    (ids ascending per row, ``table`` from ``id_blocks_kernel``; an id outside [0, V) is
    never matched: 0 is written there, or nothing). KEEP: for blocks below
    keep_blocks, e = exp(a - m) (0 at the ids) and m, as ``lce_kernels.forward_stats_kernel``.
    W_CHUNK, split0: that kernel's (a launch over a chunk of W). Traffic: the GEMM's reads,
    O(N * splits) partials, two table entries per row and tile, each id once.

    SLOTS > 0 (the fast pass): each tile compares itself with the first SLOTS ids of each
    row that fall in it, unrolled: no loop in the epilogue, so the tile loop stays one
    flattened, software-pipelined loop (a loop there broke it: 1.4-1.6x a GEMM). A program
    where some row has more ids in a tile writes 1 into flags[program] (0 otherwise) and
    its outputs are wrong; SLOTS = 0 (the retry, launched after it): only the programs
    flagged run, comparing every id in a loop, and overwrite every output of theirs."""
    pid_n, split = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), splits, group_n)
    if W_CHUNK:
        split += split0
        w_row0 = split0 * blocks_per_split * BLOCK_V
    else:
        w_row0 = 0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    target = tl.load(target_ptr + offs_n, mask=row_ok, other=-1)
    ids_rows = ids_ptr + offs_n.to(tl.int64) * K
    out_rows = z_ids_ptr + offs_n.to(tl.int64) * K
    table_rows = table_ptr + offs_n.to(tl.int64) * (tl.cdiv(V, BLOCK_V) + 1)

    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    m1 = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s1 = tl.zeros((BLOCK_N,), tl.float32)
    z_t = tl.zeros((BLOCK_N,), tl.float32)

    first_block = split * blocks_per_split
    num_blocks = tl.minimum(blocks_per_split, tl.cdiv(V, BLOCK_V) - first_block)
    flag = flags_ptr + pid_n * total_splits + split
    if SLOTS == 0:  # the retry: only a flagged program's tiles run, and only it writes
        flagged = tl.load(flag) != 0
        # (a block of the flag: triton 3.9's interpreter makes a bool block & a bool scalar an int32 mask)
        row_ok = row_ok & (tl.zeros((BLOCK_N,), tl.int32) + flagged.to(tl.int32) != 0)
        num_blocks = tl.where(flagged, num_blocks, 0)
    most = tl.zeros((BLOCK_N,), tl.int32)
    for i in tl.range(0, num_blocks, flatten=FLATTEN):
        offs_v, col_ok, z = block_tile(
            x_ptr, w_ptr, b_ptr, pid_n, first_block + i, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh,
            softcap, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H, w_row0,
        )
        a = tl.where(col_ok[None, :], z * inv_temp, float("-inf"))
        # The ids in this tile: each row's ids[start:start + count) (``id_blocks_kernel``'s table).
        start = tl.load(table_rows + first_block + i, mask=row_ok, other=0)
        count = tl.load(table_rows + first_block + i + 1, mask=row_ok, other=0) - start
        if SLOTS > 0:
            for j in tl.static_range(SLOTS):
                here = row_ok & (j < count)
                nxt = tl.load(ids_rows + start + j, mask=here, other=-1)
                hit = (offs_v[None, :] == nxt[:, None]) & col_ok[None, :]
                tl.store(out_rows + start + j, tl.sum(tl.where(hit, z, 0.0), 1), mask=here)
                a = tl.where(hit, float("-inf"), a)
        else:
            for j in range(0, tl.max(count, 0)):
                here = row_ok & (j < count)
                nxt = tl.load(ids_rows + start + j, mask=here, other=-1)
                hit = (offs_v[None, :] == nxt[:, None]) & col_ok[None, :]
                tl.store(out_rows + start + j, tl.sum(tl.where(hit, z, 0.0), 1), mask=here)
                a = tl.where(hit, float("-inf"), a)
        m, s, e, m_safe, _ = online_lse_update(a, m, s)
        if KEEP:
            block = first_block + i
            if block < keep_blocks:
                store_kept_tile(keep_ptr, keep_max_ptr, e, m_safe, block, keep_blocks, pid_n, offs_n, offs_v, row_ok,
                                col_ok, N, stride_keep, USE_TMA, BLOCK_N, BLOCK_V)
        # After the KEEP stores: before them, triton 3.6's TritonGPUFuseNestedLoops failed on
        # KEEP + FLATTEN ("scf.if ... source has 4 operands, but target successor needs 6"; an
        # sm_90 AOT compile on the CPU). Unlike linear_cross_entropy's forward, the branch stays:
        # this kernel without it (and these sums after) measured no faster (H200, f+b, K = 20).
        most = tl.maximum(most, count)
        if HAS_HARD:
            z_t += tl.sum(tl.where(offs_v[None, :] == target[:, None], z, 0.0), 1)
        if HARD_T:
            m1, s1, _, _, _ = online_lse_update(tl.where(col_ok[None, :], z, float("-inf")), m1, s1)

    if SLOTS > 0:
        tl.store(flag, (tl.max(most, 0) > SLOTS).to(tl.int32))
    out = store_partials(part_max_ptr, part_sum_ptr, part_sum_ptr, part_tgt_ptr, split, N, offs_n, row_ok, m, s,
                         s, z_t, False)
    if HARD_T:
        tl.store(part_max1_ptr + out, m1, mask=row_ok)
        tl.store(part_sum1_ptr + out, s1, mask=row_ok)


@triton.jit
def _row_terms(rows_ptr, coef_ptr, target_ptr, offs_n, row_ok, N):
    """Per row: lse_tail (-inf taken as 0: no column left, every one is overwritten),
    lse1, the coefficients c_r, c_q, c_b and the target."""
    lse_tail = tl.load(rows_ptr + offs_n, mask=row_ok, other=0.0)
    lse_tail = tl.where(lse_tail == float("-inf"), 0.0, lse_tail)
    lse1 = tl.load(rows_ptr + N + offs_n, mask=row_ok, other=0.0)
    c_r = tl.load(coef_ptr + offs_n, mask=row_ok, other=0.0)
    c_q = tl.load(coef_ptr + N + offs_n, mask=row_ok, other=0.0)
    c_b = tl.load(coef_ptr + 2 * N + offs_n, mask=row_ok, other=0.0)
    target = tl.load(target_ptr + offs_n, mask=row_ok, other=-1)
    return lse_tail, lse1, c_r, c_q, c_b, target


@triton.jit
def dense_dz(r, z, offs_v, lse1, c_r, c_q, c_b, target, softcap, HAS_SOFTCAP: tl.constexpr,
             HAS_HARD: tl.constexpr, HARD_T: tl.constexpr):
    """``formulas.topk_kl.dlogits_``: c_r r + c_q exp(z - lse1) - c_b [j = t], times the
    soft-cap's factor; r = exp(a - lse_tail), z the capped logits (read with a soft-cap or
    HARD_T)."""
    dz = r * c_r[:, None]
    if HARD_T:
        dz += tl.exp(z - lse1[:, None]) * c_q[:, None]
    if HAS_HARD:
        dz -= tl.where(offs_v[None, :] == target[:, None], c_b[:, None], 0.0)
    if HAS_SOFTCAP:
        capped = z / softcap
        dz *= 1.0 - capped * capped
    return dz


@triton.jit
def topk_dlogits_kernel(
    x_ptr, w_ptr, b_ptr, target_ptr, rows_ptr, coef_ptr, dz_ptr,
    N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, stride_dzn,
    v_start, v_end, softcap, inv_temp, group_n,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_HARD: tl.constexpr, HARD_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    DZ_TMA: tl.constexpr = False, FLATTEN: tl.constexpr = False, W_CHUNK: tl.constexpr = False,
):
    """The dense dz of columns [v_start, v_end), recomputing the GEMM tile (the ids' columns
    come out with any value: ``topk_patch_kernel`` overwrites them). Persistent when there
    are fewer programs than tiles (``lce_kernels.dlogits_kernel``'s loop)."""
    row_blocks = tl.cdiv(N, BLOCK_N)
    col_blocks = tl.cdiv(v_end - v_start, BLOCK_V)
    for tile in tl.range(tl.program_id(0), row_blocks * col_blocks, tl.num_programs(0), flatten=FLATTEN):
        pid_n, pid_v, offs_n, offs_v, row_ok, col_ok, z = recomputed_tile(
            tile, x_ptr, w_ptr, b_ptr, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh,
            v_start, v_end, softcap, row_blocks, col_blocks, group_n,
            HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H, W_CHUNK,
        )
        lse_tail, lse1, c_r, c_q, c_b, target = _row_terms(rows_ptr, coef_ptr, target_ptr, offs_n, row_ok, N)
        r = tl.exp(z * inv_temp - lse_tail[:, None])
        dz = dense_dz(r, z, offs_v, lse1, c_r, c_q, c_b, target, softcap, HAS_SOFTCAP, HAS_HARD, HARD_T)
        store_dz_tile(dz, dz_ptr, pid_n, pid_v, offs_n, offs_v, row_ok, col_ok, v_start, stride_dzn,
                      DZ_TMA, BLOCK_N, BLOCK_V)


@triton.jit
def topk_kept_dlogits_kernel(
    keep_ptr, keep_max_ptr, dz_ptr, target_ptr, rows_ptr, coef_ptr,
    N, block0, keep_cols, stride_keep, stride_dz, softcap, temperature,
    HAS_SOFTCAP: tl.constexpr, HAS_HARD: tl.constexpr, HARD_T: tl.constexpr,
    IN_PLACE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, APPROX_LOG: tl.constexpr = False,
):
    """The dense dz of the kept columns: e = exp(a - m) becomes dz (dz_ptr: keep itself, in
    place, or a chunk buffer of the launch's columns [block0 * BLOCK_V, keep_cols)), r = e
    exp(m - lse_tail); z = T (log e + m) only with a soft-cap or HARD_T (the planner keeps
    no columns where e could underflow there). BLOCK_V must be the forward's. APPROX_LOG:
    ``tile_io.kept_log``'s."""
    e, m, offs_n, offs_v, row_ok, mask, at = load_kept_tile(keep_ptr, keep_max_ptr, N, block0, keep_cols,
                                                            stride_keep, IN_PLACE, BLOCK_N, BLOCK_V)
    lse_tail, lse1, c_r, c_q, c_b, target = _row_terms(rows_ptr, coef_ptr, target_ptr, offs_n, row_ok, N)
    r = e * tl.exp(m - lse_tail)[:, None]
    z = r  # unused without a soft-cap or HARD_T
    if HAS_SOFTCAP or HARD_T:
        z = (kept_log(e, APPROX_LOG) + m[:, None]) * temperature
    dz = dense_dz(r, z, offs_v, lse1, c_r, c_q, c_b, target, softcap, HAS_SOFTCAP, HAS_HARD, HARD_T)
    store_kept_dz(dz_ptr, at, offs_n, offs_v, block0, stride_dz, mask, dz, IN_PLACE, BLOCK_V)


@triton.jit
def topk_patch_kernel(dz_ptr, stride_dzn, v_start, v_end, N, ids_ptr, sparse_ptr, K,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """dz[n, id - v_start] = sparse[n, k] for every id of row n in [v_start, v_end): the
    chunk's values at the ids, after the dense kernel. One program per BLOCK_N rows."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (offs_k < K)[None, :]
        ids = tl.load(ids_ptr + rows * K + offs_k[None, :], mask=ok, other=-1)
        inside = ok & (ids >= v_start) & (ids < v_end)
        vals = tl.load(sparse_ptr + rows * K + offs_k[None, :], mask=inside, other=0.0)
        tl.store(dz_ptr + rows * stride_dzn + (ids - v_start), vals.to(dz_ptr.dtype.element_ty), mask=inside)
