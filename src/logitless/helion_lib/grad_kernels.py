"""Helion backward of linear_cross_entropy and linear_log_probs (one kernel for both), and
the chunk loop that every Helion backward (linear_jsd's too) runs around its kernel.

The recompute design of the Triton backward (docs/design.md "Backward"): per vocabulary
chunk of C columns, one Helion kernel recomputes the logits tile by tile (z = softcap(x @
W.T + b), fp32) and writes d(logits) dz (N, C) in the input dtype; then cuBLAS takes dz
to the gradients: dX += dz @ W_chunk (an fp32 accumulator over chunks, cast once), dW_chunk
= dz^T x (written once), db_chunk = column sums of dz in fp32. The logits are recomputed
once per backward (the first version recomputed them once per hidden block of dX and of dW:
32 times each at H = 4096, 60-90x Triton's time).

``linear_dlogits`` evaluates one gradient line, with the (3, N) fp32 coefficients (A, B, C)
of the op's formulas (0 at ignored tokens) and p the softmax of the row:
- ``LOG_PROBS`` False (``formulas.cross_entropy.grad_coefficients``): p = e^(z - lse),
  dz_c = p_c A - B [c == t] - C w_c (w_c the class weight, or 1);
- ``LOG_PROBS`` True (``formulas.log_probs.grad_coefficients``, 1/T folded in):
  log p = z / T - lse, dz_j = p_j (A + C log p_j) - B [j == t] (C only with ``ENTROPY``);
times (1 - (z / s)^2) with a soft-cap. It sees one chunk: W's rows (and bias, class
weights) of the chunk, and the targets shifted by the chunk's first column. No atomics;
the flags are ``hl.constexpr`` (each combination compiles its own kernel).
"""

from __future__ import annotations

from typing import Optional

import helion
import helion.language as hl
import torch
from torch import Tensor

from logitless.helion_lib import configs
from logitless.helion_lib.runtime import kernel_settings, launch
from logitless.helion_lib.tile_math import cap_grad, hit_mask, logits_epilogue, row_coefficients

_SETTINGS = kernel_settings()

#: Columns of a dz chunk: at least 4096 (each chunk does one fp32 read-modify-write of the
#: dX accumulator: docs/design.md "Backward"), at most 16384 (the Triton planner's widest).
MIN_CHUNK, MAX_CHUNK = 4096, 16384


