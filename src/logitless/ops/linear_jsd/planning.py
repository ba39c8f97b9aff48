"""How linear_jsd's Triton backend splits its work (its ``TritonConfig`` holds these):
the tiles of its two-head kernels (``JSD_CUDA_TILES``), the forward's token chunks and
the backward's recomputed vocabulary chunks (``linear_jsd_plan``), the KL limits' fused
forward or the chunked one (``jsd_kl_fused``) and the strategy, recompute or
gradient-in-forward or kept dz columns (``linear_jsd_strategy``), the last two by this op's cost model
(``cost_model``). The pieces shared with the other ops (row chunks of the logits, the
row statistics' split, SMs, kernel options) are ``logitless.planning``'s; the map of
every planning decision is ``planning/__init__.py``'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from logitless.planning import device as _device
from logitless.planning import rocm as _rocm
from logitless.planning.logits import jsd_forward_rows
from logitless.planning.memo import memoised
from logitless.planning.overrides import current as _overrides
from logitless.planning.plans import (
    ODD_V_ALIGN,
    clamp,
    forced_strategy,
    kernel_options,
    min_chunk_cols,
    wave_blocks_per_split,
)
from logitless.planning.tiles import INTERPRETER_TILES, JSD_CUDA_TILES, MIN_CHUNK, TritonPlan


@dataclass(frozen=True)
class LinearJSDPlan:
    """How linear_jsd's Triton backend chunks its work.

    forward_rows: tokens per forward chunk; both heads' fp32 logits of the chunk
        (2 x rows x V x 4 bytes) are materialised by two cuBLAS GEMMs, then reduced to
        row statistics by the (bandwidth-bound) jsd forward kernel.
    vocab_chunk: columns of dz recomputed at once in the backward (a multiple of
        block_v), in the input dtype; dx accumulates in fp32 (tokens x H_student).
    tiles: a ``TritonPlan`` for the fused student+teacher logits tiles of the backward,
        and of the KL limits' fused forward (``tiles.vocab_splits``: its splits of the
        vocabulary, ``blocks_per_split`` blocks of block_v columns each).
    """

    forward_rows: int
    vocab_chunk: int
    tiles: TritonPlan
    blocks_per_split: int = 1


@memoised
def linear_jsd_plan(num_tokens: int, vocab: int, hidden_s: int, itemsize: int, budget: int,
                    device, *, hidden_t: int = 0, prerounded: bool = False) -> LinearJSDPlan:
    """``prerounded`` (fp32 at matmul precision "high", ``launch.tf32_prerounded``): the
    backward rounds both x's to TF32 once (4 N (H_s + H_t) bytes, taken off the budget
    while at most half of it) and each recomputed chunk's rows of both weights (4 (H_s +
    H_t) bytes per column, budgeted with the chunk's dz) into scratch buffers, as
    ``triton_plan`` does; ``tiles.w_chunk`` is then the chunk's rows (0: no scratch).
    The forward's logits are cuBLAS GEMMs, which round at "high" themselves."""
    facts = _device.facts(device)
    tiles = _overrides().tiles or (
        (_rocm.tiles(facts.arch, itemsize, jsd=True) or JSD_CUDA_TILES[itemsize]) if facts.gpu else INTERPRETER_TILES)
    block_n, block_v, block_h, num_warps, num_stages = tiles
    rows = jsd_forward_rows(num_tokens, vocab, budget, facts.gpu)
    padded_vocab = math.ceil(vocab / block_v) * block_v
    min_cols = min_chunk_cols(vocab, block_v, facts)
    # linear_cross_entropy measured 4096-column chunks faster than wider ones (a 32 MiB
    # dz chunk at 4096 tokens stays in L2: docs/design.md); narrower only if the budget
    # after the fp32 dx accumulator says so, never below min_cols.
    w_col = 4 * (hidden_s + hidden_t) if prerounded else 0
    x_scratch = 4 * num_tokens * (hidden_s + hidden_t) if prerounded else 0
    if x_scratch and x_scratch <= budget // 2:
        budget -= x_scratch
    left = budget - 4 * num_tokens * hidden_s
    cols = int(max(left, 0) // max(1, itemsize * num_tokens + w_col))
    vocab_chunk = clamp(min(cols, MIN_CHUNK) // block_v * block_v, min_cols, padded_vocab)
    # The KL limits' fused forward (``jsd_kl_forward_kernel``): splits of the vocabulary
    # for ~WAVES programs per SM, as linear_cross_entropy's forward.
    row_blocks = math.ceil(max(1, num_tokens) / block_n)
    vocab_blocks = math.ceil(max(1, vocab) / block_v)
    blocks_per_split = wave_blocks_per_split(row_blocks, vocab_blocks, facts)
    plan = TritonPlan(block_n=block_n, block_v=block_v, block_h=block_h, num_warps=num_warps,
                      num_stages=num_stages, vocab_splits=math.ceil(vocab_blocks / blocks_per_split),
                      vocab_chunk=vocab_chunk,
                      **kernel_options(num_tokens, block_n, block_v, facts),  # group_n is used
                      w_chunk=vocab_chunk if prerounded else 0)
    plan = _rocm.adapt_plan(plan, facts.arch)  # AMD GPUs: no TMA
    return LinearJSDPlan(forward_rows=rows, vocab_chunk=vocab_chunk, tiles=plan, blocks_per_split=blocks_per_split)


@memoised
def jsd_kl_fused(num_tokens: int, vocab: int, hidden_s: int, hidden_t: int, itemsize: int, budget: int,
                 device) -> bool:
    """For the KL limits on 16-bit inputs: does linear_jsd's forward take the fused kernel
    (``jsd_kl_forward_kernel``) rather than cuBLAS fp32 logit chunks of ``linear_jsd_plan``'s
    forward_rows? ``override(jsd_fused_forward=True/False)`` decides; by default the cost
    model (``cost_model.jsd_kl_fused_faster``, this op's)."""
    forced = _overrides().jsd_fused_forward
    if forced is not None:
        return forced
    rows = linear_jsd_plan(num_tokens, vocab, hidden_s, itemsize, budget, device).forward_rows
    from .cost_model import jsd_kl_fused_faster  # lazily, as plans imports planning.cost_model

    return jsd_kl_fused_faster(_device.facts(device).model, num_tokens, hidden_s, hidden_t, vocab, itemsize, rows)


def linear_jsd_strategy(num_tokens: int, vocab: int, hidden_s: int, hidden_t: int, itemsize: int, budget: int,
                        device, *, weight_fp32: bool = False, fused_forward: bool = False,
                        grad_in_forward: bool = True, keep: bool = True):
    """The cost model's choice for linear_jsd (``cost_model.choose_jsd``, this op's): a Candidate with
    strategy "recompute" (the default two-pass design), "grad_in_forward" (its token chunk)
    or "keep" (its token chunk and kept columns), each of the last two where the caller
    allows it (``grad_in_forward``, ``keep``). They are chosen on GPUs only (the CPU
    interpreter uses them when forced: ``override(strategy=("keep", tokens))``, the kept
    columns then ``forced_keep_columns``'); gradient-in-forward only when the vocabulary is
    a multiple of ODD_V_ALIGN (cuBLAS' slow odd-K path), "keep" keeps whole multiples of it."""
    forced = forced_strategy(num_tokens)
    if forced is not None:
        if forced.strategy == "keep":
            keep_cols = forced_keep_columns(num_tokens, vocab, itemsize, budget, forced.token_chunk)
            return replace(forced, keep_cols=keep_cols) if keep and keep_cols else replace(forced, strategy="recompute")
        return forced
    facts = _device.facts(device)
    gif_ok = grad_in_forward and facts.gpu and vocab % ODD_V_ALIGN == 0
    # "keep" runs the chunked forward (it writes the kept dz): never where the fused forward is forced on.
    keep = keep and not (fused_forward and _overrides().jsd_fused_forward)
    from .cost_model import choose_jsd

    return choose_jsd(num_tokens, hidden_s, hidden_t, vocab, itemsize, budget,
                      device_model=facts.model, grad_in_forward=gif_ok, weight_fp32=weight_fp32,
                      fused_forward=fused_forward, keep=keep and facts.gpu, align=ODD_V_ALIGN)


def forced_keep_columns(num_tokens: int, vocab: int, itemsize: int, budget: int, rows: int) -> int:
    """Kept columns of a forced "keep" strategy: every column when the budget holds them
    beside the forward's chunk of ``rows`` tokens (8 V bytes a token), else what it
    leaves, in whole multiples of ODD_V_ALIGN (0: nothing kept, the recompute plan runs)."""
    cols = max(0, budget - 8 * rows * vocab) // max(1, itemsize * num_tokens)
    return vocab if cols >= vocab else cols // ODD_V_ALIGN * ODD_V_ALIGN
