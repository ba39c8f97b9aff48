"""The fused linear forward statistics kernel for Hopper in the CuTe DSL (sm_90a).

For x (N, H) and W (V, H) (bf16 or fp16, row-major, unit last stride, H % 8 == 0), an
int32 target (N,) and a runtime fp32 ``scale`` > 0, with a = scale * (x W^T) in fp32
(never written to memory), it writes per vocabulary split s and row n, into (splits, N)
fp32 partials laid out as ``triton_lib.launch.partials`` (row stride N):

    m[s, n] = max_{j in s} a[n, j]
    e[s, n] = sum_{j in s} exp(a[n, j] - m[s, n])
    t[s, n] = a[n, target[n]] if target[n] falls in split s, else 0
    q[s, n] = sum_{j in s} a[n, j]                                  (SMOOTH: label smoothing)
    u[s, n] = sum_{j in s} exp(a[n, j] - m[s, n]) (a[n, j] - m[s, n])  (ENTROPY)

exactly the partials of ``triton_lib.lce_kernels.forward_stats_kernel`` (m, s, z_t,
smooth without class weights; scale 1) and of ``triton_lib.log_probs_kernels.
logp_forward_kernel`` (m, s, a_t, u; scale 1/T), so their merges and epilogues
(``ce_epilogue.forward_loss``, ``log_probs_epilogue.forward_outputs``) consume them as
they are. A split is a contiguous run of 256-column vocabulary tiles; an empty split
writes (-inf, 0, 0, 0, 0), as the Triton kernels do.

Ragged shapes: any N >= 1, V >= 1, H % 8 == 0 (TMA's 16-byte stride rule). TMA zero-fills
the loads past N, V and H (so the k tail past H adds 0, and columns past V are 0 in the
accumulator: they add 0 to q); the epilogue sets columns >= V to -inf on the last,
ragged, vocabulary tile only (a runtime branch) and stores rows < N only. A target
outside [0, V) (ignore_index) matches no column.

Memory traffic: x and W read through TMA once per (128-row block, 256-column tile) pair
(x re-read from L2 per vocabulary tile, W per row block), 4 to 5 fp32 per (row, split)
written; no (N, V) tensor.

Structure (one CTA per (128-row block, split), grid (ceil(N/128), splits): row blocks
fastest; or with ``group`` = G > 0 a 1-D grid in ``triton_lib.gemm.grouped_tile``'s order, G
row blocks at a time (row block fastest inside a group, then the split), so that the CTAs in
flight share few x blocks (G = 1: split fastest)):
  * warpgroup 0 produces: one elected thread of warp 0 issues TMA loads of x (128 x 64)
    and W (256 x 64) tiles into a ``stages``-deep shared-memory ring (48 KiB a stage)
    guarded by mbarriers (``cutlass.pipeline.PipelineTmaAsync``); setmaxnreg 40.
  * warpgroups 1 and 2 consume (setmaxnreg 232): each owns 64 rows of the 128 x 256
    tile, wgmma m64n256k16 (4 per 64-wide k slab), one group in flight, a stage released
    when the group that read it retired.
  * after a tile's last k slab each consumer thread reduces its accumulator fragment
    (2 rows x 64 columns, wgmma C layout: element i on row slot (i // 2) % 2, quads of
    lanes share rows) into online (max, sum exp2, entropy term) per row with quad
    shuffles; statistics stay in registers across the split's tiles.
``specialised=False``: 256 threads, warp 0 refills the ring only into released slots.

The DSL's preprocessor re-executes this module's imports when it compiles a kernel:
this module imports cutlass only (never torch). Measured origin: the probe
``fused_forward.py`` probe, git history (N % 128 = V % 256 = H % 64 = 0, bf16, no scale/
smoothing/entropy), generalised here.
"""

from __future__ import annotations

import importlib
import math
import warnings

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils

TILE_M, TILE_N, TILE_K = 128, 256, 64
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
#: exp2 argument floor with ENTROPY: 2^-256 is 0 in fp32, and p * y stays 0 (not 0 * -inf)
#: in masked columns.
_Y_FLOOR = -256.0
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}