def vocab_chunk(n: int, h: int, v: int, itemsize: int, budget: Optional[int]) -> int:
    """Columns per dz chunk under ``budget`` bytes (None: the widest): all V when the whole
    dz (n V itemsize) fits (no accumulator then), else what fits beside the fp32 dX
    accumulator (4 n h), within [MIN_CHUNK, MAX_CHUNK]: the budget is raised to that minimum."""
    if budget is None:
        return min(v, MAX_CHUNK)
    if n * v * itemsize <= budget:
        return v
    cols = (budget - 4 * n * h) // max(1, n * itemsize)
    return min(v, max(MIN_CHUNK, min(MAX_CHUNK, cols // 128 * 128)))


def chunked_backward(kernel, args: tuple, chunked: tuple, target_at: int, config: dict, chunk: int, *,
                     need_dx: bool, need_dw: bool, dx_acc: bool = False):
    """(dx, dW, db or None) of a fused linear op whose d(logits) kernel ``kernel`` takes
    ``args`` (x first, the weight second, the bias third) with ``args[i]`` for i in
    ``chunked`` (the weights, biases, class weights: V rows, or None) cut to a chunk's rows
    and ``args[target_at]`` (the targets) shifted by its first column, and returns that
    chunk's dz (N, columns) in x's dtype. Over chunks of ``chunk`` columns: dW rows and db
    (fp32) written once per chunk, dx = dz @ W_chunk summed in an fp32 accumulator and cast
    once (one chunk: one GEMM in x's dtype). ``dx_acc``: dx is the fp32 accumulator itself,
    not cast (a partial sum that the caller reduces first: vocabulary parallelism).
    ``need_dx`` / ``need_dw`` False skip that part (None in its place; db comes with dW)."""
    x, weight, bias = args[:3]
    n, h = x.shape
    v = weight.shape[0]
    bounds = [(v0, min(v, v0 + chunk)) for v0 in range(0, v, chunk)]
    dw = torch.empty_like(weight) if need_dw else None
    db = torch.empty(v, dtype=torch.float32, device=x.device) if need_dw and bias is not None else None
    acc = torch.zeros(n, h, dtype=torch.float32, device=x.device) if need_dx and (dx_acc or len(bounds) > 1) else None
    dx = None
    for v0, v1 in bounds:
        part = list(args)
        for i in chunked:
            if part[i] is not None:
                part[i] = part[i][v0:v1]
        part[target_at] = args[target_at] - v0 if v0 else args[target_at]
        dz = launch(kernel, tuple(part), config)
        if need_dw:
            torch.mm(dz.T, x, out=dw[v0:v1])
            if db is not None:
                db[v0:v1] = dz.sum(dim=0, dtype=torch.float32)
        if need_dx:
            if acc is None:
                dx = dz @ weight[v0:v1]
            elif acc.is_cuda:
                torch.addmm(acc, dz, weight[v0:v1], out_dtype=torch.float32, out=acc)
            else:  # (the CPU interpreter: torch has no CPU addmm with out_dtype)
                acc += dz.float() @ weight[v0:v1].float()
        del dz, part  # (the next chunk's dz reuses its memory)
    if acc is not None:
        dx = acc if dx_acc else acc.to(x.dtype)
    return dx, dw, db


def empty_gradients(x: Tensor, weight: Tensor, bias: Optional[Tensor], dx_acc: bool) -> tuple:
    """(dx, dW, db or None) of no token: zeros, no launch."""
    db = torch.zeros(weight.shape[0], dtype=torch.float32, device=x.device) if bias is not None else None
    return torch.zeros_like(x, dtype=torch.float32 if dx_acc else x.dtype), torch.zeros_like(weight), db


def backward(args: tuple, name: str, config=None, need_dx: bool = True, need_dw: bool = True,
             budget: Optional[int] = None, chunk: Optional[int] = None, dx_acc: bool = False) -> tuple:
    """(dx, dW, db or None) of ``args`` (``linear_dlogits``' arguments: x, weight, bias,
    target, class weights, ...) in chunks of ``chunk`` columns (default ``vocab_chunk``
    of ``budget``); ``name`` ("ce", "logp") picks the config ``<name>_dz`` unless ``config``
    gives it. dx, dW in x's / W's dtype (dx fp32 with ``dx_acc``), db in fp32 (as
    ``chunked_backward``)."""
    x, weight = args[:2]
    n, v = x.shape[0], weight.shape[0]
    if n == 0:
        return empty_gradients(x, weight, args[2], dx_acc)
    cfg = config or configs.pick(f"{name}_dz", configs.sizes(x, weight), x.device)
    chunk = chunk or vocab_chunk(n, x.shape[1], v, x.element_size(), budget)
    return chunked_backward(linear_dlogits, args, (1, 2, 4), 3, cfg, chunk, need_dx=need_dx, need_dw=need_dw,
                            dx_acc=dx_acc)


def dlogits_line(z, rows, cw, tile_v, cap, inv_t, HAS_CAP, LOG_PROBS, ENTROPY):
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
def linear_dlogits(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    cw: torch.Tensor | None, lse: torch.Tensor, coef: torch.Tensor, softcap: float, inv_t: float,
    HAS_SOFTCAP: hl.constexpr, LOG_PROBS: hl.constexpr, ENTROPY: hl.constexpr,
) -> torch.Tensor:
    n, h = x.size()
    v = w.size(0)
    dz = torch.empty([n, v], dtype=x.dtype, device=x.device)
    for tile_n, tile_v in hl.tile([n, v]):
        rows = row_coefficients(target, lse, coef, tile_n)
        z = hl.zeros([tile_n, tile_v], dtype=torch.float32)
        for tile_h in hl.tile(h):
            z = hl.dot(x[tile_n, tile_h], w[tile_v, tile_h].T, acc=z)
        z = logits_epilogue(z, bias, tile_v, softcap, HAS_SOFTCAP)
        dz[tile_n, tile_v] = dlogits_line(z, rows, cw, tile_v, softcap, inv_t, HAS_SOFTCAP, LOG_PROBS,
                                          ENTROPY).to(dz.dtype)
    return dz
