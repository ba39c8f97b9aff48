"""The Triton form of ``formulas.cross_entropy``'s per-element formulas, shared by every op's kernels."""

import triton
import triton.language as tl


@triton.jit
def softcap_tile(z, softcap):
    """s * tanh(z / s), with tanh(y) = 1 - 2 / (exp(2y) + 1): exact limits at +-inf."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0))


@triton.jit
def target_rows(z_ptr, target_ptr, N, V, stride_n, stride_v, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """The start of a row-block kernel on logits the caller holds (program i: rows
    [i*BLOCK_N, (i+1)*BLOCK_N)): (row offsets, row mask, the rows' pointers, the column
    offsets of one tile, whether the target is in [0, V), the target logit in fp32, 0
    where not; one load per row rather than a compare per element)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    target = tl.load(target_ptr + offs_n, mask=row_ok, other=-1)
    rows = z_ptr + offs_n.to(tl.int64)[:, None] * stride_n
    t_ok = row_ok & (target >= 0) & (target < V)
    z_t = tl.load(z_ptr + offs_n.to(tl.int64) * stride_n + target.to(tl.int64) * stride_v,
                  mask=t_ok, other=0.0).to(tl.float32)
    return offs_n, row_ok, rows, tl.arange(0, BLOCK_V), t_ok, z_t


@triton.jit
def logits_tile(z_ptr, N, V, stride_n, stride_v, softcap, HAS_SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_V: tl.constexpr):
    """The tile (program_id(0), program_id(1)) of logits the caller holds, fp32 and
    soft-capped (HAS_SOFTCAP), 0 outside the N x V logits; with its row and column offsets,
    row mask, tile mask and the int64 row / column indices (to address dz the same way)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = offs_n < N
    mask = row_ok[:, None] & (offs_v < V)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    cols = offs_v.to(tl.int64)[None, :]
    z = tl.load(z_ptr + rows * stride_n + cols * stride_v, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        z = softcap_tile(z, softcap)
    return z, offs_n, offs_v, row_ok, mask, rows, cols


@triton.jit
def dz_tile(p, z, offs_v, target, a, b, c, cw_ptr, V, softcap,
            HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr, BLOCK_V: tl.constexpr):
    """dz_c = p_c * A - B * [c == t] - C * w_c, times 1 - (z_c/s)^2 with a soft-cap
    (``formulas.cross_entropy``'s one gradient line). p, z: (BLOCK_N, BLOCK_V) fp32, z the capped
    logits (only read with HAS_SOFTCAP); a, b, c, target per row; w_c = 1 without
    class weights."""
    if HAS_CW:
        cw = tl.load(cw_ptr + offs_v, mask=offs_v < V, other=0.0).to(tl.float32)
    else:
        cw = tl.full((BLOCK_V,), 1.0, tl.float32)
    dz = p * a[:, None] - tl.where(offs_v[None, :] == target[:, None], b[:, None], 0.0)
    dz -= c[:, None] * cw[None, :]
    if HAS_SOFTCAP:
        capped = z / softcap
        dz *= 1.0 - capped * capped
    return dz


@triton.jit
def online_lse_update(z, m, s):
    """One step of the online log-sum-exp over a (BLOCK_N, BLOCK_V) tile z (fp32, -inf
    in masked columns): returns the new running max m and sum s = sum exp(z - m), the
    tile's exp(z - m_safe), m_safe (the shift used: m, or 0 while a row is all -inf so
    far, so that no inf - inf appears) and the tile's row maxima."""
    tile_max = tl.max(z, 1)
    m_new = tl.maximum(m, tile_max)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    e = tl.exp(z - m_safe[:, None])
    s = s * tl.exp(m - m_safe) + tl.sum(e, 1)
    return m_new, s, e, m_safe, tile_max


