"""The distillation (generalized Jensen-Shannon) formulas, written once for the torch side.

Both ops (``jsd`` on logits, ``linear_jsd`` from hidden states) and both backends use
this module (the Triton kernels use its twin, ``triton_lib.jsd_math``). Notation, per
token (a row), for class c:

    zs_c, zt_c  student / teacher logits after their optional soft-caps s * tanh(z / s)
    a_c = zs_c / T,  b_c = zt_c / T                   temperature T divides both
    lp_c = a_c - lse(a),  lq_c = b_c - lse(b)         log p (student), log q (teacher)
    lm_c = log(beta q_c + (1 - beta) p_c)             the mixture, for 0 < beta < 1

Loss of a token (the convention of TRL's ``generalized_jsd_loss``, liger and Helion):

    0 < beta < 1:  beta * KL(q || m) + (1 - beta) * KL(p || m)
    beta == 0:     KL(q || p)      (forward KL: teacher || student; exactly, not a limit
    beta == 1:     KL(p || q)       reverse KL: student || teacher; of the mixture form,
                                    which tends to 0 at both ends)
    + hard_label_weight * CE(zs, target)   (student cross-entropy at temperature 1)

No T**2 factor (as TRL). Written with lm := lp for beta == 0 and lm := lq for beta == 1,
every case is   loss = wq * K + wp * S + hlw * (lse(zs) - zs_target)   with the row sums

    S = sum_c p_c (lp_c - lm_c),   K = sum_c q_c (lq_c - lm_c)
    (wq, wp) = (beta, 1 - beta) for 0 < beta < 1, (1, 0) for beta == 0, (0, 1) for beta == 1

(0 * log 0 = 0: classes with p_c = 0, e.g. a -inf bias, contribute nothing).

Gradient with respect to the student's scaled logit a_j (derivation: with dL/dp_c
treating p as free, loss = beta sum q lq + (1-beta) sum p lp - sum m lm gives
dL/dp_c = (1 - beta)(lp_c - lm_c), and through the softmax dp_c/da_j = p_c (d_cj - p_j)):

    dL/da_j = wp * p_j * (lp_j - lm_j - S) + c0 * (p_j - q_j),   c0 = 1 iff beta == 0

(beta == 1 gives p_j (lp_j - lq_j - KL(p||q)), beta == 0 gives p_j - q_j). NOT
(1 - beta) * (p - m), which finite differences reject. With the upstream gradient g
of the token's loss, the gradient with respect to the student's pre-cap logit is

    dz_j = g * [ dL/da_j / T + hlw * (p1_j - [j == target]) ] * (1 - (zs_j / s)**2)

with p1 = softmax(zs) (temperature 1) and the last factor only with a soft-cap s. S
depends on the whole row, so a gradient needs the row statistics (lse(a), lse(b), S,
lse(zs)) from a full sweep first: the backends compute them in the forward and the
backward only evaluates the line above. The teacher gets no gradient.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import reduce as _reduce
from logitless.options import JSDOptions

#: Rows of the (6, N) statistics tensor that the forward ops return.
LSE_S, LSE_T, S_ROW, K_ROW, LSE1, ZTGT = range(6)
NUM_STATS = 6


def log_mixture(lp: Tensor, lq: Tensor, beta: float) -> Tensor:
    """lm of the module docstring (lp for beta == 0, lq for beta == 1)."""
    if beta == 0.0:
        return lp
    if beta == 1.0:
        return lq
    return torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))


def _plogratio(p: Tensor, lp: Tensor, lm: Tensor) -> Tensor:
    """p * (lp - lm) with 0 where p == 0 (NaN stays NaN)."""
    return torch.where(p == 0, torch.zeros_like(p), p * (lp - lm))


def row_stats(zs: Tensor, zt: Tensor, target: Tensor, opts: JSDOptions) -> Tensor:
    """The (6, rows) statistics of full rows of soft-capped logits zs, zt (rows, V),
    in their (float32 or float64) dtype: lse(a), lse(b), S, K, lse(zs), zs[target]."""
    t = opts.temperature
    a, b = zs / t, zt / t
    lse_s = torch.logsumexp(a, dim=1)
    lse_t = torch.logsumexp(b, dim=1)
    # NaN anywhere in a row must make its statistics NaN (logsumexp may skip it).
    lse_s = lse_s + a.sum(dim=1) * 0
    lse_t = lse_t + b.sum(dim=1) * 0
    lp = a - lse_s[:, None]
    lq = b - lse_t[:, None]
    lm = log_mixture(lp, lq, opts.beta)
    s = _plogratio(lp.exp(), lp, lm).sum(dim=1)
    k = _plogratio(lq.exp(), lq, lm).sum(dim=1)
    v = zs.shape[1]
    if opts.needs_lse1:
        lse1 = torch.logsumexp(zs, dim=1) + zs.sum(dim=1) * 0
        ztgt = zs.gather(1, target.clamp(0, v - 1)[:, None])[:, 0]
    else:
        lse1 = ztgt = torch.zeros_like(lse_s)
    return torch.stack([lse_s, lse_t, s, k, lse1, ztgt])


def token_loss(stats: Tensor, target: Tensor, num_classes: int, opts: JSDOptions) -> Tensor:
    """Per-token loss from the statistics (0 at ignored tokens; NaN at a non-ignored
    target outside [0, V) when the hard-label term is on)."""
    wq, wp, _ = opts.weights
    loss = wq * stats[K_ROW] + wp * stats[S_ROW]
    valid = target != opts.ignore_index
    if opts.hard_label_weight != 0.0:
        loss = loss + opts.hard_label_weight * (stats[LSE1] - stats[ZTGT])
        bad = valid & ((target < 0) | (target >= num_classes))
        loss = torch.where(bad, torch.full_like(loss, float("nan")), loss)
    return torch.where(valid, loss, torch.zeros_like(loss))


def reduce(loss_tok: Tensor, target: Tensor, reduction: str, ignore_index: int) -> Tensor:
    """"mean" over non-ignored tokens (0/0 = NaN when there are none), "sum", "none".
    Plain differentiable torch ops: autograd hands the per-token gradient to the op."""
    return _reduce(loss_tok, (target != ignore_index).to(loss_tok.dtype), reduction)


def dlogits(
    zs: Tensor, zt: Tensor, stats: Tensor, g: Tensor, target: Tensor, col0: int,
    opts: JSDOptions, zs_raw: Optional[Tensor] = None,
) -> Tensor:
    """d loss / d (pre-cap) student logits for a tile of columns col0.. (module docstring).

    zs, zt: soft-capped logits of the tile (rows, cols); stats: (6, rows); g: (rows,)
    upstream gradient, already 0 at ignored tokens. zs_raw is unused (the soft-cap factor
    is computed from the capped zs)."""
    t = opts.temperature
    wq, wp, c0 = opts.weights
    lp = zs / t - stats[LSE_S][:, None]
    lq = zt / t - stats[LSE_T][:, None]
    p = lp.exp()
    da = torch.zeros_like(zs)
    if wp != 0.0:
        lm = log_mixture(lp, lq, opts.beta)
        r = torch.where(p == 0, torch.zeros_like(p), p * (lp - lm - stats[S_ROW][:, None]))
        da = da + wp * r
    if c0 != 0.0:
        da = da + c0 * (p - lq.exp())
    dz = da * (g / t)[:, None]
    if opts.hard_label_weight != 0.0:
        p1 = (zs - stats[LSE1][:, None]).exp()
        cols = torch.arange(col0, col0 + zs.shape[1], device=zs.device)
        hit = (cols[None, :] == target[:, None]).to(zs.dtype)
        dz = dz + (opts.hard_label_weight * g)[:, None] * (p1 - hit)
    cap = opts.student_softcap
    if cap is not None:
        dz = dz * (1.0 - (zs / cap) ** 2)
    return dz


def upstream(grad_tok: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """The per-token upstream gradient, 0 at ignored tokens (also when it is inf/NaN)."""
    valid = target != ignore_index
    return torch.where(valid, grad_tok, torch.zeros_like(grad_tok))
