"""Float64 NumPy reference of the JAX linear cross-entropy (loss and gradients).

Materialises the logits: for tests and error columns at small or chunked shapes only.
Same math as ``logitless/jax/formulas/cross_entropy.py``, written independently in NumPy.
"""

from __future__ import annotations

import numpy as np


def linear_cross_entropy_ref(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                             label_smoothing=0.0, softcap=None, z_loss=0.0, weight_layout="vh",
                             grad_out=None, class_weight=None, shift=False):
    """Returns (loss, lse, (dx, dw, db)) in float64; gradients of ``sum(loss * grad_out)``
    (grad_out defaults to 1 / ones of the loss's shape); db is None without bias.
    Weight and gradient dw are in ``weight_layout``. ``class_weight``: torch's
    ``weight=`` (w_t scales the cross-entropy, smoothing averages w_c (lse - z_c), "mean"
    divides by the sum of w_t); ``shift``: position t predicts target[..., t + 1] (loss
    and lse of "none" drop the last position)."""
    target = np.asarray(target)
    if shift and target.shape[-1] > 0:
        pad = np.full(target.shape[:-1] + (1,), ignore_index, target.dtype)
        target = np.concatenate([target[..., 1:], pad], axis=-1)
    x = np.asarray(x, np.float64)
    w = np.asarray(weight, np.float64)
    if weight_layout == "hv":
        w = w.T
    b = None if bias is None else np.asarray(bias, np.float64)
    t = np.asarray(target).reshape(-1).astype(np.int64)
    shape = np.asarray(target).shape
    h = w.shape[1]
    v = w.shape[0]
    x2 = x.reshape(-1, h)
    raw = x2 @ w.T + (0.0 if b is None else b[None, :])
    z = raw if softcap is None else softcap * np.tanh(raw / softcap)
    m = z.max(axis=1, keepdims=True) if z.size else np.zeros((0, 1))
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    valid = t != ignore_index
    in_range = (t >= 0) & (t < v)
    tc = np.clip(t, 0, v - 1)
    zt = z[np.arange(len(t)), tc] if len(t) else np.zeros(0)
    eps = label_smoothing
    cw = np.ones(v) if class_weight is None else np.asarray(class_weight, np.float64)
    w_t = np.where(valid, cw[tc], 0.0)
    loss = ((1 - eps) * w_t * (lse - zt) + eps / v * ((lse[:, None] - z) * cw[None, :]).sum(axis=1)
            + z_loss * lse ** 2)
    loss = np.where(valid, loss, 0.0)
    loss = np.where(valid & ~in_range, np.nan, loss)
    count = w_t.sum()
    if reduction == "none":
        out = loss.reshape(shape)
        g = np.ones(len(t)) if grad_out is None else np.asarray(grad_out, np.float64).reshape(-1)
    elif reduction == "sum":
        out = loss.sum()
        g = np.full(len(t), 1.0 if grad_out is None else float(grad_out))
    else:
        out = loss.sum() / count if count else np.nan
        g = np.full(len(t), (1.0 if grad_out is None else float(grad_out)) / count if count else 0.0)
    g = np.where(valid, g, 0.0)
    p = np.exp(z - lse[:, None])
    onehot = np.zeros_like(z)
    if len(t):
        onehot[np.arange(len(t)), tc] = in_range
    dz = ((1 - eps) * w_t[:, None] * (p - onehot) + eps / v * (cw.sum() * p - cw[None, :])
          + 2 * z_loss * lse[:, None] * p)
    dz = dz * g[:, None]
    if softcap is not None:
        dz = dz * (1 - (z / softcap) ** 2)
    dx = (dz @ w).reshape(x.shape)
    dw = dz.T @ x2
    if weight_layout == "hv":
        dw = dw.T
    db = None if b is None else dz.sum(axis=0)
    lse = lse.reshape(shape)
    if shift:
        lse = lse[..., :-1]
        if reduction == "none":
            out = out[..., :-1]
    return out, lse, (dx, dw, db)
