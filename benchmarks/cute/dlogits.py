"""A CuTe DSL (nvidia-cutlass-dsl 4.2.1) Hopper kernel for the backward's d(logits) of one chunk.

A probe towards a warp-specialised backward backend (issue 23 item 1), not library code.
For bf16 ``x`` (N, H), the chunk's rows of W, ``w`` = W[v0:v1] (C, H) bf16, fp32 ``lse``
(N,), fp32 per-row coefficient ``g`` (N,) (the upstream gradient times the class weight /
normaliser; 0 for ignored rows) and int32 ``target`` (N,), with z = x @ w^T in fp32 (never
written), it writes

    dz[n, j] = g_n * (exp(z[n, j] - lse_n) - [v0 + j == target_n])      in bf16, (N, C)

into a row-major buffer with row stride ``ldz`` >= C (a multiple of 8: TMA's 16-byte
stride rule), the operand of the two cuBLAS GEMMs that follow (dW[v0:v1] = dz^T x and
dx += dz w). Memory traffic: x and w are read once per (row block, column block) tile
through TMA (x re-read C/256 times, w N/128 times, mostly from L2 thanks to the grouped
tile order), dz written once (2 N C bytes), 12 bytes per row read per tile.

Kernel structure (persistent: ``ctas`` CTAs, each looping over 128 x 256 output tiles
t = blockIdx.x, blockIdx.x + ctas, ... in a grouped order: ``group_m`` row blocks side by
side, so the CTAs running at once share x and w tiles in L2), 384 threads:
  * warpgroup 0 is the producer (setmaxnreg 40): one thread issues TMA loads of x
    (128 x 64) and w (256 x 64) tiles into a ``stages``-deep ring of shared memory guarded
    by mbarriers (``cutlass.pipeline.PipelineTmaAsync``), running straight from one tile's
    k slabs into the next tile's, so the ring is full when the consumers finish an epilogue;
  * warpgroups 1 and 2 are consumers (setmaxnreg 232), each owns 64 rows of the tile and
    runs wgmma m64n256k16 bf16 -> fp32 (4 per 64-wide k slab, one group in flight);
  * epilogue per tile: each consumer thread turns its 128 accumulators (2 rows x 64
    columns of the wgmma C layout) into dz (one ex2 and one fma per element, the target
    column by compare-select), converts to bf16 and
      - ``epilogue="tma"``: writes them into its warpgroup's 64 x 256 bf16 half of a
        shared-memory tile (128-byte swizzle, conflict-free), fences the async proxy and
        one thread issues a TMA bulk-tensor store (clipped at N and at C8 = C rounded down
        to a multiple of 8 by the hardware, see "Ragged C" below), which stays in flight
        while the warpgroup starts the next tile's mainloop (the buffer is reused only
        after ``cp.async.bulk.wait_group.read 0``);
      - ``epilogue="tma128"``: the same through a 32 KiB buffer, two 64 x 128 stores per
        warpgroup and tile (element i lies in column block i // 64), room for 4 stages;
      - ``epilogue="direct"``: stores each element with a masked st.global (fallback).
Ragged C (``exact_tail``, on by default): a TMA store writes whole 16-byte chunks of the
innermost dimension, so a tensor map whose column extent C is not a multiple of 8 bf16 lets
the store of the last column block write up to 7 columns past C (what the first H100 run
measured at C = 4099: the padding columns 4099..4103 of a row-padded buffer overwritten,
values correct; a dz chunk that is a column slice of a wider buffer would have the next
chunk's first columns clobbered). The tensor map's column extent is therefore C8 (at least
8, where no store is issued when C8 = 0) and the columns [C8, C) (at most 7) are read back
from the epilogue's shared tile by the warpgroup that wrote it, after its barrier, and stored
with masked st.global (2 threads per row, 4 columns each; only the column block holding C8
has any, one uniform branch per block elsewhere; no spills, where storing the tail from the
accumulator registers spilled 132 bytes). (The lowered host code encodes the extent that
make_tiled_tma_atom is given, benchmarks/cute/check_dz_store.py: the first run's map had
extent C, not the row stride; ``exact_tail=False`` keeps it for the GPU probe's diagnosis.)
Shared memory: ``stages`` x 48 KiB ring + the epilogue buffer: tma 3 stages = 208 KiB,
tma128 4 stages = 224 KiB (+1 KiB of barriers and alignment; the limit is 227 KiB).

Constraints of this probe: H a multiple of 64 (a compile-time constant), any N >= 1 and
C >= 1 (ragged edges: TMA zero-fills loads, clips stores), x and w contiguous row-major,
16-byte aligned (the w pointer is W's data pointer + v0 H elements), ldz % 8 == 0.

The DSL's preprocessor re-executes the imports it finds in this module when it compiles a
kernel: import torch only through importlib inside functions.
"""

