"""Backend "mosaic_tpu": Pallas Mosaic TPU kernels (``logitless.jax.mosaic_tpu_lib``).

Forward: one kernel, grid (row blocks "parallel", vocab tiles "arbitrary"); per step
    z = cap(x_i @ W_j^T + b_j) on the MXU (fp32), folded into (bn, 1) fp32 VMEM
    accumulators: m = max, l = l e^(m_old - m) + sum e^(z - m) (online log-sum-exp),
    z_t += z[c == t], S += sum_c w_c z_c (label smoothing). Columns >= V (the ragged
    last tile) are masked in-kernel.
Backward: two kernels, each recomputing the logits tile:
    dX: grid (row blocks, vocab tiles "arbitrary"), dx_i += dz_ij @ W_j (fp32 VMEM acc);
    dW: grid (vocab tiles, row blocks "arbitrary"), dW_j += dz_ij^T @ x_i, db_j += sum dz;
    dz = p A - B [c == t] - C w_c (x (1 - (z/s)^2) with a softcap), cast to the input
    dtype before the gradient GEMMs, as the other backends.
    Cost: 5 GEMM-equivalents in all (forward 1, backward 2 recomputes + 2).
Options: softcap, bias, class weights (``class_weights``), label smoothing, both weight
layouts without a transposed copy (``native_hv``); bf16/f32 inputs, any N, V, H.
HBM temporaries: none beyond the outputs and O(N) row vectors; the memory budget
caps the kernels' VMEM (tiles: ``mosaic_tpu_lib.choose_tiles``).
On a platform other than TPU the kernels run in Pallas' TPU interpret mode (CPU tests).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from logitless.jax import mosaic_tpu_lib as tl
from logitless.jax.mosaic_tpu_lib import MosaicTpuConfig
from logitless.jax.ops.common.mosaic_tpu import MosaicTpuBase
from logitless.jax.ops.linear_cross_entropy.contract import LceGrads, LceResiduals, LceStats

_F32 = jnp.float32


def _cap(z, softcap):
    return z if softcap is None else softcap * jnp.tanh(z * (1.0 / softcap))


def _tiles(x2d, w, weight_layout, budget):
    n, h = x2d.shape
    v = w.shape[0] if weight_layout == "vh" else w.shape[1]
    return tl.choose_tiles(n, v, h, jnp.dtype(x2d.dtype).itemsize, budget)


def forward(x2d, w, bias, target, *, softcap=None, need_smooth=False, budget=None, weight_layout="vh",
            class_weight=None, tiles: Optional[tl.Tiles] = None):
    """(lse, target_logit, smooth_sum|None), each (N,) float32. ``tiles``: the kernels'
    tiles (``MosaicTpuBackend.plan``'s); None: chosen here from ``budget``."""
    cw = class_weight if need_smooth else None

    def fold(z, hit, valid, cwt, stats):
        m, l, zt, ss = stats
        z = _cap(z, softcap)
        zt = zt + jnp.sum(jnp.where(hit, z, 0.0), axis=1, keepdims=True)
        if need_smooth:
            zw = z if cwt is None else z * cwt
            if valid is not None:
                zw = jnp.where(valid, zw, 0.0)
            ss = ss + jnp.sum(zw, axis=1, keepdims=True)
        if valid is not None:
            z = jnp.where(valid, z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        l = l * jnp.exp(m - m_safe) + jnp.sum(jnp.exp(z - m_safe), axis=1, keepdims=True)
        return m_new, l, zt, ss

    def finish(stats):
        m, l, zt, ss = stats
        return jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(l), zt, ss

    lse, zt, ss = tl.stats_call(x2d, w, bias, cw, target, layout=weight_layout,
                                tiles=_tiles(x2d, w, weight_layout, budget) if tiles is None else tiles,
                                n_stats=4,
                                init=(-jnp.inf, 0.0, 0.0, 0.0), fold=fold, finish=finish, n_out=3)
    return lse, zt, (ss if need_smooth else None)


def _epilogue(softcap):
    def epilogue(z, hit, rows, cwt):
        lse, a, b, c = rows
        z = _cap(z, softcap)
        cc = c if cwt is None else c * cwt
        dz = jnp.exp(z - lse) * a - jnp.where(hit, b, 0.0) - cc
        if softcap is not None:
            zs = z * (1.0 / softcap)
            dz = dz * (1.0 - zs * zs)
        return dz

    return epilogue


def backward(x2d, w, bias, target, lse, coef, *, softcap=None, budget=None, weight_layout="vh",
             class_weight=None, tiles: Optional[tl.Tiles] = None):
    """(dx, dw, db): dx (N, H) in x2d.dtype, dw in w's layout and dtype, db or None;
    ``tiles`` as for ``forward``."""
    rowdat = jnp.concatenate([lse[None].astype(_F32), coef.astype(_F32)], axis=0).T  # (N, 4)
    tiles = _tiles(x2d, w, weight_layout, budget) if tiles is None else tiles
    kw = dict(layout=weight_layout, tiles=tiles, epilogue=_epilogue(softcap))
    dx = tl.dx_call(x2d, w, bias, class_weight, target, rowdat, **kw)
    dw, db = tl.dw_call(x2d, w, bias, class_weight, target, rowdat, **kw)
    return dx, dw, db


class MosaicTpuBackend(MosaicTpuBase):
    """The "mosaic_tpu" backend (``contract.LceBackend``; ``MosaicTpuBase``: bf16/f32, the
    tiles): class weights, no argmax."""

    class_weights = True
    keeps = False

    def forward(self, x2d, w, bias, target, config: MosaicTpuConfig, *, softcap, need_smooth, class_weight=None,
                need_argmax=False) -> LceStats:
        return LceStats(*forward(x2d, w, bias, target, softcap=softcap, need_smooth=need_smooth,
                                 weight_layout=config.weight_layout, class_weight=class_weight, tiles=config.tiles))

    def backward(self, res: LceResiduals, coef, config: MosaicTpuConfig, *, softcap) -> LceGrads:
        return LceGrads(*backward(res.x2d, res.w, res.bias, res.target, res.lse, coef, softcap=softcap,
                                  weight_layout=config.weight_layout, class_weight=res.class_weight,
                                  tiles=config.tiles))
