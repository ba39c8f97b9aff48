"""How the JAX backends split their work: the xla backend's token and vocabulary chunks
under the memory budget (``xla_plan``), the triton backend's tiles and chunks
(``triton_plan``, from the tables of ``logitless.planning.tiles`` that the PyTorch
planner shares). Nothing here changes what is computed, so tuning never touches the
math or the kernels.
"""

from __future__ import annotations

from typing import NamedTuple

from logitless.options import DEFAULT_MEMORY_BUDGET  # noqa: F401  (off GPUs, and the floor: as the PyTorch side)
from logitless.planning.tiles import (
    BIG_SMEM_CC,
    CUDA_TILES,
    CUDA_TILES_SMALL_SMEM,
    INTERPRETER_TILES,
    MIN_CHUNK,
    PERSISTENT_MIN_ROW_BLOCKS,
    WAVES,
    TritonPlan,
    group_rows_for,
)

__all__ = ["DEFAULT_MEMORY_BUDGET", "RowsPlan", "TritonPlan", "XlaPlan", "rows_plan", "triton_plan", "xla_plan"]

#: Column chunks are a multiple of this (and at least this), unless V is smaller.
VOCAB_ALIGN = 128
#: Token chunks are a multiple of this (and at least this), unless N is smaller.
TOKEN_ALIGN = 8
#: Widest column chunk: past it, GEMMs gain nothing and dW chunks grow.
MAX_VOCAB_CHUNK = 16384
#: Fp32-sized temporaries per element of a logits tile (logits, exp/dz, dz in the input
#: dtype and fusion slack): the tile costs TILE_BYTES_PER_ELEM x rows x columns bytes.
TILE_BYTES_PER_ELEM = 16


class XlaPlan(NamedTuple):
    """Tiles of the xla backend: each tile of logits is token_chunk x vocab_chunk."""

    token_chunk: int
    vocab_chunk: int


