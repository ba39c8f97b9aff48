"""The cross-entropy formulas for JAX, written once (the JAX twin of ``logitless/_loss_math.py``).

A backend reduces each token's row of logits to fp32 statistics; everything else is
computed here with O(tokens) work (no class weights on the JAX side, so w_c = 1):

    z_c   = logit of class c, after the optional soft-cap  z_c = s * tanh(z_c / s)
    lse   = log sum_c exp(z_c)
    z_t   = z at the target class t
    S     = sum_c z_c                 (only with label smoothing)

Loss of a token (eps = label_smoothing, V = number of classes):

    loss = (1 - eps) * (lse - z_t) + (eps / V) * (V * lse - S) + z_loss * lse**2

"mean" divides the sum over non-ignored tokens by their count (NaN when there is none,
as torch's 0/0); ignored tokens have loss 0 and gradient 0. A target outside [0, V)
that is not ``ignore_index`` gives that token a NaN loss and NaN gradient rows.

Gradient with respect to the (soft-capped) logit z_c for an upstream gradient g of the
token's loss (p_c = exp(z_c - lse)):

    dz_c = p_c * A - B * [c == t] - C
    A = g * ((1 - eps) + eps + 2 * z_loss * lse),  B = g * (1 - eps),  C = g * eps / V

times (1 - (z_c / s)**2) with a soft-cap. Backends evaluate only that line.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from logitless.options import CrossEntropyOptions


class LossStats(NamedTuple):
    """Extra per-token outputs, returned with ``return_stats=True``.

    lse: float32, shape of the target: log-sum-exp of each token's (soft-capped) logits.
    num_tokens: int32 scalar, the number of non-ignored tokens.
    """

    lse: jax.Array
    num_tokens: jax.Array


def _masks(target, num_classes: int, opts: CrossEntropyOptions):
    valid = target != opts.ignore_index
    in_range = (target >= 0) & (target < num_classes)
    return valid, in_range


def token_loss(lse, target_logit, smooth_sum, target, num_classes: int, opts: CrossEntropyOptions):
    """Per-token fp32 loss (0 at ignored tokens, NaN at out-of-range targets)."""
    valid, in_range = _masks(target, num_classes, opts)
    eps = opts.label_smoothing
    loss = (1.0 - eps) * (lse - target_logit)
    if eps > 0.0:
        loss = loss + (eps / num_classes) * (num_classes * lse - smooth_sum)
    if opts.z_loss != 0.0:
        loss = loss + opts.z_loss * lse * lse
    loss = jnp.where(valid, loss, 0.0)
    return jnp.where(valid & ~in_range, jnp.nan, loss).astype(jnp.float32)


def reduce_loss(loss, target, opts: CrossEntropyOptions):
    """The reduction, as torch ("mean" over non-ignored tokens; 0/0 = NaN)."""
    if opts.reduction == "none":
        return loss
    if opts.reduction == "sum":
        return jnp.sum(loss)
    count = jnp.sum(target != opts.ignore_index).astype(jnp.float32)
    return jnp.sum(loss) / count


def upstream_per_token(g, target, opts: CrossEntropyOptions):
    """Gradient g of each token's loss from the gradient of the reduced loss."""
    g = jnp.asarray(g, jnp.float32)
    if opts.reduction == "none":
        return g.reshape(-1)
    if opts.reduction == "sum":
        return jnp.broadcast_to(g, target.shape)
    count = jnp.sum(target != opts.ignore_index).astype(jnp.float32)
    return jnp.broadcast_to(g / count, target.shape)


def grad_coefficients(lse, target, g, num_classes: int, opts: CrossEntropyOptions):
    """A, B, C of the module docstring stacked as (3, N) fp32: zero at ignored tokens
    (also when g is inf/NaN there), NaN at out-of-range targets."""
    valid, in_range = _masks(target, num_classes, opts)
    eps = opts.label_smoothing
    a = jnp.full_like(lse, 1.0)  # (1 - eps) + (eps / V) * V
    if opts.z_loss != 0.0:
        a = a + 2.0 * opts.z_loss * lse
    b = jnp.full_like(lse, 1.0 - eps)
    c = jnp.full_like(lse, eps / num_classes)
    coef = jnp.stack([a, b, c]) * g[None, :]
    coef = jnp.where(valid[None, :], coef, 0.0)
    return jnp.where((valid & ~in_range)[None, :], jnp.nan, coef).astype(jnp.float32)


def softcap_logits(z, softcap: Optional[float]):
    """z -> s * tanh(z / s) (identity without a soft-cap)."""
    if softcap is None:
        return z
    return softcap * jnp.tanh(z / softcap)


def dlogits(z_capped, lse, coef, target, col0, softcap: Optional[float]):
    """d loss / d (pre-cap) logits of a tile of soft-capped fp32 logits (rows: tokens,
    columns: classes col0 ...). The one place the epilogue formula is written in JAX."""
    a, b, c = coef[0][:, None], coef[1][:, None], coef[2][:, None]
    cols = col0 + jnp.arange(z_capped.shape[1], dtype=target.dtype)
    hit = cols[None, :] == target[:, None]
    dz = jnp.exp(z_capped - lse[:, None]) * a - jnp.where(hit, b, 0.0) - c
    if softcap is not None:
        dz = dz * (1.0 - (z_capped / softcap) ** 2)
    return dz


def merge_lse_splits(part_lse):
    """lse of rows reduced in parts along axis 0 (each part's log-sum-exp): the JAX form
    of ``logitless.formulas.common.merge_splits`` (M = 0 where every part is -inf)."""
    m = part_lse.max(axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    return m_safe + jnp.log(jnp.exp(part_lse - m_safe).sum(axis=0))
