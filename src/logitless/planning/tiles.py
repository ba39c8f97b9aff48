"""The Triton tile tables and launch plan that both frameworks share: plain Python,
no torch, no jax (the JAX side imports this module; ``plans`` re-exports all of it).

The planners themselves are framework-specific: ``plans.triton_plan`` (torch: kept
columns, TF32 scratch, the cost model, tuned tiles) and ``logitless.jax.planning``
(the JAX ops' "triton" implementation); both start from these tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Tiles (block_n, block_v, block_h, num_warps, num_stages) by input itemsize, for
#: Hopper-class GPUs; the CPU interpreter uses small tiles that still exercise masks.
#: fp32 (TF32 or 3xTF32 tensor-core dots): a 32-wide step of H is one 128-byte row of
#: each tile (the TMA swizzle's width); 3 stages of x and W tiles take 3 * 2 * 16 KiB
#: = 96 KiB of shared memory, the fp32 kept-tile store 64 KiB more, and tf32x3 its
#: split copies of the operands (up to 64 KiB): under the 227 KiB of an H100's SM. The
#: backend retries with fewer stages if a GPU has less (``triton_lib.launch.launch``).
CUDA_TILES = {2: (128, 256, 64, 8, 3), 4: (128, 128, 32, 8, 3)}
#: fp32 at "high" on operands pre-rounded to TF32 (``TritonPlan.w_chunk``), by whether
#: the forward keeps columns: without, 128 x 256 x 32 tiles and 4 stages (4 x 48 KiB)
#: ran the forward at 0.92x a cuBLAS TF32 GEMM on an H100 (4096 x 4096 x 128256;
#: 128 x 128 x 32, 4 stages: 1.06x; 3 stages: 1.30x); with kept columns the fp32 TMA
#: store of a 128 x 256 tile (128 KiB) would leave room for 2 stages only, so 128 x 128
#: (4 x 32 KiB + 64 KiB): not measured yet (docs/design.md). The
#: backward's dlogits kernel takes the gradient's tiles too: at 128 x 256 its sm_90
#: build needs 320 KiB of shared memory (its dz epilogue), at 128 x 128 192 KiB.
CUDA_TILES_TF32 = {False: (128, 256, 32, 8, 4), True: (128, 128, 32, 8, 4)}
INTERPRETER_TILES = (16, 32, 16, 4, 1)
#: Tiles of linear_jsd's two-head kernels (its backward's dz and the KL limits' fused
#: forward; PyTorch and JAX), which hold a student and a teacher tile at once (two fp32
#: accumulators: half of linear_cross_entropy's block_v keeps them in registers). 16-bit:
#: 4 stages (128 KiB of shared memory) measured f+b 1-4% faster than 3 at beta 0.5 and
#: 8-10% at beta 1 (fused forward: 15-18% faster alone); 5 stages no better (H100;
#: docs/design.md).
JSD_CUDA_TILES = {2: (128, 128, 64, 8, 4), 4: (64, 128, 32, 8, 2)}
#: Forward programs per SM (about): the tail wave is then ~1/WAVES of the work.
WAVES = 16
#: Narrowest backward chunk (columns of dz) on GPUs, whatever the budget.
MIN_CHUNK = 4096
#: GPUs with about 100 KiB of shared memory per block (SM86/SM89 RTX 30/40, SM120 RTX 50,
#: L4, A10): 48 KiB of pipelined tiles. The JAX plan takes these there; the torch
#: backend keeps ``CUDA_TILES`` and retries with fewer stages (``triton_lib.launch``).
CUDA_TILES_SMALL_SMEM = {2: (128, 128, 32, 8, 3), 4: (64, 128, 32, 4, 2)}
#: Compute capabilities (major * 10 + minor) with >= 160 KiB of shared memory per block
#: (A100 SM80, SM87, H100/H200 SM90, B200 SM100/SM103): ``CUDA_TILES`` fit there.
BIG_SMEM_CC = (80, 87, 90, 100, 103)
#: Persistent dlogits programs from this many row blocks on: with fewer, a chunk has
#: too few tiles per SM and the loop lost (512 tokens: 1.32x a GEMM against 1.17x).
PERSISTENT_MIN_ROW_BLOCKS = 16
#: Fixed cost of one forward program of the 16-bit fused GEMM kernel (pipeline fill, the
#: epilogue, its partial statistics), in steps of its K loop (BLOCK_H columns of H):
#: fitted on an H100 over 30 shapes (512-8192 tokens, H 768-8192, V 32k-262k; docs/design.md).
PROGRAM_STEPS = 32
#: Vocabulary tiles per forward program that ``forward_blocks_per_split`` weighs.
SPLIT_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
#: Predicted gain below which the WAVES rule's split stands: below 10% the A/B at the models
#: suite's shapes was within run-to-run noise.
SPLIT_MIN_GAIN = 0.10


def forward_blocks_per_split(row_blocks: int, vocab_blocks: int, k_steps: int, num_sms: int,
                             waves_rule: int) -> int:
    """Vocabulary tiles per program of the fused forward (16-bit, one program per SM).

    Each program pays a fixed cost (``PROGRAM_STEPS``) beside its tiles, and the grid runs
    in whole waves of ``num_sms`` programs: the predicted time is
    ``ceil(programs / num_sms) * (tiles_per_program * k_steps + PROGRAM_STEPS)``. The
    WAVES rule (``waves_rule``: tiles per program for ~WAVES programs per SM) stands unless
    a candidate is predicted ``SPLIT_MIN_GAIN`` faster: with few row blocks it gave each
    program one tile (512 x 4096 x 128256: 2.24x a GEMM; 16 tiles per program 1.35x)."""

    def cost(per_split: int) -> int:
        splits = math.ceil(vocab_blocks / per_split)
        per_split = math.ceil(vocab_blocks / splits)
        return math.ceil(row_blocks * splits / num_sms) * (per_split * k_steps + PROGRAM_STEPS)

    best = min((c for c in SPLIT_CANDIDATES if c <= vocab_blocks), key=cost, default=waves_rule)
    return best if cost(best) <= (1 - SPLIT_MIN_GAIN) * cost(waves_rule) else waves_rule


def group_rows_for(num_sms: int, block_n: int, block_v: int) -> int:
    """Row blocks per group of the GEMM kernels' program order on ``num_sms`` SMs: the
    G that minimises the L2 working set, sqrt(SMs * block_v / block_n) (``plans.group_rows``)."""
    return max(1, round(math.sqrt(num_sms * block_v / block_n)))


@dataclass(frozen=True)
class TritonPlan:
    """Launch configuration of the fused GEMM kernels' Triton backends: torch's
    linear_cross_entropy and linear_log_probs (``plans.triton_plan``) and the JAX ops'
    "triton" implementation (``logitless.jax.planning.triton_plan``, which leaves the
    torch-only fields keep_cols, tma, dz_tma and w_chunk at their defaults).

    block_n x block_v: the tile of logits one program holds (fp32 accumulators);
    block_h: the step along the hidden dimension of each tile's matmul;
    vocab_splits: programs that share one row block of the forward, each over a
        contiguous range of the vocabulary (their partial statistics are merged after);
    vocab_chunk: columns of d(logits) recomputed at once in the backward, in the
        input dtype, so the dx and dW matmuls run on tensor cores (a multiple of block_v);
    keep_cols: leading columns of exp(logits - max) that the forward stores for the
        backward (a multiple of block_v, or the whole vocabulary), so that they need no
        recomputed GEMM. 0 when no gradient is needed or the budget holds none.
    group_n: row blocks whose programs run next to each other (the GEMM kernels'
        program order, ``triton_lib.gemm.grouped_tile``); 0: all of them.
    flatten: the forward's tile loop and its loop over H are one pipelined loop.
    dz_tma: the dlogits kernel bulk-stores its dz tiles (TMA).
    dlogits_programs: programs of the dlogits kernel per SM when persistent (each
        loops over tiles); 0: one program per tile.
    w_chunk: fp32 at matmul precision "high" (``launch.tf32_prerounded``): rows of W
        rounded to TF32 into a scratch buffer per forward launch (a whole number of
        vocabulary splits; the backward rounds vocab_chunk rows per recomputed
        chunk). 0: no scratch, the kernels round (or take) the operands themselves.
    kept_dz_chunk: columns of the kept columns' dz written at a time by a backward that
        does not own the kept buffer (the custom ops, torch.compile: dz cannot go over
        it), into the dz chunk buffer (a multiple of block_v); 0: all at once.
    """

    block_n: int
    block_v: int
    block_h: int
    num_warps: int
    num_stages: int
    vocab_splits: int
    vocab_chunk: int
    keep_cols: int = 0
    tma: bool = True  # load x and W tiles with tensor descriptors where rows are aligned
    group_n: int = 0
    flatten: bool = False
    dz_tma: bool = False
    dlogits_programs: int = 0
    w_chunk: int = 0
    kept_dz_chunk: int = 0


@dataclass(frozen=True)
class CutePlan:
    """Launch of the CuTe DSL forward (``planning.cute``, ``cute_lib.forward_stats``):
    vocabulary splits, pipeline stages, warp specialisation and the CTA order (group 0:
    grid (row blocks, splits); G > 0: the grouped order)."""

    splits: int
    stages: int = 4
    specialised: bool = True
    group: int = 0