from __future__ import annotations

import importlib
import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils

TILE_M, TILE_N, TILE_K = 128, 256, 64
HALF_M = TILE_M // 2
LOG2E = math.log2(math.e)
EPILOGUES = ("tma", "tma128", "direct")
SMEM_LIMIT = 227 * 1024  # sm_90 dynamic shared memory per block


class DlogitsSm90:
    """Compile-time configuration: hidden size, ring depth, epilogue, tile group height."""

    def __init__(self, hidden: int, stages: int = 3, epilogue: str = "tma", group_m: int = 16,
                 exact_tail: bool = True):
        if hidden % TILE_K:
            raise ValueError(f"hidden must be a multiple of {TILE_K}, got {hidden}")
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        self.tma = epilogue != "direct"
        self.exact_tail = exact_tail and self.tma
        # columns of one TMA store box row: the whole 256 ("tma", a 64 KiB epilogue tile) or
        # 128 ("tma128": two stores per tile through a 32 KiB tile, room for a 4th stage)
        self.epi_cols = 128 if epilogue == "tma128" else TILE_N
        self.c_elems = HALF_M * self.epi_cols * 2 if self.tma else 8  # bf16 epilogue tile
        smem = stages * (TILE_M + TILE_N) * TILE_K * 2 + self.c_elems * 2 + 1024
        if smem > SMEM_LIMIT:
            raise ValueError(f"{stages} stages with the {epilogue!r} epilogue need {smem} bytes "
                             f"of shared memory, over {SMEM_LIMIT}")
        self.hidden = hidden
        self.stages = stages
        self.epilogue = epilogue
        self.group_m = group_m
        self.k_tiles = hidden // TILE_K
        self.threads = 384
        self.ab_dtype = cutlass.BFloat16

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        lse_ptr: cute.Pointer,
        g_ptr: cute.Pointer,
        t_ptr: cute.Pointer,
        dz_ptr: cute.Pointer,
        n_rows: cutlass.Int32,
        cols: cutlass.Int32,
        ldz: cutlass.Int32,
        v0: cutlass.Int32,
        ctas: cutlass.Int32,
        tma_cols: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        H = self.hidden
        mX = cute.make_tensor(x_ptr, cute.make_layout((n_rows, H), stride=(H, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((cols, H), stride=(H, 1)))
        mL = cute.make_tensor(lse_ptr, cute.make_layout(n_rows))
        mG = cute.make_tensor(g_ptr, cute.make_layout(n_rows))
        mT = cute.make_tensor(t_ptr, cute.make_layout(n_rows))
        mD = cute.make_tensor(dz_ptr, cute.make_layout((n_rows, cols), stride=(ldz, 1)))
        # the TMA store's view: tma_cols columns (C8 = C // 8 * 8, at least 8, with
        # exact_tail; C without), so that no 16-byte chunk it writes reaches past C
        mDs = cute.make_tensor(dz_ptr, cute.make_layout((n_rows, tma_cols), stride=(ldz, 1)))

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            cutlass.Float32,
            (2, 1, 1),
            tiler_mn=(64, TILE_N),
        )
        kind = sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.ab_dtype, TILE_K)
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(kind, self.ab_dtype)
        sa_layout = cute.tile_to_shape(atom, (TILE_M, TILE_K, self.stages), order=(0, 1, 2))
        sb_layout = cute.tile_to_shape(atom, (TILE_N, TILE_K, self.stages), order=(0, 1, 2))
        # the epilogue tile: one 64 x epi_cols bf16 block per consumer warpgroup, 128-byte swizzle
        sc_layout = cute.tile_to_shape(atom, (HALF_M, self.epi_cols, 2), order=(0, 1, 2))

        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tma_x = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mX, cute.slice_(sa_layout, (None, None, 0)), (TILE_M, TILE_K))
        tma_b, tma_w = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mW, cute.slice_(sb_layout, (None, None, 0)), (TILE_N, TILE_K))
        tma_c, tma_d = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mDs,
            cute.slice_(sc_layout, (None, None, 0)), (HALF_M, self.epi_cols))
        c_elems = self.c_elems

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(sa_layout)], 1024]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(sb_layout)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, c_elems], 1024]

        self.shared_storage = SharedStorage
        self.kernel(tiled_mma, tma_a, tma_x, tma_b, tma_w, tma_c, tma_d,
                    sa_layout, sb_layout, sc_layout, mL, mG, mT, mD,
                    n_rows, cols, v0).launch(
            grid=(ctas, 1, 1),
            block=(self.threads, 1, 1),
            stream=stream,
        )

    # ---------------------------------------------------------------- device side
    @cute.jit
    def tile_coords(self, tile, row_blocks, col_blocks):
        """Grouped order: group_m row blocks side by side, rows fastest inside a group."""
        per_group = self.group_m * col_blocks
        first_m = (tile // per_group) * self.group_m
        height = cutlass.min(row_blocks - first_m, self.group_m)
        inner = tile % per_group
        return first_m + inner % height, inner // height

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_a: cute.CopyAtom,
        mX: cute.Tensor,
        tma_b: cute.CopyAtom,
        mW: cute.Tensor,
        tma_c: cute.CopyAtom,
        mDt: cute.Tensor,
        sa_layout: cute.ComposedLayout,
        sb_layout: cute.ComposedLayout,
        sc_layout: cute.ComposedLayout,
        mL: cute.Tensor,
        mG: cute.Tensor,
        mT: cute.Tensor,
        mD: cute.Tensor,
        n_rows: cutlass.Int32,
        cols: cutlass.Int32,
        v0: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            if cutlass.const_expr(self.tma):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_c)

        row_blocks = (n_rows + TILE_M - 1) // TILE_M
        col_blocks = (cols + TILE_N - 1) // TILE_N
        tiles = row_blocks * col_blocks

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tx_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(sa_layout, (None, None, 0))) \
            + cute.size_in_bytes(self.ab_dtype, cute.slice_(sb_layout, (None, None, 0)))
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
            tx_count=tx_bytes,
        )
        sA = storage.sA.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sB = storage.sB.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)

        gX = cute.local_tile(mX, (TILE_M, TILE_K), (None, None))
        gW = cute.local_tile(mW, (TILE_N, TILE_K), (None, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gX, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gW, 0, 2))

        if tidx < 128:
            cute.arch.warpgroup_reg_dealloc(40)
            if warp_idx == 0:
                self.produce(ring, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, bid, nctas, tiles,
                             row_blocks, col_blocks)
        else:
            cute.arch.warpgroup_reg_alloc(232)
            self.consumer_wg(tiled_mma, ring, sA, sB, storage, sc_layout, tma_c, mDt, mL, mG,
                             mT, mD, n_rows, cols, v0, bid, nctas, tiles, row_blocks,
                             col_blocks, tidx - 128)

    @cute.jit
    def produce(self, ring, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, bid, nctas, tiles,
                row_blocks, col_blocks):
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for tile in cutlass.range(bid, tiles, nctas, unroll=1):
            tm, tn = self.tile_coords(tile, row_blocks, col_blocks)
            for kt in cutlass.range(self.k_tiles, unroll=1):
                ring.producer_acquire(state)
                bar = ring.producer_get_barrier(state)
                cute.copy(tma_a, tAgA[(None, tm, kt)], tAsA[(None, state.index)],
                          tma_bar_ptr=bar)
                cute.copy(tma_b, tBgB[(None, tn, kt)], tBsB[(None, state.index)],
                          tma_bar_ptr=bar)
                ring.producer_commit(state)
                state.advance()

    @cute.jit
    def consumer_wg(self, tiled_mma, ring, sA, sB, storage, sc_layout, tma_c, mDt, mL, mG, mT,
                    mD, n_rows, cols, v0, bid, nctas, tiles, row_blocks, col_blocks, ctid):
        if cutlass.const_expr(self.tma):
            sC = storage.sC.get_tensor(sc_layout.outer, swizzle=sc_layout.inner)
            gD = cute.local_tile(mDt, (HALF_M, self.epi_cols), (None, None))
            tCsC, tCgC = cute.nvgpu.cpasync.tma_partition(
                tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                cute.group_modes(gD, 0, 2))
            self.consume(tiled_mma, ring, sA, sB, sC, tma_c, tCsC, tCgC, mL, mG, mT, mD,
                         n_rows, cols, v0, bid, nctas, tiles, row_blocks, col_blocks, ctid)
        else:
            self.consume(tiled_mma, ring, sA, sB, None, tma_c, None, None, mL, mG, mT, mD,
                         n_rows, cols, v0, bid, nctas, tiles, row_blocks, col_blocks, ctid)

    @cute.jit
    def consume(self, tiled_mma, ring, sA, sB, sC, tma_c, tCsC, tCgC, mL, mG, mT, mD,
                n_rows, cols, v0, bid, nctas, tiles, row_blocks, col_blocks, ctid):
        wg = ctid // 128
        lt = ctid % 128
        thr_wg = tiled_mma.get_slice(wg * 128)
        thr = tiled_mma.get_slice(ctid)
        tCsA = thr_wg.partition_A(sA)
        tCsB = thr_wg.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        # (row, col) of every accumulator element of this thread inside the 128 x 256 tile
        tCcC = thr.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
        acc = cute.make_fragment(tCcC.shape, cutlass.Float32)
        n_acc = cute.size(acc)
        k_blocks = cute.size(tCrA, mode=[2])
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        r0 = tCcC[0][0]
        r1 = tCcC[2][0]

        # the TMA store covers columns [0, c8) (16-byte chunks that end at or before C)
        c8 = cols // 8 * 8 if self.exact_tail else cols
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for tile in cutlass.range(bid, tiles, nctas, unroll=1):
            tm, tn = self.tile_coords(tile, row_blocks, col_blocks)
            acc.fill(0.0)
            for kt in cutlass.range(self.k_tiles, unroll=1):
                ring.consumer_wait(read)
                cute.nvgpu.warpgroup.fence()
                for kb in cutlass.range_constexpr(k_blocks):
                    cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)],
                              tCrB[(None, None, kb, read.index)], acc)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(1)
                if kt > 0:
                    ring.consumer_release(release)
                    release.advance()
                read.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            ring.consumer_release(release)
            release.advance()

            # epilogue: dz = g (exp(z - lse) - [v0 + col == target]) for the thread's 2 rows
            row0 = tm * TILE_M + r0
            row1 = tm * TILE_M + r1
            b0 = cutlass.Float32(0.0)
            b1 = cutlass.Float32(0.0)
            g0 = cutlass.Float32(0.0)
            g1 = cutlass.Float32(0.0)
            j0 = cutlass.Int32(-1)
            j1 = cutlass.Int32(-1)
            if row0 < n_rows:
                b0 = mL[row0] * LOG2E
                g0 = mG[row0]
                j0 = mT[row0] - v0
            if row1 < n_rows:
                b1 = mL[row1] * LOG2E
                g1 = mG[row1]
                j1 = mT[row1] - v0
            col_base = tn * TILE_N
            for i in cutlass.range_constexpr(n_acc):
                col = col_base + tCcC[i][1]
                if cutlass.const_expr((i // 2) % 2 == 0):
                    d = g0 * cute.arch.exp2(acc[i] * LOG2E - b0)
                    acc[i] = d - g0 if col == j0 else d
                else:
                    d = g1 * cute.arch.exp2(acc[i] * LOG2E - b1)
                    acc[i] = d - g1 if col == j1 else d
            dz = cute.make_fragment(tCcC.shape, self.ab_dtype)
            dz.store(acc.load().to(self.ab_dtype))

            if cutlass.const_expr(self.tma):
                # element i of the wgmma C layout lies in column 8 (i // 4) + 2 (lane % 4) + i % 2
                # of the tile: column block b of epi_cols holds elements [b per, (b + 1) per)
                # (check_compile.py checks it on the layout algebra)
                blocks = TILE_N // self.epi_cols
                per = n_acc // blocks
                for b in cutlass.range_constexpr(blocks):
                    # the buffer is free once the previous bulk store has read it
                    if lt == 0:
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                    cute.arch.barrier(barrier_id=1 + wg, number_of_threads=128)
                    for i in cutlass.range_constexpr(b * per, (b + 1) * per):
                        sC[(tCcC[i][0] - wg * HALF_M, tCcC[i][1] - b * self.epi_cols, wg)] = dz[i]
                    cute.arch.fence_proxy(cute.arch.ProxyKind.async_shared,
                                          space=cute.arch.SharedSpace.shared_cta)
                    cute.arch.barrier(barrier_id=1 + wg, number_of_threads=128)
                    if cutlass.const_expr(self.exact_tail):
                        # columns [C8, C) (see "Ragged C"): read back from this block's shared
                        # tile (written and fenced above, reused only after the next barrier)
                        # and stored directly, 2 threads per row, 4 columns each; only the
                        # block holding column C8 of the last column tile has any
                        tc = c8 - col_base - b * self.epi_cols
                        if c8 < cols and tc >= 0 and tc < self.epi_cols:
                            r = lt // 2
                            row = (tm * 2 + wg) * HALF_M + r
                            for k in cutlass.range_constexpr(4):
                                j = (lt % 2) * 4 + k
                                if row < n_rows and c8 + j < cols:
                                    mD[row, c8 + j] = sC[(r, tc + j, wg)]
                    # (a block wholly below row N or right of column C has nothing to store)
                    cb = tn * blocks + b
                    if lt == 0 and (tm * 2 + wg) * HALF_M < n_rows and cb * self.epi_cols < c8:
                        cute.copy(tma_c, tCsC[(None, wg)], tCgC[(None, tm * 2 + wg, cb)])
                        cute.arch.cp_async_bulk_commit_group()
            else:
                for i in cutlass.range_constexpr(n_acc):
                    row = row0 if cutlass.const_expr((i // 2) % 2 == 0) else row1
                    col = col_base + tCcC[i][1]
                    if row < n_rows and col < cols:
                        mD[row, col] = dz[i]
        if cutlass.const_expr(self.tma):
            if lt == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=False)


_COMPILED: dict = {}


def compile_dlogits(hidden: int, stages: int = 3, epilogue: str = "tma", group_m: int = 16,
                    stream=None, exact_tail: bool = True):
    """cute.compile the kernel for one hidden size (N, C, ldz, v0, ctas stay runtime values).

    The pointers given to cute.compile only carry types (dtype, address space, alignment):
    dummy addresses, so the whole lowering also runs on a machine without a GPU (the host
    JIT then stops for lack of libcuda)."""
    from cutlass.cute.runtime import make_ptr

    key = (hidden, stages, epilogue, group_m, exact_tail)
    if key in _COMPILED:
        return _COMPILED[key]
    gmem = cute.AddressSpace.gmem
    base = 1 << 20
    ptrs = [
        make_ptr(cutlass.BFloat16, base, gmem, assumed_align=16),
        make_ptr(cutlass.BFloat16, base * 2, gmem, assumed_align=16),
        make_ptr(cutlass.Float32, base * 3, gmem, assumed_align=16),
        make_ptr(cutlass.Float32, base * 4, gmem, assumed_align=16),
        make_ptr(cutlass.Int32, base * 5, gmem, assumed_align=16),
        make_ptr(cutlass.BFloat16, base * 6, gmem, assumed_align=16),
    ]
    kern = DlogitsSm90(hidden, stages, epilogue, group_m, exact_tail)
    stream = cuda.CUstream(0) if stream is None else stream
    compiled = cute.compile(kern, *ptrs, cutlass.Int32(TILE_M), cutlass.Int32(TILE_N),
                            cutlass.Int32(TILE_N), cutlass.Int32(0), cutlass.Int32(1),
                            cutlass.Int32(TILE_N), stream)
    _COMPILED[key] = compiled
    return compiled


def dz_buffer(n: int, c: int, device=None):
    """A bf16 (n, c) view with a row stride rounded up to 8 elements (TMA's 16-byte rule)."""
    torch = importlib.import_module("torch")
    ld = (c + 7) // 8 * 8
    return torch.empty(n, ld, device=device, dtype=torch.bfloat16)[:, :c]


def tma_store_cols(c: int, exact_tail: bool = True) -> int:
    """The TMA store's column extent for a chunk of C columns: C8 = C // 8 * 8 (at least 8: a
    tensor map needs one; the kernel issues no store when C8 = 0), C without exact_tail."""
    return max(c // 8 * 8, 8) if exact_tail else c


def dlogits_chunk(x, w, v0: int, v1: int, lse, g, target, dz=None, *, stages: int = 3,
                  epilogue: str = "tma", group_m: int = 16, ctas: int = 0,
                  exact_tail: bool = True):
    """dz (N, v1 - v0) bf16 for CUDA torch tensors x (N, H), w (V, H) bf16, lse, g (N,) fp32,
    target (N,) integer. ``ctas``: persistent CTAs (0: one per SM, at most one per tile).
    ``dz`` may be a column slice of a wider buffer (row stride % 8 == 0, data pointer 16-byte
    aligned): nothing outside its N x C elements is written (``exact_tail=False`` only for
    the probe's diagnosis: the TMA epilogues then write up to 7 columns past a ragged C)."""
    torch = importlib.import_module("torch")
    from cutlass.cute.runtime import make_ptr

    n, h = x.shape
    c = v1 - v0
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError("x and w must be bfloat16")
    if h % TILE_K or w.shape[1] != h:
        raise ValueError(f"H must be a multiple of {TILE_K} and match: x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}")
    if not (0 <= v0 < v1 <= w.shape[0]):
        raise ValueError(f"bad chunk [{v0}, {v1}) of {w.shape[0]} rows")
    if not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("x and w must be contiguous")
    lse = lse.to(torch.float32).contiguous()
    g = g.to(torch.float32).contiguous()
    tgt = target.to(torch.int32).contiguous()
    if dz is None:
        dz = dz_buffer(n, c, x.device)
    if dz.shape != (n, c) or dz.stride(1) != 1 or dz.stride(0) % 8 or dz.dtype != torch.bfloat16:
        raise ValueError("dz must be bf16 (N, C) with unit column stride and row stride % 8 == 0")
    if dz.data_ptr() % 16:
        raise ValueError("dz's data pointer must be 16-byte aligned (a column offset % 8 == 0)")
    if n == 0:
        return dz
    tiles = -(-n // TILE_M) * -(-c // TILE_N)
    if ctas <= 0:
        ctas = torch.cuda.get_device_properties(x.device).multi_processor_count
    ctas = min(ctas, tiles)
    compiled = compile_dlogits(h, stages, epilogue, group_m, exact_tail=exact_tail)
    gmem = cute.AddressSpace.gmem
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    compiled(
        make_ptr(cutlass.BFloat16, x.data_ptr(), gmem, assumed_align=16),
        make_ptr(cutlass.BFloat16, w.data_ptr() + v0 * h * 2, gmem, assumed_align=16),
        make_ptr(cutlass.Float32, lse.data_ptr(), gmem, assumed_align=16),
        make_ptr(cutlass.Float32, g.data_ptr(), gmem, assumed_align=16),
        make_ptr(cutlass.Int32, tgt.data_ptr(), gmem, assumed_align=16),
        make_ptr(cutlass.BFloat16, dz.data_ptr(), gmem, assumed_align=16),
        cutlass.Int32(n), cutlass.Int32(c), cutlass.Int32(dz.stride(0)), cutlass.Int32(v0),
        cutlass.Int32(ctas), cutlass.Int32(tma_store_cols(c, exact_tail)), stream,
    )
    return dz
