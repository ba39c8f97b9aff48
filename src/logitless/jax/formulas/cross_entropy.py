"""The cross-entropy formulas for JAX, written once (the JAX twin of
``logitless.formulas.cross_entropy``, class weights included).

A backend reduces each token's row of logits to fp32 statistics (lse, the target's
logit z_t, and with label smoothing S = sum_c w_c z_c); everything else is computed
here with O(tokens) work, with the loss and gradient that
``logitless.formulas.cross_entropy``'s docstring derives: per token
(1 - eps) w_t (lse - z_t) + (eps / V) (W lse - S) + z_loss lse**2, and
dz_c = p_c A - B [c == t] - C w_c (times (1 - (z_c / s)**2) with a soft-cap), the one
line backends evaluate, A, B, C from ``grad_coefficients``.

"mean" divides the sum over non-ignored tokens by the sum of w_t over them (their count
without class weights), exactly as ``torch.nn.functional.cross_entropy(weight=...)``;
the z-loss sum is divided by the same denominator (NaN when it is 0, as torch's 0/0).
Ignored tokens have loss 0 and gradient 0. A target outside [0, V) that is not
``ignore_index`` gives that token a NaN loss and NaN gradient rows.
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
    argmax: int32, shape of the target: the predicted class, the index of each token's
        largest (soft-capped) logit (first maximum on ties, as ``jnp.argmax``); -1 at
        ignored tokens. From the statistics' own pass over the vocabulary; None when an
        explicitly named backend keeps no running argmax (mosaic_gpu, mosaic_tpu).
    """

    lse: jax.Array
    num_tokens: jax.Array
    argmax: jax.Array


def _masks(target, num_classes: int, opts: CrossEntropyOptions):
    valid = target != opts.ignore_index
    in_range = (target >= 0) & (target < num_classes)
    return valid, in_range


def target_weight(target, class_weight, valid):
    """w_t per token (fp32): the class weight of the target (1 without), 0 at ignored
    tokens; an out-of-range target reads a clamped index (its loss is NaN anyway)."""
    if class_weight is None:
        return valid.astype(jnp.float32)
    w = jnp.take(class_weight.astype(jnp.float32), jnp.clip(target, 0, class_weight.shape[0] - 1))
    return jnp.where(valid, w, 0.0)


def class_weight_sum(class_weight, num_classes: int):
    """W = sum_c w_c (a Python float without class weights)."""
    return float(num_classes) if class_weight is None else jnp.sum(class_weight.astype(jnp.float32))


def token_loss(lse, target_logit, smooth_sum, target, num_classes: int, opts: CrossEntropyOptions,
               class_weight=None):
    """Per-token fp32 loss (0 at ignored tokens, NaN at out-of-range targets);
    ``class_weight``: optional (V,) weights w_c (smooth_sum is then sum_c w_c z_c)."""
    valid, in_range = _masks(target, num_classes, opts)
    eps = opts.label_smoothing
    loss = (1.0 - eps) * target_weight(target, class_weight, valid) * (lse - target_logit)
    if eps > 0.0:
        w_sum = class_weight_sum(class_weight, num_classes)
        loss = loss + (eps / num_classes) * (w_sum * lse - smooth_sum)
    if opts.z_loss != 0.0:
        loss = loss + opts.z_loss * lse * lse
    loss = jnp.where(valid, loss, 0.0)
    return jnp.where(valid & ~in_range, jnp.nan, loss).astype(jnp.float32)


def _denominator(target, opts: CrossEntropyOptions, class_weight):
    """"mean"'s denominator: sum of w_t over non-ignored tokens (their count without
    class weights)."""
    valid = target != opts.ignore_index
    return jnp.sum(target_weight(target, class_weight, valid))


def reduce_loss(loss, target, opts: CrossEntropyOptions, class_weight=None):
    """The reduction, as torch ("mean" over non-ignored tokens, weighted by w_t; 0/0 = NaN)."""
    if opts.reduction == "none":
        return loss
    if opts.reduction == "sum":
        return jnp.sum(loss)
    return jnp.sum(loss) / _denominator(target, opts, class_weight)


def upstream_per_token(g, target, opts: CrossEntropyOptions, class_weight=None):
    """Gradient g of each token's loss from the gradient of the reduced loss."""
    g = jnp.asarray(g, jnp.float32)
    if opts.reduction == "none":
        return g.reshape(-1)
    if opts.reduction == "sum":
        return jnp.broadcast_to(g, target.shape)
    return jnp.broadcast_to(g / _denominator(target, opts, class_weight), target.shape)


