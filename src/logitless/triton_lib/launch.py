"""Torch-side helpers of the Triton kernels, shared by every op's Triton backend.

    tf32_allowed / dot_precision   fp32 operands follow torch's matmul precision
    run_kernel                     kernel[grid](...), repeated launches through the cached
                                   compiled kernel, fewer pipeline stages where the tiles
                                   do not fit the shared memory (``triton_lib.fast_launch``)
    operands                       TMA tensor descriptors of x and W (or the tensors)
    padded_buffer                  (n, row) buffers whose rows are padded to 16 bytes
    chunk_gradients                dW, db and dx of one chunk of d(logits) (cuBLAS)
    logits_fp32 / head_logit_chunks  fp32 logits by cuBLAS; linear_jsd's row chunks of
                                   both heads' (the Triton and Helion forwards)
    gradient_buffers / finished_dx the outputs (and fp32 dx accumulator) of a chunked
                                   backward, and its dx after the last chunk
    kept_shapes_of / keep_buffers  the columns of exp(z - m) a forward keeps for its backward
    partials                       a forward's (S, N) partial statistics, one allocation
    descriptor                     a TMA descriptor, validated once per layout (``fast_launch``)
    backward_chunks / dz_buffer /  the backward's column chunks, its dz buffer, dz's TMA
      dz_operand / dlogits_tiles   descriptor and the dlogits kernel's grid
    DlogitsKernels /               the backward's loop over those chunks, launching the
      chunked_backward             kernels an op describes (no callbacks)

No host syncs; no atomics: results are bitwise repeatable.

Host time: at 512-2048 tokens an eager call is bound by the host, so
what is pure per (plan, shape, layout) is computed once: ``cdiv`` is plain integer
arithmetic (``triton.cdiv`` is a ``constexpr_function``: ~2 us per call on the host),
``descriptor`` checks a layout's TMA constraints once and then builds descriptors
without Triton's per-object validation, and the backward builds x's and W's
descriptors only when a chunk is recomputed. ``benchmarks/probe_host.py`` counts what is left (Python
calls, allocations, launches per forward+backward; ``tests/test_host_overhead.py``).
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from logitless.planning import plans as _plans
from logitless.planning import rocm as _rocm
from logitless.planning.overrides import current as _overrides
from logitless.planning.tiles import TritonPlan
from logitless.triton_lib.fast_launch import descriptor, run_kernel  # noqa: F401  (the ops' launches)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of positive Python ints (``triton.cdiv`` without its constexpr layer)."""
    return -(-a // b)


def tf32_allowed() -> bool:
    """Whether torch's own fp32 matmuls on CUDA may use TF32 right now: False at
    ``torch.set_float32_matmul_precision("highest")`` (the default), True at "high" or
    "medium" (torch ties ``torch.backends.cuda.matmul.allow_tf32`` to that setting)."""
    matmul = torch.backends.cuda.matmul
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        # torch >= 2.9 raises when the legacy and the new (fp32_precision) APIs were
        # mixed; the new one is then the one to follow ("none": the global setting).
        prec = getattr(matmul, "fp32_precision", "none")
        if prec == "none":
            prec = getattr(torch.backends, "fp32_precision", "ieee")
        return prec == "tf32"


#: PyTorch built for ROCm: the kernels run on AMD GPUs (``planning.rocm``).
_HIP = getattr(torch.version, "hip", None) is not None


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the kernels' tl.dot, read from torch's setting at each call.

    fp32 inputs run on tensor cores either way: "tf32-round" (operands rounded to TF32,
    one TF32 product, 10-bit mantissas, as cuBLAS at precision "high"/"medium") or, at
    "highest", "tf32x3" (each operand split into a TF32
    head and a TF32 tail, three TF32 products: about the accuracy of fp32 FMA, on
    tensor cores). Never "ieee" (scalar FMA loops, 77x a cuBLAS fp32 GEMM on an H100).
    16-bit inputs ignore the setting. AMD GPUs (ROCm): ``planning.rocm.dot_precision``
    ("ieee", or "tf32-round" for fp32 at "high" on gfx942; never "tf32x3").
    """
    if _HIP:
        return _rocm.dot_precision(dtype == torch.float32, tf32_allowed())
    if dtype == torch.float32:
        if not tf32_allowed():
            return "tf32x3"
        return "tf32-round"
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return "interpreter-bf16"  # see gemm.dot: works around an interpreter bug
    return "tf32"  # ignored for 16-bit inputs


def padded_buffer(n: int, row: int, like: Tensor) -> Tensor:
    """An (n, row) buffer in ``like``'s dtype whose rows are padded past the columns in
    use. Zero-filled off the GPU: torch's CPU bf16 matmul reads the padding of a strided
    operand (uninitialised memory: NaN * 0 = NaN in the result), cuBLAS does not."""
    alloc = torch.empty if like.is_cuda else torch.zeros
    return alloc(n, row, dtype=like.dtype, device=like.device)


def _aligned(t: Tensor) -> bool:
    """Rows contiguous and 16-byte aligned (what a TMA bulk copy needs)."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def operands(x: Tensor, weight: Tensor, plan):
    """(x, W, USE_TMA): tensor descriptors when the plan allows TMA and rows are
    16-byte aligned and contiguous (what the bulk tensor copy needs), else the tensors."""
    if not (plan.tma and _aligned(x) and _aligned(weight)):
        return x, weight, False
    x_desc = descriptor(x, tuple(x.shape), (x.stride(0), 1), (plan.block_n, plan.block_h))
    w_desc = descriptor(weight, tuple(weight.shape), (weight.stride(0), 1), (plan.block_v, plan.block_h))
    return x_desc, w_desc, True


def logits_fp32(x: Tensor, w: Tensor, b, out: Tensor) -> None:
    """out (fp32) = x @ w.T (+ b), fp32 accumulation and output."""
    if x.is_cuda and x.dtype != torch.float32:
        torch.mm(x, w.T, out_dtype=torch.float32, out=out)
    else:
        torch.mm(x.float(), w.float().T, out=out)
    if b is not None:
        out += b.float()


def head_logit_chunks(xs: Tensor, ws: Tensor, bs, xt: Tensor, wt: Tensor, bt, rows: int):
    """Yields (n0, n1, zs, zt) per chunk [n0, n1) of ``rows`` tokens: both heads' fp32
    logits of the chunk (bias added, not soft-capped) by cuBLAS, in two (rows, V) buffers
    that every chunk reuses (read them before the next one)."""
    n = xs.shape[0]
    zs = torch.empty(min(rows, n), ws.shape[0], dtype=torch.float32, device=xs.device)
    zt = torch.empty_like(zs)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        logits_fp32(xs[n0:n1], ws, bs, zs[: n1 - n0])
        logits_fp32(xt[n0:n1], wt, bt, zt[: n1 - n0])
        yield n0, n1, zs[: n1 - n0], zt[: n1 - n0]


def dx_accumulate(acc: Tensor, dz: Tensor, w: Tensor) -> None:
    """acc (fp32) += dz @ w with fp32 accumulation and no rounding to the input dtype."""
    if acc.is_cuda:
        torch.addmm(acc, dz, w, out_dtype=torch.float32, out=acc)
    else:  # the interpreter on CPU
        acc += dz.float() @ w.float()


def gradient_buffers(x: Tensor, weight: Tensor, bias: Optional[Tensor], chunks: int, *, need_dx: bool,
                     need_dw: bool, need_db: bool, keep_acc: bool) -> tuple:
    """(dW, db, dx accumulator) of a backward over ``chunks`` column chunks: dW and db
    (None where not needed) are written chunk by chunk (``chunk_gradients``); the fp32
    (N, H) accumulator of dx when it needs one (several chunks, or ``keep_acc``: dx as
    the accumulator), else None."""
    dw = torch.empty_like(weight) if need_dw else None
    db = torch.empty_like(bias) if need_db else None
    acc = None
    if need_dx and (keep_acc or chunks > 1):
        acc = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    return dw, db, acc


def finished_dx(dx: Optional[Tensor], acc: Optional[Tensor], keep_acc: bool, dtype: torch.dtype):
    """dx after the last chunk: the accumulator (as it is with ``keep_acc``, else cast once
    to ``dtype``), or the one chunk's dx (``chunk_gradients``' return) without one."""
    if acc is None:
        return dx
    return acc if keep_acc else acc.to(dtype)


def chunk_gradients(dz: Tensor, x: Tensor, w_rows: Tensor, dw_rows: Optional[Tensor],
                     db_rows: Optional[Tensor], dx_acc: Optional[Tensor], need_dx: bool):
    """The GEMMs fed by one chunk of dz (N, v1 - v0), for columns [v0, v1) of W:
    dW[v0:v1] = dz^T x (written once), db[v0:v1] = column sums of dz in fp32, and
    dx += dz W[v0:v1] into the fp32 accumulator ``dx_acc``. Without an accumulator (one
    chunk covers V) returns dx = dz W[v0:v1] in the input dtype; otherwise None."""
    if dw_rows is not None:
        torch.mm(dz.T, x, out=dw_rows)
    if db_rows is not None:
        db_rows.copy_(dz.sum(dim=0, dtype=torch.float32))
    if not need_dx:
        return None
    if dx_acc is None:
        return dz @ w_rows
    dx_accumulate(dx_acc, dz, w_rows)
    return None


# ------------------------------------------------- kept columns, dz chunks (every linear op)

def kept_shapes_of(plan: TritonPlan, n: int):
    """Shapes of the kept buffers: exp(z - m) of the first keep_cols columns, rows padded
    to 8 elements (16 bytes, so that tiles can be bulk-stored), and the per-tile maxima."""
    row = cdiv(plan.keep_cols, 8) * 8
    return (n, row), (cdiv(plan.keep_cols, plan.block_v), n)


def keep_buffers(plan: TritonPlan, n: int, x: Tensor, use_tma: bool):
    """(buffer (n, row), its (n, keep_cols) view, fp32 tile maxima, the view's kernel
    operand: a TMA descriptor of block_n x block_v tiles when ``use_tma``) of the
    ``kept_shapes_of`` shapes: what a forward keeping columns writes. The descriptor's
    shape is the kept columns': the forward kernels store every tile, and TMA drops the
    ones past keep_cols (``tile_io.store_kept_tile``)."""
    (_, row), max_shape = kept_shapes_of(plan, n)
    keep_buf = padded_buffer(n, row, x)
    keep = keep_buf[:, : plan.keep_cols]
    keep_max = torch.empty(max_shape, dtype=torch.float32, device=x.device)
    keep_op = keep
    if use_tma:
        keep_op = descriptor(keep, (n, plan.keep_cols), (row, 1), (plan.block_n, plan.block_v))
    return keep_buf, keep, keep_max, keep_op


def partials(count: int, splits: int, n: int, device) -> tuple:
    """``count`` (splits, n) fp32 buffers (a forward's partial statistics) carved out of
    one allocation, each contiguous and 16-byte aligned (as separate allocations would
    be: Triton specialises kernels on pointer alignment)."""
    size = splits * n
    row = cdiv(size, 4) * 4
    buf = torch.empty(count * row, dtype=torch.float32, device=device)
    return buf.as_strided((count, splits, n), (row, n, 1)).unbind(0)


def backward_chunks(plan: TritonPlan, v: int, keep_cols: int, kept_step: int = 0) -> list[tuple[int, int]]:
    """The backward's column ranges [v0, v1): the kept columns in chunks of ``kept_step``
    (0: one chunk), then chunks of ``plan.vocab_chunk`` recomputed columns."""
    step = kept_step or keep_cols
    chunks = [(v0, min(keep_cols, v0 + step)) for v0 in range(0, keep_cols, step)] if keep_cols else []
    chunks += [(v0, min(v, v0 + plan.vocab_chunk)) for v0 in range(keep_cols, v, plan.vocab_chunk)]
    return chunks


def dz_buffer(plan: TritonPlan, n: int, v: int, keep_cols: int, x: Tensor, kept_step: int = 0,
              spent: Optional[Tensor] = None) -> Tensor:
    """The (n, width) buffer of one dz chunk: the widest recomputed chunk, or kept chunk of
    ``kept_step`` columns (0: none goes there), rows padded to 16 bytes so that dz tiles can
    be bulk-stored (TMA). ``spent``: the kept buffer, whose dz (written over it) the
    previous chunk's GEMMs have read: the chunk is laid in its storage when it fits (no
    new memory: ``cost_model.predict_partial`` counts it so), else allocated."""
    width = max(min(plan.vocab_chunk, v - keep_cols), min(kept_step, keep_cols))
    row = cdiv(width, 8) * 8
    if spent is not None and spent.is_contiguous() and n * row <= spent.numel():
        return spent.view(-1)[: n * row].view(n, row)
    return padded_buffer(n, row, x)


def dz_operand(dz: Tensor, plan: TritonPlan, use_tma: bool):
    """(dz's kernel operand, DZ_TMA): a TMA descriptor of block_n x block_v tiles when the
    plan bulk-stores dz and x and W load by TMA, else dz itself."""
    dz_tma = plan.dz_tma and use_tma
    if dz_tma:
        n, cols = dz.shape
        return descriptor(dz, (n, cols), (dz.stride(0), 1), (plan.block_n, plan.block_v)), True
    return dz, dz_tma


def dlogits_tiles(plan: TritonPlan, n: int, cols: int, device) -> tuple[int, int]:
    """(programs of the dlogits kernel over an (n, cols) chunk, row blocks): one per tile,
    or when persistent (``plan.dlogits_programs``) at most that many per SM."""
    row_blocks = cdiv(n, plan.block_n)
    tiles = row_blocks * cdiv(cols, plan.block_v)
    if plan.dlogits_programs:  # persistent: each program loops over tiles
        tiles = min(tiles, plan.dlogits_programs * _plans.num_sms(device))
    return tiles, row_blocks


#: Rows per program, and warps, of a kept-columns dz pass that holds a third fp32 tile (z or
#: log p beside p and dz: a soft-cap, entropy, hard labels at T != 1): the plan's 128 x 256
#: tile spills registers there; 16 rows in 4 warps ran ahead of 32 in 8 (docs/design.md "RL
#: token log-probs and entropy").
KEPT_ROWS_WITH_LOG = 16
KEPT_WARPS_WITH_LOG = 4


def kept_pass_shape(tiles, with_log: bool) -> tuple[int, int]:
    """(rows per program, warps) of a kept-columns dz pass over ``tiles``' block_v columns:
    KEPT_ROWS_WITH_LOG in KEPT_WARPS_WITH_LOG warps when it holds a third fp32 tile
    (``with_log``), else the tiles' block_n in their warps. Every kept pass launches so
    (``chunked_backward``, linear_cross_entropy's gradient in the forward)."""
    return (KEPT_ROWS_WITH_LOG, KEPT_WARPS_WITH_LOG) if with_log else (tiles.block_n, tiles.num_warps)


def approx_log(t: Tensor) -> bool:
    """Whether the kept passes take log e from the MUFU (``tile_io.kept_log``'s APPROX: PTX
    inline assembly): compiled kernels on an NVIDIA GPU; not ROCm, not the interpreter."""
    return t.is_cuda and not _HIP and os.environ.get("TRITON_INTERPRET") != "1"


class DlogitsKernels(NamedTuple):
    """What a fused linear op's Triton backward launches per column chunk, described for
    ``chunked_backward`` (which owns the loop and the launches; no callbacks):

        kept_kernel[(row blocks, tiles of [v0, v1))](keep, tile_max, dz, *kept_head,
            v0 // BLOCK_V, v1, keep's row stride, dz's row stride, *kept_tail, **kept_flags,
            IN_PLACE, BLOCK_N, BLOCK_V, APPROX_LOG, num_warps)
            (BLOCK_N and num_warps: ``kept_pass_shape(plan, kept_log)``;
            APPROX_LOG: ``approx_log``; BLOCK_V: the plan's,
            the forward's tile maxima are per block_v columns; dz: keep itself (v0 = 0)
            or the chunk buffer of columns [v0, v1))
        kernel[(programs,)](x operand, W operand, *inputs, dz operand, n, v, h,
            x strides, W strides, dz row stride, v0, v1, *scalars, group_n, **flags,
            USE_TMA, DZ_TMA, FLATTEN, W_CHUNK, BLOCK_N, BLOCK_V, BLOCK_H, num_warps,
            num_stages)

        patch_kernel[(cdiv(n, BLOCK_N),)](dz, dz row stride, v0, v1, n, *patch_inputs,
            **patch_flags)   (after either, when given; BLOCK_N in patch_flags)

    ``kept_kernel`` turns the kept columns into dz (in place, or chunk by chunk into the
    dz buffer: ``chunked_backward``'s ``kept``); ``kernel`` recomputes a
    chunk's dz; ``patch_kernel`` then overwrites a few of each row's values in the chunk
    (linear_topk_kl: its values at the teacher's ids); ``prerounded``: its operands are
    rounded to TF32 into scratch buffers first (``prerounded_dlogits_operands``, W_CHUNK)."""

    kept_kernel: object
    kept_head: tuple
    kept_tail: tuple
    kept_flags: dict
    kernel: object
    inputs: tuple
    scalars: tuple
    flags: dict
    prerounded: bool
    kept_log: bool = False  # the kept pass holds a third fp32 tile (``kept_pass_shape``)
    patch_kernel: object = None
    patch_inputs: tuple = ()
    patch_flags: Optional[dict] = None


def chunked_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], plan: TritonPlan,
                     kept: Optional[tuple[Tensor, Tensor, Optional[Tensor]]], kernels: DlogitsKernels, *,
                     need_dx: bool, need_dw: bool, need_db: bool, dx_acc: bool = False):
    """dx, dW, db of a fused linear op's Triton backward, column chunk by chunk
    (``backward_chunks``): the kept columns (``kept`` = (buffer, tile maxima, where their
    dz goes: the buffer itself, or None: the dz buffer in chunks of
    ``plan.kept_dz_chunk`` columns; ``ops.common.kept.Kept``) from the forward, or None)
    become dz (``kernels.kept_kernel``); the others are
    recomputed into one padded dz buffer (``kernels.kernel``; in place, laid in the kept
    buffer once its dz is spent: ``dz_buffer``). Each chunk of dz feeds
    ``chunk_gradients`` (dW, db rows written once; dx into an fp32 accumulator when
    there are several chunks). ``dx_acc``: dx as the fp32 accumulator (also for one
    chunk), not cast to x's dtype (a partial sum that the caller reduces first: vocab
    parallelism). Temporaries: one dz chunk (the plan's vocab_chunk columns, or its
    kept_dz_chunk) and the (N, H) fp32 accumulator (and the rounded operands with
    ``kernels.prerounded``)."""
    keep_acc = dx_acc
    n, h = x.shape
    v = weight.shape[0]
    k = kernels
    keep_cols = plan.keep_cols if kept is not None else 0
    # Chunks of columns: the kept ones (one chunk in place, else kept_dz_chunk wide), then recomputed ones.
    in_place = kept is not None and kept[2] is not None
    kept_step = keep_cols if in_place else plan.kept_dz_chunk or keep_cols
    chunks = backward_chunks(plan, v, keep_cols, kept_step)
    dw, db, dx_acc = gradient_buffers(x, weight, bias, len(chunks), need_dx=need_dx, need_dw=need_dw,
                                      need_db=need_db, keep_acc=keep_acc)
    dx = dz_buf = None
    # fp32 at "high": x rounded once (at the first recomputed chunk), each chunk's W rows.
    rounded = prerounded_dlogits_operands(x, weight, plan, keep_cols) if k.prerounded else None
    x_op = w_op = use_tma = None  # (built at the first recomputed chunk: none when every column was kept)
    for v0, v1 in chunks:
        if dz_buf is None and not (in_place and v1 <= keep_cols):
            # In place, the kept chunk came first: its buffer is spent (stream order).
            dz_buf = dz_buffer(plan, n, v, keep_cols, x, 0 if in_place else kept_step,
                               spent=kept[2] if in_place else None)
        if v1 <= keep_cols:
            keep_buf, tile_max, dz_in_place = kept
            dz = dz_in_place[:, :keep_cols] if in_place else dz_buf[:, : v1 - v0]
            rows, warps = kept_pass_shape(plan, k.kept_log)
            run_kernel(k.kept_kernel, (cdiv(n, rows), cdiv(v1 - v0, plan.block_v)),
                       keep_buf, tile_max, dz, *k.kept_head, v0 // plan.block_v, v1, keep_buf.stride(0), dz.stride(0),
                       *k.kept_tail, **k.kept_flags, IN_PLACE=in_place, BLOCK_N=rows, BLOCK_V=plan.block_v,
                       APPROX_LOG=approx_log(x), num_warps=warps)
        else:
            if x_op is None:
                x_op, w_op, use_tma = operands(x, weight, plan)
            dz = dz_buf[:, : v1 - v0]
            dz_op, dz_tma = dz_operand(dz, plan, use_tma)
            tiles, row_blocks = dlogits_tiles(plan, n, v1 - v0, x.device)
            kx, kw, k_tma, xs, ws = x_op, w_op, use_tma, x, weight
            if rounded is not None:
                kx, kw, k_tma, xs, ws = rounded(v0, v1)
            run_kernel(
                k.kernel, (tiles,),
                kx, kw, *k.inputs, dz_op,
                n, v, h, xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1), dz.stride(0),
                v0, v1, *k.scalars, plan.group_n or row_blocks,
                **k.flags, USE_TMA=k_tma, DZ_TMA=dz_tma, FLATTEN=plan.flatten and plan.dlogits_programs > 0,
                W_CHUNK=k.prerounded, BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, BLOCK_H=plan.block_h,
                num_warps=plan.num_warps, num_stages=plan.num_stages,
            )
        if k.patch_kernel is not None:
            run_kernel(k.patch_kernel, (cdiv(n, k.patch_flags["BLOCK_N"]),), dz, dz.stride(0), v0, v1, n,
                       *k.patch_inputs, **k.patch_flags)
        dx_chunk = chunk_gradients(
            dz, x, weight[v0:v1], dw[v0:v1] if need_dw else None, db[v0:v1] if need_db else None,
            dx_acc, need_dx)
        if dx_chunk is not None:
            dx = dx_chunk
    return finished_dx(dx, dx_acc, keep_acc, x.dtype), dw, db


