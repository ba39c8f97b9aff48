"""Shared Triton code of the fused GEMM kernels: one tile of logits z = x W^T (+ b),
computed in fp32 on tensor cores, and the grouped program order of the GEMM grids.

Shapes: x (N, H), W (V, H), logits z = x W^T (+ b) of shape (N, V), never stored whole.
Each program holds a tile of BLOCK_N tokens x BLOCK_V classes of z, computed by a loop
of tl.dot over BLOCK_H-wide slices of H with fp32 accumulation. Used by every fused
linear op (linear_cross_entropy, linear_jsd, ...); the torch-side launch helpers that
go with these kernels (dot precision, TMA descriptors, stage fitting) are in
``launch.py``.
"""

import triton
import triton.language as tl

from logitless.triton_lib.ce_math import softcap_tile


@triton.jit
def round_to_tf32(v):
    """fp32 -> the nearest TF32 value (10-bit mantissa; ties away from zero, as
    cvt.rna.tf32.f32 and cuBLAS), still stored as fp32. Tensor cores given raw fp32
    truncate instead (about 2.6x the error of rounding, in an emulation at H=2048)."""
    bits = v.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def round_to_tf32_kernel(src_ptr, dst_ptr, rows, cols, stride_r, stride_c,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dst = ``round_to_tf32``(src) for an fp32 (rows, cols) matrix (any strides) into a
    contiguous one: one read and one write per element (memory bound: a pass over a
    2 GB W is about a copy's time). The fused kernels then multiply TF32-exact operands
    with DOT_PRECISION "tf32", the tensor cores' truncation being exact on them: the
    same products as "tf32-round", with the operands loaded by TMA straight into the
    MMAs instead of through registers."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r < rows)[:, None] & (offs_c < cols)[None, :]
    r64 = offs_r.to(tl.int64)[:, None]
    v = tl.load(src_ptr + r64 * stride_r + offs_c[None, :] * stride_c, mask=mask, other=0.0)
    tl.store(dst_ptr + r64 * cols + offs_c[None, :], round_to_tf32(v), mask=mask)


@triton.jit
def dot(a, b_t, acc, DOT_PRECISION: tl.constexpr):
    """acc += a @ b_t^T with fp32 accumulation. For fp32 inputs DOT_PRECISION follows
    torch's fp32 matmul precision (``launch.dot_precision``):
    "tf32-round" (operands rounded to TF32, one TF32 tensor-core product: what cuBLAS
    does at "high"), "tf32" (the tensor cores truncate the raw fp32 operands), or
    "tf32x3" (3xTF32: a = a_hi + a_lo in TF32, a_hi b_hi + a_hi b_lo + a_lo b_hi,
    about fp32 accuracy, at "highest")."""
    # One return at the end: Triton 3.6 still compiles the statements after a
    # constexpr-if that returns (an early return made "tf32-round" reach the last dot).
    if DOT_PRECISION == "tf32-round":
        acc = tl.dot(round_to_tf32(a), tl.trans(round_to_tf32(b_t)), acc, input_precision="tf32")
    elif DOT_PRECISION == "interpreter-bf16":
        # TRITON_INTERPRET=1 (triton 3.6) multiplies bf16 as their uint16 storage:
        # widen first (bf16 x bf16 products are exact in fp32, as on tensor cores).
        acc = tl.dot(a.to(tl.float32), tl.trans(b_t.to(tl.float32)), acc)
    else:
        acc = tl.dot(a, tl.trans(b_t), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def grouped_tile(pid, row_blocks, cols, group):
    """Program id -> (row block, column index), ``group`` row blocks at a time: the
    programs resident together share a few row blocks of x (kept in L2 while they
    sweep the columns) and each column's W tile (read once per group), instead of
    every row block at once (at 16k tokens x 4096 the 128 MB of x do not fit the 50 MB
    L2 and were re-read from memory for each tile of W). group >= row_blocks gives the
    plain order: row block fastest."""
    per_group = group * cols
    first = (pid // per_group) * group
    size = tl.minimum(row_blocks - first, group)
    r = first + (pid % per_group) % size
    c = (pid % per_group) // size
    return r, c


@triton.jit
def logits_tile(
    x_ptr, w_ptr, b_ptr, n0, v0, N, V, H,
    stride_xn, stride_xh, stride_wv, stride_wh, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, w_row0=0,
):
    """z[n0:n0+BLOCK_N, v0:v0+BLOCK_V] = x W^T (+ b), soft-capped; fp32 (BLOCK_N, BLOCK_V).

    Reads BLOCK_N x H of x and BLOCK_V x H of W. ``w_row0``: w_ptr holds the rows of W
    from column w_row0 on (a chunk of W, e.g. rounded to TF32 into a scratch buffer);
    columns, bias and masks stay in global indices (the default 0 compiles to the code
    without the offset). With USE_TMA, x_ptr and w_ptr are
    host-made tensor descriptors (Hopper's bulk tensor copies, zero-filled out of
    bounds); otherwise pointers with masked loads and 64-bit offsets (N*H and V*H
    beyond 2**31 are safe). Rows/columns out of range hold junk (callers mask).
    """
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    offs_v = v0 + tl.arange(0, BLOCK_V)
    col_ok = offs_v < V
    if USE_TMA:
        for h0 in range(0, H, BLOCK_H):
            acc = dot(x_ptr.load([n0, h0]), w_ptr.load([v0 - w_row0, h0]), acc, DOT_PRECISION)
    else:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_h = tl.arange(0, BLOCK_H)
        row_ok = offs_n < N
        x_rows = x_ptr + offs_n.to(tl.int64)[:, None] * stride_xn
        w_rows = w_ptr + (offs_v - w_row0).to(tl.int64)[:, None] * stride_wv
        for h0 in range(0, H, BLOCK_H):
            h = h0 + offs_h
            h_ok = h < H
            x_blk = tl.load(x_rows + h[None, :] * stride_xh, mask=row_ok[:, None] & h_ok[None, :], other=0.0)
            w_blk = tl.load(w_rows + h[None, :] * stride_wh, mask=col_ok[:, None] & h_ok[None, :], other=0.0)
            acc = dot(x_blk, w_blk, acc, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_v, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        acc = softcap_tile(acc, softcap)
    return acc
