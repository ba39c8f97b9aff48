"""The cross-entropy formulas once more, in float64 numpy: the one statement of the math
that ``logitless.formulas.cross_entropy`` (torch) and ``logitless.jax.formulas`` (JAX)
are both held to, on the same deterministic cases (tests/test_formulas_agree.py and
tests_jax/test_formulas_agree.py).

Framework-free (numpy only): tests_jax imports this file by path, since tests/ imports
torch in its conftest. The math is the module docstring of logitless.formulas.cross_entropy:

    loss = (1 - eps) w_t (lse - z_t) + (eps / V) (W lse - S) + z_loss lse^2
    dz_c = (p_c A - B [c == t] - C w_c) (1 - (z_c / s)^2)
    A = g ((1 - eps) w_t + (eps / V) W + 2 z_loss lse),  B = g (1 - eps) w_t,  C = g eps / V

0 at ignored tokens, NaN at tokens whose target is outside [0, V) and not ignored.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import numpy as np

N, V = 17, 13
REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class FormulaCase:
    """Per-token statistics as a backend would produce them, and the options."""

    name: str
    lse: np.ndarray  # (N,) float64
    target_logit: np.ndarray  # (N,)
    smooth_sum: np.ndarray  # (N,) sum_c w_c z_c
    target: np.ndarray  # (N,) int64: ignored and out-of-range entries included
    grad_out: np.ndarray  # () or (N,) upstream gradient of the reduced loss
    z: np.ndarray  # (N, V - col0) a tile of soft-capped logits (for dlogits): classes col0 .. V-1
    col0: int
    ignore_index: int
    reduction: str
    label_smoothing: float
    z_loss: float
    softcap: Optional[float]
    class_weight: Optional[np.ndarray]  # (V,) or None (the JAX side has none)

    @property
    def options(self) -> dict:
        """The keyword arguments of CrossEntropyOptions."""
        return dict(ignore_index=self.ignore_index, reduction=self.reduction,
                    label_smoothing=self.label_smoothing, softcap=self.softcap, z_loss=self.z_loss)


def make_case(seed: int, ignore_index: int, reduction: str, label_smoothing: float, z_loss: float,
              softcap: Optional[float], class_weight: bool = False, out_of_range: bool = True) -> FormulaCase:
    rng = np.random.default_rng(seed)
    col0 = 4
    z = rng.normal(size=(N, V)) * 2.0
    if softcap is not None:
        z = softcap * np.tanh(z / softcap)
    lse = np.log(np.exp(z).sum(axis=1))
    z = z[:, col0:]
    target = rng.integers(0, V, size=N)
    target[[1, 6]] = ignore_index
    if out_of_range:
        target[9] = V  # out of range: NaN
        target[12] = -1 if ignore_index != -1 else V + 3
    cw = rng.uniform(0.5, 1.5, size=V) if class_weight else None
    target_logit = rng.normal(size=N)
    smooth_sum = rng.normal(size=N) * V
    grad_out = rng.normal(size=N) if reduction == "none" else np.asarray(rng.uniform(0.5, 1.5))
    name = (f"ii{ignore_index}-{reduction}-eps{label_smoothing}-z{z_loss}-cap{softcap}"
            f"{'-cw' if class_weight else ''}{'' if out_of_range else '-inrange'}")
    return FormulaCase(name, lse, target_logit, smooth_sum, target, grad_out, z, col0, ignore_index,
                       reduction, label_smoothing, z_loss, softcap, cw)


def cases(class_weight: bool = False) -> list[FormulaCase]:
    """Every combination of the options that enter the formulas (deterministic)."""
    out = []
    for i, (ii, red, eps, zl, cap) in enumerate(itertools.product(
            (-100, 2), REDUCTIONS, (0.0, 0.1), (0.0, 1e-3), (None, 5.0))):
        out.append(make_case(i, ii, red, eps, zl, cap, class_weight=class_weight))
        if red != "none":  # a finite reduced loss as well (no NaN token)
            out.append(make_case(1000 + i, ii, red, eps, zl, cap, class_weight=class_weight, out_of_range=False))
    return out


# ------------------------------------------------------------------ the math, float64


def _masks(c: FormulaCase):
    valid = c.target != c.ignore_index
    in_range = (c.target >= 0) & (c.target < V)
    return valid, in_range


def target_weight(c: FormulaCase) -> np.ndarray:
    valid, _ = _masks(c)
    w = c.class_weight if c.class_weight is not None else np.ones(V)
    return np.where(valid, w[np.clip(c.target, 0, V - 1)], 0.0)


def token_loss(c: FormulaCase) -> np.ndarray:
    valid, in_range = _masks(c)
    w_t = target_weight(c)
    big_w = c.class_weight.sum() if c.class_weight is not None else float(V)
    eps = c.label_smoothing
    loss = (1 - eps) * w_t * (c.lse - c.target_logit)
    loss = loss + (eps / V) * (big_w * c.lse - c.smooth_sum)
    loss = loss + c.z_loss * c.lse**2
    loss = np.where(valid, loss, 0.0)
    return np.where(valid & ~in_range, np.nan, loss)


def reduced_loss(c: FormulaCase):
    loss = token_loss(c)
    if c.reduction == "none":
        return loss
    if c.reduction == "sum":
        return loss.sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        return loss.sum() / target_weight(c).sum()


def upstream(c: FormulaCase) -> np.ndarray:
    """g per token: the upstream gradient of each token's loss."""
    if c.reduction == "none":
        return c.grad_out
    if c.reduction == "sum":
        return np.broadcast_to(c.grad_out, (N,))
    return np.broadcast_to(c.grad_out / target_weight(c).sum(), (N,))


