"""Shared Triton code of the fused linear ops' kept columns and d(logits) chunks: where
a tile of the (N, V) grid lies, and its stores and loads of the kept buffer and of dz.

    block_tile        a forward's tile: vocabulary block ``block`` of row block pid_n,
                      its columns, their mask and logits z (one GEMM tile)
    recomputed_tile   one tile of a dlogits kernel's chunk [v_start, v_end): its place
                      (``grouped_tile`` order), masks and logits z (one GEMM tile)
    store_dz_tile     dz of that tile into the chunk buffer (TMA bulk store or masked)
    store_kept_tile   a forward's e = exp(z - m) tile and its maxima m (KEEP)
    load_kept_tile    the backward's read of a kept tile (e, m)
    kept_log          log e of that tile (the MUFU's on NVIDIA GPUs, ``launch.approx_log``)
    store_kept_dz     its dz, in place or into a chunk of dz columns

Each op's own math (what dz is, from z or from e) stays in its kernel; these helpers
are inlined by Triton (plain @triton.jit functions), so a kernel that calls them
compiles to the code it had with the statements written out. Memory traffic: the
GEMM's reads of x and W for a recomputed tile, one write per dz or kept element, one
read and write per kept element in the backward.
"""

import triton
import triton.language as tl

from logitless.triton_lib.gemm import grouped_tile, logits_tile


@triton.jit
def block_tile(
    x_ptr, w_ptr, b_ptr, pid_n, block, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    w_row0=0,
):
    """(offs_v, col_ok, z): the columns of vocabulary block ``block``, which of them are
    below V, and the (BLOCK_N, BLOCK_V) fp32 logits of row block ``pid_n`` there
    (soft-capped with HAS_SOFTCAP; columns past V are the caller's to mask).
    ``w_row0``: w_ptr holds W from that column on (``gemm.logits_tile``)."""
    offs_v = block * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = offs_v < V
    z = logits_tile(
        x_ptr, w_ptr, b_ptr, pid_n * BLOCK_N, block * BLOCK_V, N, V, H,
        stride_xn, stride_xh, stride_wv, stride_wh, softcap,
        HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H, w_row0,
    )
    return offs_v, col_ok, z


@triton.jit
def recomputed_tile(
    tile, x_ptr, w_ptr, b_ptr, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh,
    v_start, v_end, softcap, row_blocks, col_blocks, group_n,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    W_CHUNK: tl.constexpr = False,
):
    """Tile ``tile`` of the chunk of columns [v_start, v_end) (``grouped_tile`` order,
    ``group_n`` row blocks at a time): (pid_n, pid_v, offs_n, offs_v, row_ok, col_ok,
    z) with z the (BLOCK_N, BLOCK_V) fp32 logits (soft-capped with HAS_SOFTCAP).
    W_CHUNK: w_ptr holds W's rows [v_start, v_end) only (e.g. rounded to TF32 into a
    scratch buffer), so W is read from column v_start on (``gemm.logits_tile``'s
    ``w_row0``); without it w_ptr is all of W (the offset compiles away)."""
    if W_CHUNK:
        w_row0 = v_start
    else:
        w_row0 = 0
    pid_n, pid_v = grouped_tile(tile, row_blocks, col_blocks, group_n)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = v_start + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = offs_n < N
    col_ok = offs_v < v_end
    z = logits_tile(
        x_ptr, w_ptr, b_ptr, pid_n * BLOCK_N, v_start + pid_v * BLOCK_V, N, V, H,
        stride_xn, stride_xh, stride_wv, stride_wh, softcap,
        HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H, w_row0,
    )
    return pid_n, pid_v, offs_n, offs_v, row_ok, col_ok, z


