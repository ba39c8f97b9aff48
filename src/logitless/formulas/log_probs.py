"""Token log-probabilities and entropy at a temperature, written once (the spec).

For a token's row of logits z (from x @ W.T + b, or given), soft-capped first when
``softcap`` s is set (z <- s * tanh(z / s)), and a temperature T > 0:

    a_c   = z_c / T                     (fp32 from the fp32 logits: x / T is never rounded)
    lse   = log sum_c exp(a_c)
    logp  = a_t - lse                   t = the token
    H     = lse - sum_c p_c a_c = -sum_c p_c log p_c,   p = softmax(a)

Statistics a backend computes from each row, in one streaming pass (online, over
column tiles): the running max m, s = sum_c exp(a_c - m), u = sum_c exp(a_c - m) (a_c - m)
(only with entropy) and a_t. When m grows to m', s <- e^(m - m') s + ... and
u <- e^(m - m') (u + (m - m') s) + ...; at the end lse = m + log s and H = log s - u / s
(u / s = E_p[a - m] <= 0: no cancellation between large numbers).

Merge of split statistics (vocabulary splits of one kernel, or vocabulary shards of
tensor-parallel ranks): parts k = 1..K each hold (m_k, s_k, u_k, a_t,k) over their
columns (a_t,k = 0 where the token is elsewhere). Then

    M = max_k m_k                                   (an all-reduce of max)
    s = sum_k e^(m_k - M) s_k                       (then one all-reduce of sum of the
    u = sum_k e^(m_k - M) (u_k + (m_k - M) s_k)      three rescaled local terms)
    a_t = sum_k a_t,k

(a part with m_k = -inf contributes 0; M = 0 when every part is -inf). ``merge_splits``
below is that merge along one tensor dimension. A part's finished statistics (its own
lse_k and H_k, e.g. a backend's forward on one vocabulary shard, the token given
relative to the shard: a_t,k = 0 when the token is elsewhere) are the partials
(m_k, s_k, u_k) = (lse_k, 1, -H_k) (``partials_of``). The backward on a shard then needs
only the merged lse and H (the coefficients below), the shard's columns and the token
relative to the shard.

Outputs: logp and H per token in fp32 (fp64 for fp64 inputs on the torch backend), 0
at tokens equal to ``ignore_index``; a token outside [0, V) gives NaN (the CPU raises
instead, ``validate.check_targets_in_range``).

Gradient. For upstream gradients g_lp (of logp) and g_H (of H) of one token,

    d/da_j = g_lp ([j == t] - p_j) - g_H p_j (log p_j + H)

so with respect to the soft-capped logit z_j (1/T folded into the coefficients)

    dz_j = p_j (A + C log p_j) - B [j == t]
    A = -(g_lp + g_H H) / T,   B = -g_lp / T,   C = -g_H / T

and with a soft-cap the chain rule multiplies by (1 - (z_j / s)^2). log p_j = a_j - lse
is formed directly (never log of an underflowed p): p_j log p_j -> 0 as p_j -> 0.
Without entropy C = 0 and kernels skip the log. Coefficients are 0 at ignored tokens
(whatever g is there) and NaN at out-of-range tokens.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype, sub_at_target_
from logitless.options import LogProbOptions


class LogProbStats(NamedTuple):
    """Per-token statistics of a row (compute dtype: fp32, or fp64 for fp64 inputs)."""

    lse: Tensor  # (N,) logsumexp of a = softcap(z) / T
    target: Tensor  # (N,) a at the token (any value when out of range)
    entropy: Optional[Tensor]  # (N,) H; None without entropy


def online_update(a: Tensor, m: Tensor, s: Tensor, u: Optional[Tensor]):
    """One step of the online statistics over a (rows, cols) tile a (-inf in masked
    columns): returns the new (m, s, u); u None without entropy. Torch form of
    ``triton_lib.log_probs_math.online_entropy_update``. ``a`` is overwritten."""
    m_new = torch.maximum(m, a.max(dim=1).values)
    m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
    d = m - m_safe  # -inf while the row had nothing (then s = u = 0)
    scale = torch.exp(d)
    a.sub_(m_safe[:, None])  # a - m'
    e = torch.exp(a)
    s_new = s * scale + e.sum(dim=1)
    u_new = None
    if u is not None:
        corr = torch.where(s > 0, d * s, torch.zeros_like(s))
        ea = torch.where(e > 0, e * a, torch.zeros_like(e))
        u_new = scale * (u + corr) + ea.sum(dim=1)
    return m_new, s_new, u_new


def finish(m: Tensor, s: Tensor, u: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """lse and H from one part's (m, s, u). NaN in a row propagates through s."""
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    lse = m_safe + torch.log(s)
    ent = None if u is None else torch.log(s) - u / s
    return lse, ent


