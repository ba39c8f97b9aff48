"""Issue 23, second Gluon probe: persistent software-pipelined Hopper kernels for the fused
LCE forward statistics and for the backward's dlogits tile.

The first probe (``benchmarks/probe_gluon.py``, results in docs/gluon_probe.md) found the
plain pipelined kernel ``sw`` (4-slot TMA ring, 128 x 256 x 64 tiles, 8 warps = two
warpgroups on m64n256 wgmma, CUTLASS's "cooperative" split of the tile) at 0.97-1.02x one
cuBLAS GEMM at H = 4096, but 1.17-1.24x at H = 2048 and at V = 32000. This probe adds:

  persist     the ``sw`` main loop made persistent: a fixed grid of min(#SMs, items)
              programs, program p taking the work items p, p + G, p + 2G, ... (G = the
              grid) of the (row block, vocabulary split) items in ``grouped_tile`` order.
              The TMA producer is a cursor (item, vocabulary block, step of H) that runs
              STAGES - 1 steps ahead of the wgmma across tile AND item boundaries, so the
              loads of the next tile (also of the next item) are in flight during a
              tile's softmax epilogue and an item's partial store; no CTA launch / ring
              fill between items. Splits: the library planner's
              (``logitless.planning.plans.triton_plan(...).vocab_splits``: ~16 programs
              per SM's worth of items, so the persistent programs' loads are balanced to
              within one item).
  persist_fill the same kernel with splits chosen for the persistent grid: the fewest
              items whose count fills the grid evenly (items per program max / mean
              <= 1.03 where possible) with at least SMs / group splits, so the resident
              programs keep the grouped order's L2 footprint (<= ``group`` row blocks).
  persist_nt  ``persist`` without the target logit in the epilogue (it costs a compare,
              a select and an add per element, about as much as the exponential's
              share of the SFU): the merge gets z_t as its own fp32 dot x_i . W[t_i]
              (2 H bytes of W per token). Measures what the target costs the epilogue.
  overlap     hides the softmax epilogue without partitions: 128 x 128 tiles so that two
              fp32 accumulators fit in the registers (64 each); per tile the first
              AHEAD = 3 wgmma steps of the next tile are issued, then a wait that leaves
              only those outstanding, then the previous tile's epilogue (and its item's
              store) runs under them; 6-slot ring, grid-filling splits.
  dlogits     the backward's recompute kernel (``dlogits_kernel`` of
              ``triton_lib/lce_kernels.py``): each item is one 128 x 256 tile of
              z = x W^T, recomputed and turned into dz = p * A - B [c == t] - C
              (p = exp(z - lse); A, B, C the per-token coefficients, a (3, N) fp32
              tensor as ``_loss_math.grad_coefficients`` gives), stored in bf16 (dX and dW
              are then two cuBLAS GEMMs on dz, not timed here). Persistent (grid =
              #SMs), same cursor; the next tile's loads are in flight during a tile's
              exp + store.
  dlogits_tma ``dlogits`` with dz written through shared memory by a TMA bulk store that
              overlaps the next tile's MMAs (3 ring slots + the 64 KB dz tile).
  dlogits_np  the same kernel as ``dlogits`` with one program per tile (grid = tiles):
              what persistence buys.

The persistent kernels do not overlap the epilogue with tensor-core work (only with
loads): a second 128 x 256 fp32 accumulator does not fit in the registers (128 per
thread each). The first probe's warp-specialised variants, which would, lost.

Correctness: forward variants against float64 torch (lse, target logit: 320 rows over the
whole vocabulary, relative error <= 1e-3) and ``logitless.linear_cross_entropy(...,
return_stats=True)`` on all rows; dlogits against float64 dz on the same rows (max abs
error relative to max |dz| <= 1e-2, bf16 output) and against the library's Triton
``dlogits_kernel`` run on the same inputs (same bf16 rounding of the same fp32 math up to
the accumulation order: max abs difference reported).

Usage:
    python benchmarks/probe_gluon2.py --out $OUT [--variant sw,persist,...] [--shapes ...]
    python benchmarks/probe_gluon2.py --smoke     # no GPU: plans of every variant
    python benchmarks/probe_gluon2.py --compile   # no GPU: AOT compile for sm_90a + ptxas -v

Timing as ``probe_gluon.py``: CUDA events around each call, calls back to back, 3
warm-ups, median of --reps, L2 not flushed; ratios to cuBLAS ``torch.mm(x, W.T,
out=bf16)`` (which also writes an (N, V) bf16 tensor: the dlogits kernels' unit too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe_gluon as pg  # noqa: E402  (the first probe: sw kernel, checks, timing)
from _probe_common import probe_meta, write_json  # noqa: E402

SHAPES = pg.SHAPES + [(16384, 4096, 128256)]
CHECK_SHAPES = pg.CHECK_SHAPES

# kind: which kernel; splits: how the forward's vocabulary splits are chosen.
VARIANTS = {
    "sw": dict(kind="sw", BM=128, BV=256, BK=64, stages=4, num_warps=8, warps_m=8),
    "persist": dict(kind="persist", BM=128, BV=256, BK=64, stages=4, num_warps=8, warps_m=8, splits="planner"),
    "persist_fill": dict(kind="persist", BM=128, BV=256, BK=64, stages=4, num_warps=8, warps_m=8, splits="fill"),
    "persist_nt": dict(kind="persist", BM=128, BV=256, BK=64, stages=4, num_warps=8, warps_m=8, splits="planner",
                       target=False),
    "overlap": dict(kind="overlap", BM=128, BV=128, BK=64, stages=6, num_warps=8, warps_m=8, splits="fill", ahead=3),
    "dlogits": dict(kind="dlogits", BM=128, BV=256, BK=64, stages=4, num_warps=8, warps_m=8, persistent=True),
    "dlogits_tma": dict(kind="dlogits_tma", BM=128, BV=256, BK=64, stages=3, num_warps=8, warps_m=8,
                        persistent=True),
    "dlogits_np": dict(kind="dlogits", BM=128, BV=256, BK=64, stages=4, num_warps=8, warps_m=8,
                       persistent=False),
}
FORWARD = [v for v, c in VARIANTS.items() if not c["kind"].startswith("dlogits")]
DLOGITS = [v for v, c in VARIANTS.items() if c["kind"].startswith("dlogits")]

_RUNTIME_INTS = ["N", "V", "vblocks", "splits", "row_blocks", "group", "items"]


# ----------------------------------------------------------------------------- kernels
@gluon.jit
def _item(w, items, row_blocks, splits, vblocks, group, BM: gl.constexpr):
    """Work item w (clamped to the last one: past the end the caller predicates the
    loads off) -> (first token, first vocabulary block, blocks): row block and split in
    ``grouped_tile`` order; split c takes blocks [c * B // splits, (c + 1) * B // splits)."""
    wc = gl.minimum(w, items - 1)
    r, c = pg._grouped(wc, row_blocks, splits, group)
    first = (c * vblocks) // splits
    return r * BM, first, ((c + 1) * vblocks) // splits - first


@gluon.jit
def _load_step(x_desc, w_desc, x_bufs, w_bufs, bars, slot, off_m, vblock, k, pred):
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BV: gl.constexpr = w_desc.block_type.shape[0]
    bar = bars.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [off_m, k * BK], bar, x_bufs.index(slot), pred)
    tma.async_copy_global_to_shared(w_desc, [vblock * BV, k * BK], bar, w_bufs.index(slot), pred)


