"""Consumer ping-pong variant of the CuTe DSL fused forward (issue 23 item 1: hide the epilogue).

A probe (nvidia-cutlass-dsl 4.2.1), not library code; the math is that of
``fused_forward.py``: for bf16 ``x`` (N, H), ``w`` (V, H), int32 ``target`` (N,) and
z = x @ w^T in fp32 (never written to memory) it computes, per row n and *column* c of the
(N, 2 * splits) partials (column c = 2 s + g: vocabulary split s, consumer warpgroup g),

    m[n, c] = max_{j in the tiles of (s, g)} z[n, j]
    e[n, c] = sum_{j in the tiles of (s, g)} exp(z[n, j] - m[n, c])
    t[n, c] = z[n, target[n]] if target[n] falls in a tile of (s, g) else 0

(m = -inf, e = t = 0 where (s, g) has no tile); ``merge_partials`` (the same torch merge as
``fused_forward.py``: max over columns, rescaled sum) gives lse and the per-row loss.

Why: in ``fused_forward.py`` both consumer warpgroups share one 128 x 256 tile (64 rows each),
so while they reduce the accumulator (the epilogue: ~900 instructions per thread per tile)
neither issues wgmma and the tensor cores idle (measured on the H100: ~1.06-1.09x cuBLAS,
level with the Triton forward). Here (CUTLASS's sm90 "pingpong" schedule, our code):

  * one CTA per (64-row block, vocabulary split), 384 threads, grid (N / 64, splits);
  * warpgroup 0 is the TMA producer (setmaxnreg 40; one elected thread issues the loads of
    x (64 x 64) and w (256 x 64) slabs, 40 KiB a stage, into a ``stages``-deep ring: 5 stages
    = 200 KiB). It walks the split's vocabulary tiles in order 0, 1, 2, ... (all k slabs of
    one tile, then the next): tile j belongs to consumer warpgroup j % 2, so the ring carries
    A0 B0 A1 B1 ...;
  * consumer warpgroups 1 and 2 (setmaxnreg 232) each own a WHOLE 64 x 256 tile (wgmma
    m64n256k16, 128 fp32 accumulators per thread, as before): warpgroup g runs the mainloop
    of tiles g, g + 2, g + 4, ... and skips the other's ring slots (its pipeline state jumps
    K = H / 64 slots after each tile; each ring slot is released by the 4 warps of its one
    consumer);
  * an ordering barrier (two named barriers, ids 2 and 3, 256 threads: ``bar.arrive`` by the
    warpgroup that finished issuing tile j's wgmma, ``bar.sync`` by the owner of tile j + 1
    before its first wgmma) keeps the two mainloops apart: while B issues tile j + 1's wgmma,
    A reduces tile j's accumulator, then waits for B's arrive before tile j + 2. The arrive is
    made only when a tile j + 1 exists, the wait only for j > 0, so every barrier phase
    completes. It also keeps the ring's parity waits valid (see the class docstring);
  * each warpgroup keeps its own running (max, sum exp2, target) for its two rows per thread
    in registers across its tiles and writes them as its own column of the partials (the
    "2x splits" choice: no shared-memory merge between the warpgroups, the torch merge
    combines them exactly as it combines splits).

The second tile, ``tile=(128, 128)``: one CTA per (128-row block, split), each warpgroup a
whole 128 x 128 tile on 2 x wgmma m64n128k16 per k block (still 128 accumulators per thread,
now 4 rows x 32 columns: ``consume4``), 32 KiB a stage (6 stages = 192 KiB), V % 128 suffices.

Memory traffic (smem fill per flop): 64 x 256 tiles read x once per (64-row block, vocabulary
tile) and w once per 64-row block (N / 64 times: twice the cooperative kernel's; 51 flop per
byte of fill instead of 85); 128 x 128 tiles read w N / 128 times and x V / 128 times (64 flop
per byte); 12 bytes per row and partial column written.

Constraints of this probe: N a multiple of the tile's rows, V of its columns, H a multiple of
64 (compile-time constant), x and w contiguous row-major bf16, 16-byte aligned; forward only.

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

TILE_K = 64
TILES = ((64, 256), (128, 128))  # a consumer warpgroup's whole tile (m64n256k16 / 2 x m64n128k16)
LOG2E = math.log2(math.e)
ORDER_BAR = 2  # named barriers ORDER_BAR + g: "warpgroup g issued its tile's last wgmma"


def _slot4(i: int) -> int:
    """Row slot (0..3) of accumulator element i of a thread in the 128 x 128 tile (2 x m64n128)."""
    return 2 * (i // 64) + (i // 2) % 2


class FusedForwardPingpongSm90:
    """Compile-time configuration: hidden size, ring depth, setmaxnreg split.

    The ordering barrier is not optional: besides keeping the two mainloops apart it is what
    makes the ring's parity waits valid. An mbarrier wait names a phase only by its parity, so
    a warpgroup may wait on slot i for count c only once the fill of count c - stages has
    completed (else an older phase of the same parity passes the wait: ABA). Warpgroup B's
    first wait (count K) would otherwise run while warpgroup A still consumes counts < K; with
    the barrier, every count below the first of a tile has been waited on by the other
    warpgroup before the tile starts."""

    def __init__(self, hidden: int, stages: int = 5,
                 producer_regs: int = 40, consumer_regs: int = 232, tile: tuple = (64, 256)):
        if tuple(tile) not in TILES:
            raise ValueError(f"tile must be one of {TILES}, got {tile}")
        self.tile_m, self.tile_n = tile
        if hidden % TILE_K:
            raise ValueError(f"hidden must be a multiple of {TILE_K}, got {hidden}")
        if 128 * producer_regs + 256 * consumer_regs > 65536:
            raise ValueError("setmaxnreg budget exceeds the 64K registers of an SM")
        self.hidden = hidden
        self.stages = stages
        self.producer_regs = producer_regs
        self.consumer_regs = consumer_regs
        self.k_tiles = hidden // TILE_K
        self.threads = 384
        self.ab_dtype = cutlass.BFloat16

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        x_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        t_ptr: cute.Pointer,
        m_ptr: cute.Pointer,
        e_ptr: cute.Pointer,
        g_ptr: cute.Pointer,
        n_rows: cutlass.Int32,
        vocab: cutlass.Int32,
        splits: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        H = self.hidden
        mX = cute.make_tensor(x_ptr, cute.make_layout((n_rows, H), stride=(H, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((vocab, H), stride=(H, 1)))
        mT = cute.make_tensor(t_ptr, cute.make_layout(n_rows))
        # (N, 2 * splits): column 2 s + g holds warpgroup g's statistics of split s
        part_layout = cute.make_layout((n_rows, splits * 2), stride=(splits * 2, 1))
        mM = cute.make_tensor(m_ptr, part_layout)
        mE = cute.make_tensor(e_ptr, part_layout)
        mG = cute.make_tensor(g_ptr, part_layout)

        # ONE warpgroup per tile: a 64 x 256 tiled MMA of a single m64n256k16 atom
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            cutlass.Float32,
            (1, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        kind = sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.ab_dtype, TILE_K)
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(kind, self.ab_dtype)
        sa_layout = cute.tile_to_shape(atom, (self.tile_m, TILE_K, self.stages), order=(0, 1, 2))
        sb_layout = cute.tile_to_shape(atom, (self.tile_n, TILE_K, self.stages), order=(0, 1, 2))

        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tma_x = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mX, cute.slice_(sa_layout, (None, None, 0)), (self.tile_m, TILE_K))
        tma_b, tma_w = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mW, cute.slice_(sb_layout, (None, None, 0)), (self.tile_n, TILE_K))

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(sa_layout)], 1024]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(sb_layout)], 1024]

        self.shared_storage = SharedStorage
        row_blocks = (n_rows + self.tile_m - 1) // self.tile_m
        self.kernel(tiled_mma, tma_a, tma_x, tma_b, tma_w, sa_layout, sb_layout,
                    mT, mM, mE, mG, vocab, splits).launch(
            grid=(row_blocks, splits, 1),
            block=(self.threads, 1, 1),
            stream=stream,  # dynamic smem: the SmemAllocator's total (~200 KiB at 5 stages)
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_a: cute.CopyAtom,
        mX: cute.Tensor,
        tma_b: cute.CopyAtom,
        mW: cute.Tensor,
        sa_layout: cute.ComposedLayout,
        sb_layout: cute.ComposedLayout,
        mT: cute.Tensor,
        mM: cute.Tensor,
        mE: cute.Tensor,
        mG: cute.Tensor,
        vocab: cutlass.Int32,
        splits: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bm, bs, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

        # vocabulary tiles of this split: [v_lo, v_lo + n_here)
        v_tiles = vocab // self.tile_n
        per_split = (v_tiles + splits - 1) // splits
        v_lo = bs * per_split
        n_here = cutlass.max(cutlass.min(per_split, v_tiles - v_lo), 0)
        total = n_here * self.k_tiles

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tx_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(sa_layout, (None, None, 0))) \
            + cute.size_in_bytes(self.ab_dtype, cute.slice_(sb_layout, (None, None, 0)))
        # each ring slot is read by ONE consumer warpgroup: 4 warps release it
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=tx_bytes,
        )
        sA = storage.sA.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sB = storage.sB.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)

        # global tiles: x (64, 64, k), w (256, 64, vocab tile, k)
        gX = cute.local_tile(mX, (self.tile_m, TILE_K), (bm, None))
        gW = cute.local_tile(mW, (self.tile_n, TILE_K), (None, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gX, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gW, 0, 2))

        if tidx < 128:
            cute.arch.warpgroup_reg_dealloc(self.producer_regs)
            if warp_idx == 0:
                self.produce(ring, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, v_lo, total)
        else:
            cute.arch.warpgroup_reg_alloc(self.consumer_regs)
            if cutlass.const_expr(self.tile_m == 64):
                self.consume(tiled_mma, ring, sA, sB, mT, mM, mE, mG, bm, bs, n_here,
                             tidx - 128, v_lo)
            else:
                self.consume4(tiled_mma, ring, sA, sB, mT, mM, mE, mG, bm, bs, n_here,
                              tidx - 128, v_lo)

    @cute.jit
    def produce(self, ring, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, v_lo, total):
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for _it in cutlass.range(total, unroll=1):
            ring.producer_acquire(state)
            kt = state.count % self.k_tiles
            vt = v_lo + state.count // self.k_tiles
            bar = ring.producer_get_barrier(state)
            cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar)
            cute.copy(tma_b, tBgB[(None, vt, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar)
            ring.producer_commit(state)
            state.advance()

    @cute.jit
    def skip_tile(self, state):
        """Move a consumer's ring state past the other warpgroup's tile (K slots)."""
        for _ in cutlass.range_constexpr(self.k_tiles % self.stages):
            state.advance()
        if cutlass.const_expr((self.k_tiles // self.stages) % 2 == 1):
            state._phase = state._phase ^ 1
        state._count = state._count + (self.k_tiles - self.k_tiles % self.stages)

    @cute.jit
    def consume(self, tiled_mma, ring, sA, sB, mT, mM, mE, mG, bm, bs, n_here, ctid, v_lo):
        wg = ctid // 128  # 0: tiles 0, 2, 4, ...; 1: tiles 1, 3, 5, ...
        lt = ctid % 128
        thr_wg = tiled_mma.get_slice(0)
        thr = tiled_mma.get_slice(lt)
        tCsA = thr_wg.partition_A(sA)
        tCsB = thr_wg.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        # (row, col) of every accumulator element of this thread inside its tile
        tCcC = thr.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        acc = cute.make_fragment(tCcC.shape, cutlass.Float32)
        n_acc = cute.size(acc)
        k_blocks = cute.size(tCrA, mode=[2])
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

        # the thread's two rows (wgmma C layout: element i sits on row slot (i // 2) % 2)
        row0 = bm * self.tile_m + tCcC[0][0]
        row1 = bm * self.tile_m + tCcC[2][0]
        tgt0 = mT[row0]
        tgt1 = mT[row1]
        neg_inf = cutlass.Float32(-math.inf)
        m0, m1 = neg_inf, neg_inf
        e0, e1 = cutlass.Float32(0.0), cutlass.Float32(0.0)
        g0, g1 = cutlass.Float32(0.0), cutlass.Float32(0.0)

        # consumer ring states start at slot wg * K (warpgroup B's first tile is tile 1)
        c0 = wg * self.k_tiles
        read = pipeline.PipelineState(self.stages, c0, c0 % self.stages, (c0 // self.stages) % 2)
        release = pipeline.PipelineState(self.stages, c0, c0 % self.stages,
                                         (c0 // self.stages) % 2)
        mine = (n_here - wg + 1) // 2
        wait_bar = ORDER_BAR + 1 - wg  # the other warpgroup's "issued" barrier
        arrive_bar = ORDER_BAR + wg

        for it in cutlass.range(mine, unroll=1):
            j = it * 2 + wg  # the split's tile index
            acc.fill(0.0)
            if j > 0:  # wait until the owner of tile j - 1 issued its last wgmma
                cute.arch.barrier(barrier_id=wait_bar, number_of_threads=256)
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
            if j + 1 < n_here:  # let the owner of tile j + 1 start its mainloop
                cute.arch.barrier_arrive(barrier_id=arrive_bar, number_of_threads=256)
            cute.nvgpu.warpgroup.wait_group(0)
            ring.consumer_release(release)
            release.advance()
            # the other warpgroup's tile j + 1 occupies the next K ring slots
            self.skip_tile(read)
            self.skip_tile(release)

            # epilogue (under the other warpgroup's mainloop): online (max, sum exp) per row
            # and the target logit; no logits written
            col0 = (v_lo + j) * self.tile_n
            t0 = neg_inf
            t1 = neg_inf
            for i in cutlass.range_constexpr(n_acc):
                if cutlass.const_expr((i // 2) % 2 == 0):
                    t0 = cute.arch.fmax(t0, acc[i])
                else:
                    t1 = cute.arch.fmax(t1, acc[i])
            for off in cutlass.range_constexpr(2):
                t0 = cute.arch.fmax(t0, cute.arch.shuffle_sync_bfly(t0, 1 << off))
                t1 = cute.arch.fmax(t1, cute.arch.shuffle_sync_bfly(t1, 1 << off))
            n0 = cute.arch.fmax(m0, t0)
            n1 = cute.arch.fmax(m1, t1)
            s0 = cutlass.Float32(0.0)
            s1 = cutlass.Float32(0.0)
            b0 = n0 * LOG2E
            b1 = n1 * LOG2E
            for i in cutlass.range_constexpr(n_acc):
                z = acc[i]
                col = col0 + tCcC[i][1]
                if cutlass.const_expr((i // 2) % 2 == 0):
                    s0 = s0 + cute.arch.exp2(z * LOG2E - b0)
                    if col == tgt0:
                        g0 = z
                else:
                    s1 = s1 + cute.arch.exp2(z * LOG2E - b1)
                    if col == tgt1:
                        g1 = z
            for off in cutlass.range_constexpr(2):
                s0 = s0 + cute.arch.shuffle_sync_bfly(s0, 1 << off)
                s1 = s1 + cute.arch.shuffle_sync_bfly(s1, 1 << off)
            e0 = e0 * cute.arch.exp2(m0 * LOG2E - b0) + s0
            e1 = e1 * cute.arch.exp2(m1 * LOG2E - b1) + s1
            m0 = n0
            m1 = n1

        # the target logit sits in one thread of the quad (others hold 0): sum the quad
        for off in cutlass.range_constexpr(2):
            g0 = g0 + cute.arch.shuffle_sync_bfly(g0, 1 << off)
            g1 = g1 + cute.arch.shuffle_sync_bfly(g1, 1 << off)
        col = bs * 2 + wg
        if lt % 4 == 0:
            mM[row0, col] = m0
            mE[row0, col] = e0
            mG[row0, col] = g0
            mM[row1, col] = m1
            mE[row1, col] = e1
            mG[row1, col] = g1


    @cute.jit
    def consume4(self, tiled_mma, ring, sA, sB, mT, mM, mE, mG, bm, bs, n_here, ctid, v_lo):
        """``consume`` for the 128 x 128 tile (2 x m64n128k16 per k block): each thread holds
        4 rows x 32 columns; element i lies on row slot 2 (i // 64) + (i // 2) % 2 (checked on
        the layout algebra by check_compile.py). Same ring / ordering protocol."""
        wg = ctid // 128
        lt = ctid % 128
        thr_wg = tiled_mma.get_slice(0)
        thr = tiled_mma.get_slice(lt)
        tCsA = thr_wg.partition_A(sA)
        tCsB = thr_wg.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        tCcC = thr.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        acc = cute.make_fragment(tCcC.shape, cutlass.Float32)
        n_acc = cute.size(acc)
        k_blocks = cute.size(tCrA, mode=[2])
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

        first = [0, 2, 64, 66]  # an element of each row slot
        rows = [bm * self.tile_m + tCcC[first[r]][0] for r in range(4)]
        tgts = [mT[rows[r]] for r in range(4)]
        neg_inf = cutlass.Float32(-math.inf)
        zero = cutlass.Float32(0.0)
        m0, m1, m2, m3 = neg_inf, neg_inf, neg_inf, neg_inf
        e0, e1, e2, e3 = zero, zero, zero, zero
        g0, g1, g2, g3 = zero, zero, zero, zero

        c0 = wg * self.k_tiles
        read = pipeline.PipelineState(self.stages, c0, c0 % self.stages, (c0 // self.stages) % 2)
        release = pipeline.PipelineState(self.stages, c0, c0 % self.stages,
                                         (c0 // self.stages) % 2)
        mine = (n_here - wg + 1) // 2
        wait_bar = ORDER_BAR + 1 - wg
        arrive_bar = ORDER_BAR + wg

        for it in cutlass.range(mine, unroll=1):
            j = it * 2 + wg
            acc.fill(0.0)
            if j > 0:
                cute.arch.barrier(barrier_id=wait_bar, number_of_threads=256)
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
            if j + 1 < n_here:
                cute.arch.barrier_arrive(barrier_id=arrive_bar, number_of_threads=256)
            cute.nvgpu.warpgroup.wait_group(0)
            ring.consumer_release(release)
            release.advance()
            self.skip_tile(read)
            self.skip_tile(release)

            # epilogue: 4 rows per thread, the quad (4 lanes) shares them
            col0 = (v_lo + j) * self.tile_n
            mo = [m0, m1, m2, m3]
            eo = [e0, e1, e2, e3]
            go = [g0, g1, g2, g3]
            t = [neg_inf, neg_inf, neg_inf, neg_inf]
            for i in cutlass.range_constexpr(n_acc):
                t[_slot4(i)] = cute.arch.fmax(t[_slot4(i)], acc[i])
            for r in cutlass.range_constexpr(4):
                for off in cutlass.range_constexpr(2):
                    t[r] = cute.arch.fmax(t[r], cute.arch.shuffle_sync_bfly(t[r], 1 << off))
            nn = [cute.arch.fmax(mo[r], t[r]) for r in range(4)]
            b = [nn[r] * LOG2E for r in range(4)]
            sm = [zero, zero, zero, zero]
            for i in cutlass.range_constexpr(n_acc):
                z = acc[i]
                r = _slot4(i)
                sm[r] = sm[r] + cute.arch.exp2(z * LOG2E - b[r])
                go[r] = cutlass.select_(col0 + tCcC[i][1] == tgts[r], z, go[r])
            for r in cutlass.range_constexpr(4):
                for off in cutlass.range_constexpr(2):
                    sm[r] = sm[r] + cute.arch.shuffle_sync_bfly(sm[r], 1 << off)
                eo[r] = eo[r] * cute.arch.exp2(mo[r] * LOG2E - b[r]) + sm[r]
            m0, m1, m2, m3 = nn[0], nn[1], nn[2], nn[3]
            e0, e1, e2, e3 = eo[0], eo[1], eo[2], eo[3]
            g0, g1, g2, g3 = go[0], go[1], go[2], go[3]

        go = [g0, g1, g2, g3]
        for r in cutlass.range_constexpr(4):
            for off in cutlass.range_constexpr(2):
                go[r] = go[r] + cute.arch.shuffle_sync_bfly(go[r], 1 << off)
        col = bs * 2 + wg
        if lt % 4 == 0:
            mo = [m0, m1, m2, m3]
            eo = [e0, e1, e2, e3]
            for r in cutlass.range_constexpr(4):
                mM[rows[r], col] = mo[r]
                mE[rows[r], col] = eo[r]
                mG[rows[r], col] = go[r]


_COMPILED: dict = {}


def compile_forward(hidden: int, stages: int = 5, regs: tuple = (40, 232), tile: tuple = (64, 256),
                    stream=None):
    """cute.compile the kernel for one hidden size (N, V, splits stay runtime values).

    The pointers given to cute.compile only carry types (dtype, address space, alignment):
    dummy addresses, so the whole lowering also runs on a machine without a GPU."""
    from cutlass.cute.runtime import make_ptr

    key = (hidden, stages, tuple(regs), tuple(tile))
    if key in _COMPILED:
        return _COMPILED[key]
    gmem = cute.AddressSpace.gmem
    base = 1 << 20
    ptrs = [
        make_ptr(cutlass.BFloat16, base, gmem, assumed_align=16),
        make_ptr(cutlass.BFloat16, base * 2, gmem, assumed_align=16),
        make_ptr(cutlass.Int32, base * 3, gmem, assumed_align=16),
        make_ptr(cutlass.Float32, base * 4, gmem, assumed_align=16),
        make_ptr(cutlass.Float32, base * 5, gmem, assumed_align=16),
        make_ptr(cutlass.Float32, base * 6, gmem, assumed_align=16),
    ]
    kern = FusedForwardPingpongSm90(hidden, stages, *regs, tile=tuple(tile))
    stream = cuda.CUstream(0) if stream is None else stream
    compiled = cute.compile(kern, *ptrs, cutlass.Int32(tile[0]), cutlass.Int32(tile[1]),
                            cutlass.Int32(1), stream)
    _COMPILED[key] = compiled
    return compiled


def fused_forward_partials(x, w, target, splits: int, stages: int = 5, regs: tuple = (40, 232),
                           tile: tuple = (64, 256)):
    """Run the kernel on CUDA torch tensors; returns (m, e, t), each (N, 2 * splits) fp32
    (column 2 s + g: split s, consumer warpgroup g; ``merge_partials`` combines them)."""
    torch = importlib.import_module("torch")
    from cutlass.cute.runtime import make_ptr

    n, h = x.shape
    v = w.shape[0]
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError("x and w must be bfloat16")
    tm, tn = tile
    if n % tm or v % tn or h % TILE_K or w.shape[1] != h:
        raise ValueError(f"shapes must be multiples of ({tm}, {tn}, {TILE_K}): "
                         f"x {tuple(x.shape)}, w {tuple(w.shape)}")
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    x = x.contiguous()
    w = w.contiguous()
    tgt = target.to(torch.int32).contiguous()
    parts = torch.empty(3, n, 2 * splits, device=x.device, dtype=torch.float32)
    compiled = compile_forward(h, stages, regs, tile)
    gmem = cute.AddressSpace.gmem
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    compiled(
        make_ptr(cutlass.BFloat16, x.data_ptr(), gmem, assumed_align=16),
        make_ptr(cutlass.BFloat16, w.data_ptr(), gmem, assumed_align=16),
        make_ptr(cutlass.Int32, tgt.data_ptr(), gmem, assumed_align=16),
        make_ptr(cutlass.Float32, parts[0].data_ptr(), gmem, assumed_align=16),
        make_ptr(cutlass.Float32, parts[1].data_ptr(), gmem, assumed_align=16),
        make_ptr(cutlass.Float32, parts[2].data_ptr(), gmem, assumed_align=16),
        cutlass.Int32(n), cutlass.Int32(v), cutlass.Int32(splits), stream,
    )
    return parts[0], parts[1], parts[2]


def merge_partials(m, e, t, target, ignore_index: int = -100):
    """Torch merge of (N, columns) partials: (lse (N,), per-row loss (N,), 0 where ignored).

    Columns with no tile (m = -inf, e = 0) contribute e * exp(-inf - max) = 0."""
    torch = importlib.import_module("torch")
    mx = m.max(dim=1, keepdim=True).values
    lse = mx.squeeze(1) + torch.log((e * torch.exp(m - mx)).sum(dim=1))
    zt = t.sum(dim=1)
    loss = torch.where(target == ignore_index, torch.zeros_like(lse), lse - zt)
    return lse, loss
