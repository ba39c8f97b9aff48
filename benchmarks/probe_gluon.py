"""Issue 23, the route: can a Gluon (triton.experimental.gluon, triton 3.6) warp-specialised
Hopper kernel run the fused LCE forward statistics faster than our Triton kernel, and
close to one cuBLAS GEMM?

For bf16 x (N, H) and W (V, H) each kernel computes, per token and per vocabulary split,
the online max m, sum exp(z - m) and the target logit z[target] of z = x W^T (fp32
accumulation on wgmma), as (splits, N) fp32 partials like ``forward_stats_kernel``; torch
merges them (lse = M + log sum_i s_i exp(m_i - M), z_t = sum_i t_i). Variants:

  sw        no warp specialisation: one 8-warp program per (row block, split), 128 x 256
            x 64 tiles, a STAGES-deep TMA ring flattened over (vocabulary block, step of
            H) so the next tile's loads are in flight during a tile's softmax epilogue;
            async wgmma with one group in flight. What Triton's own pipeliner does.
  ws        warp-specialised: a 1-warp TMA producer partition fills the ring (empty /
            ready mbarriers); the default 8-warp partition (two warpgroups, one 128 x 256
            tile) issues wgmma and runs the epilogue. The epilogue is still serial with
            this program's MMAs; only the loads run ahead.
  pingpong  warp-specialised, two consumer warpgroups (the default partition and a
            4-warp worker), each with its own 128 x 128 tile and its own ring; the
            1-warp producer fills the rings tile by tile in order (tile j -> ring j % 2),
            so the warpgroups' main loops alternate: one's epilogue runs while the
            other's wgmma keep the tensor cores busy (CUTLASS's "ping-pong" schedule).
            Each warpgroup writes its own partials (2 per split).
  pingpong7 the same with CUTLASS's arrangement: one shared 7-slot ring (224 KB) and
            "turn" mbarriers that make the two warpgroups' main loops alternate strictly
            (each hands the turn over once its tile's last wgmma is issued). Deeper
            prefetch than pingpong's 2 x 3 slots, no overlap of the two main loops.

Grid: one program per (row block of 128 tokens, vocabulary split), grouped row blocks
first (as ``grouped_tile``); splits differ by at most one block and are chosen so the
programs fill whole waves of one program per SM (``choose_splits``).

Usage:
    python benchmarks/probe_gluon.py --out $OUT [--variant sw,ws,pingpong,pingpong7] [--shapes ...]
    python benchmarks/probe_gluon.py --smoke      # no GPU: imports, layouts, plans
    python benchmarks/probe_gluon.py --compile    # no GPU: AOT-compile every variant for
                                                  # sm_90 (TTGIR -> PTX -> cubin, ptxas)

Timing: CUDA events around each call, calls back to back (one synchronisation at the
end), 3 warm-up calls, median of --reps (>= 10); L2 is NOT flushed between calls (the
GEMM unit gets the same warm L2). Ratios are to cuBLAS
``torch.mm(x, W.T, out=bf16 buffer)`` timed in the same round.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import traceback

import torch
import triton
from _probe_common import probe_meta, write_json  # the probes' folder is on sys.path
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

SHAPES = [  # (N, H, V)
    (4096, 2048, 128256),
    (8192, 4096, 128256),
    (4096, 4096, 151936),
    (16384, 2048, 32000),
]
#: Correctness shapes besides the timed ones: odd N, V not a multiple of any tile, H not
#: a multiple of BLOCK_K (TMA zero-fills the tails).
CHECK_SHAPES = [(1000, 1000, 50257), (300, 2048, 32000)]


# ----------------------------------------------------------------------------- variants
# BM: tokens per tile (per warpgroup for pingpong), BV: vocabulary columns per tile,
# BK: step of H. warps_m: warps along M of the wgmma layout (the rest along N).
# maxnreg: per-thread register cap of the launch; with warp specialisation the warps are
# counted in warpgroups (8 + 4 for ws, 4 + 4 + 4 for pingpong: 384 threads), so
# maxnreg * 384 <= 65536 -> 168; the producer gets WORKER_REGS, the consumers the rest
# (232 = (168 * 384 - 40 * 128) / 256, CUTLASS's 40/232 split).
VARIANTS = {
    "sw": dict(kind="sw", BM=128, BV=256, BK=64, stages=4, num_warps=8, warps_m=8, maxnreg=None),
    "ws": dict(kind="ws", BM=128, BV=256, BK=64, stages=4, num_warps=8, warps_m=8, maxnreg=168,
               loader_regs=40),
    "pingpong": dict(kind="pingpong", BM=128, BV=128, BK=64, stages=3, num_warps=4, warps_m=4,
                     maxnreg=168, loader_regs=40, consumer_regs=232),
    "pingpong7": dict(kind="pingpong_shared", BM=128, BV=128, BK=64, stages=7, num_warps=4, warps_m=4,
                      maxnreg=168, loader_regs=40, consumer_regs=232),
}


def instr_n(bm: int, bv: int, num_warps: int) -> int:
    """wgmma instruction N: the largest multiple of 8 <= 256 dividing BV and <= BV / nReps
    (nReps = ceil(num_warps / ceil(BM / 16))), as the Gluon wgmma tutorial states."""
    m_reps = -(-bm // 16)
    n_reps = -(-num_warps // m_reps)
    max_n = max(bv // n_reps, 8)
    n = 256
    while n > max_n or bv % n:
        n -= 8
    assert n >= 8
    return n


# ----------------------------------------------------------------------------- kernels
#: Scalar kernel arguments not specialised on (divisibility by 16, == 1): one binary per
#: variant for every shape, so the GPU run compiles each variant once.
_RUNTIME_INTS = ["N", "V", "vblocks", "splits", "row_blocks", "group"]

@gluon.jit
def _grouped(pid, row_blocks, cols, group):
    """Program id -> (row block, split), ``group`` row blocks at a time (as
    ``triton_lib.gemm.grouped_tile``): the programs resident together share a few row
    blocks of x in L2 while they sweep the vocabulary."""
    per_group = group * cols
    first = (pid // per_group) * group
    size = gl.minimum(row_blocks - first, group)
    r = first + (pid % per_group) % size
    c = (pid % per_group) // size
    return r, c


@gluon.jit
def _tile_update(acc, m, s, t, tgt, col0, V, BV: gl.constexpr, layout: gl.constexpr):
    """Online log-sum-exp step over one fp32 tile of logits z = acc (BM x BV, columns
    col0 + [0, BV)); m: running row max (natural units), s = sum exp(z - m), t += the
    target logit (tgt: int32 target per row). Columns >= V (TMA zero-fill of the last
    tile) are -inf. exp via exp2 with one fma per element."""
    LOG2E: gl.constexpr = 1.4426950408889634
    cols = gl.arange(0, BV, layout=gl.SliceLayout(0, layout))
    z = acc
    if col0 + BV > V:
        z = gl.where(gl.expand_dims(cols < V - col0, 0), z, float("-inf"))
    hit = gl.expand_dims(cols, 0) == gl.expand_dims(tgt - col0, 1)
    t = t + gl.sum(gl.where(hit, z, 0.0), axis=1)
    m_new = gl.maximum(m, gl.max(z, axis=1))
    e = gl.exp2(z * LOG2E - gl.expand_dims(m_new * LOG2E, 1))
    s = s * gl.exp2((m - m_new) * LOG2E) + gl.sum(e, axis=1)
    return m_new, s, t


@gluon.jit
def _store_partials(m, s, t, part_m, part_s, part_t, out_row, off_m, N,
                    BM: gl.constexpr, layout: gl.constexpr):
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    ok = rows < N
    out = out_row.to(gl.int64) * N + rows
    gl.store(part_m + out, m, mask=ok)
    gl.store(part_s + out, s, mask=ok)
    gl.store(part_t + out, t, mask=ok)


@gluon.jit
def _load_targets(target_ptr, off_m, N, BM: gl.constexpr, layout: gl.constexpr):
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    return gl.load(target_ptr + rows, mask=rows < N, other=-1).to(gl.int32)


@gluon.jit
def _issue_load(x_desc, w_desc, x_bufs, w_bufs, bars, it, off_m, first, ksteps, total,
                STAGES: gl.constexpr):
    """TMA loads of flat step ``it`` (vocabulary block it // ksteps of this split, step
    it % ksteps of H) into ring slot it % STAGES; skipped when it >= total."""
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BV: gl.constexpr = w_desc.block_type.shape[0]
    pred = it < total
    j = it // ksteps
    k = it - j * ksteps
    slot = it % STAGES
    bar = bars.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [off_m, k * BK], bar, x_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(w_desc, [(first + j) * BV, k * BK], bar, w_bufs.index(slot), pred)


@gluon.jit(do_not_specialize=_RUNTIME_INTS)
def lce_stats_sw_kernel(x_desc, w_desc, target_ptr, part_m, part_s, part_t,
                        N, V, vblocks, splits, row_blocks, group,
                        STAGES: gl.constexpr, WARPS_M: gl.constexpr, INSTR_N: gl.constexpr,
                        num_warps: gl.constexpr):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BV: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, num_warps // WARPS_M], instr_shape=[16, INSTR_N, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)

    row_block, split = _grouped(gl.program_id(0), row_blocks, splits, group)
    off_m = row_block * BM
    first = (split * vblocks) // splits  # splits differ by at most one block
    nblocks = ((split + 1) * vblocks) // splits - first
    ksteps = gl.cdiv(x_desc.shape[1], BK)
    total = nblocks * ksteps

    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    tgt = _load_targets(target_ptr, off_m, N, BM, layout)
    m = gl.full([BM], float("-inf"), gl.float32, layout=row_layout)
    s = gl.zeros([BM], gl.float32, layout=row_layout)
    t = gl.zeros([BM], gl.float32, layout=row_layout)

    for i in gl.static_range(STAGES - 1):
        _issue_load(x_desc, w_desc, x_bufs, w_bufs, bars, i, off_m, first, ksteps, total, STAGES)
    it = 0  # flat step counter over (block, step of H): ring slot and phase
    for j in range(nblocks):
        # A fresh accumulator per tile (not carried across tiles: the epilogue then
        # needs no second copy of it in registers).
        acc = gl.zeros([BM, BV], gl.float32, layout=layout)
        for k in range(ksteps):
            slot = it % STAGES
            mbarrier.wait(bars.index(slot), (it // STAGES) & 1)
            acc = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc,
                                use_acc=k > 0, is_async=True)
            # Step it-1's wgmma is done: its slot takes the load of step it + STAGES - 1,
            # which crosses into the next tile near the end of this one.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            _issue_load(x_desc, w_desc, x_bufs, w_bufs, bars, it + STAGES - 1, off_m, first, ksteps, total,
                        STAGES)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        m, s, t = _tile_update(acc, m, s, t, tgt, (first + j) * BV, V, BV, layout)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    _store_partials(m, s, t, part_m, part_s, part_t, split, off_m, N, BM, layout)


@gluon.jit
def _ring_loader(x_desc, w_desc, x_bufs, w_bufs, ready, empty, off_m, first, nblocks, ksteps,
                 RINGS: gl.constexpr):
    """Producer partition (1 warp): vocabulary block j of the split, steps of H in order,
    into ring j % RINGS (STAGES slots each, slot index ring * STAGES + c % STAGES, c the
    ring's own step counter). Waits for a slot to be released (empty) before refilling
    it; the TMA completion arrives on ready."""
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BV: gl.constexpr = w_desc.block_type.shape[0]
    SLOTS: gl.constexpr = x_bufs.type.shape[0]
    STAGES: gl.constexpr = SLOTS // RINGS
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    for j in range(nblocks):
        ring = j % RINGS
        c0 = (j // RINGS) * ksteps
        for k in range(ksteps):
            c = c0 + k
            slot = ring * STAGES + c % STAGES
            # Slots start free: the first wait is on the phase before the barrier's first.
            mbarrier.wait(empty.index(slot), ((c // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(x_desc, [off_m, k * BK], bar, x_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [(first + j) * BV, k * BK], bar, w_bufs.index(slot))


@gluon.jit
def _ring_consumer(x_bufs, w_bufs, ready, empty, target_ptr, part_m, part_s, part_t,
                   out_row, N, V, off_m, first, nblocks, ksteps,
                   RING: gl.constexpr, RINGS: gl.constexpr, WARPS_M: gl.constexpr,
                   WARPS: gl.constexpr, INSTR_N: gl.constexpr):
    """MMA + epilogue partition: vocabulary blocks RING, RING + RINGS, ... of the split from
    ring RING; async wgmma with one group in flight, each slot released (empty) as soon
    as the wgmma reading it has completed; the tile's last slot before its epilogue, so
    the producer can refill every slot during it. Writes partials row ``out_row``."""
    BM: gl.constexpr = x_bufs.type.shape[1]
    BV: gl.constexpr = w_bufs.type.shape[1]
    SLOTS: gl.constexpr = x_bufs.type.shape[0]
    STAGES: gl.constexpr = SLOTS // RINGS
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, WARPS // WARPS_M], instr_shape=[16, INSTR_N, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)

    tgt = _load_targets(target_ptr, off_m, N, BM, layout)
    m = gl.full([BM], float("-inf"), gl.float32, layout=row_layout)
    s = gl.zeros([BM], gl.float32, layout=row_layout)
    t = gl.zeros([BM], gl.float32, layout=row_layout)
    c = 0
    for j in range(RING, nblocks, RINGS):
        acc = gl.zeros([BM, BV], gl.float32, layout=layout)  # per tile: not carried across
        for k in range(ksteps):
            slot = RING * STAGES + c % STAGES
            mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
            acc = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc,
                                use_acc=k > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            # The previous step's wgmma (same tile: k > 0) has completed: free its slot.
            mbarrier.arrive(empty.index(RING * STAGES + (c + STAGES - 1) % STAGES), pred=k > 0)
            c += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index(RING * STAGES + (c + STAGES - 1) % STAGES))
        m, s, t = _tile_update(acc, m, s, t, tgt, (first + j) * BV, V, BV, layout)
    _store_partials(m, s, t, part_m, part_s, part_t, out_row, off_m, N, BM, layout)


@gluon.jit(do_not_specialize=_RUNTIME_INTS)
def lce_stats_ws_kernel(x_desc, w_desc, target_ptr, part_m, part_s, part_t,
                        N, V, vblocks, splits, row_blocks, group,
                        STAGES: gl.constexpr, WARPS_M: gl.constexpr, INSTR_N: gl.constexpr,
                        LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    dtype: gl.constexpr = x_desc.dtype

    row_block, split = _grouped(gl.program_id(0), row_blocks, splits, group)
    off_m = row_block * BM
    first = (split * vblocks) // splits  # splits differ by at most one block
    nblocks = ((split + 1) * vblocks) // splits - first
    ksteps = gl.cdiv(x_desc.shape[1], BK)

    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    gl.warp_specialize([
        (_ring_consumer, (x_bufs, w_bufs, ready, empty, target_ptr, part_m, part_s, part_t,
                          split, N, V, off_m, first, nblocks, ksteps, 0, 1, WARPS_M, num_warps, INSTR_N)),
        (_ring_loader, (x_desc, w_desc, x_bufs, w_bufs, ready, empty, off_m, first, nblocks, ksteps, 1)),
    ], [1], [LOADER_REGS])


@gluon.jit(do_not_specialize=_RUNTIME_INTS)
def lce_stats_pingpong_kernel(x_desc, w_desc, target_ptr, part_m, part_s, part_t,
                              N, V, vblocks, splits, row_blocks, group,
                              STAGES: gl.constexpr, WARPS_M: gl.constexpr, INSTR_N: gl.constexpr,
                              LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                              num_warps: gl.constexpr):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    dtype: gl.constexpr = x_desc.dtype

    row_block, split = _grouped(gl.program_id(0), row_blocks, splits, group)
    off_m = row_block * BM
    first = (split * vblocks) // splits  # splits differ by at most one block
    nblocks = ((split + 1) * vblocks) // splits - first
    ksteps = gl.cdiv(x_desc.shape[1], BK)

    # Two rings of STAGES slots: ring r = slots [r * STAGES, (r + 1) * STAGES).
    x_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    # Worker order: the 4-warp consumer first, so that it takes the warpgroup after the
    # default partition's (wgmma needs 4 aligned warps), the 1-warp producer last.
    gl.warp_specialize([
        (_ring_consumer, (x_bufs, w_bufs, ready, empty, target_ptr, part_m, part_s, part_t,
                          2 * split, N, V, off_m, first, nblocks, ksteps, 0, 2, WARPS_M, num_warps, INSTR_N)),
        (_ring_consumer, (x_bufs, w_bufs, ready, empty, target_ptr, part_m, part_s, part_t,
                          2 * split + 1, N, V, off_m, first, nblocks, ksteps, 1, 2, WARPS_M, 4, INSTR_N)),
        (_ring_loader, (x_desc, w_desc, x_bufs, w_bufs, ready, empty, off_m, first, nblocks, ksteps, 2)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@gluon.jit
def _turn_consumer(x_bufs, w_bufs, ready, empty, turn, target_ptr, part_m, part_s, part_t,
                   out_row, N, V, off_m, first, nblocks, ksteps,
                   WG: gl.constexpr, WARPS_M: gl.constexpr, INSTR_N: gl.constexpr):
    """Ping-pong consumer on one shared ring (CUTLASS's order): warpgroup WG takes the
    vocabulary blocks j = WG, WG + 2, ...; global step c = j * ksteps + k is in slot
    c % STAGES. Before each main loop it waits for its turn (turn[WG]), and hands the turn
    to the other warpgroup (turn[1 - WG]) once its last wgmma of the tile is issued, so
    the main loops alternate and one's epilogue overlaps the other's MMAs. The order also
    makes the shared ring's phases safe: a warpgroup waits on a slot only after the other
    has waited on (so consumed the completion of) every earlier fill of it."""
    BM: gl.constexpr = x_bufs.type.shape[1]
    BV: gl.constexpr = w_bufs.type.shape[1]
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, 4 // WARPS_M], instr_shape=[16, INSTR_N, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)

    tgt = _load_targets(target_ptr, off_m, N, BM, layout)
    m = gl.full([BM], float("-inf"), gl.float32, layout=row_layout)
    s = gl.zeros([BM], gl.float32, layout=row_layout)
    t = gl.zeros([BM], gl.float32, layout=row_layout)
    q = 0
    for j in range(WG, nblocks, 2):
        # Warpgroup 0's first wait passes at once (a fresh barrier's "previous phase").
        mbarrier.wait(turn.index(WG), (q & 1) ^ (1 - WG))
        acc = gl.zeros([BM, BV], gl.float32, layout=layout)
        c = j * ksteps
        for k in range(ksteps):
            slot = c % STAGES
            mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
            acc = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc,
                                use_acc=k > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES), pred=k > 0)
            c += 1
        mbarrier.arrive(turn.index(1 - WG))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
        m, s, t = _tile_update(acc, m, s, t, tgt, (first + j) * BV, V, BV, layout)
        q += 1
    _store_partials(m, s, t, part_m, part_s, part_t, out_row, off_m, N, BM, layout)


@gluon.jit(do_not_specialize=_RUNTIME_INTS)
def lce_stats_pingpong_shared_kernel(x_desc, w_desc, target_ptr, part_m, part_s, part_t,
                                     N, V, vblocks, splits, row_blocks, group,
                                     STAGES: gl.constexpr, WARPS_M: gl.constexpr, INSTR_N: gl.constexpr,
                                     LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                     num_warps: gl.constexpr):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    dtype: gl.constexpr = x_desc.dtype

    row_block, split = _grouped(gl.program_id(0), row_blocks, splits, group)
    off_m = row_block * BM
    first = (split * vblocks) // splits  # splits differ by at most one block
    nblocks = ((split + 1) * vblocks) // splits - first
    ksteps = gl.cdiv(x_desc.shape[1], BK)

    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    gl.warp_specialize([
        (_turn_consumer, (x_bufs, w_bufs, ready, empty, turn, target_ptr, part_m, part_s, part_t,
                          2 * split, N, V, off_m, first, nblocks, ksteps, 0, WARPS_M, INSTR_N)),
        (_turn_consumer, (x_bufs, w_bufs, ready, empty, turn, target_ptr, part_m, part_s, part_t,
                          2 * split + 1, N, V, off_m, first, nblocks, ksteps, 1, WARPS_M, INSTR_N)),
        (_ring_loader, (x_desc, w_desc, x_bufs, w_bufs, ready, empty, off_m, first, nblocks, ksteps, 1)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


KERNELS = {"sw": lce_stats_sw_kernel, "ws": lce_stats_ws_kernel, "pingpong": lce_stats_pingpong_kernel,
           "pingpong_shared": lce_stats_pingpong_shared_kernel}


# ----------------------------------------------------------------------------- host side
def choose_splits(row_blocks: int, vblocks: int, sms: int, min_blocks: int = 4) -> tuple[int, int]:
    """(splits, most blocks per split): split c takes vocabulary blocks [c * B // splits,
    (c + 1) * B // splits), so splits differ by at most one block. One program per SM at
    a time (the SMEM rings take 192-224 KB): minimise waves x (blocks per program + 0.15
    of a block for each program's pipeline fill and partial stores), with at least
    min_blocks blocks per program. E.g. 32 row blocks x 501 blocks on 132 SMs: 33 splits,
    1056 programs = 8 full waves of 15-16 blocks (4 splits would leave 4 SMs idle)."""
    best = None
    for splits in range(1, max(1, vblocks // min_blocks) + 1):
        waves = -(-(row_blocks * splits) // sms)
        cost = waves * (vblocks / splits + 0.15)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, splits)
    return best[1], -(-vblocks // best[1])


def group_rows(sms: int, bm: int, bv: int) -> int:
    return max(1, round(math.sqrt(sms * bv / bm)))


def layouts(cfg: dict):
    xl = gl.NVMMASharedLayout.get_default_for([cfg["BM"], cfg["BK"]], gl.bfloat16)
    wl = gl.NVMMASharedLayout.get_default_for([cfg["BV"], cfg["BK"]], gl.bfloat16)
    return xl, wl


def constexprs(cfg: dict) -> dict:
    # The warps of one consumer: 4 per warpgroup in the ping-pong kernels.
    consumer_warps = cfg["warps_m"] if cfg["kind"].startswith("pingpong") else cfg["num_warps"]
    c = dict(STAGES=cfg["stages"], WARPS_M=cfg["warps_m"], INSTR_N=instr_n(cfg["BM"], cfg["BV"], consumer_warps),
             num_warps=cfg["num_warps"])
    if cfg["kind"] != "sw":
        c["LOADER_REGS"] = cfg["loader_regs"]
    if cfg["kind"].startswith("pingpong"):
        c["CONSUMER_REGS"] = cfg["consumer_regs"]
    return c


def smem_bytes(cfg: dict) -> int:
    rings = 2 if cfg["kind"] == "pingpong" else 1
    return rings * cfg["stages"] * (cfg["BM"] + cfg["BV"]) * cfg["BK"] * 2


class GluonStats:
    """One variant prepared for one (x, W, target): descriptors, plan and buffers made
    once; ``__call__`` launches the kernel and merges the partials -> (lse, z_target)."""

    def __init__(self, name: str, x, W, target, sms: int):
        cfg = VARIANTS[name]
        self.name, self.cfg = name, cfg
        N, H = x.shape
        V = W.shape[0]
        xl, wl = layouts(cfg)
        self.x_desc = TensorDescriptor.from_tensor(x, [cfg["BM"], cfg["BK"]], xl)
        self.w_desc = TensorDescriptor.from_tensor(W, [cfg["BV"], cfg["BK"]], wl)
        row_blocks = -(-N // cfg["BM"])
        vblocks = -(-V // cfg["BV"])
        # pingpong: each program's blocks alternate between 2 warpgroups: >= 8 per split.
        self.splits, self.bps = choose_splits(row_blocks, vblocks, sms, 8 if cfg["kind"].startswith("pingpong") else 4)
        self.group = group_rows(sms, cfg["BM"], cfg["BV"] * (2 if cfg["kind"].startswith("pingpong") else 1))
        self.row_blocks, self.N, self.V, self.vblocks = row_blocks, N, V, vblocks
        parts = self.splits * (2 if cfg["kind"].startswith("pingpong") else 1)
        dev = x.device
        self.pm = torch.empty(parts, N, device=dev, dtype=torch.float32)
        self.ps = torch.empty_like(self.pm)
        self.pt = torch.empty_like(self.pm)
        self.target = target
        self.grid = (row_blocks * self.splits, )
        self.kw = constexprs(cfg)
        if cfg["maxnreg"]:
            self.kw["maxnreg"] = cfg["maxnreg"]

    def plan(self) -> dict:
        return dict(splits=self.splits, max_blocks_per_split=self.bps, group=self.group,
                    programs=self.grid[0], smem_kb=smem_bytes(self.cfg) // 1024, **{
                        k: v for k, v in self.cfg.items() if k != "kind"})

    def launch(self):
        KERNELS[self.cfg["kind"]][self.grid](
            self.x_desc, self.w_desc, self.target, self.pm, self.ps, self.pt,
            self.N, self.V, self.vblocks, self.splits, self.row_blocks, self.group, **self.kw)

    def __call__(self):
        self.launch()
        M = self.pm.max(0).values
        lse = M + torch.log((self.ps * torch.exp(self.pm - M)).sum(0))
        return lse, self.pt.sum(0)


# ----------------------------------------------------------------------------- measuring
def time_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median GPU time of one call: calls issued back to back, an event pair around each,
    one synchronisation at the end, so the host (launch, descriptors, the library's
    planner) runs ahead and its time does not show up as idle GPU between the events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def short(exc: BaseException, n: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= n else text[: n // 2] + " ... " + text[-n // 2:]


def reference_rows(x, W, target, rows):
    """float64 lse and target logit of the given rows (the full vocabulary)."""
    xr = x[rows].double()
    z = torch.cat([xr @ W[v:v + 16384].double().T for v in range(0, W.shape[0], 16384)], 1)
    return torch.logsumexp(z, 1), z.gather(1, target[rows, None]).squeeze(1)


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).abs() / b.double().abs().clamp_min(1.0)).max().item()


def check_rows(N, device):
    """The rows checked against float64: the first 192, the last 64 (the partial row
    block) and 64 random ones."""
    return torch.unique(torch.cat([torch.arange(min(N, 192)), torch.arange(max(0, N - 64), N),
                                   torch.randint(0, N, (64, ), generator=torch.Generator().manual_seed(1))])).to(device)


def check(fn_out, ref, lib_lse, lib_zt) -> dict:
    lse, zt = fn_out
    rows, ref_lse, ref_zt = ref
    res = dict(
        lse_err_f64=rel_err(lse[rows], ref_lse), zt_err_f64=rel_err(zt[rows], ref_zt),
        finite=bool(torch.isfinite(lse).all().item() and torch.isfinite(zt).all().item()))
    if lib_lse is not None:
        res["lse_err_lib"] = rel_err(lse, lib_lse)
        res["zt_err_lib"] = rel_err(zt, lib_zt)
    res["ok"] = res["finite"] and res["lse_err_f64"] <= 1e-3 and res["zt_err_f64"] <= 1e-3
    return res


def inputs(N, H, V, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(N, H, device="cuda", generator=g) / math.sqrt(H) * 2).to(torch.bfloat16)
    W = torch.randn(V, H, device="cuda", generator=g).to(torch.bfloat16)
    target = torch.randint(0, V, (N, ), device="cuda", generator=g)
    return x, W, target


def lib_stats(x, W, target):
    import logitless
    loss, stats = logitless.linear_cross_entropy(x, W, target, reduction="none", return_stats=True)
    return stats.lse.float(), (stats.lse - loss).float()


def run_shape(N, H, V, variants, reps, sms, timed=True, with_lib=True) -> dict:
    import logitless
    x, W, target = inputs(N, H, V)
    out = dict(N=N, H=H, V=V, gflop=2 * N * H * V / 1e9, variants={})
    rows = check_rows(N, x.device)
    ref = (rows, *reference_rows(x, W, target, rows))
    lib_lse = lib_zt = None
    if with_lib:
        try:
            lib_lse, lib_zt = lib_stats(x, W, target)
            out["lib_check"] = check((lib_lse, lib_zt), ref, None, None)
        except Exception as exc:  # noqa: BLE001
            out["lib_error"] = short(exc)
    if timed:
        buf = torch.empty(N, V, device="cuda", dtype=torch.bfloat16)
        out["cublas_ms"] = time_ms(lambda: torch.mm(x, W.T, out=buf), reps)
        del buf
        try:
            out["triton_ms"] = time_ms(lambda: logitless.linear_cross_entropy(x, W, target), reps)
        except Exception as exc:  # noqa: BLE001
            out["triton_error"] = short(exc)
    for name in variants:
        rec = out["variants"].setdefault(name, {})
        try:
            g = GluonStats(name, x, W, target, sms)
            rec["plan"] = g.plan()
            rec["check"] = check(g(), ref, lib_lse, lib_zt)
            torch.cuda.synchronize()
            if timed:
                rec["ms"] = time_ms(g, reps)
                rec["kernel_ms"] = time_ms(g.launch, reps)
        except Exception as exc:  # noqa: BLE001
            rec["error"] = short(exc)
            traceback.print_exc(limit=3)
        torch.cuda.empty_cache()
    if timed and "cublas_ms" in out:
        unit = out["cublas_ms"]
        out["tflops_cublas"] = out["gflop"] / unit
        if "triton_ms" in out:
            out["triton_ratio"] = out["triton_ms"] / unit
        for rec in out["variants"].values():
            if "ms" in rec:
                rec["ratio"] = rec["ms"] / unit
                rec["kernel_ratio"] = rec["kernel_ms"] / unit
    return out


def table(results, variants) -> str:
    head = f"{'N x H x V':>22} {'cuBLAS ms':>9} {'triton':>13}" + "".join(f" {v:>22}" for v in variants)
    lines = [head, "ratios to cuBLAS; gluon: 'with merge (kernel only)'; 'ERR' = failed, see JSON"]
    for r in results:
        if "cublas_ms" not in r:
            continue
        tri = f"{r['triton_ms']:.3f} {r['triton_ratio']:.3f}x" if "triton_ms" in r else "ERR"
        row = f"{r['N']:>6}x{r['H']:>5}x{r['V']:>7}   {r['cublas_ms']:>9.3f} {tri:>13}"
        for v in variants:
            rec = r["variants"].get(v, {})
            if "ratio" in rec:
                flag = "" if rec["check"]["ok"] else " BAD"
                cell = f"{rec['ratio']:.3f}x ({rec['kernel_ratio']:.3f}x){flag}"
            else:
                cell = "ERR"
            row += f" {cell:>22}"
        lines.append(row)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- no-GPU modes
def smoke(variants) -> None:
    """Imports, layouts and plans without a GPU."""
    for name in variants:
        cfg = VARIANTS[name]
        xl, wl = layouts(cfg)
        c = constexprs(cfg)
        R, B = -(-4096 // cfg["BM"]), -(-128256 // cfg["BV"])
        splits, bps = choose_splits(R, B, 132, 8 if cfg["kind"].startswith("pingpong") else 4)
        print(f"{name}: x smem {xl}, W smem {wl}, constexprs {c}, smem {smem_bytes(cfg) // 1024} KB, "
              f"4096 x 128256 on 132 SMs: {splits} splits x {bps} blocks, {R * splits} programs, "
              f"group {group_rows(132, cfg['BM'], cfg['BV'])}")
        assert smem_bytes(cfg) <= 227 * 1024, name


def ptxas_log(ptx: str) -> str:
    """What ``ptxas -v --gpu-name sm_90a`` (the ptxas in the triton wheel) says on the PTX."""
    import subprocess
    import tempfile
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        return subprocess.run([exe, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True, timeout=300).stderr


def ptxas_info(ptx: str) -> dict:
    """Registers and spills from ``ptxas -v`` (the ptxas in the triton wheel) on the PTX."""
    import re
    try:
        out = ptxas_log(ptx)
        regs = re.search(r"Used (\d+) registers", out)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
        return dict(ptxas_regs=int(regs.group(1)) if regs else None,
                    spill_bytes=(int(spills.group(1)) + int(spills.group(2))) if spills else None)
    except Exception as exc:  # noqa: BLE001
        return dict(ptxas_error=short(exc))


def compile_variants(variants, dump=None) -> dict:
    """AOT-compile each variant for sm_90 without a GPU (TTGIR, PTX, and cubin with the
    ptxas shipped in the triton wheel). Reports per variant: ok / the error, registers,
    spills, shared memory, and the setmaxnreg values found in the PTX."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    res = {}
    for name in variants:
        cfg = VARIANTS[name]
        kern = KERNELS[cfg["kind"]]
        try:
            xl, wl = layouts(cfg)
            # Small CPU tensors: the descriptor type depends only on block shape, dtype, layout.
            xd = TensorDescriptor.from_tensor(torch.empty(256, 128, dtype=torch.bfloat16), [cfg["BM"], cfg["BK"]], xl)
            wd = TensorDescriptor.from_tensor(torch.empty(512, 128, dtype=torch.bfloat16), [cfg["BV"], cfg["BK"]], wl)
            c = constexprs(cfg)
            sig = {"x_desc": mangle_type(xd), "w_desc": mangle_type(wd), "target_ptr": "*i64",
                   "part_m": "*fp32", "part_s": "*fp32", "part_t": "*fp32"}
            for a in _RUNTIME_INTS:
                sig[a] = "i32"
            for a in c:
                sig[a] = "constexpr"
            opts = {"num_warps": cfg["num_warps"]}
            if cfg["maxnreg"]:
                opts["maxnreg"] = cfg["maxnreg"]
            src = GluonASTSource(kern, sig, constexprs=dict(c))
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
            ptx = k.asm["ptx"]
            md = k.metadata
            info = dict(ok=True, shared=getattr(md, "shared", None), num_warps=getattr(md, "num_warps", None),
                        setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx))),
                        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)))
            info.update(ptxas_info(ptx))
            if "cubin" in k.asm:
                info["cubin_bytes"] = len(k.asm["cubin"])
            if dump:
                os.makedirs(dump, exist_ok=True)
                for ext in ("ttgir", "llir", "ptx"):
                    if ext in k.asm:
                        with open(os.path.join(dump, f"{name}.{ext}"), "w") as f:
                            f.write(k.asm[ext])
            res[name] = info
        except Exception as exc:  # noqa: BLE001
            res[name] = dict(ok=False, error=short(exc, 3000))
        print(f"{name}: {res[name]}", flush=True)
    return res


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default=",".join(VARIANTS), help="comma-separated: " + ",".join(VARIANTS))
    ap.add_argument("--shapes", default=None, help="NxHxV,... (default: the four of issue 23)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="no GPU needed: imports, layouts, plans")
    ap.add_argument("--compile", action="store_true", help="no GPU needed: AOT compile for sm_90")
    ap.add_argument("--dump", default=None, help="with --compile: write TTGIR/LLIR/PTX here")
    ap.add_argument("--no-check-shapes", action="store_true")
    ap.add_argument("--check-only", action="store_true",
                    help="only the small correctness shapes (exit 2 if a variant fails): the GPU script "
                    "runs each variant this way first, in its own process under a timeout, so that a "
                    "hang or crash of one variant does not take the others with it")
    ap.add_argument("--table-from", default=None, metavar="JSON",
                    help="print the table of a (possibly partial) probe_gluon.json and exit")
    args = ap.parse_args()
    if args.table_from:
        with open(args.table_from) as f:
            data = json.load(f)
        meta = data["meta"]
        timed = [r for r in data["results"] if r.get("kind") == "timed"]
        names = list(dict.fromkeys(v for r in data["results"] for v in r["variants"]))
        print(f"{meta['device']} | torch {meta['torch']} | triton {meta['triton']} | L2 not flushed | "
              f"median of {meta['reps']} | {meta['date']}")
        for r in data["results"]:
            if r.get("kind") == "check":
                print(f"check {r['N']}x{r['H']}x{r['V']}: " + ", ".join(
                    f"{v} {'ok' if rec.get('check', {}).get('ok') else 'FAILED'}" for v, rec in r["variants"].items()))
        print(table(timed, names))
        return 0
    variants = [v for v in args.variant.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v}")
    shapes = SHAPES if not args.shapes else [tuple(int(a) for a in s.split("x")) for s in args.shapes.split(",")]

    if args.smoke:
        smoke(variants)
        if not torch.cuda.is_available():
            print("no CUDA: skipped")
            return 0
    if args.compile:
        res = compile_variants(variants, args.dump)
        return 0 if all(r["ok"] for r in res.values()) else 1
    if not torch.cuda.is_available():
        print("no CUDA: skipped")
        return 0

    reps = max(10, args.reps)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    meta = probe_meta(device=torch.cuda.get_device_name(), sms=sms, reps=reps, l2_flushed=False,
                timing="CUDA events around each call, calls back to back, 3 warm-up calls, median; "
                "gluon 'ms' = kernel + torch merge of the partials, 'kernel_ms' = kernel alone; "
                "triton = logitless.linear_cross_entropy forward, reduction mean")
    print(json.dumps(meta), flush=True)
    results = []
    path = os.path.join(args.out, "probe_gluon.json" if not args.check_only
                        else f"probe_gluon_check_{'_'.join(variants)}.json")
    os.makedirs(args.out, exist_ok=True)

    def save():
        write_json(path, dict(meta=meta, variants=VARIANTS, results=results))

    if not args.no_check_shapes:
        for (N, H, V) in CHECK_SHAPES:
            # --check-only: float64 only (no library kernels to compile in each process).
            r = run_shape(N, H, V, variants, reps, sms, timed=False, with_lib=not args.check_only)
            r["kind"] = "check"
            results.append(r)
            print(f"check {N}x{H}x{V}: lib {r.get('lib_check', r.get('lib_error'))}", flush=True)
            for v, rec in r["variants"].items():
                print(f"  {v}: {rec.get('check', rec.get('error'))}", flush=True)
            save()
    if args.check_only:
        bad = [v for r in results for v, rec in r["variants"].items() if not rec.get("check", {}).get("ok")]
        print("check-only:", "all ok" if not bad else f"FAILED {sorted(set(bad))}")
        return 2 if bad else 0
    for (N, H, V) in shapes:
        r = run_shape(N, H, V, variants, reps, sms)
        r["kind"] = "timed"
        results.append(r)
        print(f"{N}x{H}x{V}: cublas {r.get('cublas_ms')} ms, triton {r.get('triton_ms', r.get('triton_error'))}",
              flush=True)
        for v, rec in r["variants"].items():
            print(f"  {v}: {rec.get('ms')} ms (kernel {rec.get('kernel_ms')}) plan {rec.get('plan')} "
                  f"check {rec.get('check')} {rec.get('error', '')}", flush=True)
        save()
    print()
    print(f"{meta['device']} | torch {meta['torch']} | triton {meta['triton']} | L2 not flushed | median of {reps}")
    print(table([r for r in results if r["kind"] == "timed"], variants))
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
