"""TRL's extra per-token fields (``integrations.trl_fields``) in the log-prob forward's one
pass, framework-free (triton + triton_lib only).

``fields_update``: what ``log_probs_kernels.logp_forward_kernel`` adds per tile under
``FIELDS``: s2 = sum exp(2(a - m)) (times e^(2(m - m')) when the running max grows to
m'), sum_a = sum of a over the real columns and the first argmax (``ce_math.side_stats_update``,
the cross-entropy kernels' own). ``fields_epilogue_kernel``: the merge over vocabulary
splits (as lse's: ``formulas.log_probs.merge_splits``; the argmax keeps the earlier split
on ties) and the fields of each token:

    log_sum_sq_probs = log(S2) - 2 log(S),   S, S2 the merged sums at the common max
    mean_logits      = sum_a / V
    is_top1          = argmax == token

0 (False) at ignored tokens, NaN at tokens outside [0, V) (False for is_top1).
"""

import triton
import triton.language as tl

from logitless.triton_lib.ce_math import side_stats_update
from logitless.triton_lib.log_probs_math import epilogue_block, merge_split, token_value


@triton.jit
def fields_update(a, m_prev, m_safe, e, offs_v, s2, zsum, best, best_idx, V, BLOCK_V: tl.constexpr):
    """One tile's step of the extra statistics: a (BLOCK_N, BLOCK_V) scaled logits (-inf
    in masked columns), m_prev the running max before the tile, m_safe and e = exp(a -
    m_safe) from ``log_probs_math.online_entropy_update`` of this tile."""
    scale = tl.exp(m_prev - m_safe)
    s2 = s2 * scale * scale + tl.sum(e * e, 1)
    zsum, best, best_idx = side_stats_update(a, tl.max(a, 1), offs_v, zsum, best, best_idx, V, V,
                                             True, True, False, BLOCK_V)
    return s2, zsum, best, best_idx


@triton.jit
def fields_epilogue_kernel(
    part_max, part_sum, part_s2, part_zsum, part_best, part_arg, tokens_ptr, sq_ptr, mean_ptr, top1_ptr,
    N, V, SPLITS, ignore_index, BLOCK: tl.constexpr,
):
    """(SPLITS, N) partials -> log_sum_sq_probs, mean_logits (fp32) and is_top1 (int8) per token."""
    offs, ok, m_safe, t, valid, bad = epilogue_block(part_max, tokens_ptr, N, V, SPLITS, ignore_index, BLOCK)
    total = tl.zeros((BLOCK,), tl.float32)
    total2 = tl.zeros((BLOCK,), tl.float32)
    zsum = tl.zeros((BLOCK,), tl.float32)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    arg = tl.zeros((BLOCK,), tl.int32)
    for s in range(0, SPLITS):
        total, _, scale, _ = merge_split(part_max, part_sum, s, N, offs, ok, m_safe, total)
        total2 += tl.load(part_s2 + s * N + offs, mask=ok, other=0.0) * scale * scale
        zsum += tl.load(part_zsum + s * N + offs, mask=ok, other=0.0)
        b = tl.load(part_best + s * N + offs, mask=ok, other=float("-inf"))
        better = b > best  # strict: an earlier split keeps a tie (torch.argmax's first index)
        arg = tl.where(better, tl.load(part_arg + s * N + offs, mask=ok, other=0), arg)
        best = tl.where(better, b, best)
    tl.store(sq_ptr + offs, token_value(tl.log(total2) - 2.0 * tl.log(total), valid, bad), mask=ok)
    tl.store(mean_ptr + offs, token_value(zsum / V, valid, bad), mask=ok)
    tl.store(top1_ptr + offs, (valid & (arg.to(tl.int64) == t.to(tl.int64))).to(tl.int8), mask=ok)