# Names that moved between DSL releases (the same operations; 4.2.1 has only the old names,
# 4.7 removed ``cute.make_fragment``, 4.8 deprecates the others' old homes):
#: a register tensor of a shape (4.2: ``cute.make_fragment``)
_make_rmem_tensor = getattr(cute, "make_rmem_tensor", None) or getattr(cute, "make_fragment")
#: setmaxnreg.inc / .dec (4.2: ``warpgroup_reg_alloc`` / ``warpgroup_reg_dealloc``)
_reg_increase = getattr(cute.arch, "setmaxregister_increase", None) or getattr(cute.arch, "warpgroup_reg_alloc")
_reg_decrease = getattr(cute.arch, "setmaxregister_decrease", None) or getattr(cute.arch, "warpgroup_reg_dealloc")
# 4.8: cutlass.tensor_utils.LayoutEnum, cutlass.memory.SmemAllocator (4.2: in cutlass.utils).
# importlib, not import statements: the DSL's preprocessor re-runs every import statement of
# this module (even one under try) when it compiles, and 4.2 has neither module.
try:
    _LayoutEnum = importlib.import_module("cutlass.tensor_utils").LayoutEnum
    _SmemAllocator = importlib.import_module("cutlass.memory").SmemAllocator
except (ImportError, AttributeError):
    _LayoutEnum, _SmemAllocator = utils.LayoutEnum, utils.SmemAllocator