# ------------------------------------------------- fp32 at "high": operands rounded to TF32 once

def tf32_prerounded(dtype: torch.dtype) -> bool:
    """Whether fp32 operands may be rounded to TF32 by ``round_to_tf32`` into scratch
    buffers before the fused GEMM kernels, which then multiply them with DOT_PRECISION
    "tf32" (exact on TF32 values: the products of "tf32-round", through TMA). True for
    fp32 at matmul precision "high"/"medium" unless ``override(tf32_preround=False)``
    (the kernels then round in registers). The plan decides (``plans.triton_plan``: ``w_chunk > 0``)."""
    return (dtype == torch.float32 and _overrides().tf32_preround is not False
            and dot_precision(dtype) == "tf32-round")


def runs_prerounded(plan: TritonPlan, dtype: torch.dtype) -> bool:
    """``plan``'s launches multiply pre-rounded operands: it has W chunks and ``tf32_prerounded``."""
    return plan.w_chunk > 0 and tf32_prerounded(dtype)


def round_to_tf32(src: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``src`` (fp32, 2-D, any strides) rounded to the nearest TF32 (as cuBLAS and the
    kernels' "tf32-round") into ``out`` (contiguous, src's shape; allocated if None):
    one Triton kernel, one read and one write per element. No host sync."""
    from logitless.triton_lib.gemm import round_to_tf32_kernel

    rows, cols = src.shape
    if out is None:
        out = torch.empty(rows, cols, dtype=torch.float32, device=src.device)
    if rows and cols:
        if src.is_cuda:
            block_r, block_c, warps = 16, 256, 4
        else:  # the interpreter: few programs
            block_r, block_c, warps = 64, 64, 1
        grid = (cdiv(rows, block_r), cdiv(cols, block_c))
        run_kernel(round_to_tf32_kernel, grid, src, out, rows, cols, src.stride(0), src.stride(1),
                   BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


def forward_w_chunks(plan: TritonPlan, v: int) -> list[tuple[int, int, int]]:
    """(first split, splits, first column) of each launch of a forward over W in chunks of
    ``plan.w_chunk`` rows (a whole number of vocabulary splits; one launch when it
    covers V)."""
    if plan.w_chunk >= v:
        return [(0, plan.vocab_splits, 0)]
    split_cols = cdiv(cdiv(v, plan.block_v), plan.vocab_splits) * plan.block_v
    per = max(1, plan.w_chunk // split_cols)
    return [(s0, min(per, plan.vocab_splits - s0), s0 * split_cols) for s0 in range(0, plan.vocab_splits, per)]


def forward_launches(x: Tensor, weight: Tensor, plan: TritonPlan, prerounded: bool):
    """(USE_TMA, steps) of a fused forward over vocabulary splits. Without ``prerounded``
    one step on x and W. With it, x is rounded to TF32 once and each step rounds its
    chunk of W (``forward_w_chunks``) into one scratch buffer first. A step() returns
    (x operand, W operand, x, W rows used (for strides), splits in the launch, the
    kernel's extra arguments: split0 and W_CHUNK when W goes in several chunks)."""
    v, h = weight.shape
    if not prerounded:
        x_op, w_op, use_tma = operands(x, weight, plan)
        return use_tma, [lambda: (x_op, w_op, x, weight, plan.vocab_splits, {})]
    xr = round_to_tf32(x)
    chunks = forward_w_chunks(plan, v)
    rows = min(v, chunks[1][2]) if len(chunks) > 1 else v  # one chunk's rows (plan.w_chunk at most)
    scratch = torch.empty(rows, h, dtype=torch.float32, device=x.device)
    use_tma = operands(xr, scratch, plan)[2]

    def step(i):
        split0, splits, c0 = chunks[i]
        c1 = min(v, chunks[i + 1][2]) if i + 1 < len(chunks) else v
        w_rows = round_to_tf32(weight[c0:c1], scratch[: c1 - c0])
        x_op, w_op, _ = operands(xr, w_rows, plan)
        extra = dict(split0=split0, W_CHUNK=True) if len(chunks) > 1 else {}
        return x_op, w_op, xr, w_rows, splits, extra

    return use_tma, [lambda i=i: step(i) for i in range(len(chunks))]


def prerounded_dlogits_operands(x: Tensor, weight: Tensor, plan: TritonPlan, keep_cols: int):
    """A backward's rounded operands for the recomputed chunk [v0, v1): returns
    round(v0, v1) -> (x operand, W operand, USE_TMA, x rounded, W rows rounded): x is
    rounded once (at the first chunk) and each chunk's rows of W into one scratch
    buffer of min(plan.vocab_chunk, V - keep_cols) rows (dz's width), both held by the
    returned function for the backward's chunk loop."""
    v, h = weight.shape
    scratch: dict = {}

    def rounded(v0, v1):
        if not scratch:
            scratch["x"] = round_to_tf32(x)
            rows = min(plan.vocab_chunk, v - keep_cols)
            scratch["w"] = torch.empty(rows, h, dtype=torch.float32, device=x.device)
        ws = round_to_tf32(weight[v0:v1], scratch["w"][: v1 - v0])
        x_op, w_op, use_tma = operands(scratch["x"], ws, plan)
        return x_op, w_op, use_tma, scratch["x"], ws

    return rounded
