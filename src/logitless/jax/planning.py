"""Heuristics of the JAX backends in one place: memory budget and chunk sizes.

Everything that decides *how* (not *what*) is computed lives here, so that tuning
never touches the math or the kernels.
"""

from __future__ import annotations

from typing import NamedTuple

from logitless.options import DEFAULT_MEMORY_BUDGET  # noqa: F401  (the same default as the PyTorch side)

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