class ForwardStatsSm90:
    """Compile-time configuration: hidden size, operand dtype, optional statistics, pipeline."""

    def __init__(self, hidden: int, dtype: str = "bfloat16", smooth: bool = False, entropy: bool = False,
                 stages: int = 4, specialised: bool = True, group: int = 0, keep_block: int = 0):
        if hidden < 8 or hidden % 8:
            raise ValueError(f"hidden must be a positive multiple of 8 (TMA strides), got {hidden}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.hidden = hidden
        self.stages = stages
        self.specialised = specialised
        self.group = group
        if keep_block and (keep_block % 8 or TILE_N % keep_block):
            raise ValueError(f"keep_block must divide {TILE_N} (and be a multiple of 8), got {keep_block}")
        self.keep_block = keep_block  # 0: nothing kept; else the kept maxima's column block
        self.smooth = smooth
        self.entropy = entropy
        self.k_tiles = (hidden + TILE_K - 1) // TILE_K
        self.consumer_wgs = 2
        self.threads = 128 * (self.consumer_wgs + (1 if specialised else 0))
        self.consumer_base = 128 if specialised else 0
        self.ab_dtype = DTYPES[dtype]

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
        q_ptr: cute.Pointer,
        u_ptr: cute.Pointer,
        k_ptr: cute.Pointer,
        km_ptr: cute.Pointer,
        scale: cutlass.Float32,
        n_rows: cutlass.Int32,
        vocab: cutlass.Int32,
        splits: cutlass.Int32,
        keep_cols: cutlass.Int32,
        keep_stride: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        H = self.hidden
        mX = cute.make_tensor(x_ptr, cute.make_layout((n_rows, H), stride=(H, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((vocab, H), stride=(H, 1)))
        mT = cute.make_tensor(t_ptr, cute.make_layout(n_rows))
        part_layout = cute.make_layout((splits, n_rows), stride=(n_rows, 1))
        parts = tuple(cute.make_tensor(p, part_layout) for p in (m_ptr, e_ptr, g_ptr, q_ptr, u_ptr))
        mK, mKM = parts[0], parts[0]  # (unused without KEEP)
        if cutlass.const_expr(self.keep_block > 0):
            mK = cute.make_tensor(k_ptr, cute.make_layout((n_rows, keep_cols), stride=(keep_stride, 1)))
            keep_blocks = (keep_cols + self.keep_block - 1) // self.keep_block
            mKM = cute.make_tensor(km_ptr, cute.make_layout((keep_blocks, n_rows), stride=(n_rows, 1)))

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            _LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            _LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            cutlass.Float32,
            (self.consumer_wgs, 1, 1),
            tiler_mn=(64, TILE_N),
        )
        kind = sm90_utils.get_smem_layout_atom(_LayoutEnum.ROW_MAJOR, self.ab_dtype, TILE_K)
        atom = cute.nvgpu.warpgroup.make_smem_layout_atom(kind, self.ab_dtype)
        sa_layout = cute.tile_to_shape(atom, (TILE_M, TILE_K, self.stages), order=(0, 1, 2))
        sb_layout = cute.tile_to_shape(atom, (TILE_N, TILE_K, self.stages), order=(0, 1, 2))

        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tma_x = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mX, cute.slice_(sa_layout, (None, None, 0)), (TILE_M, TILE_K))
        tma_b, tma_w = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mW, cute.slice_(sb_layout, (None, None, 0)), (TILE_N, TILE_K))

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(sa_layout)], 1024]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(sb_layout)], 1024]

        self.shared_storage = SharedStorage
        row_blocks = (n_rows + TILE_M - 1) // TILE_M
        grid = (row_blocks * splits, 1, 1) if cutlass.const_expr(self.group > 0) else (row_blocks, splits, 1)
        self.kernel(tiled_mma, tma_a, tma_x, tma_b, tma_w, sa_layout, sb_layout,
                    mT, parts[0], parts[1], parts[2], parts[3], parts[4], mK, mKM,
                    scale, n_rows, vocab, splits, keep_cols).launch(
            grid=grid,
            block=(self.threads, 1, 1),
            stream=stream,  # dynamic smem: the DSL takes the SmemAllocator's total (~193 KiB)
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
        mQ: cute.Tensor,
        mU: cute.Tensor,
        mK: cute.Tensor,
        mKM: cute.Tensor,
        scale: cutlass.Float32,
        n_rows: cutlass.Int32,
        vocab: cutlass.Int32,
        splits: cutlass.Int32,
        keep_cols: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bm, bs, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.group > 0):  # grouped order (triton_lib.gemm.grouped_tile)
            pid = bm
            row_blocks = (n_rows + TILE_M - 1) // TILE_M
            per_group = self.group * splits
            first = (pid // per_group) * self.group
            size = cutlass.min(row_blocks - first, self.group)
            bm = first + (pid % per_group) % size
            bs = (pid % per_group) // size
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)

        # vocabulary tiles of this split: [v_lo, v_lo + n_here)
        v_tiles = (vocab + TILE_N - 1) // TILE_N
        per_split = (v_tiles + splits - 1) // splits
        v_lo = bs * per_split
        n_here = cutlass.max(cutlass.min(per_split, v_tiles - v_lo), 0)
        total = n_here * self.k_tiles

        smem = _SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tx_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(sa_layout, (None, None, 0))) \
            + cute.size_in_bytes(self.ab_dtype, cute.slice_(sb_layout, (None, None, 0)))
        consumer_warps = self.consumer_wgs * 4
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
            tx_count=tx_bytes,
        )
        sA = storage.sA.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sB = storage.sB.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)

        # global tiles: x (128, 64, k), w (256, 64, vocab tile, k); TMA zero-fills past N, V, H
        gX = cute.local_tile(mX, (TILE_M, TILE_K), (bm, None))
        gW = cute.local_tile(mW, (TILE_N, TILE_K), (None, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gX, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gW, 0, 2))

        outs = (mT, mM, mE, mG, mQ, mU, scale, n_rows, vocab, (mK, mKM, keep_cols))
        is_producer_wg = tidx < self.consumer_base
        if cutlass.const_expr(self.specialised):
            if is_producer_wg:
                _reg_decrease(40)
                if warp_idx == 0:
                    self.produce(ring, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, v_lo, total)
            else:
                _reg_increase(232)
                self.consume(tiled_mma, ring, sA, sB, outs, bm, bs, v_lo, n_here,
                             tidx - self.consumer_base, warp_idx, None)
        else:
            self.consume(tiled_mma, ring, sA, sB, outs, bm, bs, v_lo, n_here,
                         tidx, warp_idx, (tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, total))

    @cute.jit
    def produce(self, ring, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, v_lo, total):
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for _it in cutlass.range(total, unroll=1):
            self.load_stage(ring, state, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, v_lo)
            state.advance()

    @cute.jit
    def load_stage(self, ring, state, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, v_lo):
        ring.producer_acquire(state)
        kt = state.count % self.k_tiles
        vt = v_lo + state.count // self.k_tiles
        bar = ring.producer_get_barrier(state)
        cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar)
        cute.copy(tma_b, tBgB[(None, vt, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar)
        ring.producer_commit(state)

    @cute.jit
    def consume(self, tiled_mma, ring, sA, sB, outs, bm, bs, v_lo, n_here,
                ctid, warp_idx, inline_producer):
        mT, mM, mE, mG, mQ, mU, scale, n_rows, vocab, kept = outs
        wg = ctid // 128
        thr_wg = tiled_mma.get_slice(wg * 128)
        thr = tiled_mma.get_slice(ctid)
        tCsA = thr_wg.partition_A(sA)
        tCsB = thr_wg.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA)
        tCrB = tiled_mma.make_fragment_B(tCsB)
        # (row, col) of every accumulator element of this thread inside the 128 x 256 tile
        tCcC = thr.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
        acc = _make_rmem_tensor(tCcC.shape, cutlass.Float32)
        n_acc = cute.size(acc)
        k_blocks = cute.size(tCrA, mode=[2])
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)

        # the thread's two rows (wgmma C layout: element i sits on row slot (i // 2) % 2);
        # a row past N or a target outside [0, V) gets -1 (matches no column)
        row0 = bm * TILE_M + tCcC[0][0]
        row1 = bm * TILE_M + tCcC[2][0]
        tgt0 = cutlass.Int32(-1)
        tgt1 = cutlass.Int32(-1)
        if row0 < n_rows:
            tgt0 = mT[row0]
        if row1 < n_rows:
            tgt1 = mT[row1]
        if tgt0 >= vocab:
            tgt0 = cutlass.Int32(-1)
        if tgt1 >= vocab:
            tgt1 = cutlass.Int32(-1)
        neg_inf = cutlass.Float32(-math.inf)
        c2 = scale * LOG2E  # a * log2(e) = acc * c2
        m0, m1 = neg_inf, neg_inf
        e0, e1 = cutlass.Float32(0.0), cutlass.Float32(0.0)
        g0, g1 = cutlass.Float32(0.0), cutlass.Float32(0.0)
        q0, q1 = cutlass.Float32(0.0), cutlass.Float32(0.0)
        u0, u1 = cutlass.Float32(0.0), cutlass.Float32(0.0)

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if cutlass.const_expr(inline_producer is not None):
            tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, total = inline_producer
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            if warp_idx == 0:
                for _ in cutlass.range(cutlass.min(self.stages, total), unroll=1):
                    self.load_stage(ring, prod, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, v_lo)
                    prod.advance()

        for vt in cutlass.range(n_here, unroll=1):
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
                if cutlass.const_expr(inline_producer is not None):
                    # refill only a slot already released: a blocked warp 0 would stall
                    # its warpgroup's next wgmma (sync.aligned) and deadlock the CTA
                    if warp_idx == 0 and prod.count < total \
                            and prod.count < release.count + self.stages:
                        self.load_stage(ring, prod, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, v_lo)
                        prod.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            ring.consumer_release(release)
            release.advance()

            # ---- epilogue: no logits written
            col0 = (v_lo + vt) * TILE_N
            if cutlass.const_expr(self.smooth):  # columns past V are 0 (TMA zero fill)
                for i in cutlass.range_constexpr(n_acc):
                    if cutlass.const_expr((i // 2) % 2 == 0):
                        q0 = q0 + acc[i]
                    else:
                        q1 = q1 + acc[i]
            # the ragged last tile masks columns >= V (a second copy of the epilogue: masking
            # the accumulator in place under a runtime branch spills 44 bytes at 168 registers)
            state = (m0, m1, e0, e1, g0, g1, u0, u1)
            if cutlass.const_expr(self.keep_block > 0):
                # KEEP: tiles starting below keep_cols also store exp(a - m) and m (two more
                # epilogue copies, chosen by a runtime branch, so that other tiles pay nothing)
                if col0 < kept[2]:
                    m0, m1, e0, e1, g0, g1, u0, u1 = self.epilogue(
                        acc, tCcC, col0, vocab, tgt0, tgt1, c2, scale, state, kept, (row0, row1, ctid % 4 == 0),
                        n_rows)
                else:
                    m0, m1, e0, e1, g0, g1, u0, u1 = self.epilogue(
                        acc, tCcC, col0, vocab, tgt0, tgt1, c2, scale, state)
            else:
                m0, m1, e0, e1, g0, g1, u0, u1 = self.epilogue(acc, tCcC, col0, vocab, tgt0, tgt1, c2, scale, state)

        # the target logit sits in one thread of the quad (others hold 0): sum the quad
        for off in cutlass.range_constexpr(2):
            g0 = g0 + cute.arch.shuffle_sync_bfly(g0, 1 << off)
            g1 = g1 + cute.arch.shuffle_sync_bfly(g1, 1 << off)
            if cutlass.const_expr(self.smooth):
                q0 = q0 + cute.arch.shuffle_sync_bfly(q0, 1 << off)
                q1 = q1 + cute.arch.shuffle_sync_bfly(q1, 1 << off)
        if ctid % 4 == 0:
            outs_row = (mM, mE, mG, mQ, mU, bs, scale, n_rows)
            self.store_row(outs_row, row0, (m0, e0, g0, q0, u0))
            self.store_row(outs_row, row1, (m1, e1, g1, q1, u1))

    @cute.jit
    def store_row(self, outs_row, row, stats):
        """One row's statistics (m, e, g, q, u) into slice ``bs`` of the outputs, where the
        row exists (row < n_rows): g and q times ``scale``, q with label smoothing only,
        u with the entropy only."""
        mM, mE, mG, mQ, mU, bs, scale, n_rows = outs_row
        m, e, g, q, u = stats
        if row < n_rows:
            mM[bs, row] = m
            mE[bs, row] = e
            mG[bs, row] = g * scale
            if cutlass.const_expr(self.smooth):
                mQ[bs, row] = q * scale
            if cutlass.const_expr(self.entropy):
                mU[bs, row] = u


    @cute.jit
    def epilogue(self, acc, tCcC, col0, vocab, tgt0, tgt1, c2, scale, state, kept=None, rows=None, n_rows=None):
        """``tile_update`` of one tile: the ragged last tile (columns >= V) through its own
        copy (a runtime branch)."""
        m0, m1, e0, e1, g0, g1, u0, u1 = state
        if col0 + TILE_N > vocab:
            m0, m1, e0, e1, g0, g1, u0, u1 = self.tile_update(
                acc, tCcC, col0, vocab, tgt0, tgt1, c2, scale, state, True, kept, rows, n_rows)
        else:
            m0, m1, e0, e1, g0, g1, u0, u1 = self.tile_update(
                acc, tCcC, col0, vocab, tgt0, tgt1, c2, scale, state, False, kept, rows, n_rows)
        return m0, m1, e0, e1, g0, g1, u0, u1

    @cute.jit
    def tile_update(self, acc, tCcC, col0, vocab, tgt0, tgt1, c2, scale, state, masked: cutlass.Constexpr,
                    kept=None, rows=None, n_rows=None):
        """One vocabulary tile's online update of the two rows' (m, e, g, u); ``masked``:
        columns >= V count as -inf (the ragged last tile). ``kept`` = (keep, keep_max,
        keep_cols) (a tile starting below keep_cols): also store p = exp(a - m') for columns
        < keep_cols of rows < N into keep (operand dtype) and m' (the new running max, a's
        units) into keep_max[block, row] for each ``keep_block``-column block of the tile
        that starts below keep_cols (one lane of each quad: ``rows`` = (row0, row1, lead))."""
        m0, m1, e0, e1, g0, g1, u0, u1 = state
        neg_inf = cutlass.Float32(-math.inf)
        n_acc = cute.size(acc)
        t0 = neg_inf
        t1 = neg_inf
        for i in cutlass.range_constexpr(n_acc):
            z = acc[i]
            if cutlass.const_expr(masked):
                if col0 + tCcC[i][1] >= vocab:
                    z = neg_inf
            if cutlass.const_expr((i // 2) % 2 == 0):
                t0 = cute.arch.fmax(t0, z)
            else:
                t1 = cute.arch.fmax(t1, z)
        for off in cutlass.range_constexpr(2):
            t0 = cute.arch.fmax(t0, cute.arch.shuffle_sync_bfly(t0, 1 << off))
            t1 = cute.arch.fmax(t1, cute.arch.shuffle_sync_bfly(t1, 1 << off))
        # scale > 0: max(scale * acc) = scale * max(acc); a tile has a column < V
        n0 = cute.arch.fmax(m0, t0 * scale)
        n1 = cute.arch.fmax(m1, t1 * scale)
        if cutlass.const_expr(kept is not None):
            mK, mKM, keep_cols = kept
            row0, row1, lead = rows
            if lead:
                for j in cutlass.range_constexpr(TILE_N // self.keep_block):
                    c = col0 + j * self.keep_block
                    if c < keep_cols:
                        if row0 < n_rows:
                            mKM[c // self.keep_block, row0] = n0
                        if row1 < n_rows:
                            mKM[c // self.keep_block, row1] = n1
        s0 = cutlass.Float32(0.0)
        s1 = cutlass.Float32(0.0)
        y0 = cutlass.Float32(0.0)
        y1 = cutlass.Float32(0.0)
        b0 = n0 * LOG2E
        b1 = n1 * LOG2E
        for i in cutlass.range_constexpr(n_acc):
            z = acc[i]
            col = col0 + tCcC[i][1]
            if cutlass.const_expr(masked):
                if col >= vocab:
                    z = neg_inf
            y = z * c2 - (b0 if (i // 2) % 2 == 0 else b1)
            if cutlass.const_expr(self.entropy):
                y = cute.arch.fmax(y, cutlass.Float32(_Y_FLOOR))
            p = cute.arch.exp2(y)
            if cutlass.const_expr(kept is not None):
                if col < keep_cols:
                    if cutlass.const_expr((i // 2) % 2 == 0):
                        if row0 < n_rows:
                            mK[row0, col] = p.to(self.ab_dtype)
                    else:
                        if row1 < n_rows:
                            mK[row1, col] = p.to(self.ab_dtype)
            if cutlass.const_expr((i // 2) % 2 == 0):
                s0 = s0 + p
                if cutlass.const_expr(self.entropy):
                    y0 = y0 + p * y
                if col == tgt0:
                    g0 = z
            else:
                s1 = s1 + p
                if cutlass.const_expr(self.entropy):
                    y1 = y1 + p * y
                if col == tgt1:
                    g1 = z
        for off in cutlass.range_constexpr(2):
            s0 = s0 + cute.arch.shuffle_sync_bfly(s0, 1 << off)
            s1 = s1 + cute.arch.shuffle_sync_bfly(s1, 1 << off)
        f0 = cute.arch.exp2(m0 * LOG2E - b0)  # 0 on the first tile (m = -inf)
        f1 = cute.arch.exp2(m1 * LOG2E - b1)
        if cutlass.const_expr(self.entropy):
            for off in cutlass.range_constexpr(2):
                y0 = y0 + cute.arch.shuffle_sync_bfly(y0, 1 << off)
                y1 = y1 + cute.arch.shuffle_sync_bfly(y1, 1 << off)
            # u <- e^(m - m') (u + (m - m') e) + sum p (a - m'); no correction while e = 0
            d0 = cutlass.Float32(0.0)
            d1 = cutlass.Float32(0.0)
            if e0 > 0.0:
                d0 = (m0 - n0) * e0
            if e1 > 0.0:
                d1 = (m1 - n1) * e1
            u0 = f0 * (u0 + d0) + y0 * LN2
            u1 = f1 * (u1 + d1) + y1 * LN2
        e0 = e0 * f0 + s0
        e1 = e1 * f1 + s1
        return n0, n1, e0, e1, g0, g1, u0, u1


_COMPILED: dict = {}


def compile_forward(hidden: int, dtype: str = "bfloat16", smooth: bool = False, entropy: bool = False,
                    stages: int = 4, specialised: bool = True, group: int = 0, keep_block: int = 0):
    """``cute.compile`` the kernel for one configuration (N, V, splits, scale stay runtime
    values), cached. The pointers given to cute.compile carry only types (dtype, address
    space, 16-byte alignment): dummy addresses, so the lowering also runs without a GPU
    (the host JIT then stops for lack of libcuda). The stream is a runtime argument."""
    from cutlass.cute.runtime import make_ptr

    key = (hidden, dtype, smooth, entropy, stages, specialised, group, keep_block)
    if key in _COMPILED:
        return _COMPILED[key]
    gmem = cute.AddressSpace.gmem
    base = 1 << 20
    ab = DTYPES[dtype]
    ptrs = [make_ptr(ab, base, gmem, assumed_align=16), make_ptr(ab, base * 2, gmem, assumed_align=16),
            make_ptr(cutlass.Int32, base * 3, gmem, assumed_align=4)]
    ptrs += [make_ptr(cutlass.Float32, base * (4 + i), gmem, assumed_align=4) for i in range(5)]
    ptrs += [make_ptr(ab, base * 9, gmem, assumed_align=4), make_ptr(cutlass.Float32, base * 10, gmem, assumed_align=4)]
    kern = ForwardStatsSm90(hidden, dtype, smooth, entropy, stages, specialised, group, keep_block)
    with warnings.catch_warnings():
        # 4.8 deprecates cute.arch.exp2 (kept: the exact ex2.approx.ftz the kernel was measured
        # with) and flags the epilogue's 128-step constexpr loops (unrolled on purpose)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message="This static loop has")
        compiled = cute.compile(kern, *ptrs, cutlass.Float32(1.0), cutlass.Int32(TILE_M), cutlass.Int32(TILE_N),
                                cutlass.Int32(1), cutlass.Int32(TILE_N if keep_block else 0),
                                cutlass.Int32(TILE_N), cuda.CUstream(0))
    _COMPILED[key] = compiled
    return compiled


def launch(compiled, x_addr: int, w_addr: int, t_addr: int, part_addrs, scale: float, n: int, v: int,
           splits: int, stream_handle: int, dtype: str = "bfloat16", keep=(0, 0, 0, 0)):
    """Launch a compiled kernel on raw device addresses (x, w 16-byte aligned; target
    int32; five fp32 partial buffers (splits, n), unused ones may repeat the first) on
    the CUDA stream ``stream_handle``. ``keep`` = (keep address (operand dtype, rows of
    ``keep_stride`` elements), keep_max address (fp32 (ceil(keep_cols / keep_block), n)),
    keep_cols, keep_stride) for a kernel compiled with ``keep_block`` (else unused)."""
    from cutlass.cute.runtime import make_ptr

    gmem = cute.AddressSpace.gmem
    ab = DTYPES[dtype]
    compiled(
        make_ptr(ab, x_addr, gmem, assumed_align=16),
        make_ptr(ab, w_addr, gmem, assumed_align=16),
        make_ptr(cutlass.Int32, t_addr, gmem, assumed_align=4),
        *[make_ptr(cutlass.Float32, a, gmem, assumed_align=4) for a in part_addrs],
        make_ptr(ab, keep[0] or x_addr, gmem, assumed_align=4),
        make_ptr(cutlass.Float32, keep[1] or part_addrs[0], gmem, assumed_align=4),
        cutlass.Float32(scale), cutlass.Int32(n), cutlass.Int32(v), cutlass.Int32(splits),
        cutlass.Int32(keep[2]), cutlass.Int32(keep[3]),
        cuda.CUstream(stream_handle),
    )
