"""Float64 NumPy reference of the JAX linear_jsd (loss and the student's gradients),
written from the definition (``formulas/jsd.py``'s docstring), independently of it.

Materialises both heads' logits: for tests at small shapes only.
"""

from __future__ import annotations

import numpy as np


def _log_softmax(z):
    m = z.max(axis=1, keepdims=True)
    return z - (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))


def linear_jsd_ref(student_x, student_weight, teacher_x, teacher_weight, target=None, *, beta=0.5,
                   temperature=1.0, ignore_index=-100, reduction="mean", hard_label_weight=0.0, weight_layout="vh",
                   grad_out=None):
    """(loss, (dx, dw)) in float64: the loss as the op returns it and the gradients of
    ``sum(loss * grad_out)`` (grad_out defaults to ones) with respect to student_x and
    student_weight (dw in ``weight_layout``)."""
    xs = np.asarray(student_x, np.float64)
    xt = np.asarray(teacher_x, np.float64)
    ws = np.asarray(student_weight, np.float64)
    wt = np.asarray(teacher_weight, np.float64)
    if weight_layout == "hv":
        ws, wt = ws.T, wt.T
    lead = xs.shape[:-1]
    xs2, xt2 = xs.reshape(-1, ws.shape[1]), xt.reshape(-1, wt.shape[1])
    n, v = xs2.shape[0], ws.shape[0]
    t = np.zeros(n, np.int64) if target is None else np.asarray(target).reshape(-1).astype(np.int64)
    valid = np.ones(n, bool) if target is None else t != ignore_index
    zs, zt = xs2 @ ws.T, xt2 @ wt.T
    lp, lq = _log_softmax(zs / temperature), _log_softmax(zt / temperature)
    p, q = np.exp(lp), np.exp(lq)
    with np.errstate(divide="ignore", invalid="ignore"):
        if beta == 0.0:
            loss = np.where(q > 0, q * (lq - lp), 0.0).sum(1)
        elif beta == 1.0:
            loss = np.where(p > 0, p * (lp - lq), 0.0).sum(1)
        else:
            m = beta * q + (1 - beta) * p
            lm = np.log(m)
            loss = (beta * np.where(q > 0, q * (lq - lm), 0.0).sum(1)
                    + (1 - beta) * np.where(p > 0, p * (lp - lm), 0.0).sum(1))
    tc = np.clip(t, 0, v - 1)
    lp1 = _log_softmax(zs)
    if hard_label_weight:
        ce = -lp1[np.arange(n), tc] if n else np.zeros(0)
        loss = loss + hard_label_weight * ce
    loss = np.where(valid, loss, 0.0)
    count = valid.sum()
    if reduction == "none":
        out = loss.reshape(lead)
        g = np.ones(n) if grad_out is None else np.asarray(grad_out, np.float64).reshape(-1)
    elif reduction == "sum":
        out = loss.sum()
        g = np.full(n, 1.0 if grad_out is None else float(grad_out))
    else:
        out = loss.sum() / count if count else np.nan
        g = np.full(n, (1.0 if grad_out is None else float(grad_out)) / count if count else 0.0)
    g = np.where(valid, g, 0.0)
    # d loss / d a (a = zs / T): the divergence's gradient through the softmax
    with np.errstate(divide="ignore", invalid="ignore"):
        if beta == 0.0:
            da = p - q
        else:
            lm = lq if beta == 1.0 else np.log(beta * q + (1 - beta) * p)
            r = np.where(p > 0, p * (lp - lm), 0.0)
            da = (1.0 if beta == 1.0 else 1 - beta) * (r - p * r.sum(1, keepdims=True))
    dz = da / temperature
    if hard_label_weight:
        onehot = np.zeros_like(zs)
        onehot[np.arange(n), tc] = 1.0
        dz = dz + hard_label_weight * (np.exp(lp1) - onehot)
    dz = dz * g[:, None]
    dx = (dz @ ws).reshape(xs.shape)
    dw = dz.T @ xs2
    return out, (dx, dw.T if weight_layout == "hv" else dw)
