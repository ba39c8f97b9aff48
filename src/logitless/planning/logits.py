"""Plans over whole rows of logits, shared by several ops: the ops on given logits
(cross_entropy, log_probs, jsd) and linear_jsd, whose forward materialises chunks of both
heads' logits and reduces them with jsd's row-statistics kernel.

    ce_torch_plan     rows per chunk of the PyTorch backends of cross_entropy and log_probs
    ce_triton_plan    tiles of the Triton kernels on given logits (cross_entropy, log_probs,
                      jsd; the row statistics' tiles)
    jsd_stats_plan    the row statistics' split of the vocabulary (jsd, linear_jsd)
    jsd_torch_rows    rows per chunk of the PyTorch backends of jsd and linear_jsd
    jsd_forward_rows  tokens per logit chunk of linear_jsd's chunked forward (its Triton
                      backend and ``helion_lib.linear_jsd``)

An op's own heuristics live beside its backends (``ops/<op>/``); the map of every
planning decision is ``planning/__init__.py``'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from logitless.planning import device as _device
from logitless.planning.plans import clamp, num_sms
from logitless.planning.tiles import WAVES


def ce_torch_plan(num_tokens: int, vocab: int, itemsize: int, budget: int) -> int:
    """Rows per chunk of the PyTorch backend of cross_entropy.

    Each chunk holds about 4 (rows x V) temporaries in the compute dtype (the upcast
    copy, exp, the target mask and the soft-cap copy of the backward). One row is the
    least: the budget can never force a row to be split.
    """
    return clamp(budget // max(1, 4 * vocab * itemsize), 1, max(1, num_tokens))


@dataclass(frozen=True)
class CETritonPlan:
    """Launch configuration of the Triton backend of cross_entropy.

    block_n x block_v: the tile of logits one program holds per step (block_n rows,
    streamed over the vocabulary in block_v-wide steps in the forward; one tile per
    program in the backward).
    """

    block_n: int
    block_v: int
    num_warps: int


def ce_triton_plan(num_tokens: int, vocab: int, itemsize: int, device) -> CETritonPlan:
    """About 16 KiB of logits per step; several rows per program when V is small."""
    if _device.facts(device).gpu:
        tile, max_block_v, num_warps = 16384 // itemsize, 4096, 8
    else:  # TRITON_INTERPRET=1: small tiles, still exercising every mask
        tile, max_block_v, num_warps = 256, 64, 4
    block_v = min(max_block_v, 1 << max(0, vocab - 1).bit_length())
    rows = 1 << max(0, num_tokens - 1).bit_length()
    block_n = clamp(tile // block_v, 1, rows)
    return CETritonPlan(block_n=block_n, block_v=block_v, num_warps=num_warps)



@dataclass(frozen=True)
class JSDStatsPlan:
    """Launch of the distillation row statistics (``triton_lib.jsd_rows.row_stats``):
    block_n x block_v tiles (``ce_triton_plan``), each row split over ``splits``
    programs of ``blocks_per_split`` column blocks each (1: one program per row block)."""

    block_n: int
    block_v: int
    num_warps: int
    splits: int
    blocks_per_split: int


def jsd_stats_plan(num_tokens: int, vocab: int, itemsize: int, device) -> JSDStatsPlan:
    """Split rows when there are too few row blocks for ~WAVES programs per SM (a few
    hundred rows of a 128k+ vocabulary: linear_jsd's chunks), so the sweeps run at
    bandwidth instead of one long latency-bound program per row; no split (the single
    kernel, bitwise as before) when the row blocks alone fill the device."""
    t = ce_triton_plan(num_tokens, vocab, itemsize, device)
    row_blocks = math.ceil(max(1, num_tokens) / t.block_n)
    vocab_blocks = math.ceil(max(1, vocab) / t.block_v)
    programs = WAVES * num_sms(device)
    # at least WAVES / 2 row programs per SM already: one program per row block
    want = 1 if 2 * row_blocks >= programs else clamp(math.ceil(programs / row_blocks), 1, vocab_blocks)
    per_split = math.ceil(vocab_blocks / want)
    return JSDStatsPlan(block_n=t.block_n, block_v=t.block_v, num_warps=t.num_warps,
                        splits=math.ceil(vocab_blocks / per_split), blocks_per_split=per_split)


def jsd_torch_rows(num_tokens: int, vocab: int, itemsize: int, budget: int) -> int:
    """Rows per chunk of the PyTorch backends of jsd / linear_jsd (full rows of both
    logits): about 12 (rows x V) temporaries in the compute dtype (both upcast logits,
    both log-probabilities, the mixture, products). One row is the least."""
    return clamp(budget // max(1, 12 * vocab * itemsize), 1, max(1, num_tokens))


def jsd_forward_rows(num_tokens: int, vocab: int, budget: int, cuda: bool) -> int:
    """Tokens per chunk of linear_jsd's chunked forward (the Triton and Helion backends):
    both heads' fp32 logits of the chunk (8 V bytes a token) fill ``budget``."""
    rows = budget // max(1, 8 * vocab)
    if cuda and rows >= 16:
        # Multiples of 8, not of 128-row GEMM tiles: each chunk's two GEMMs read both
        # weights once (V (H_s + H_t) itemsize bytes), so at ~200 rows they are bound by
        # that read, not by FLOPs, and rounding 220 rows down to 128 (V = 151936, 256 MiB)
        # took 1.6x the weight traffic (32 chunks of 4096 tokens instead of 20 of 208);
        # 216 (multiples of 8, not 16) makes it 19 chunks (docs/design.md).
        rows = rows // 8 * 8
    return clamp(rows, 1, max(1, num_tokens))
