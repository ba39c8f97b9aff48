"""Helion backward kernels of linear_cross_entropy and linear_log_probs (one pair for both).

Both backwards recompute a tile of z = softcap(x @ W.T + b) and evaluate one gradient
line dz, with the (3, N) fp32 coefficients (A, B, C) of the op's formulas (0 at ignored
tokens) and p the softmax of the row:
- ``LOG_PROBS`` False (``formulas.cross_entropy.grad_coefficients``): p = e^(z - lse),
  dz_c = p_c A - B [c == t] - C w_c (w_c the class weight, or 1);
- ``LOG_PROBS`` True (``formulas.log_probs.grad_coefficients``, 1/T folded in):
  log p = z / T - lse, dz_j = p_j (A + C log p_j) - B [j == t] (C only with ``ENTROPY``);
times (1 - (z / s)^2) with a soft-cap. ``linear_dx`` accumulates dz @ W over vocabulary
tiles per (row, hidden) block, ``linear_dw`` dz^T @ x (and db) over row tiles per
(vocabulary, hidden) block. No atomics. The flags are ``hl.constexpr``: each combination
compiles its own kernel, without the branches it does not take.
"""

from __future__ import annotations

import torch

import helion
import helion.language as hl

from logitless.helion_lib import configs
from logitless.helion_lib.runtime import kernel_settings, launch
from logitless.helion_lib.tile_math import cap_grad, hit_mask, logits_epilogue, row_coefficients

_SETTINGS = kernel_settings()


def backward(args: tuple, name: str, configs_=None, need_dx: bool = True, need_dw: bool = True) -> tuple:
    """(dx, dW, db or None) of ``args`` (the kernels' arguments: x, weight, bias first);
    ``name`` ("ce", "logp") picks the configs ``<name>_dx`` / ``<name>_dw`` unless
    ``configs_`` gives them. dx, dW in x's / W's dtype, db in fp32. ``need_dx`` /
    ``need_dw`` False skip that kernel (None in its place; db comes with dW). No token:
    zeros, no launch."""
    x, weight, bias = args[:3]
    if x.shape[0] == 0:
        db = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if bias is not None else None
        return torch.zeros_like(x), torch.zeros_like(weight), db
    sizes = configs.sizes(x, weight)
    cfg_dx, cfg_dw = configs_ or tuple(configs.pick(f"{name}_{part}", sizes, x.device) for part in ("dx", "dw"))
    dx = launch(linear_dx, args, cfg_dx) if need_dx else None
    dw, db = launch(linear_dw, args, cfg_dw) if need_dw else (None, None)
    return dx, dw, (db if bias is not None else None)


def dlogits(z, rows, cw, tile_v, cap, inv_t, HAS_CAP, LOG_PROBS, ENTROPY):
    """The gradient line of the module docstring on one tile of soft-capped logits z."""
    t, row_lse, ca, cb, cc = rows
    if LOG_PROBS:
        logp = z * inv_t - row_lse.unsqueeze(1)
        p = torch.exp(logp)
        if ENTROPY:
            dz = torch.where(p > 0.0, p * (ca.unsqueeze(1) + cc.unsqueeze(1) * logp), 0.0)
        else:
            dz = p * ca.unsqueeze(1)
        dz = dz - torch.where(hit_mask(tile_v, t), cb.unsqueeze(1), 0.0)
    else:
        p = torch.exp(z - row_lse.unsqueeze(1))
        dz = p * ca.unsqueeze(1) - torch.where(hit_mask(tile_v, t), cb.unsqueeze(1), 0.0)
        if cw is not None:
            dz = dz - cc.unsqueeze(1) * cw[tile_v].to(torch.float32).unsqueeze(0)
        else:
            dz = dz - cc.unsqueeze(1)
    return cap_grad(dz, z, cap, HAS_CAP)


@helion.kernel(**_SETTINGS)
def linear_dx(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    cw: torch.Tensor | None, lse: torch.Tensor, coef: torch.Tensor, softcap: float, inv_t: float,
    HAS_SOFTCAP: hl.constexpr, LOG_PROBS: hl.constexpr, ENTROPY: hl.constexpr,
) -> torch.Tensor:
    n, h = x.size()
    v = w.size(0)
    dx = torch.empty_like(x)
    for tile_n, tile_k in hl.tile([n, h]):
        rows = row_coefficients(target, lse, coef, tile_n)
        acc = hl.zeros([tile_n, tile_k], dtype=torch.float32)
        for tile_v in hl.tile(v):
            z = hl.zeros([tile_n, tile_v], dtype=torch.float32)
            for tile_h in hl.tile(h):
                z = hl.dot(x[tile_n, tile_h], w[tile_v, tile_h].T, acc=z)
            z = logits_epilogue(z, bias, tile_v, softcap, HAS_SOFTCAP)
            dz = dlogits(z, rows, cw, tile_v, softcap, inv_t, HAS_SOFTCAP, LOG_PROBS, ENTROPY)
            dz = torch.where((tile_v.index < v)[None, :], dz, 0.0)
            acc = hl.dot(dz.to(w.dtype), w[tile_v, tile_k], acc=acc)
        dx[tile_n, tile_k] = acc.to(dx.dtype)
    return dx


@helion.kernel(**_SETTINGS)
def linear_dw(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    cw: torch.Tensor | None, lse: torch.Tensor, coef: torch.Tensor, softcap: float, inv_t: float,
    HAS_SOFTCAP: hl.constexpr, LOG_PROBS: hl.constexpr, ENTROPY: hl.constexpr,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, h = x.size()
    v = w.size(0)
    dw = torch.empty_like(w)
    db = torch.empty([v], dtype=torch.float32, device=w.device)
    for tile_v, tile_k in hl.tile([v, h]):
        acc = hl.zeros([tile_v, tile_k], dtype=torch.float32)
        acc_b = hl.zeros([tile_v], dtype=torch.float32)
        for tile_n in hl.tile(n):
            rows = row_coefficients(target, lse, coef, tile_n)
            z = hl.zeros([tile_n, tile_v], dtype=torch.float32)
            for tile_h in hl.tile(h):
                z = hl.dot(x[tile_n, tile_h], w[tile_v, tile_h].T, acc=z)
            z = logits_epilogue(z, bias, tile_v, softcap, HAS_SOFTCAP)
            dz = dlogits(z, rows, cw, tile_v, softcap, inv_t, HAS_SOFTCAP, LOG_PROBS, ENTROPY)
            dz = torch.where((tile_n.index < n)[:, None], dz, 0.0)
            acc = hl.dot(dz.to(x.dtype).T, x[tile_n, tile_k], acc=acc)
            acc_b = acc_b + torch.sum(dz, dim=0)
        dw[tile_v, tile_k] = acc.to(dw.dtype)
        # Every hidden block of a vocabulary block computes the same db (same order): the
        # duplicate stores write equal values, so db needs neither a flag nor atomics.
        db[tile_v] = acc_b
    return dw, db