def grad_coefficients(lse, target, g, num_classes: int, opts: CrossEntropyOptions, class_weight=None):
    """A, B, C of the module docstring stacked as (3, N) fp32: zero at ignored tokens
    (also when g is inf/NaN there), NaN at out-of-range targets."""
    valid, in_range = _masks(target, num_classes, opts)
    eps = opts.label_smoothing
    w_t = target_weight(target, class_weight, valid)
    a = (1.0 - eps) * w_t + (eps / num_classes) * class_weight_sum(class_weight, num_classes)
    if opts.z_loss != 0.0:
        a = a + 2.0 * opts.z_loss * lse
    b = (1.0 - eps) * w_t
    c = jnp.full_like(lse, eps / num_classes)
    coef = jnp.stack([a, b, c]) * g[None, :]
    coef = jnp.where(valid[None, :], coef, 0.0)
    return jnp.where((valid & ~in_range)[None, :], jnp.nan, coef).astype(jnp.float32)


def softcap_logits(z, softcap: Optional[float]):
    """z -> s * tanh(z / s) (identity without a soft-cap)."""
    if softcap is None:
        return z
    return softcap * jnp.tanh(z / softcap)


def dlogits(z_capped, lse, coef, target, col0, softcap: Optional[float], class_weight=None):
    """d loss / d (pre-cap) logits of a tile of soft-capped fp32 logits (rows: tokens,
    columns: classes col0 ...; ``class_weight``: the tile's (columns,) w_c or None).
    The one place the epilogue formula is written in JAX."""
    a, b, c = coef[0][:, None], coef[1][:, None], coef[2][:, None]
    cols = col0 + jnp.arange(z_capped.shape[1], dtype=target.dtype)
    hit = cols[None, :] == target[:, None]
    if class_weight is not None:
        c = c * class_weight.astype(jnp.float32)[None, :]
    dz = jnp.exp(z_capped - lse[:, None]) * a - jnp.where(hit, b, 0.0) - c
    if softcap is not None:
        dz = dz * (1.0 - (z_capped / softcap) ** 2)
    return dz


def dlogits_kept(e, tile_max, lse, coef, target, col0, num_columns: int):
    """``dlogits`` (no soft-cap, no class weights) from what a forward kept instead of z:
    e = exp(z - m) in the input dtype and m per row and tile of ``e.shape[1] //
    tile_max.shape[0]`` columns (tile_max (tiles, N) fp32), so exp(z - lse) = e exp(m -
    lse); columns ``col0 + j`` >= ``num_columns`` are 0. Returns fp32 (N, columns)."""
    cols = e.shape[1]
    # The per-tile scale broadcast to the columns (e's own path stays elementwise).
    scale = per_column(kept_scale(tile_max, lse, coef), cols)
    idx = col0 + jnp.arange(cols, dtype=target.dtype)[None, :]
    return dlogits_of_scaled(e.astype(jnp.float32) * scale, coef[1][:, None], coef[2][:, None], target[:, None],
                             idx, num_columns)


def per_column(tile_values, cols: int):
    """(N, tiles) values of each row's tiles repeated over the tiles' columns: (N, cols)."""
    n, tiles = tile_values.shape
    return jnp.broadcast_to(tile_values[:, :, None], (n, tiles, cols // tiles)).reshape(n, cols)


def kept_scale(tile_max, lse, coef):
    """A exp(m - lse) per row and tile, (N, tiles) fp32: what turns a kept e = exp(z - m)
    into p A (``dlogits_kept``)."""
    return (jnp.exp(tile_max - lse[None, :]) * coef[0][None, :]).T


def dlogits_of_scaled(p_a, b, c, target, idx, num_columns: int):
    """dz = p A - B [c == t] - C from p A (fp32) and the columns' ids ``idx`` (any shapes
    that broadcast: b, c, target per row), 0 at columns >= ``num_columns``."""
    dz = p_a - jnp.where(idx == target, b, 0.0) - c
    return jnp.where(idx < num_columns, dz, 0.0)


def merge_argmax(part_best, part_arg):
    """The argmax of rows reduced in parts along axis 0 (each part's maximum and the
    global index of its first maximum): the first part holding the largest maximum."""
    first = jnp.argmax(part_best, axis=0)
    return jnp.take_along_axis(part_arg, first[None, :], axis=0)[0].astype(jnp.int32)


def merge_lse_splits(part_lse):
    """lse of rows reduced in parts along axis 0 (each part's log-sum-exp): the JAX form
    of ``logitless.formulas.common.merge_splits`` (M = 0 where every part is -inf)."""
    m = part_lse.max(axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    return m_safe + jnp.log(jnp.exp(part_lse - m_safe).sum(axis=0))


def logsumexp_rows(z):
    """log sum_c exp(z_c) per row of a (rows, cols) tile: -inf for an all -inf row (M = 0
    there), NaN for a row holding NaN."""
    m = jnp.max(z, axis=1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    return m_safe + jnp.log(jnp.sum(jnp.exp(z - m_safe[:, None]), axis=1))