@triton.jit
def store_dz_tile(
    dz, dz_ptr, pid_n, pid_v, offs_n, offs_v, row_ok, col_ok, v_start, stride_dzn,
    DZ_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """dz (fp32 tile) into the chunk buffer in its dtype: DZ_TMA: dz_ptr is a tensor
    descriptor of the (N, v_end - v_start) chunk (a bulk store); else a masked store
    at row stride ``stride_dzn``."""
    if DZ_TMA:
        dz_ptr.store([pid_n * BLOCK_N, pid_v * BLOCK_V], dz.to(dz_ptr.dtype))
    else:
        dz_ptrs = dz_ptr + offs_n.to(tl.int64)[:, None] * stride_dzn + (offs_v - v_start)[None, :]
        tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def store_kept_tile(
    keep_ptr, keep_max_ptr, e, m_safe, block, keep_blocks, pid_n, offs_n, offs_v, row_ok, col_ok, N, stride_keep,
    USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """A forward's kept tile: e = exp(z - m) of vocabulary block ``block`` in keep's
    dtype (USE_TMA: keep_ptr is a descriptor, an asynchronous bulk store) and the
    running max used, m (fp32), at keep_max[block, rows]. Nothing where block >= keep_blocks,
    without a branch (a branch around the store kept the logits tile alive and spilled
    registers, docs/design.md "Kept columns"): masks, and with USE_TMA the descriptor's
    (N, keep_cols) bounds (``launch.keep_buffers``), past which a bulk store writes nothing."""
    # (block masks: triton 3.9's interpreter makes a bool block & a bool scalar an int32 mask)
    if USE_TMA:
        keep_ptr.store([pid_n * BLOCK_N, block * BLOCK_V], e.to(keep_ptr.dtype))
    else:
        keep_ptrs = keep_ptr + offs_n.to(tl.int64)[:, None] * stride_keep + offs_v[None, :]
        kept_cols = col_ok & (offs_v < keep_blocks * BLOCK_V)
        tl.store(keep_ptrs, e.to(keep_ptr.dtype.element_ty), mask=row_ok[:, None] & kept_cols[None, :])
    kept_rows = row_ok & (block + tl.zeros_like(offs_n) < keep_blocks)
    tl.store(keep_max_ptr + block.to(tl.int64) * N + offs_n, m_safe, mask=kept_rows)


@triton.jit
def load_kept_tile(keep_ptr, keep_max_ptr, N, block0, keep_cols, stride_keep, IN_PLACE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """The kept tile of program (row block, column block) = (program_id(0), block0 +
    program_id(1)) of a launch over kept column blocks from ``block0`` on (the columns
    below ``keep_cols``; IN_PLACE: every kept column, block0 = 0): (e in fp32, its maxima
    m, offs_n, offs_v (columns of V), row_ok, mask, at: its offsets in keep). (block0 a
    block index, not a column: offs_v stays a known multiple of BLOCK_V, so the accesses
    stay vectorised; a column offset spilled 4-7 kB per thread on sm_90.)"""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    if not IN_PLACE:
        pid_v += block0
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = offs_n < N
    mask = row_ok[:, None] & (offs_v < keep_cols)[None, :]
    at = offs_n.to(tl.int64)[:, None] * stride_keep + offs_v[None, :]
    e = tl.load(keep_ptr + at, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(keep_max_ptr + pid_v.to(tl.int64) * N + offs_n, mask=row_ok, other=0.0)
    return e, m, offs_n, offs_v, row_ok, mask, at


@triton.jit
def kept_log(e, APPROX: tl.constexpr):
    """log e of a kept tile (the passes that need log p or z: entropy, a soft-cap). APPROX
    (``launch.approx_log``: compiled for an NVIDIA GPU): the MUFU's lg2.approx.f32 times ln 2
    (absolute error <= 2^-22 in log2 on [0.5, 2], relative elsewhere; subnormals kept, e = 0
    gives -inf as logf does); libdevice's logf is 20+ instructions a value, and it made the
    pass compute-bound (RL at 8192 x 151936: 2.8 -> 1.5 ms with 16-row programs, docs/design.md
    "RL token log-probs and entropy"). Else tl.log (the interpreter, ROCm)."""
    if APPROX:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [e], dtype=tl.float32, is_pure=True,
                                         pack=1) * 0.6931471805599453
    return tl.log(e)


@triton.jit
def store_kept_dz(dz_ptr, at, offs_n, offs_v, block0, stride_dz, mask, dz, IN_PLACE: tl.constexpr,
                  BLOCK_V: tl.constexpr):
    """A kept tile's dz (``load_kept_tile``'s offsets and mask): IN_PLACE, over the kept
    buffer at its offsets ``at`` (one address computation: 5% of the pass at gemma3-4b);
    else at column offs_v - block0 * BLOCK_V of a chunk buffer of row stride stride_dz."""
    if not IN_PLACE:
        at = offs_n.to(tl.int64)[:, None] * stride_dz + (offs_v - block0 * BLOCK_V)[None, :]
    tl.store(dz_ptr + at, dz.to(dz_ptr.dtype.element_ty), mask=mask)
