"""The Triton form of ``formulas.log_probs``: the online statistics with the entropy
term and the gradient epilogue, shared by the log-prob kernels (linear and on logits),
and the row-block prologue and scaled tile of the split forward kernels
(``log_probs_kernels.logp_forward_kernel``, ``log_probs_candidates``; their partials
epilogue is ``ce_math.store_partials``)."""

import triton
import triton.language as tl

from logitless.triton_lib.ce_math import splits_max
from logitless.triton_lib.tile_io import block_tile


@triton.jit
def row_tokens(token_ptr, pid_n, N, V, BLOCK_N: tl.constexpr):
    """(offs_n, row_ok, token) of row block pid_n. A token outside [0, V) (another
    shard's, or invalid) becomes -1: it matches no column, not even padding."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    token = tl.load(token_ptr + offs_n, mask=row_ok, other=-1)
    token = tl.where((token >= 0) & (token < V), token, -1)
    return offs_n, row_ok, token


@triton.jit
def online_start(BLOCK_N: tl.constexpr):
    """(m, s, u, a_t) per row before the first tile: -inf, 0, 0, 0."""
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    u = tl.zeros((BLOCK_N,), tl.float32)
    a_t = tl.zeros((BLOCK_N,), tl.float32)
    return m, s, u, a_t


@triton.jit
def split_blocks(split, blocks_per_split, V, BLOCK_V: tl.constexpr):
    """(first block, number of blocks) of vocabulary split ``split``."""
    first_block = split * blocks_per_split
    num_blocks = tl.minimum(blocks_per_split, tl.cdiv(V, BLOCK_V) - first_block)
    return first_block, num_blocks


@triton.jit
def scaled_tile(x_ptr, w_ptr, b_ptr, pid_n, block, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, softcap,
                inv_temp, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
                USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                w_row0=0):
    """(offs_v, col_ok, a): ``tile_io.block_tile``'s columns and mask of vocabulary block
    ``block`` and a = softcap(z) / T there (fp32, -inf past V); USE_TMA: x_ptr and w_ptr
    are tensor descriptors, ``w_row0`` as ``block_tile``'s."""
    offs_v, col_ok, z = block_tile(
        x_ptr, w_ptr, b_ptr, pid_n, block, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh,
        softcap, HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, USE_TMA, BLOCK_N, BLOCK_V, BLOCK_H, w_row0,
    )
    return offs_v, col_ok, tl.where(col_ok[None, :], z * inv_temp, float("-inf"))


@triton.jit
def online_entropy_update(a, m, s, u, ENTROPY: tl.constexpr):
    """One online step over a (BLOCK_N, BLOCK_V) tile of scaled logits a (fp32, -inf in
    masked columns): returns the new max m, s = sum exp(a - m), u = sum exp(a - m)(a - m)
    (updated only with ENTROPY), the tile's e = exp(a - m_safe) and m_safe (m, or 0
    while a row is all -inf so far). When m grows to m': u <- e^(m - m') (u + (m - m') s)."""
    tile_max = tl.max(a, 1)
    m_new = tl.maximum(m, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    d = m - m_safe
    scale = tl.exp(d)
    shifted = a - m_safe[:, None]
    e = tl.exp(shifted)
    if ENTROPY:
        corr = tl.where(s > 0.0, d * s, 0.0)
        u = scale * (u + corr) + tl.sum(tl.where(e > 0.0, e * shifted, 0.0), 1)
    s = s * scale + tl.sum(e, 1)
    return m_new, s, u, e, m_safe


@triton.jit
def logp_dz_tile(p, logp, lse, offs_v, token, ca, cb, cc, softcap, temperature,
                 HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr):
    """dz_j = p_j (A + C log p_j) - B [j == t], times 1 - (z_j / s)^2 with a soft-cap;
    (A, B, C) per row from ``formulas.log_probs.grad_coefficients`` (1/T folded in;
    loaded by ``ce_math.load_row_coefficients``).
    p_j = 0 gives 0 for the first term (no 0 * inf where a column is -inf). The capped
    logit is recomputed from log p, z_j = T (log p_j + lse), so that only two tiles
    (p, log p) are live at once (registers: a third fp32 tile would spill)."""
    if ENTROPY:
        dz = tl.where(p > 0.0, p * (ca[:, None] + cc[:, None] * logp), 0.0)
    else:
        dz = p * ca[:, None]
    dz -= tl.where(offs_v[None, :] == token[:, None], cb[:, None], 0.0)
    if HAS_SOFTCAP:
        capped = (logp + lse[:, None]) * (temperature / softcap)
        dz *= 1.0 - capped * capped
    return dz


@triton.jit
def epilogue_block(part_max, tokens_ptr, N, V, SPLITS, ignore_index, BLOCK: tl.constexpr):
    """The prologue of a per-token epilogue program over (SPLITS, N) vocabulary-split
    partials: its BLOCK token offsets, their mask, the shift m_safe of the merge
    (``ce_math.splits_max``), and which tokens are valid (not ignore_index) and which are
    bad (valid but outside [0, V)): the log-prob ops give 0 at ignored tokens and NaN at
    bad ones (``token_value``)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    m_safe = splits_max(part_max, offs, ok, N, SPLITS)
    t = tl.load(tokens_ptr + offs, mask=ok, other=ignore_index)
    valid = t != ignore_index
    bad = valid & ((t < 0) | (t >= V))
    return offs, ok, m_safe, t, valid, bad


@triton.jit
def merge_split(part_max, part_sum, s, N, offs, ok, m_safe, total):
    """Split s's step of the merge of (SPLITS, N) partial sums at the common shift m_safe
    of ``epilogue_block`` (``formulas.log_probs.merge_splits``): d = m_s - m_safe and the
    split's sum s_s at offs; returns (total + s_s e^d, d, e^d, s_s), total unchanged where
    not ``ok`` (tokens past N, splits past the last)."""
    d = tl.load(part_max + s * N + offs, mask=ok, other=0.0) - m_safe
    scale = tl.exp(d)
    ps = tl.load(part_sum + s * N + offs, mask=ok, other=0.0)
    return total + tl.where(ok, ps * scale, 0.0), d, scale, ps


@triton.jit
def token_value(x, valid, bad):
    """x at valid tokens, 0 at ignored ones, NaN at out-of-range ones."""
    return tl.where(bad, float("nan"), tl.where(valid, x, 0.0))
