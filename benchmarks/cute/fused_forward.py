"""A CuTe DSL (nvidia-cutlass-dsl 4.2.1) Hopper kernel for the fused linear cross-entropy forward.

A probe towards a warp-specialised backend (issue 23 item 1), not library code. For bf16
``x`` (N, H), ``w`` (V, H) and int32 ``target`` (N,), with z = x @ w^T in fp32 (never
written to memory), it computes for every row n and vocabulary split s the partials

    m[n, s] = max_{j in split s} z[n, j]
    e[n, s] = sum_{j in split s} exp(z[n, j] - m[n, s])
    t[n, s] = z[n, target[n]] if target[n] falls in split s else 0

as three (N, splits) fp32 tensors; ``merge_partials`` turns them into
lse[n] = max_s m + log(sum_s e * exp(m - max_s m)) and the per-row loss lse - z[n, target]
(0 where target is negative: ignore_index). Memory traffic: x and w are read once per
(row block, vocabulary tile) pair through TMA (x is re-read V/256 times from L2, w N/128
times), 12 bytes per row and split are written; the (N, V) logits never exist.

Kernel structure (one CTA per (128-row block, split), 384 threads):
  * warpgroup 0 is the producer: one elected warp issues TMA loads of x (128 x 64) and
    w (256 x 64) tiles into a ``stages``-deep shared-memory ring guarded by mbarriers
    (``cutlass.pipeline.PipelineTmaAsync``); it gives its registers away (setmaxnreg 40).
  * warpgroups 1 and 2 are consumers (setmaxnreg 232): each owns 64 rows of the
    128 x 256 tile and runs wgmma m64n256k16 (4 per 64-wide k slab), one wgmma group in
    flight, releasing a stage when the group that read it has retired.
  * after the last k slab of a vocabulary tile each consumer thread reduces its
    accumulator fragment (2 rows x 64 columns per thread in the wgmma C layout) into an
    online (max, sum exp2) per row with quad shuffles, and picks the target logit; the
    running statistics stay in registers across the split's vocabulary tiles; only the
    (m, e, t) partials are stored.
The epilogue is not overlapped with the next tile's mainloop within a CTA (no ping-pong
of the two consumer warpgroups yet): the producer warp does run ahead into the next
tile's k slabs while the consumers reduce, so the ring is full when they come back.

Constraints of this probe: N a multiple of 128, V a multiple of 256, H a multiple of 64
(H is a compile-time constant), x and w contiguous row-major, 16-byte aligned.

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
LOG2E = math.log2(math.e)


class FusedForwardSm90:
    """Compile-time configuration of the kernel: hidden size and pipeline depth."""

    def __init__(self, hidden: int, stages: int = 4, specialised: bool = True):
        if hidden % TILE_K:
            raise ValueError(f"hidden must be a multiple of {TILE_K}, got {hidden}")
        self.hidden = hidden
        self.stages = stages
        self.specialised = specialised
        self.k_tiles = hidden // TILE_K
        self.consumer_wgs = 2
        self.threads = 128 * (self.consumer_wgs + (1 if specialised else 0))
        self.consumer_base = 128 if specialised else 0
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
        part_layout = cute.make_layout((n_rows, splits), stride=(splits, 1))
        mM = cute.make_tensor(m_ptr, part_layout)
        mE = cute.make_tensor(e_ptr, part_layout)
        mG = cute.make_tensor(g_ptr, part_layout)

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            utils.LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            cutlass.Float32,
            (self.consumer_wgs, 1, 1),
            tiler_mn=(64, TILE_N),
        )
        kind = sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.ab_dtype, TILE_K)
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
        self.kernel(tiled_mma, tma_a, tma_x, tma_b, tma_w, sa_layout, sb_layout,
                    mT, mM, mE, mG, vocab, splits).launch(
            grid=(row_blocks, splits, 1),
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
        v_tiles = vocab // TILE_N
        per_split = (v_tiles + splits - 1) // splits
        v_lo = bs * per_split
        n_here = cutlass.max(cutlass.min(per_split, v_tiles - v_lo), 0)
        total = n_here * self.k_tiles

        smem = utils.SmemAllocator()
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

        # global tiles: x (128, 64, k), w (256, 64, vocab tile, k)
        gX = cute.local_tile(mX, (TILE_M, TILE_K), (bm, None))
        gW = cute.local_tile(mW, (TILE_N, TILE_K), (None, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gX, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gW, 0, 2))

        is_producer_wg = tidx < self.consumer_base
        if cutlass.const_expr(self.specialised):
            if is_producer_wg:
                cute.arch.warpgroup_reg_dealloc(40)
                if warp_idx == 0:
                    self.produce(ring, tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, v_lo, total)
            else:
                cute.arch.warpgroup_reg_alloc(232)
                self.consume(tiled_mma, ring, sA, sB, mT, mM, mE, mG, bm, bs, v_lo, n_here,
                             tidx - self.consumer_base, warp_idx, None)
        else:
            self.consume(tiled_mma, ring, sA, sB, mT, mM, mE, mG, bm, bs, v_lo, n_here,
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
    def consume(self, tiled_mma, ring, sA, sB, mT, mM, mE, mG, bm, bs, v_lo, n_here,
                ctid, warp_idx, inline_producer):
        wg = ctid // 128
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

        # the thread's two rows (wgmma C layout: element i sits on row slot (i // 2) % 2)
        row0 = bm * TILE_M + tCcC[0][0]
        row1 = bm * TILE_M + tCcC[2][0]
        tgt0 = mT[row0]
        tgt1 = mT[row1]
        neg_inf = cutlass.Float32(-math.inf)
        m0, m1 = neg_inf, neg_inf
        e0, e1 = cutlass.Float32(0.0), cutlass.Float32(0.0)
        g0, g1 = cutlass.Float32(0.0), cutlass.Float32(0.0)

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

            # epilogue: online (max, sum exp) per row and the target logit, no logits written
            col0 = (v_lo + vt) * TILE_N
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
        if ctid % 4 == 0:
            mM[row0, bs] = m0
            mE[row0, bs] = e0
            mG[row0, bs] = g0
            mM[row1, bs] = m1
            mE[row1, bs] = e1
            mG[row1, bs] = g1


_COMPILED: dict = {}


def compile_forward(hidden: int, stages: int = 4, specialised: bool = True, stream=None):
    """cute.compile the kernel for one hidden size (N, V, splits stay runtime values).

    The pointers given to cute.compile only carry types (dtype, address space, alignment):
    dummy addresses, so the whole lowering also runs on a machine without a GPU (the host
    JIT then stops for lack of libcuda)."""
    from cutlass.cute.runtime import make_ptr

    key = (hidden, stages, specialised)
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
    kern = FusedForwardSm90(hidden, stages, specialised)
    stream = cuda.CUstream(0) if stream is None else stream
    compiled = cute.compile(kern, *ptrs, cutlass.Int32(TILE_M), cutlass.Int32(TILE_N),
                            cutlass.Int32(1), stream)
    _COMPILED[key] = compiled
    return compiled


def fused_forward_partials(x, w, target, splits: int, stages: int = 4, specialised: bool = True):
    """Run the kernel on CUDA torch tensors; returns (m, e, t), each (N, splits) fp32."""
    torch = importlib.import_module("torch")
    from cutlass.cute.runtime import make_ptr

    n, h = x.shape
    v = w.shape[0]
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError("x and w must be bfloat16")
    if n % TILE_M or v % TILE_N or h % TILE_K or w.shape[1] != h:
        raise ValueError(f"shapes must be multiples of ({TILE_M}, {TILE_N}, {TILE_K}): "
                         f"x {tuple(x.shape)}, w {tuple(w.shape)}")
    x = x.contiguous()
    w = w.contiguous()
    tgt = target.to(torch.int32).contiguous()
    parts = torch.empty(3, n, splits, device=x.device, dtype=torch.float32)
    compiled = compile_forward(h, stages, specialised)
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
    """Torch merge of the (N, splits) partials: (lse (N,), per-row loss (N,), 0 where ignored)."""
    torch = importlib.import_module("torch")
    mx = m.max(dim=1, keepdim=True).values
    lse = mx.squeeze(1) + torch.log((e * torch.exp(m - mx)).sum(dim=1))
    zt = t.sum(dim=1)
    loss = torch.where(target == ignore_index, torch.zeros_like(lse), lse - zt)
    return lse, loss