@gluon.jit
def _advance(lw, lj, lk, loff, lfirst, lnb, ksteps, G, items, row_blocks, splits, vblocks, group,
             BM: gl.constexpr):
    """The load cursor's next step: step of H, then vocabulary block, then the program's
    next item (w + G)."""
    lk += 1
    if lk == ksteps:
        lk = 0
        lj += 1
        if lj == lnb:
            lj = 0
            lw += G
            loff, lfirst, lnb = _item(lw, items, row_blocks, splits, vblocks, group, BM)
    return lw, lj, lk, loff, lfirst, lnb


@gluon.jit
def _mainloop(x_desc, w_desc, x_bufs, w_bufs, bars, it, nblk, ksteps, acc_layout: gl.constexpr,
              cur, G, items, row_blocks, splits, vblocks, group, STAGES: gl.constexpr):
    """One tile's K loop: wgmma on ring slot it % STAGES (one group in flight); after
    each wait the slot of the previous step is free and takes the cursor's load, which
    is STAGES - 1 steps ahead and crosses into the next tile / item. Returns the fp32
    accumulator (all wgmma done), the step counter and the cursor."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BV: gl.constexpr = w_desc.block_type.shape[0]
    lw, lj, lk, loff, lfirst, lnb = cur
    acc = gl.zeros([BM, BV], gl.float32, layout=acc_layout)
    for k in range(ksteps):
        slot = it % STAGES
        mbarrier.wait(bars.index(slot), (it // STAGES) & 1)
        acc = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc,
                            use_acc=k > 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        _load_step(x_desc, w_desc, x_bufs, w_bufs, bars, (it + STAGES - 1) % STAGES, loff, lfirst + lj, lk,
                   lw < items)
        lw, lj, lk, loff, lfirst, lnb = _advance(lw, lj, lk, loff, lfirst, lnb, ksteps, G, items, row_blocks,
                                                 splits, vblocks, group, BM)
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return acc, it, (lw, lj, lk, loff, lfirst, lnb)


@gluon.jit
def _prologue(x_desc, w_desc, x_bufs, w_bufs, bars, ksteps, G, items, row_blocks, splits, vblocks, group,
              STAGES: gl.constexpr):
    """Barriers, and the cursor at the program's first item with STAGES - 1 loads issued."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    lw = gl.program_id(0)
    lj = 0
    lk = 0
    loff, lfirst, lnb = _item(lw, items, row_blocks, splits, vblocks, group, BM)
    for i in gl.static_range(STAGES - 1):
        _load_step(x_desc, w_desc, x_bufs, w_bufs, bars, i, loff, lfirst + lj, lk, lw < items)
        lw, lj, lk, loff, lfirst, lnb = _advance(lw, lj, lk, loff, lfirst, lnb, ksteps, G, items, row_blocks,
                                                 splits, vblocks, group, BM)
    return lw, lj, lk, loff, lfirst, lnb


@gluon.jit
def _tile_update_nt(acc, m, s, col0, V, BV: gl.constexpr, layout: gl.constexpr):
    """``_tile_update`` without the target logit (3 fewer operations per element:
    compare, select, add)."""
    LOG2E: gl.constexpr = 1.4426950408889634
    z = acc
    if col0 + BV > V:
        cols = gl.arange(0, BV, layout=gl.SliceLayout(0, layout))
        z = gl.where(gl.expand_dims(cols < V - col0, 0), z, float("-inf"))
    m_new = gl.maximum(m, gl.max(z, axis=1))
    e = gl.exp2(z * LOG2E - gl.expand_dims(m_new * LOG2E, 1))
    s = s * gl.exp2((m - m_new) * LOG2E) + gl.sum(e, axis=1)
    return m_new, s


@gluon.jit(do_not_specialize=_RUNTIME_INTS)
def lce_stats_persist_kernel(x_desc, w_desc, target_ptr, part_m, part_s, part_t,
                             N, V, vblocks, splits, row_blocks, group, items,
                             STAGES: gl.constexpr, WARPS_M: gl.constexpr, INSTR_N: gl.constexpr,
                             num_warps: gl.constexpr, TARGET: gl.constexpr = True):
    """Persistent forward statistics: items (row block, split) p, p + G, ...; per item the
    online (max, sum exp, target logit) over its vocabulary blocks, stored as the split's
    fp32 partials (as ``forward_stats_kernel``). Traffic: the GEMM's (x once per split,
    W once per row block, through L2 in grouped order) + 12 bytes per (token, split).
    TARGET=False: no target logit in the epilogue (part_t untouched; the caller gets it
    as a separate dot x_i . W[t_i]: 2 H bytes of W per token)."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BV: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, num_warps // WARPS_M], instr_shape=[16, INSTR_N, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    G = gl.num_programs(0)
    ksteps = gl.cdiv(x_desc.shape[1], BK)

    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    cur = _prologue(x_desc, w_desc, x_bufs, w_bufs, bars, ksteps, G, items, row_blocks, splits, vblocks, group,
                    STAGES)
    it = 0
    for w in range(gl.program_id(0), items, G):
        off_m, first, nblocks = _item(w, items, row_blocks, splits, vblocks, group, BM)
        split = (pg._grouped(w, row_blocks, splits, group))[1]
        tgt = pg._load_targets(target_ptr, off_m, N, BM, layout)
        m = gl.full([BM], float("-inf"), gl.float32, layout=row_layout)
        s = gl.zeros([BM], gl.float32, layout=row_layout)
        t = gl.zeros([BM], gl.float32, layout=row_layout)
        for j in range(nblocks):
            acc, it, cur = _mainloop(x_desc, w_desc, x_bufs, w_bufs, bars, it, nblocks, ksteps, layout, cur, G,
                                     items, row_blocks, splits, vblocks, group, STAGES)
            if TARGET:
                m, s, t = pg._tile_update(acc, m, s, t, tgt, (first + j) * BV, V, BV, layout)
            else:
                m, s = _tile_update_nt(acc, m, s, (first + j) * BV, V, BV, layout)
        pg._store_partials(m, s, t, part_m, part_s, part_t, split, off_m, N, BM, layout)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit(do_not_specialize=_RUNTIME_INTS)
def lce_dlogits_persist_kernel(x_desc, w_desc, target_ptr, lse_ptr, coef_ptr, dz_ptr,
                               N, V, vblocks, splits, row_blocks, group, items,
                               STAGES: gl.constexpr, WARPS_M: gl.constexpr, INSTR_N: gl.constexpr,
                               num_warps: gl.constexpr):
    """dz = exp(z - lse) * A - B [c == t] - C for every (row block, vocabulary block)
    tile, in bf16 (dz row stride = V). Items are tiles (splits = vblocks: one block each)
    in grouped order, p, p + G, ...; dz columns >= V and rows >= N are not stored.
    Traffic: the GEMM's reads + one write of dz (N x V x 2 bytes) + 20 bytes per token
    per tile (lse, coefficients, target)."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BV: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    LOG2E: gl.constexpr = 1.4426950408889634
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, num_warps // WARPS_M], instr_shape=[16, INSTR_N, 16])
    G = gl.num_programs(0)
    ksteps = gl.cdiv(x_desc.shape[1], BK)

    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    cur = _prologue(x_desc, w_desc, x_bufs, w_bufs, bars, ksteps, G, items, row_blocks, splits, vblocks, group,
                    STAGES)
    it = 0
    for w in range(gl.program_id(0), items, G):
        off_m, first, nblocks = _item(w, items, row_blocks, splits, vblocks, group, BM)
        acc, it, cur = _mainloop(x_desc, w_desc, x_bufs, w_bufs, bars, it, nblocks, ksteps, layout, cur, G,
                                 items, row_blocks, splits, vblocks, group, STAGES)
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        cols = first * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, layout))
        row_ok = rows < N
        lse = gl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        a = gl.load(coef_ptr + rows, mask=row_ok, other=0.0)
        b = gl.load(coef_ptr + N + rows, mask=row_ok, other=0.0)
        c = gl.load(coef_ptr + 2 * N + rows, mask=row_ok, other=0.0)
        tgt = gl.load(target_ptr + rows, mask=row_ok, other=-1).to(gl.int32)
        p = gl.exp2(acc * LOG2E - gl.expand_dims(lse * LOG2E, 1))
        hit = gl.expand_dims(cols, 0) == gl.expand_dims(tgt, 1)
        dz = p * gl.expand_dims(a, 1) - gl.where(hit, gl.expand_dims(b, 1), 0.0) - gl.expand_dims(c, 1)
        ptrs = dz_ptr + gl.expand_dims(rows.to(gl.int64) * V, 1) + gl.expand_dims(cols, 0)
        ok = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < V, 0)
        gl.store(ptrs, dz.to(dz_ptr.dtype.element_ty), mask=ok)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _tile_cursor(w, j, off, first, nb, G, items, row_blocks, splits, vblocks, group, BM: gl.constexpr):
    """A tile-granular cursor (item w, block j of it): the next tile. Returns also
    whether (w, j) was the last block of its item."""
    last = j + 1 == nb
    j += 1
    if last:
        j = 0
        w += G
        off, first, nb = _item(w, items, row_blocks, splits, vblocks, group, BM)
    return w, j, off, first, nb, last