def _round_down(v: int, m: int) -> int:
    return max(m, v // m * m)


def xla_plan(num_tokens: int, vocab: int, hidden: int, itemsize: int, budget: int) -> XlaPlan:
    """Largest tiles whose temporaries fit the budget.

    Fixed costs, taken off the budget first: the backward's fp32 dx accumulator
    (4 x tokens x hidden bytes; bounded by the size of x, never by the vocabulary).
    A tile of n x v costs TILE_BYTES_PER_ELEM x n x v bytes plus its dW chunk
    (fp32 accumulator + slice of W: (4 + itemsize) x v x hidden). When even the
    smallest tile (TOKEN_ALIGN x VOCAB_ALIGN) does not fit, the smallest is used:
    the budget is then exceeded by at most that tile and the accumulator.
    """
    avail = max(budget - 4 * num_tokens * hidden, budget // 4)
    per_col_w = (4 + itemsize) * hidden
    n = num_tokens
    v = avail // (TILE_BYTES_PER_ELEM * n + per_col_w)
    if v < min(vocab, 4 * VOCAB_ALIGN) and n > TOKEN_ALIGN:
        # Too many tokens for decent column chunks: chunk the tokens as well.
        v = min(vocab, 4 * VOCAB_ALIGN)
        n = (avail - per_col_w * v) // (TILE_BYTES_PER_ELEM * v)
        n = min(num_tokens, _round_down(n, TOKEN_ALIGN))
    v = min(v, MAX_VOCAB_CHUNK)
    if v >= vocab:
        v = vocab
    else:
        v = min(vocab, _round_down(v, VOCAB_ALIGN))
    return XlaPlan(token_chunk=max(1, n), vocab_chunk=max(1, v))


#: Bytes per element of a forward row chunk and fp32 array: an op's chunk holds ``arrays``
#: of them (linear_jsd: both heads' logits; linear_topk_kl: the logits and their copy
#: masked at the ids). XLA's compiled temporaries of the differentiated call on an H100 at
#: the default budget: 1826 MiB of 1843 (linear_jsd, llama 8B <- 70B heads, 4096 tokens;
#: benchmarks/results/jax-distill-H100-2026-11-26.md); on a CPU, XLA keeps up to three
#: times more fp32 temporaries per chunk.
ROW_BYTES_PER_ELEM = 4
#: Kept columns are a multiple of this (the column tiles of every backend's recompute
#: kernels divide it, so the recomputed columns start on a tile).
KEEP_ALIGN = 256
#: Rows of a forward chunk the kept-dz plan reserves before it keeps columns: fewer rows
#: would re-read the weight too often (its GEMMs turn bandwidth-bound near 300 rows on an
#: H100, bf16).
KEEP_MIN_ROWS = 512


class RowsPlan(NamedTuple):
    """How an op whose statistics need full rows (linear_jsd, linear_topk_kl) runs its
    forward: ``rows`` tokens per chunk (every head's fp32 logits of the chunk's full rows
    at once), and ``keep`` leading columns of each token's dz computed there and kept for
    the backward (0: the backward recomputes every column; V: no column)."""

    rows: int
    keep: int


def rows_plan(num_tokens: int, vocab: int, itemsize: int, budget: int, *, arrays: int = 1,
              keep: bool = False) -> RowsPlan:
    """The forward's row chunk and the kept columns under ``budget`` (bytes).

    A chunk of r rows costs ``arrays x ROW_BYTES_PER_ELEM x r x vocab`` bytes (plus, when
    keeping, its dz in the input dtype, itemsize x r x vocab, written into the kept
    buffer). Without ``keep``: the most rows that fit (a multiple of TOKEN_ALIGN, at
    least TOKEN_ALIGN). With ``keep`` (a backward follows): a chunk of KEEP_MIN_ROWS rows
    (or all tokens) first, then as many leading columns of the (tokens x vocab) dz as the
    rest holds (``itemsize x tokens`` bytes per column, a multiple of KEEP_ALIGN, none
    below it); when every column is kept, the rows grow into what is left. The backward
    then needs only the GEMMs of the kept columns (no recomputed logits) and recomputes
    the others. Pure arithmetic of static sizes.
    """
    per_row = arrays * ROW_BYTES_PER_ELEM * vocab
    n = max(1, num_tokens)
    fit = _round_down(budget // max(1, per_row), TOKEN_ALIGN)
    if not keep:
        return RowsPlan(rows=min(n, fit), keep=0)
    rows = min(n, max(TOKEN_ALIGN, min(fit, KEEP_MIN_ROWS)))
    left = budget - rows * per_row
    cols = max(0, left) // max(1, itemsize * n)
    if cols >= vocab:
        more = (budget - n * vocab * itemsize) // max(1, per_row)
        return RowsPlan(rows=min(n, max(rows, _round_down(more, TOKEN_ALIGN))), keep=vocab)
    cols = cols // KEEP_ALIGN * KEEP_ALIGN
    return RowsPlan(rows=rows, keep=cols)


#: The "triton" backend's tables are the torch side's (``logitless.planning.tiles``):
#: ``CUDA_TILES`` where ``BIG_SMEM_CC`` (>= 160 KiB of shared memory per block),
#: ``CUDA_TILES_SMALL_SMEM`` on other GPUs, ``INTERPRETER_TILES`` on Triton's CPU
#: interpreter; ``WAVES`` forward programs per SM, backward chunks of at least
#: ``MIN_CHUNK`` columns on GPUs, a persistent dlogits kernel (one program per SM) from
#: ``PERSISTENT_MIN_ROW_BLOCKS`` row blocks on, ``group_rows_for`` row blocks per group.


def triton_plan(num_tokens: int, vocab: int, hidden: int, itemsize: int, budget: int, *,
                interpret: bool, compute_capability: int = 90, num_sms: int = 132) -> TritonPlan:
    """The "triton" backend's plan (``logitless.planning.tiles.TritonPlan``, the torch
    side's; keep_cols, tma, dz_tma and w_chunk stay at their defaults); pure arithmetic
    of static sizes.

    Memory of the backward (the forward keeps only O(tokens x splits) fp32 partials):
    the fp32 dx accumulator (4 x tokens x hidden bytes, when more than one chunk) and
    per chunk of c columns a dz buffer (tokens x c x itemsize) plus the fp32 dW chunk
    XLA's GEMM writes before the cast (c x hidden x 4). c is the widest multiple of
    block_v that fits the budget, at least MIN_CHUNK (GPUs) or 2 x block_v (the
    interpreter): below that minimum the budget is exceeded by it.
    """
    if interpret:
        tiles = INTERPRETER_TILES
    elif compute_capability in BIG_SMEM_CC:
        tiles = CUDA_TILES[itemsize]
    else:
        tiles = CUDA_TILES_SMALL_SMEM[itemsize]
    block_n, block_v, block_h, num_warps, num_stages = tiles
    row_blocks = -(-num_tokens // block_n)
    vocab_blocks = -(-vocab // block_v)
    want = -(-WAVES * num_sms // max(1, row_blocks))
    blocks_per_split = -(-vocab_blocks // max(1, min(want, vocab_blocks)))
    splits = -(-vocab_blocks // blocks_per_split)
    padded = vocab_blocks * block_v
    per_col = num_tokens * itemsize + 4 * hidden
    acc = 4 * num_tokens * hidden
    if budget >= per_col * vocab:
        chunk = padded  # one chunk covers V: dx = dz @ w, no accumulator
    else:
        chunk = max(0, budget - acc) // per_col // block_v * block_v
    min_chunk = 2 * block_v if interpret else MIN_CHUNK
    chunk = max(min(min_chunk, padded), min(chunk, padded))
    group_n = 1 if interpret else group_rows_for(num_sms, block_n, block_v)
    persistent = not interpret and row_blocks >= PERSISTENT_MIN_ROW_BLOCKS
    return TritonPlan(block_n, block_v, block_h, num_warps, num_stages, splits, chunk,
                      group_n=group_n, flatten=not interpret, dlogits_programs=1 if persistent else 0)