def grad_coefficients(c: FormulaCase) -> np.ndarray:
    """A, B, C stacked (3, N)."""
    valid, in_range = _masks(c)
    w_t = target_weight(c)
    big_w = c.class_weight.sum() if c.class_weight is not None else float(V)
    eps, g = c.label_smoothing, upstream(c)
    a = g * ((1 - eps) * w_t + (eps / V) * big_w + 2 * c.z_loss * c.lse)
    b = g * (1 - eps) * w_t
    cc = g * np.full(N, eps / V)
    coef = np.where(valid, np.stack([a, b, cc]), 0.0)
    return np.where(valid & ~in_range, np.nan, coef)


def dlogits(c: FormulaCase) -> np.ndarray:
    """d loss / d (pre-cap) logits of the tile c.z (classes col0 .. V - 1)."""
    a, b, cc = grad_coefficients(c)
    cols = c.col0 + np.arange(c.z.shape[1])
    w_cols = c.class_weight[cols] if c.class_weight is not None else np.ones(len(cols))
    hit = cols[None, :] == c.target[:, None]
    dz = np.exp(c.z - c.lse[:, None]) * a[:, None] - np.where(hit, b[:, None], 0.0) - cc[:, None] * w_cols[None, :]
    if c.softcap is not None:
        dz = dz * (1 - (c.z / c.softcap) ** 2)
    return dz


def split_lse_case(seed: int = 0):
    """Rows of logits split in 3 parts along the vocabulary, with a row of -inf in a
    part and a row that is -inf everywhere: (full rows, part_lse (3, N), part_max,
    part_sum) and the expected lse of each row (float64)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(6, 12)) * 3
    z[2, 4:8] = -np.inf
    z[4, :] = -np.inf
    parts = np.split(z, 3, axis=1)
    part_max = np.stack([p.max(axis=1) for p in parts])
    safe = np.where(np.isfinite(part_max), part_max, 0.0)
    part_sum = np.stack([np.exp(p - s[:, None]).sum(axis=1) for p, s in zip(parts, safe)])
    with np.errstate(divide="ignore"):
        part_lse = safe + np.log(part_sum)
        m = z.max(axis=1)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        expected = m_safe + np.log(np.exp(z - m_safe[:, None]).sum(axis=1))
    part_max = np.where(np.isfinite(part_max), part_max, -np.inf)
    return z, part_lse, part_max, part_sum, expected