@gluon.jit(do_not_specialize=_RUNTIME_INTS)
def lce_stats_overlap_kernel(x_desc, w_desc, target_ptr, part_m, part_s, part_t,
                             N, V, vblocks, splits, row_blocks, group, items,
                             STAGES: gl.constexpr, WARPS_M: gl.constexpr, INSTR_N: gl.constexpr,
                             AHEAD: gl.constexpr, num_warps: gl.constexpr):
    """Persistent forward statistics with the softmax epilogue of tile q run while the
    first AHEAD wgmma steps of tile q + 1 are on the tensor cores (one 8-warp partition,
    no warp specialisation): two fp32 accumulators (BV = 128 so that both fit in the
    registers). Per tile: issue AHEAD steps of the new tile without waiting, run the
    previous tile's epilogue (and its item's partial store if it was the item's last
    tile), then the rest of the K loop as ``persist`` and a full wait at the tile's end
    (reading registers of a wgmma still in flight would make ptxas serialise them all).
    Needs ksteps > AHEAD and AHEAD < STAGES (the host checks). Same partials as
    ``persist``."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BV: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, num_warps // WARPS_M], instr_shape=[16, INSTR_N, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    ksteps = gl.cdiv(x_desc.shape[1], BK)
    total = 0
    for w in range(pid, items, G):
        total += _item(w, items, row_blocks, splits, vblocks, group, BM)[2]

    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    lw, lj, lk, loff, lfirst, lnb = _prologue(x_desc, w_desc, x_bufs, w_bufs, bars, ksteps, G, items, row_blocks,
                                              splits, vblocks, group, STAGES)
    loaded = STAGES - 1  # steps whose loads were issued
    # Consumer cursor (the tile being multiplied) and epilogue cursor (the tile before it).
    cw = pid
    cj = 0
    coff, cfirst, cnb = _item(cw, items, row_blocks, splits, vblocks, group, BM)
    ew = cw
    ej = cj
    eoff = coff
    efirst = cfirst
    enb = cnb
    tgt = pg._load_targets(target_ptr, eoff, N, BM, layout)
    m = gl.full([BM], float("-inf"), gl.float32, layout=row_layout)
    s = gl.zeros([BM], gl.float32, layout=row_layout)
    t = gl.zeros([BM], gl.float32, layout=row_layout)
    prev = gl.zeros([BM, BV], gl.float32, layout=layout)
    it = 0
    for q in range(total):
        # Phase A: AHEAD steps of this tile, no waits (their slots were loaded already).
        acc = gl.zeros([BM, BV], gl.float32, layout=layout)
        for k in gl.static_range(AHEAD):
            slot = (it + k) % STAGES
            mbarrier.wait(bars.index(slot), ((it + k) // STAGES) & 1)
            acc = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, use_acc=k > 0,
                                is_async=True)
        # Returns at once (only these AHEAD groups are outstanding: the previous tile was
        # waited for at its end); it makes acc a plain tensor for the loop below.
        acc = warpgroup_mma_wait(num_outstanding=AHEAD, deps=(acc, ))
        while loaded < it + STAGES:  # the first tile: the ring's last free slot
            _load_step(x_desc, w_desc, x_bufs, w_bufs, bars, loaded % STAGES, loff, lfirst + lj, lk, lw < items)
            lw, lj, lk, loff, lfirst, lnb = _advance(lw, lj, lk, loff, lfirst, lnb, ksteps, G, items, row_blocks,
                                                     splits, vblocks, group, BM)
            loaded += 1
        if q > 0:  # the previous tile's epilogue, under this tile's first AHEAD steps
            m, s, t = pg._tile_update(prev, m, s, t, tgt, (efirst + ej) * BV, V, BV, layout)
            if ej + 1 == enb:  # the item's last tile: its partials
                split = (pg._grouped(ew, row_blocks, splits, group))[1]
                pg._store_partials(m, s, t, part_m, part_s, part_t, split, eoff, N, BM, layout)
            ew, ej, eoff, efirst, enb, done = _tile_cursor(ew, ej, eoff, efirst, enb, G, items, row_blocks, splits,
                                                            vblocks, group, BM)
            if done:
                tgt = pg._load_targets(target_ptr, eoff, N, BM, layout)
                m = gl.full([BM], float("-inf"), gl.float32, layout=row_layout)
                s = gl.zeros([BM], gl.float32, layout=row_layout)
                t = gl.zeros([BM], gl.float32, layout=row_layout)
        it += AHEAD
        # Phase B: the rest of the K loop, one group in flight, refills as ``persist``.
        for _k in range(AHEAD, ksteps):
            slot = it % STAGES
            mbarrier.wait(bars.index(slot), (it // STAGES) & 1)
            acc = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            while loaded < it + STAGES:
                _load_step(x_desc, w_desc, x_bufs, w_bufs, bars, loaded % STAGES, loff, lfirst + lj, lk, lw < items)
                lw, lj, lk, loff, lfirst, lnb = _advance(lw, lj, lk, loff, lfirst, lnb, ksteps, G, items,
                                                         row_blocks, splits, vblocks, group, BM)
                loaded += 1
            it += 1
        # The tile done (the tensor pipe drains here, as in ``persist``): the epilogue
        # will read prev while the next tile's wgmma run, and ptxas serialises every
        # wgmma if registers of one still in flight are read (C7514).
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        while loaded < it + STAGES:  # the last step's slot is free too
            _load_step(x_desc, w_desc, x_bufs, w_bufs, bars, loaded % STAGES, loff, lfirst + lj, lk, lw < items)
            lw, lj, lk, loff, lfirst, lnb = _advance(lw, lj, lk, loff, lfirst, lnb, ksteps, G, items, row_blocks,
                                                     splits, vblocks, group, BM)
            loaded += 1
        prev = acc
    # The last tile's epilogue and its item's store.
    if total > 0:
        m, s, t = pg._tile_update(prev, m, s, t, tgt, (efirst + ej) * BV, V, BV, layout)
        split = (pg._grouped(ew, row_blocks, splits, group))[1]
        pg._store_partials(m, s, t, part_m, part_s, part_t, split, eoff, N, BM, layout)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit(do_not_specialize=_RUNTIME_INTS)
def lce_dlogits_tma_kernel(x_desc, w_desc, target_ptr, lse_ptr, coef_ptr, dz_desc,
                           N, V, vblocks, splits, row_blocks, group, items,
                           STAGES: gl.constexpr, WARPS_M: gl.constexpr, INSTR_N: gl.constexpr,
                           num_warps: gl.constexpr):
    """``lce_dlogits_persist_kernel`` with dz stored by TMA: the tile goes to shared
    memory (64 KB of bf16) and one bulk store writes it while the next tile's wgmma run
    (the store is waited for only before the buffer is rewritten, one tile later). dz's
    descriptor clips rows >= N and columns >= V; its rows must be 16-byte aligned (a
    padded buffer). 3 ring slots (144 KB) + the dz tile: 208 KB of shared memory."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BV: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    LOG2E: gl.constexpr = 1.4426950408889634
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, num_warps // WARPS_M], instr_shape=[16, INSTR_N, 16])
    G = gl.num_programs(0)
    ksteps = gl.cdiv(x_desc.shape[1], BK)

    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    dz_smem = gl.allocate_shared_memory(dz_desc.dtype, dz_desc.block_type.shape, dz_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    cur = _prologue(x_desc, w_desc, x_bufs, w_bufs, bars, ksteps, G, items, row_blocks, splits, vblocks, group,
                    STAGES)
    it = 0
    for w in range(gl.program_id(0), items, G):
        off_m, first, nblocks = _item(w, items, row_blocks, splits, vblocks, group, BM)
        acc, it, cur = _mainloop(x_desc, w_desc, x_bufs, w_bufs, bars, it, nblocks, ksteps, layout, cur, G,
                                 items, row_blocks, splits, vblocks, group, STAGES)
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        cols = first * BV + gl.arange(0, BV, layout=gl.SliceLayout(0, layout))
        row_ok = rows < N
        lse = gl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        a = gl.load(coef_ptr + rows, mask=row_ok, other=0.0)
        b = gl.load(coef_ptr + N + rows, mask=row_ok, other=0.0)
        c = gl.load(coef_ptr + 2 * N + rows, mask=row_ok, other=0.0)
        tgt = gl.load(target_ptr + rows, mask=row_ok, other=-1).to(gl.int32)
        p = gl.exp2(acc * LOG2E - gl.expand_dims(lse * LOG2E, 1))
        hit = gl.expand_dims(cols, 0) == gl.expand_dims(tgt, 1)
        dz = p * gl.expand_dims(a, 1) - gl.where(hit, gl.expand_dims(b, 1), 0.0) - gl.expand_dims(c, 1)
        tma.store_wait(0)  # the previous tile's store has read the buffer
        dz_smem.store(dz.to(dz_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dz_desc, [off_m, first * BV], dz_smem)
    tma.store_wait(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


KERNELS = {"sw": pg.lce_stats_sw_kernel, "persist": lce_stats_persist_kernel, "overlap": lce_stats_overlap_kernel,
           "dlogits": lce_dlogits_persist_kernel, "dlogits_tma": lce_dlogits_tma_kernel}


# ----------------------------------------------------------------------------- plans
def planner_splits(N: int, V: int, H: int, sms: int, cfg: dict) -> int:
    """The library planner's forward split count for the shape at this probe's tile
    (``triton_plan`` with the tiles and the SM count given: ~16 programs per SM)."""
    from logitless.planning import overrides, plans
    with overrides.override(num_sms=sms):
        tiles = (cfg["BM"], cfg["BV"], cfg["BK"], cfg["num_warps"], cfg["stages"])
        # The split count depends only on the SM count and the tiles (given): the CPU device
        # skips the cost model of the backward columns, which needs a CUDA device.
        return plans.triton_plan(N, V, H, 2, 1 << 40, torch.device("cpu"), tiles=tiles).vocab_splits


def program_blocks(row_blocks: int, vblocks: int, splits: int, group: int, grid: int, per_item: float = 0.0):
    """Vocabulary blocks each persistent program runs (+ per_item for each of its items)
    when program p takes the items p, p + grid, ... in ``grouped_tile`` order: a
    (grid,) float64 tensor."""
    w = torch.arange(row_blocks * splits, dtype=torch.int64)
    per_group = group * splits
    first = (w // per_group) * group
    size = torch.clamp(row_blocks - first, max=group)
    c = (w % per_group) // size
    nb = ((c + 1) * vblocks) // splits - (c * vblocks) // splits
    return torch.bincount(w % grid, weights=nb.double() + per_item, minlength=grid)


def fill_splits(row_blocks: int, vblocks: int, sms: int, group: int) -> int:
    """Splits for a persistent grid of min(sms, items) programs: minimise the most
    blocks any program runs (+0.15 block per item for its targets, partial store and
    the tile boundary), with splits >= sms / group (the resident programs then span
    <= group row blocks: the grouped order's L2 footprint) and >= 4 blocks per split;
    ties to fewer splits. Measured in the first probe: ``sw`` ran at 0.97x cuBLAS where
    its waves were full and 1.02-1.17x where they were 95% full."""
    lo = min(vblocks, max(1, math.ceil(sms / max(1, min(group, row_blocks)))))
    best = None
    for splits in range(lo, max(lo, vblocks // 4) + 1):
        grid = min(sms, row_blocks * splits)
        cost = program_blocks(row_blocks, vblocks, splits, group, grid, 0.15).max().item()
        if best is None or cost < best[0] - 1e-9:
            best = (cost, splits)
    return best[1]


def instr_n(cfg) -> int:
    return pg.instr_n(cfg["BM"], cfg["BV"], cfg["num_warps"])


def constexprs(cfg) -> dict:
    c = dict(STAGES=cfg["stages"], WARPS_M=cfg["warps_m"], INSTR_N=instr_n(cfg), num_warps=cfg["num_warps"])
    if cfg.get("target") is False:
        c["TARGET"] = False
    if "ahead" in cfg:
        c["AHEAD"] = cfg["ahead"]
    return c


class Plan:
    """Grid and splits of one variant at one shape (no GPU needed)."""

    def __init__(self, name, N, H, V, sms, device):
        cfg = VARIANTS[name]
        self.cfg, self.sms = cfg, sms
        self.row_blocks = -(-N // cfg["BM"])
        self.vblocks = -(-V // cfg["BV"])
        self.group = pg.group_rows(sms, cfg["BM"], cfg["BV"])
        kind = cfg["kind"]
        if kind == "sw":
            self.splits, _ = pg.choose_splits(self.row_blocks, self.vblocks, sms, 4)
        elif kind in ("persist", "overlap"):
            self.splits = (planner_splits(N, V, H, sms, cfg) if cfg["splits"] == "planner"
                           else fill_splits(self.row_blocks, self.vblocks, sms, self.group))
        else:
            self.splits = self.vblocks  # one tile per item
        self.items = self.row_blocks * self.splits
        persistent = kind in ("persist", "overlap") or (kind.startswith("dlogits") and cfg["persistent"])
        self.grid = min(sms, self.items) if persistent else self.items

    def info(self) -> dict:
        """The plan and its fill: mean / most blocks per program (1.0 = every SM busy to
        the end; for ``sw``, one program per item, waves of #SMs programs)."""
        per_prog = -(-self.items // self.grid)
        blocks = program_blocks(self.row_blocks, self.vblocks, self.splits, self.group, self.grid)
        if self.cfg["kind"] == "sw":  # waves: each as long as its longest program
            sms = self.sms
            most = sum(blocks[i:i + sms].max().item() for i in range(0, self.grid, sms))
            fill = self.row_blocks * self.vblocks / sms / most
        else:
            fill = self.row_blocks * self.vblocks / self.grid / blocks.max().item()
        return dict(splits=self.splits, items=self.items, programs=self.grid, group=self.group,
                    max_items_per_program=per_prog, max_blocks_per_split=-(-self.vblocks // self.splits),
                    fill=round(fill, 4))


class Runner:
    """One variant prepared for (x, W, target): descriptors, plan, buffers once.
    Forward variants: ``__call__`` -> (lse, z_target) (kernel + torch merge); dlogits
    variants: ``__call__`` -> dz (bf16, N x V)."""

    def __init__(self, name, x, W, target, sms, lse=None, coef=None):
        cfg = VARIANTS[name]
        self.name, self.cfg = name, cfg
        N, H = x.shape
        V = W.shape[0]
        self.N, self.V = N, V
        self.plan = Plan(name, N, H, V, sms, x.device)
        if "ahead" in cfg and not (cfg["ahead"] < -(-H // cfg["BK"]) and cfg["ahead"] < cfg["stages"]):
            raise ValueError(f"{name}: needs more than {cfg['ahead']} steps of H (H > {cfg['ahead'] * cfg['BK']}) "
                             f"and ahead < stages")
        xl = gl.NVMMASharedLayout.get_default_for([cfg["BM"], cfg["BK"]], gl.bfloat16)
        wl = gl.NVMMASharedLayout.get_default_for([cfg["BV"], cfg["BK"]], gl.bfloat16)
        self.x_desc = TensorDescriptor.from_tensor(x, [cfg["BM"], cfg["BK"]], xl)
        self.w_desc = TensorDescriptor.from_tensor(W, [cfg["BV"], cfg["BK"]], wl)
        self.target, self.x, self.W = target, x, W
        self.kw = constexprs(cfg)
        if cfg["kind"] == "dlogits":
            self.lse, self.coef = lse, coef
            self.dz = torch.empty(N, V, device=x.device, dtype=torch.bfloat16)
        elif cfg["kind"] == "dlogits_tma":
            self.lse, self.coef = lse, coef
            # Rows padded to 16 bytes (TMA's global stride); the descriptor covers [N, V].
            self.dz = torch.empty(N, -(-V // 8) * 8, device=x.device, dtype=torch.bfloat16)[:, :V]
            dl = gl.NVMMASharedLayout.get_default_for([cfg["BM"], cfg["BV"]], gl.bfloat16)
            self.dz_desc = TensorDescriptor(self.dz, [N, V], [self.dz.stride(0), 1], [cfg["BM"], cfg["BV"]], dl)
        else:
            self.pm = torch.empty(self.plan.splits, N, device=x.device, dtype=torch.float32)
            self.ps = torch.empty_like(self.pm)
            self.pt = torch.empty_like(self.pm)

    def launch(self):
        p = self.plan
        kind = self.cfg["kind"]
        if kind == "sw":
            KERNELS["sw"][(p.grid, )](self.x_desc, self.w_desc, self.target, self.pm, self.ps, self.pt,
                                      self.N, self.V, p.vblocks, p.splits, p.row_blocks, p.group, **self.kw)
        elif kind in ("persist", "overlap"):
            KERNELS[kind][(p.grid, )](self.x_desc, self.w_desc, self.target, self.pm, self.ps, self.pt,
                                           self.N, self.V, p.vblocks, p.splits, p.row_blocks, p.group, p.items,
                                           **self.kw)
        else:
            dz = self.dz_desc if kind == "dlogits_tma" else self.dz
            KERNELS[kind][(p.grid, )](self.x_desc, self.w_desc, self.target, self.lse, self.coef, dz,
                                      self.N, self.V, p.vblocks, p.splits, p.row_blocks, p.group, p.items,
                                      **self.kw)

    def __call__(self):
        self.launch()
        if self.cfg["kind"].startswith("dlogits"):
            return self.dz
        M = self.pm.max(0).values
        lse = M + torch.log((self.ps * torch.exp(self.pm - M)).sum(0))
        if self.cfg.get("target") is False:  # the target logit as its own fp32 dot
            return lse, torch.linalg.vecdot(self.x.float(), self.W[self.target].float())
        return lse, self.pt.sum(0)


# ----------------------------------------------------------------------------- checks
def coefficients(N, target, device, seed=2):
    """(3, N) fp32 (A, B, C): A = B = g (a mean-like scale, varying per token so a wrong
    row shows), C small (label-smoothing-like), as ``_loss_math.grad_coefficients``."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = (0.5 + torch.rand(N, device=device, generator=g)) / N
    c = 0.1 * a / 1000
    return torch.stack([a, a, c]).contiguous()


def dz_reference(x, W, target, lse64, coef, rows):
    """float64 dz on the given rows (all columns)."""
    xr = x[rows].double()
    z = torch.cat([xr @ W[v:v + 16384].double().T for v in range(0, W.shape[0], 16384)], 1)
    p = torch.exp(z - lse64[:, None])
    a, b, c = (coef[i, rows].double() for i in range(3))
    dz = p * a[:, None] - c[:, None]
    dz[torch.arange(len(rows), device=x.device), target[rows]] -= b
    return dz


def triton_dlogits(x, W, target, lse, coef):
    """The library's ``dlogits_kernel`` over the whole vocabulary (one chunk), launched
    as ``triton_backend.backward`` does for a recomputed chunk, into an (N, V) bf16 dz.
    Returns a callable -> dz."""
    from logitless.triton_lib import lce_kernels as K
    from logitless.planning import plans
    from logitless.triton_lib import launch
    N, H = x.shape
    V = W.shape[0]
    plan = plans.triton_plan(N, V, H, 2, 1 << 40, x.device)
    x_op, w_op, use_tma = launch.operands(x, W, plan)
    dz = launch.padded_buffer(N, triton.cdiv(V, 8) * 8, x)[:, :V]
    row_blocks = triton.cdiv(N, plan.block_n)
    tiles = row_blocks * triton.cdiv(V, plan.block_v)
    if plan.dlogits_programs:
        tiles = min(tiles, plan.dlogits_programs * plans.num_sms(x.device))

    def run():
        launch.launch_kernel(
            K.dlogits_kernel, (tiles, ), x_op, w_op, x, x, target, lse, coef, dz,
            N, V, H, x.stride(0), x.stride(1), W.stride(0), W.stride(1), dz.stride(0),
            0, V, 1.0, plan.group_n or row_blocks,
            HAS_BIAS=False, HAS_SOFTCAP=False, HAS_CW=False, DOT_PRECISION=launch.dot_precision(x.dtype),
            USE_TMA=use_tma, DZ_TMA=False, FLATTEN=plan.flatten and plan.dlogits_programs > 0,
            BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, BLOCK_H=plan.block_h,
            num_warps=plan.num_warps, num_stages=plan.num_stages)
        return dz
    return run


def check_dz(dz, ref, rows, lib_dz=None, target=None) -> dict:
    """dz (bf16) against float64 on ``rows``: max abs error / max |dz| over all entries
    and, with ``target``, over the entries off the target column alone (p * A - C, tiny
    next to the target's p * A - B: a kernel that got only the target right would pass
    the first); on all rows (in chunks: no (N, V) fp32 temporaries) the max difference
    to the library kernel's dz, relative to max |dz|."""
    got = dz[rows].double()
    scale = ref.abs().max().item()
    off_err = None
    if target is not None:
        off = torch.ones_like(ref, dtype=torch.bool)
        off[torch.arange(len(rows), device=ref.device), target[rows]] = False
        off_err = ((got - ref).abs()[off].max() / ref.abs()[off].max()).item()
    finite = True
    diff = 0.0
    for i in range(0, dz.shape[0], 1024):
        d = dz[i:i + 1024].float()
        finite = finite and bool(torch.isfinite(d).all().item())
        if lib_dz is not None:
            diff = max(diff, (d - lib_dz[i:i + 1024].float()).abs().max().item())
    res = dict(dz_err_f64=(got - ref).abs().max().item() / scale, finite=finite)
    if off_err is not None:
        res["dz_err_f64_off_target"] = off_err
    if lib_dz is not None:
        res["dz_maxdiff_lib"] = diff / scale
    res["ok"] = res["finite"] and res["dz_err_f64"] <= 1e-2 and (off_err is None or off_err <= 1e-2)
    return res


# ----------------------------------------------------------------------------- one shape
def time_interleaved(fns: dict, reps: int, warmup: int = 3):
    """Median GPU time (ms) of each callable, all timed in the same rounds: each round
    calls every callable once (order rotated round by round), an event pair around each
    call, calls back to back, one synchronisation at the end. Returns (ms, errors): a
    callable that raises in its warm-up is dropped with its error."""
    import statistics
    ok, errors = {}, {}
    for k, f in fns.items():
        try:
            for _ in range(warmup):
                f()
            ok[k] = f
        except Exception as exc:  # noqa: BLE001
            errors[k] = pg.short(exc)
    torch.cuda.synchronize()
    names = list(ok)
    events = {k: [] for k in names}
    for r in range(reps):
        for i in range(len(names)):
            k = names[(i + r) % len(names)]
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            ok[k]()
            b.record()
            events[k].append((a, b))
    torch.cuda.synchronize()
    return {k: statistics.median(a.elapsed_time(b) for a, b in ev) for k, ev in events.items()}, errors

def run_shape(N, H, V, variants, reps, sms, timed=True, with_lib=True) -> dict:
    import logitless
    x, W, target = pg.inputs(N, H, V)
    out = dict(N=N, H=H, V=V, gflop=2 * N * H * V / 1e9, variants={})
    rows = pg.check_rows(N, x.device)
    ref_lse, ref_zt = pg.reference_rows(x, W, target, rows)
    ref = (rows, ref_lse, ref_zt)
    lib_lse = lib_zt = None
    if with_lib:
        try:
            lib_lse, lib_zt = pg.lib_stats(x, W, target)
            out["lib_check"] = pg.check((lib_lse, lib_zt), ref, None, None)
        except Exception as exc:  # noqa: BLE001
            out["lib_error"] = pg.short(exc)
    dl = [v for v in variants if VARIANTS[v]["kind"].startswith("dlogits")]
    lse = coef = dz_ref = lib_dz_run = lib_dz = None
    if dl:
        # The dz kernels' lse: the library's when it ran, else torch's fp32 one (rows in
        # chunks), so that only the dz math differs from the float64 reference.
        if lib_lse is not None:
            lse = lib_lse.contiguous()
        else:
            lse = torch.cat([torch.logsumexp((x[i:i + 1024] @ W.T).float(), 1) for i in range(0, N, 1024)])
        coef = coefficients(N, target, x.device)
        dz_ref = dz_reference(x, W, target, lse[rows].double(), coef, rows)
        if with_lib:
            try:
                lib_dz_run = triton_dlogits(x, W, target, lse, coef)
                lib_dz = lib_dz_run().clone()
                out["lib_dz_check"] = check_dz(lib_dz, dz_ref, rows, target=target)
            except Exception as exc:  # noqa: BLE001
                out["lib_dz_error"] = pg.short(exc)
                lib_dz_run = None
    runners = {}
    for name in variants:
        rec = out["variants"].setdefault(name, {})
        try:
            g = Runner(name, x, W, target, sms, lse, coef)
            rec["plan"] = g.plan.info()
            if VARIANTS[name]["kind"].startswith("dlogits"):
                rec["check"] = check_dz(g(), dz_ref, rows, lib_dz, target)
            else:
                rec["check"] = pg.check(g(), ref, lib_lse, lib_zt)
            torch.cuda.synchronize()
            runners[name] = g
        except Exception as exc:  # noqa: BLE001
            rec["error"] = pg.short(exc)
            traceback.print_exc(limit=3)
    if timed:
        # Everything timed in the same rounds (one call of each per round, the order
        # rotated), so that clock drift between measurements cancels out of the ratios:
        # timed one after the other, a variant's kernel-only time came out 10% above
        # its time with the merge in the first run.
        buf = torch.empty(N, V, device=x.device, dtype=torch.bfloat16)
        fns = {"cublas": lambda: torch.mm(x, W.T, out=buf)}
        if any(not VARIANTS[v]["kind"].startswith("dlogits") for v in variants):
            fns["triton"] = lambda: logitless.linear_cross_entropy(x, W, target)
        if lib_dz_run is not None:
            fns["triton_dlogits"] = lib_dz_run
        for name, g in runners.items():
            fns[name] = g
            if not VARIANTS[name]["kind"].startswith("dlogits"):
                fns[name + "/kernel"] = g.launch
        ms, errors = time_interleaved(fns, reps)
        del buf
        for k, v in ms.items():
            if k in ("cublas", "triton", "triton_dlogits"):
                out[f"{k}_ms"] = v
            elif k.endswith("/kernel"):
                out["variants"][k[:-7]]["kernel_ms"] = v
            else:
                out["variants"][k]["ms"] = v
                out["variants"][k].setdefault("kernel_ms", v)
        for k, e in errors.items():
            if k in ("cublas", "triton", "triton_dlogits"):
                out[f"{k}_error"] = e
            else:
                out["variants"][k.split("/")[0]]["error"] = e
    del runners
    torch.cuda.empty_cache()
    if timed and "cublas_ms" in out:
        unit = out["cublas_ms"]
        out["tflops_cublas"] = out["gflop"] / unit
        for k in ("triton", "triton_dlogits"):
            if f"{k}_ms" in out:
                out[f"{k}_ratio"] = out[f"{k}_ms"] / unit
        for rec in out["variants"].values():
            if "ms" in rec:
                rec["ratio"] = rec["ms"] / unit
                rec["kernel_ratio"] = rec["kernel_ms"] / unit
    return out


def table(results, variants, markdown=False) -> str:
    """Ratios to cuBLAS; forward variants 'with merge (kernel only)'."""
    cols = ["triton fwd"] + [v for v in variants if v in FORWARD]
    if any(v in DLOGITS for v in variants):
        cols += ["triton dlogits"] + [v for v in variants if v in DLOGITS]
    lines = []
    if markdown:
        lines.append("| N x H x V | cuBLAS ms | " + " | ".join(cols) + " |")
        lines.append("|---" * (len(cols) + 2) + "|")
    else:
        lines.append(f"{'N x H x V':>22} {'cuBLAS ms':>9}" + "".join(f" {c:>18}" for c in cols))
    for r in results:
        if "cublas_ms" not in r:
            continue
        cells = []
        for c in cols:
            if c == "triton fwd":
                cells.append(f"{r['triton_ratio']:.3f}x" if "triton_ratio" in r else "-")
            elif c == "triton dlogits":
                cells.append(f"{r['triton_dlogits_ratio']:.3f}x" if "triton_dlogits_ratio" in r else "-")
            else:
                rec = r["variants"].get(c, {})
                if "ratio" in rec:
                    flag = "" if rec["check"]["ok"] else " BAD"
                    cells.append(f"{rec['ratio']:.3f}x ({rec['kernel_ratio']:.3f}x){flag}"
                                 if c in FORWARD else f"{rec['ratio']:.3f}x{flag}")
                else:
                    cells.append("ERR" if rec else "-")
        name = f"{r['N']} x {r['H']} x {r['V']}"
        if markdown:
            lines.append(f"| {name} | {r['cublas_ms']:.3f} | " + " | ".join(cells) + " |")
        else:
            lines.append(f"{name:>22} {r['cublas_ms']:>9.3f}" + "".join(f" {c:>18}" for c in cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- no-GPU modes
def _grouped_py(pid, row_blocks, cols, group):
    per_group = group * cols
    first = (pid // per_group) * group
    size = min(row_blocks - first, group)
    return first + (pid % per_group) % size, (pid % per_group) // size


def simulate(plan, ksteps, stages=4) -> dict:
    """The persistent kernels' schedule replayed in Python (``_item``, ``_prologue``,
    ``_advance``, ``_mainloop`` step for step): asserts that every consumed step finds
    the load of exactly its (rows, vocabulary block, step of H) in its ring slot, that
    no slot is refilled before its previous wgmma completed, and that the items cover
    every (row block, vocabulary block) tile once. Returns the most blocks a program runs."""
    rb, sp, vb, grp, items, G = plan.row_blocks, plan.splits, plan.vblocks, plan.group, plan.items, plan.grid

    def item(w):
        r, c = _grouped_py(min(w, items - 1), rb, sp, grp)
        first = c * vb // sp
        return r, first, (c + 1) * vb // sp - first

    seen = set()
    most = 0
    for pid in range(G):
        slots = {}

        def issue(it, cur):
            lw, lj, lk, (lr, lfirst, lnb) = cur
            if lw < items:
                slots[it % stages] = (it, lr, lfirst + lj, lk)

        def advance(cur):
            lw, lj, lk, it3 = cur
            lk += 1
            if lk == ksteps:
                lk, lj = 0, lj + 1
                if lj == it3[2]:
                    lj, lw = 0, lw + G
                    it3 = item(lw)
            return lw, lj, lk, it3

        cur = (pid, 0, 0, item(pid))
        for i in range(stages - 1):
            issue(i, cur)
            cur = advance(cur)
        it = 0
        blocks = 0
        for w in range(pid, items, G):
            r, first, nb = item(w)
            assert nb >= 1
            for j in range(nb):
                tile = (r, first + j)
                assert tile not in seen, tile
                seen.add(tile)
                blocks += 1
                for k in range(ksteps):
                    assert slots.get(it % stages) == (it, r, first + j, k), (pid, it, slots.get(it % stages))
                    del slots[it % stages]  # consumed; the refill below goes to slot (it - 1) % stages
                    assert (it + stages - 1) % stages not in slots or it == 0
                    issue(it + stages - 1, cur)
                    cur = advance(cur)
                    it += 1
        most = max(most, blocks)
        assert not slots, (pid, slots)  # no load issued past the program's last step
    assert len(seen) == rb * vb, (len(seen), rb * vb)
    return dict(max_blocks_per_program=most, mean=round(rb * vb / G, 2))


def simulate_overlap(plan, ksteps, stages, ahead) -> dict:
    """``lce_stats_overlap_kernel``'s schedule replayed in Python: loads in cursor order
    into slot (step % stages), refilled only once the step that held the slot has
    completed (steps complete at the waits: phase B's leave the newest step
    outstanding, the tile's last none; phase A waits for nothing); every wgmma finds its own
    step's load; each tile's epilogue runs once, in tile order, on the tile the
    consumer multiplied before; items' partials stored once each, after their last
    tile's epilogue."""
    rb, sp, vb, grp, items, G = plan.row_blocks, plan.splits, plan.vblocks, plan.group, plan.items, plan.grid
    assert ahead < ksteps and ahead < stages

    def item(w):
        r, c = _grouped_py(min(w, items - 1), rb, sp, grp)
        first = c * vb // sp
        return r, first, (c + 1) * vb // sp - first

    stored, seen = [], set()
    for pid in range(G):
        order = [(w, j) for w in range(pid, items, G) for j in range(item(w)[2])]
        steps = [(w, j, k) for (w, j) in order for k in range(ksteps)]
        slots, done = {}, -1  # slot -> step index; steps <= done have completed
        loaded = 0

        def refill(limit):
            nonlocal loaded
            while loaded < limit:
                old = slots.get(loaded % stages)
                assert old is None or old <= done, ("slot refilled under a running wgmma", pid, loaded)
                if loaded < len(steps):
                    slots[loaded % stages] = loaded
                loaded += 1

        refill(stages - 1)
        it = 0
        epi = []
        for q in range(len(order)):
            for k in range(ahead):  # phase A: no waits
                assert slots.get((it + k) % stages) == it + k, ("phase A slot", pid, it + k)
            refill(it + stages)  # steps < it completed at the previous tile's end
            if q > 0:
                epi.append(order[q - 1])
            it += ahead
            for _k in range(ahead, ksteps):
                assert slots.get(it % stages) == it, ("phase B slot", pid, it)
                done = it - 1  # wait(1)
                refill(it + stages)
                it += 1
            done = it - 1  # wait(0) at the tile's end
            refill(it + stages)
        if order:
            epi.append(order[-1])
        assert epi == order
        for (w, j) in epi:
            r, first, nb = item(w)
            seen.add((r, first + j))
            if j + 1 == nb:
                stored.append(w)
        assert loaded >= len(steps)
    assert len(seen) == rb * vb and sorted(stored) == list(range(items))
    return dict(ok=True)


def smoke(variants, sms=132) -> None:
    """Plans of every variant at every shape and the persistent schedule replayed in
    Python at the check shapes and a few small ones (the Gluon kernels have no CPU
    interpreter)."""
    for name in variants:
        for (N, H, V) in CHECK_SHAPES + SHAPES + [(1, 64, 300), (300, 100, 3000)]:
            p = Plan(name, N, H, V, sms, torch.device("cpu"))
            info = p.info()
            cfg = VARIANTS[name]
            ksteps = -(-H // cfg["BK"])
            if cfg["kind"] == "overlap":
                if N * V <= 1000 * 50257 and ksteps > cfg["ahead"]:
                    info["simulated"] = simulate_overlap(p, ksteps, cfg["stages"], cfg["ahead"])
            elif cfg["kind"] != "sw" and N * V <= 1000 * 50257:
                info["simulated"] = simulate(p, ksteps)
            print(f"{name:>13} {N}x{H}x{V}: {info}")


def wgmma_serialized(ptx: str):
    """True if ptxas reports that it serialised the wgmma (C7514/C7515...: e.g. registers
    of a wgmma in flight read by other instructions), which removes all MMA overlap."""
    try:
        return "serialized" in pg.ptxas_log(ptx)
    except Exception:  # noqa: BLE001
        return None


def sass_mix(cubin: bytes) -> dict:
    """Static SASS instruction counts (cuobjdump from the triton wheel) of the opcodes
    that make up the softmax epilogue: one unrolled tile's worth per thread, so with 8
    warps (2 per scheduler) the epilogue issues ~2 x (their sum) cycles per scheduler."""
    import collections
    import re
    import subprocess
    import tempfile
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            out = subprocess.run([exe, "-sass", f.name], capture_output=True, text=True, timeout=300).stdout
        line = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")
        ops = collections.Counter(m.group(1).split(".")[0] for m in line.finditer(out))
        keep = ["MUFU", "FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "ISETP", "FSETP", "SHFL", "HGMMA", "STG", "F2FP",
                "SYNCS", "BAR"]
        return {k: ops.get(k, 0) for k in keep} | {"total": sum(ops.values())}
    except Exception as exc:  # noqa: BLE001
        return dict(error=pg.short(exc))


def compile_variants(variants, dump=None) -> dict:
    """AOT compile each kernel for sm_90a on the CPU (Gluon front end, TTGIR, PTX, the
    wheel's ptxas): ok, registers, spills, shared memory, wgmma / TMA counts."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    res = {}
    for name in variants:
        cfg = VARIANTS[name]
        kern = KERNELS[cfg["kind"]]
        try:
            xl = gl.NVMMASharedLayout.get_default_for([cfg["BM"], cfg["BK"]], gl.bfloat16)
            wl = gl.NVMMASharedLayout.get_default_for([cfg["BV"], cfg["BK"]], gl.bfloat16)
            xd = TensorDescriptor.from_tensor(torch.empty(256, 128, dtype=torch.bfloat16), [cfg["BM"], cfg["BK"]], xl)
            wd = TensorDescriptor.from_tensor(torch.empty(512, 128, dtype=torch.bfloat16), [cfg["BV"], cfg["BK"]], wl)
            c = constexprs(cfg)
            sig = {}
            for a in kern.arg_names:
                if a in c:
                    sig[a] = "constexpr"
                elif a == "x_desc":
                    sig[a] = mangle_type(xd)
                elif a == "w_desc":
                    sig[a] = mangle_type(wd)
                elif a == "target_ptr":
                    sig[a] = "*i64"
                elif a == "dz_ptr":
                    sig[a] = "*bf16"
                elif a == "dz_desc":
                    dl = gl.NVMMASharedLayout.get_default_for([cfg["BM"], cfg["BV"]], gl.bfloat16)
                    sig[a] = mangle_type(TensorDescriptor.from_tensor(
                        torch.empty(256, 512, dtype=torch.bfloat16), [cfg["BM"], cfg["BV"]], dl))
                elif a.endswith("_ptr") or a.startswith("part_"):
                    sig[a] = "*fp32"
                else:
                    sig[a] = "i32"
            src = GluonASTSource(kern, sig, constexprs=dict(c))
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]})
            ptx = k.asm["ptx"]
            info = dict(ok=True, shared=getattr(k.metadata, "shared", None),
                        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                        wgmma_shape=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
                        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)))
            info.update(pg.ptxas_info(ptx))
            info["wgmma_serialized"] = wgmma_serialized(ptx)
            if "cubin" in k.asm:
                info["sass"] = sass_mix(k.asm["cubin"])
            if dump:
                os.makedirs(dump, exist_ok=True)
                for ext in ("ttgir", "ptx"):
                    with open(os.path.join(dump, f"{name}.{ext}"), "w") as f:
                        f.write(k.asm[ext])
            res[name] = info
        except Exception as exc:  # noqa: BLE001
            res[name] = dict(ok=False, error=pg.short(exc, 3000))
        print(f"{name}: {res[name]}", flush=True)
    return res


# ----------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", default=",".join(VARIANTS), help="comma-separated: " + ",".join(VARIANTS))
    ap.add_argument("--shapes", default=None, help="NxHxV,... (default: the five of issue 23)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--dump", default=None)
    ap.add_argument("--check-only", action="store_true",
                    help="only the small correctness shapes, float64 only (exit 2 if a variant fails)")
    ap.add_argument("--no-check-shapes", action="store_true")
    ap.add_argument("--warm-lib", action="store_true",
                    help="only run the library's Triton kernels once at every shape (fills the triton cache: the "
                    "GPU script runs this next to the checks, so the timed run does not compile)")
    ap.add_argument("--table-from", default=None, metavar="JSON")
    ap.add_argument("--markdown", default=None, metavar="MD", help="with --table-from: also write a markdown table")
    args = ap.parse_args()
    if args.table_from:
        with open(args.table_from) as f:
            data = json.load(f)
        meta = data["meta"]
        names = list(dict.fromkeys(v for r in data["results"] for v in r["variants"]))
        timed = [r for r in data["results"] if r.get("kind") == "timed"]
        head = (f"{meta['device']} | torch {meta['torch']} | triton {meta['triton']} | L2 not flushed | "
                f"median of {meta['reps']} | {meta['date']}")
        print(head)
        checks = []
        for r in data["results"]:
            checks.append(f"{r.get('kind')} {r['N']}x{r['H']}x{r['V']}: " + ", ".join(
                f"{v} {'ok' if rec.get('check', {}).get('ok') else 'FAILED'}" for v, rec in r["variants"].items()))
        print("\n".join(checks))
        print(table(timed, names))
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(f"# Gluon probe 2 (`benchmarks/probe_gluon2.py`)\n\n- {head}\n- command: "
                        f"`{meta['command']}`\n- ratios to cuBLAS `x @ W.T` (bf16 out); forward: with merge "
                        f"(kernel only)\n\n{table(timed, names, markdown=True)}\n\n```\n" + "\n".join(checks)
                        + "\n```\n")
        return 0
    variants = [v for v in args.variant.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v}")
    shapes = SHAPES if not args.shapes else [tuple(int(a) for a in s.split("x")) for s in args.shapes.split(",")]
    if args.smoke:
        smoke(variants)
    if args.compile:
        res = compile_variants(variants, args.dump)
        return 0 if all(r["ok"] for r in res.values()) else 1
    if args.smoke:
        return 0
    if not torch.cuda.is_available():
        print("no CUDA: skipped")
        return 0

    if args.warm_lib:
        for (N, H, V) in CHECK_SHAPES + shapes:
            try:
                import logitless
                x, W, target = pg.inputs(N, H, V)
                lse, _ = pg.lib_stats(x, W, target)
                logitless.linear_cross_entropy(x, W, target)
                triton_dlogits(x, W, target, lse.contiguous(), coefficients(N, target, x.device))()
                torch.cuda.synchronize()
                print(f"warm {N}x{H}x{V}: ok", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"warm {N}x{H}x{V}: {pg.short(exc)}", flush=True)
            torch.cuda.empty_cache()
        return 0
    reps = max(10, args.reps)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    meta = probe_meta(device=torch.cuda.get_device_name(), sms=sms, reps=reps, l2_flushed=False,
                timing="CUDA events around each call, calls back to back, 3 warm-ups, median; every function of a "
                "shape timed in the same rounds (order rotated); forward 'ms' = "
                "kernel + torch merge, 'kernel_ms' = kernel alone; triton = logitless.linear_cross_entropy "
                "forward (mean); triton_dlogits = the library's dlogits_kernel over all columns")
    print(json.dumps(meta), flush=True)
    results = []
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "probe_gluon2.json" if not args.check_only
                        else f"probe_gluon2_check_{'_'.join(variants)}.json")

    def save():
        write_json(path, dict(meta=meta, variants=VARIANTS, results=results))

    if not args.no_check_shapes:
        for (N, H, V) in CHECK_SHAPES:
            r = run_shape(N, H, V, variants, reps, sms, timed=False, with_lib=not args.check_only)
            r["kind"] = "check"
            results.append(r)
            print(f"check {N}x{H}x{V}: lib {r.get('lib_check', r.get('lib_error'))} "
                  f"lib dz {r.get('lib_dz_check', r.get('lib_dz_error'))}", flush=True)
            for v, rec in r["variants"].items():
                print(f"  {v}: {rec.get('check', rec.get('error'))} plan {rec.get('plan')}", flush=True)
            save()
    if args.check_only:
        bad = [v for r in results for v, rec in r["variants"].items() if not rec.get("check", {}).get("ok")]
        print("check-only:", "all ok" if not bad else f"FAILED {sorted(set(bad))}")
        return 2 if bad else 0
    for (N, H, V) in shapes:
        r = run_shape(N, H, V, variants, reps, sms)
        r["kind"] = "timed"
        results.append(r)
        print(f"{N}x{H}x{V}: cublas {r.get('cublas_ms')} ms, triton {r.get('triton_ms', r.get('triton_error'))}, "
              f"triton dlogits {r.get('triton_dlogits_ms', r.get('lib_dz_error'))}", flush=True)
        for v, rec in r["variants"].items():
            print(f"  {v}: {rec.get('ms')} ms (kernel {rec.get('kernel_ms')}) plan {rec.get('plan')} "
                  f"check {rec.get('check')} {rec.get('error', '')}", flush=True)
        save()
    print(table([r for r in results if r["kind"] == "timed"], variants))
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
