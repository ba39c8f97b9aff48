"""The cross-entropy formulas, written once for every op and every backend.

Every backend (PyTorch chunks, Triton kernels; fused linear or plain logits) reduces
each token's row of logits to a few fp32 statistics, and everything else is computed
here from those statistics with O(tokens) work:

    z_c   = logit of class c, after the optional soft-cap  z_c = s * tanh(z_c / s)
    lse   = log sum_c exp(z_c)
    z_t   = z at the target class t
    S     = sum_c w_c z_c                 (only with label smoothing; w_c = class weight or 1)

Loss of a token (eps = label_smoothing, V = number of classes, W = sum_c w_c):

    loss = (1 - eps) * w_t * (lse - z_t)             cross-entropy, as torch's nll
         + (eps / V) * (W * lse - S)                 = (eps / V) * sum_c w_c (lse - z_c)
         + z_loss * lse**2                           z-loss (PaLM), not class-weighted

"mean" divides the sum over non-ignored tokens by sum of w_t over them (their count
without class weights), exactly as ``torch.nn.functional.cross_entropy``; the z-loss
sum is divided by the same denominator. Ignored tokens have loss 0 and gradient 0.

Gradient with respect to the (soft-capped) logit z_c, for an upstream gradient g of
the token's loss (p_c = exp(z_c - lse)):

    dz_c = p_c * A - B * [c == t] - C * w_c
    A = g * ((1 - eps) * w_t + (eps / V) * W + 2 * z_loss * lse)
    B = g * (1 - eps) * w_t
    C = g * eps / V

and with a soft-cap the chain rule multiplies by (1 - (z_c / s)**2). Kernels only ever
evaluate that one line; A, B, C come from ``grad_coefficients``.

A target outside [0, V) that is not ``ignore_index`` makes that token's loss and
gradient NaN (``check_targets`` raises instead where a check is cheap, on the CPU).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from logitless.formulas.common import compute_dtype, sub_at_target_
from logitless.options import CrossEntropyOptions


class TokenStats(NamedTuple):
    """Per-token statistics that a backend computes from each row of logits: fp32
    (fp64 for fp64 inputs on the torch backend; everything below follows lse's dtype)."""

    lse: Tensor  # (N,) log-sum-exp of the soft-capped logits
    # (N,) soft-capped logit at the target (any value when out of range); None where nothing
    # reads it (a kernel that computed the loss itself, ``loss_stats``' input)
    target_logit: Optional[Tensor]
    smooth_sum: Optional[Tensor]  # (N,) sum_c w_c z_c; None without label smoothing
    argmax: Optional[Tensor]  # (N,) int64, first index of the row maximum; None if not asked


class LossStats(NamedTuple):
    """Extra per-token outputs, returned with ``return_stats=True``.

    lse: fp32, shape of the target: log-sum-exp of each token's (soft-capped) logits;
        differentiable (its gradient reaches x, weight and bias, or the logits), so a
        loss of the caller's may use it, e.g. a z-loss of its own.
    correct: bool, shape of the target: argmax of the logits equals the target
        (first maximum on ties, as ``torch.argmax``); False at ignored tokens.
    num_tokens: int64 scalar tensor, the number of non-ignored tokens.
    argmax: int64, shape of the target: the predicted class, the index of each token's
        largest (soft-capped) logit (first maximum on ties, as ``torch.argmax``); -1 at
        ignored tokens. From the same pass as ``correct`` (Liger's predicted tokens).
    """

    lse: Tensor
    correct: Tensor
    num_tokens: Tensor
    argmax: Tensor

    @property
    def accuracy(self) -> Tensor:
        """Fraction of non-ignored tokens predicted right (a tensor: no host sync)."""
        return self.correct.sum() / self.num_tokens.clamp_min(1)


def target_weight(target: Tensor, class_weight: Optional[Tensor], valid: Tensor,
                   dtype: torch.dtype = torch.float32) -> Tensor:
    """w_t per token: class weight of the target (1 without), 0 at ignored tokens."""
    if class_weight is None:
        return valid.to(dtype)
    num_classes = class_weight.shape[0]
    # Clamp so that an out-of-range target never indexes out of bounds (its loss is NaN).
    w = class_weight.to(dtype)[target.clamp(0, num_classes - 1)]
    return torch.where(valid, w, torch.zeros_like(w))


def _class_weight_sum(class_weight: Optional[Tensor], num_classes: int, dtype: torch.dtype = torch.float32):
    """W = sum_c w_c: a Python float without class weights (no host-to-device copy)."""
    if class_weight is None:
        return float(num_classes)
    return class_weight.to(dtype).sum()


def token_loss(
    stats: TokenStats,
    target: Tensor,
    num_classes: int,
    class_weight: Optional[Tensor],
    opts: CrossEntropyOptions,
) -> tuple[Tensor, Tensor]:
    """Per-token loss (0 at ignored tokens) and per-token denominator weight w_t, in
    the compute dtype of the statistics (fp32, or fp64 for fp64 statistics)."""
    dt = compute_dtype(stats.lse.dtype)
    valid = target != opts.ignore_index
    in_range = (target >= 0) & (target < num_classes)
    w_t = target_weight(target, class_weight, valid, dt)
    lse = stats.lse.to(dt)
    eps = opts.label_smoothing
    loss = (1.0 - eps) * w_t * (lse - stats.target_logit)
    if eps > 0.0:
        w_sum = _class_weight_sum(class_weight, num_classes, dt)
        loss = loss + (eps / num_classes) * (w_sum * lse - stats.smooth_sum.to(dt))
    if opts.z_loss != 0.0:
        loss = loss + opts.z_loss * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    loss = torch.where(valid & ~in_range, torch.full_like(loss, float("nan")), loss)
    return loss, w_t


def upstream_per_token(grad_out: Tensor, w_t: Tensor, reduction: str) -> Tensor:
    """The gradient g of each token's loss, from the gradient of the reduced loss
    (in w_t's dtype: fp32, or fp64 for fp64 statistics)."""
    grad_out = grad_out.to(w_t.dtype)
    if reduction == "none":
        return grad_out.reshape(-1)
    if reduction == "sum":
        return grad_out.expand(w_t.shape)
    return (grad_out / w_t.sum()).expand(w_t.shape)


def grad_coefficients(
    lse: Tensor,
    target: Tensor,
    g: Tensor,
    num_classes: int,
    class_weight: Optional[Tensor],
    opts: CrossEntropyOptions,
) -> Tensor:
    """A, B, C of the module docstring, stacked as a (3, N) tensor in the compute
    dtype of lse (fp32; fp64 for fp64 statistics).

    Zero at ignored tokens (also when g is inf or NaN there, e.g. a "mean" over no
    token), NaN at tokens whose target is out of range.
    """
    dt = compute_dtype(lse.dtype)
    lse, g = lse.to(dt), g.to(dt)
    valid = target != opts.ignore_index
    in_range = (target >= 0) & (target < num_classes)
    w_t = target_weight(target, class_weight, valid, dt)
    eps = opts.label_smoothing
    a = (1.0 - eps) * w_t
    if eps > 0.0:
        a = a + (eps / num_classes) * _class_weight_sum(class_weight, num_classes, dt)
    if opts.z_loss != 0.0:
        a = a + 2.0 * opts.z_loss * lse
    b = (1.0 - eps) * w_t
    c = torch.full_like(lse, eps / num_classes)
    coef = torch.stack([a, b, c]) * g
    coef = torch.where(valid, coef, torch.zeros_like(coef))
    return torch.where(valid & ~in_range, torch.full_like(coef, float("nan")), coef)


def loss_stats(stats: TokenStats, target: Tensor, opts: CrossEntropyOptions) -> LossStats:
    """The extra outputs of ``return_stats=True`` (flat; the caller reshapes)."""
    valid = target != opts.ignore_index
    correct = (stats.argmax == target) & valid
    argmax = torch.where(valid, stats.argmax, torch.full_like(stats.argmax, -1))
    return LossStats(lse=stats.lse, correct=correct, num_tokens=valid.sum(), argmax=argmax)


def dlogits_(
    z: Tensor,
    lse: Tensor,
    coef: Tensor,
    target: Tensor,
    col0: int,
    class_weight: Optional[Tensor],
    softcap: Optional[float],
) -> Tensor:
    """Turn a tile of soft-capped logits z (rows: tokens, columns: classes col0..) into
    d loss / d (pre-cap) logits, in place. The PyTorch form of the kernels' epilogue.

    Temporaries: one more tile with a soft-cap (the factor 1 - (z/s)^2, taken before z
    is overwritten), none without; everything else is in place or per row.
    """
    a, b, c = coef
    factor = None
    if softcap is not None:
        factor = torch.div(z, softcap).square_().neg_().add_(1.0)
    z.sub_(lse[:, None]).exp_().mul_(a[:, None])
    sub_at_target_(z, target, col0, b)  # - B at the target's column when it lies in this tile
    if class_weight is not None:
        z.addcmul_(c[:, None], class_weight[col0 : col0 + z.shape[1]].to(z.dtype)[None, :], value=-1.0)
    else:
        z.sub_(c[:, None])
    if factor is not None:
        z.mul_(factor)
    return z
