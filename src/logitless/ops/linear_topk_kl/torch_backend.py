"""Pure-PyTorch backend of linear_topk_kl: the same math in bounded tiles (any device; the
CPU path).

forward:  for each token chunk, for each vocab chunk: z = softcap(x_c W_v^T + b_v) in the
          compute dtype (fp32; fp64 for fp64 inputs), z at the ids that fall in the chunk,
          the ids' columns set to -inf in a = z / T, the online (m, s) of the tail
          (``formulas.log_probs.online_update``), the target's z and, at T != 1 with hard
          labels, the online (m, s) of z.
backward: for each vocab chunk, for each token chunk: the tile recomputed and turned into
          the dense dz in place (``formulas.topk_kl.dlogits_``), the ids' columns
          overwritten with the sparse values; dW_v += dz^T x_c, dx_c += dz W_v
          (``ops.common.torch_tiles.chunked_backward``).

Memory: the tiles ``torch_plan`` sizes within ``memory_budget`` (a logits tile, the
ids' mask and values, one more with a soft-cap or a second log-sum-exp), O(N K + V)
vectors and, for 16-bit inputs, the fp32 dx accumulator.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.common import apply_softcap, compute_dtype
from logitless.formulas.log_probs import finish, online_update
from logitless.formulas.topk_kl import TopKStats, dlogits_
from logitless.ops.common.contract import TorchKind
from logitless.ops.common.torch_tiles import chunked_backward, linear_torch_plan
from logitless.options import TopKKLOptions

from .contract import TopKForward, TorchConfig


def _logits_tile(x_c: Tensor, w_v: Tensor, b_v: Optional[Tensor], softcap) -> Tensor:
    z = x_c @ w_v.T
    if b_v is not None:
        z += b_v
    return apply_softcap(z, softcap, inplace=True)


def _ids_in(ids: Tensor, v0: int, width: int):
    """(where each id lies in the tile of columns [v0, v0 + width): its column there or
    ``width`` (one column past the tile, shared by every other id), whether it lies there)."""
    local = ids - v0
    inside = (local >= 0) & (local < width)
    return torch.where(inside, local, torch.full_like(local, width)), inside


def _mask_of(cols: Tensor, width: int) -> Tensor:
    """(rows, width) bools, True at the ids' columns (``_ids_in``'s)."""
    mask = torch.zeros(cols.shape[0], width + 1, dtype=torch.bool, device=cols.device)
    return mask.scatter_(1, cols, True)[:, :width]


def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, target: Tensor,
             opts: TopKKLOptions, plan) -> TopKStats:
    n = x.shape[0]
    v = weight.shape[0]
    cd = compute_dtype(x.dtype)
    k = ids.shape[1]
    lse_tail = torch.empty(n, dtype=cd, device=x.device)
    z_ids = torch.zeros(n, k, dtype=cd, device=x.device)
    z_t = torch.zeros(n, dtype=cd, device=x.device) if opts.hard else None
    lse1 = torch.empty(n, dtype=cd, device=x.device) if opts.hard_at_other_temperature else None
    for n0 in range(0, n, plan.token_chunk):
        n1 = min(n, n0 + plan.token_chunk)
        x_c, ids_c = x[n0:n1].to(cd), ids[n0:n1]
        m = torch.full((n1 - n0,), float("-inf"), dtype=cd, device=x.device)
        s = torch.zeros_like(m)
        m1, s1 = m.clone(), s.clone()
        for v0 in range(0, v, plan.vocab_chunk):
            v1 = min(v, v0 + plan.vocab_chunk)
            z = _logits_tile(x_c, weight[v0:v1].to(cd), bias[v0:v1].to(cd) if bias is not None else None,
                             opts.softcap)
            cols, inside = _ids_in(ids_c, v0, v1 - v0)
            picked = z.gather(1, cols.clamp(max=v1 - v0 - 1))
            z_ids[n0:n1] = torch.where(inside, picked, z_ids[n0:n1])
            if z_t is not None:  # (opts.hard)
                local = target[n0:n1] - v0
                t_in = (local >= 0) & (local < v1 - v0)
                zt = z.gather(1, local.clamp(0, v1 - v0 - 1)[:, None])[:, 0]
                z_t[n0:n1] += torch.where(t_in, zt, torch.zeros_like(zt))
            if lse1 is not None:
                m1, s1, _ = online_update(z.clone(), m1, s1, None)
            a = z.div_(opts.temperature) if opts.temperature != 1.0 else z
            a.masked_fill_(_mask_of(cols, v1 - v0), float("-inf"))
            m, s, _ = online_update(a, m, s, None)  # (a is spent)
            del z, a
        lse_tail[n0:n1] = finish(m, s, None)[0]
        if lse1 is not None:
            lse1[n0:n1] = finish(m1, s1, None)[0]
    return TopKStats(lse_tail, z_ids, z_t, lse1)


def _backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, target: Tensor, opts: TopKKLOptions,
              rows: Tensor, coef: Tensor, sparse: Tensor, plan, *, need_dx: bool, need_dw: bool, need_db: bool,
              dx_acc: bool = False):
    cd = compute_dtype(x.dtype)
    rows, coef, sparse = rows.to(cd), coef.to(cd), sparse.to(cd)
    lse_tail, lse1 = rows

    def dz_of(x_c, w_v, b_v, n0, n1, v0):  # dz in place of the recomputed tile, the ids' columns set
        z = _logits_tile(x_c, w_v, b_v, opts.softcap)
        width = z.shape[1]
        cols, _ = _ids_in(ids[n0:n1], v0, width)
        dz = dlogits_(z, lse_tail[n0:n1], lse1[n0:n1], coef[:, n0:n1], target[n0:n1], v0, opts)
        values = torch.zeros(n1 - n0, width + 1, dtype=cd, device=x.device).scatter_(1, cols, sparse[n0:n1])
        return dz.masked_fill_(_mask_of(cols, width), 0.0).add_(values[:, :width])  # (values: 0 off the ids)

    return chunked_backward(x, weight, bias, plan, dz_of, need_dx=need_dx, need_dw=need_dw, need_db=need_db,
                            dx_acc=dx_acc)


class TorchBackend(TorchKind):
    """backend="torch" (``contract.TopKBackend``): any device, fp64 too; keeps nothing for the
    backward; its Config (``TorchConfig``) holds the forward's and the backward's tiles."""


    def plan(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], opts: TopKKLOptions, *, budget: int,
             need_grad: bool, k: int = 0, cute: bool = True, kept_owned: bool = True) -> TorchConfig:
        v = weight.shape[0]
        exact = x.dtype == compute_dtype(x.dtype)
        # forward: the tile, the ids' mask (1 byte per element: counted as a tile), a copy for lse1
        # backward: the tile, the ids' values and mask, the soft-cap's factor or the second exponential
        extra = (opts.softcap is not None) + opts.hard_at_other_temperature
        return TorchConfig(
            forward=linear_torch_plan(x, v, budget, tiles=2 + opts.hard_at_other_temperature, accumulators=0),
            backward=linear_torch_plan(x, v, budget, tiles=3 + extra, accumulators=0 if exact else 1),
        )

    def kept_shapes(self, config: TorchConfig, n: int) -> None:
        return None

    def forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, target: Tensor,
                opts: TopKKLOptions, config: TorchConfig) -> TopKForward:
        return TopKForward(_forward(x, weight, bias, ids, target, opts, config.forward))

    def backward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, target: Tensor,
                 opts: TopKKLOptions, rows: Tensor, coef: Tensor, sparse: Tensor, config: TorchConfig, *,
                 kept=None, need_dx: bool, need_dw: bool, need_db: bool, dx_acc: bool = False):
        return _backward(x, weight, bias, ids, target, opts, rows, coef, sparse, config.backward, need_dx=need_dx,
                         need_dw=need_dw, need_db=need_db, dx_acc=dx_acc)