def merge_splits(part_max: Tensor, part_sum: Tensor, part_u: Optional[Tensor], dim: int = 0):
    """(lse, H or None) of rows reduced in parts along ``dim`` (the module docstring's
    merge). Tensor parallelism: the same with all-reduces (max of part_max, then sum of
    the rescaled part_sum and part_u terms)."""
    big_m = part_max.max(dim=dim).values
    m_safe = torch.where(big_m == float("-inf"), torch.zeros_like(big_m), big_m)
    d = part_max - m_safe.unsqueeze(dim)
    scale = torch.exp(d)
    s = (part_sum * scale).sum(dim=dim)
    u = None
    if part_u is not None:
        corr = torch.where(part_sum > 0, d * part_sum, torch.zeros_like(part_sum))
        u = (scale * (part_u + corr)).sum(dim=dim)
    return finish(big_m, s, u)


def partials_of(lse: Tensor, entropy: Optional[Tensor]):
    """(m, s, u) of a part whose finished statistics are (lse, H): (lse, 1, -H)."""
    return lse, torch.ones_like(lse), (-entropy if entropy is not None else None)


def token_outputs(stats: LogProbStats, tokens: Tensor, num_classes: int, opts: LogProbOptions):
    """(logp, H or None) per token: 0 at ignored tokens, NaN at out-of-range ones."""
    dt = compute_dtype(stats.lse.dtype)
    valid = tokens != opts.ignore_index
    bad = valid & ((tokens < 0) | (tokens >= num_classes))

    def clean(t: Tensor) -> Tensor:
        t = torch.where(valid, t.to(dt), torch.zeros((), dtype=dt, device=t.device))
        return torch.where(bad, torch.full_like(t, float("nan")), t)

    logp = clean(stats.target.to(dt) - stats.lse.to(dt))
    return logp, (clean(stats.entropy) if stats.entropy is not None else None)


def grad_coefficients(entropy: Optional[Tensor], tokens: Tensor, g_lp: Optional[Tensor],
                      g_h: Optional[Tensor], num_classes: int, opts: LogProbOptions,
                      like: Tensor) -> Tensor:
    """(A, B, C) of the module docstring as a (3, N) tensor in ``like``'s dtype (the
    compute dtype); missing upstream gradients count as 0."""
    dt = like.dtype
    zero = torch.zeros_like(like, dtype=dt)
    g_lp = g_lp.to(dt).reshape(-1) if g_lp is not None else zero
    inv_t = 1.0 / opts.temperature
    if g_h is not None and entropy is not None:
        g_h = g_h.to(dt).reshape(-1)
        a = -(g_lp + g_h * entropy.to(dt)) * inv_t
        c = -g_h * inv_t
    else:
        a = -g_lp * inv_t
        c = zero
    coef = torch.stack([a, -g_lp * inv_t, c])
    valid = tokens != opts.ignore_index
    bad = valid & ((tokens < 0) | (tokens >= num_classes))
    coef = torch.where(valid, coef, torch.zeros_like(coef))
    return torch.where(bad, torch.full_like(coef, float("nan")), coef)


def scaled_logits_(z: Tensor, opts: LogProbOptions) -> Tensor:
    """z (already soft-capped) -> a = z / T, in place."""
    if opts.temperature != 1.0:
        z.div_(opts.temperature)
    return z


def dlogits_(a: Tensor, lse: Tensor, coef: Tensor, tokens: Tensor, col0: int, opts: LogProbOptions) -> Tensor:
    """A tile of scaled logits a = softcap(z) / T (rows: tokens, columns col0..) ->
    d / d (pre-cap) z, in place: the PyTorch form of the kernels' epilogue. One more
    tile with a soft-cap (its factor) or with entropy (p), none otherwise."""
    a_coef, b, c = coef
    factor = None
    if opts.softcap is not None:
        capped = a * (opts.temperature / opts.softcap)
        factor = capped.square_().neg_().add_(1.0)
    a.sub_(lse[:, None])  # log p
    if opts.entropy:
        p = torch.exp(a)
        a.mul_(c[:, None]).add_(a_coef[:, None]).mul_(p)
        a.masked_fill_(p == 0, 0.0)  # p log p -> 0 (a = -inf columns: no 0 * inf)
        del p
    else:
        a.exp_().mul_(a_coef[:, None])
    sub_at_target_(a, tokens, col0, b)
    if factor is not None:
        a.mul_(factor)
    return a