@triton.jit
def side_stats_update(z, tile_max, offs_v, smooth, best, best_idx, cw_ptr, V,
                      NEED_SMOOTH: tl.constexpr, NEED_ARGMAX: tl.constexpr,
                      HAS_CW: tl.constexpr, BLOCK_V: tl.constexpr):
    """The optional per-row statistics of a tile: smooth += sum_c w_c z_c (label
    smoothing) and the first argmax so far (best value, best index; ties keep the
    earlier column, as torch.argmax). Tiles must come in increasing column order."""
    col_ok = offs_v < V
    if NEED_SMOOTH:
        if HAS_CW:
            cw = tl.load(cw_ptr + offs_v, mask=col_ok, other=0.0).to(tl.float32)
        else:
            cw = tl.full((BLOCK_V,), 1.0, tl.float32)
        smooth += tl.sum(tl.where(col_ok[None, :], z * cw[None, :], 0.0), 1)
    if NEED_ARGMAX:
        idx = tl.min(tl.where(z == tile_max[:, None], offs_v[None, :], V), 1)
        better = tile_max > best
        best_idx = tl.where(better, idx, best_idx)
        best = tl.where(better, tile_max, best)
    return smooth, best, best_idx


@triton.jit
def load_row_coefficients(lse_ptr, coef_ptr, target_ptr, offs_n, row_ok, N):
    """Per-row inputs of ``dz_tile`` (and of ``log_probs_math.logp_dz_tile``): lse, A, B, C
    (coef is the (3, N) fp32 tensor of ``formulas.cross_entropy.grad_coefficients``, or of
    ``formulas.log_probs.grad_coefficients``) and the target; neutral values past N."""
    lse = tl.load(lse_ptr + offs_n, mask=row_ok, other=0.0)
    a = tl.load(coef_ptr + offs_n, mask=row_ok, other=0.0)
    b = tl.load(coef_ptr + N + offs_n, mask=row_ok, other=0.0)
    c = tl.load(coef_ptr + 2 * N + offs_n, mask=row_ok, other=0.0)
    target = tl.load(target_ptr + offs_n, mask=row_ok, other=-1)
    return lse, a, b, c, target


#: Splits read per step of the merges over splits (``splits_max``, the epilogues' sums):
#: their loads issued together, then added in split order (the sequential sum's bits; a
#: one-at-a-time loop waits one memory round trip per split).
SPLIT_STEP = 16


@triton.jit
def split_ok(s, SPLITS, ok):
    """The mask of split s's row at the tokens ``ok`` (False past the last split): a
    tensor of ok's shape even where s and SPLITS are constants (no Python bool in a mask)."""
    return tl.where(ok, s, SPLITS) < SPLITS


@triton.jit
def splits_max(part_max, offs, ok, N, SPLITS, STEP: tl.constexpr = SPLIT_STEP):
    """M = max over the vocabulary splits of the per-split maxima part_max[s, offs] ((SPLITS,
    N) fp32, row-major), NaN propagated, with -inf (a row no split saw) replaced by 0: the
    shift of the merge lse = M + log sum_s s_s exp(m_s - M) (``formulas.merge_splits``).
    STEP splits per step (their loads in flight together)."""
    big_m = tl.load(part_max + offs, mask=ok, other=0.0)
    for s0 in range(1, SPLITS, STEP):
        for j in tl.static_range(STEP):
            m_s = tl.load(part_max + (s0 + j) * N + offs, mask=split_ok(s0 + j, SPLITS, ok), other=float("-inf"))
            big_m = tl.maximum(big_m, m_s, propagate_nan=tl.PropagateNan.ALL)
    return tl.where(big_m == float("-inf"), 0.0, big_m)


@triton.jit
def store_partials(part_max_ptr, part_sum_ptr, part_u_ptr, part_tgt_ptr, split, N, offs_n, row_ok, m, s, u, a_t,
                   EXTRA: tl.constexpr):
    """A split's per-row statistics into (splits, N) fp32 buffers: the running max m, the
    sum s, the target logit a_t and, with EXTRA, a fourth one u (the log-prob kernels'
    entropy sum, linear_cross_entropy's smoothing sum). Returns the rows' flat offsets
    (split * N + row) for further per-split outputs."""
    out = split.to(tl.int64) * N + offs_n
    tl.store(part_max_ptr + out, m, mask=row_ok)
    tl.store(part_sum_ptr + out, s, mask=row_ok)
    tl.store(part_tgt_ptr + out, a_t, mask=row_ok)
    if EXTRA:
        tl.store(part_u_ptr + out, u, mask=row_ok)
    return out
