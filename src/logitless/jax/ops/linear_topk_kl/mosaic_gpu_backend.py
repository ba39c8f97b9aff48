"""The "mosaic_gpu" backend of linear_topk_kl (SM90; Mosaic GPU's interpret mode without a
GPU): the "xla" backend's forward (XLA's GEMMs, the ids masked by a scatter, the kept dz)
and a backward whose recomputed columns come from ``mosaic_lib.dz_call``, the Mosaic GPU
kernel of linear_cross_entropy's backward with this op's epilogue:

    dz_j = c_r 2^(z_j log2(e) / T - lse_tail log2(e)) [+ c_q 2^(z_j log2(e) - lse1 log2(e))]
           [- c_b [j == t]]

(the GEMM tile in registers, one write of dz per chunk in the input dtype); then the
chunk's values at the ids are written by XLA (a scatter of K values per token, distinct
ids: no collisions) and XLA's GEMMs take dx += dz @ W[chunk], dW[chunk] = dz^T x
(``rows.chunk_gradients``). Limits (``why_not``): bf16/f16, H a multiple of 64, V of 8, at
least one token; an (H, V) weight whose V is not a multiple of 64 is padded (a copy).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from logitless.jax import mosaic_lib as ml
from logitless.jax.formulas import topk_kl as tk
from logitless.jax.mosaic_lib import BLOCK_K, LOG2E
from logitless.jax.ops.common.mosaic_gpu import MosaicGpuBase, interpret_params
from logitless.jax.ops.common.rows import W_AXIS, RowsConfig, chunk_gradients, kept_gradients, plan_rows
from logitless.jax.ops.linear_topk_kl import xla_backend
from logitless.jax.ops.linear_topk_kl.contract import TopKForward, TopKResiduals


def _epilogue(opts):
    """The dense dz of a tile from its fp32 logits z (``formulas.topk_kl.dense_dlogits``
    on the exp2 of an FMA); rows: lse_tail log2(e) (-inf taken as 0), c_r[, lse1
    log2(e), c_q][, c_b]."""
    scale = LOG2E / opts.temperature

    def epilogue(z, rows, hit):
        bc = lambda r: ml.bcast(r, z.shape)
        rows = list(rows)
        lt, cr = rows.pop(0), rows.pop(0)
        dz = bc(cr) * jnp.exp2(z * scale - bc(lt))
        if opts.hard_at_other_temperature:
            l1, cq = rows.pop(0), rows.pop(0)
            dz = dz + bc(cq) * jnp.exp2(z * LOG2E - bc(l1))
        if opts.hard:
            dz = dz - jnp.where(hit, bc(rows.pop(0)), 0.0)
        return dz

    return epilogue


def backward(res: TopKResiduals, g, g_kept, config: RowsConfig, *, opts, merge):
    """The contract's backward: the kept columns' GEMMs, then the Mosaic GPU dz chunks'."""
    x2d, w, ids, target, lse_tail, lse1, coef, sparse, kept = res
    layout = config.weight_layout
    vaxis = W_AXIS[layout]
    n = x2d.shape[0]
    v = w.shape[vaxis]
    off = merge.offset(v)
    mcfg = config.recompute
    start, dx, dw = kept_gradients(kept, x2d, w, g_kept, layout=layout)
    if start >= v:
        return dx.astype(x2d.dtype), dw
    coef_g = coef * g[None, :]
    sparse_g = sparse * g[:, None]
    tiles = mcfg.tiles
    x8 = ml.pad_rows8(x2d)
    n_pad = ml.rows_padded(x8.shape[0], tiles)
    lt = jnp.where(lse_tail == -jnp.inf, 0.0, lse_tail) * LOG2E
    rows = [lt, coef_g[0]]
    if opts.hard_at_other_temperature:
        rows += [lse1 * LOG2E, coef_g[1]]
    if opts.hard:
        rows += [coef_g[2]]
    rowdat, tgt = ml.row_inputs(target - off, jnp.stack(rows), n_pad)
    wk = ml.pad_hv(w) if layout == "hv" else w
    epilogue = _epilogue(opts)
    bv = tiles.block_v
    il = ids - off

    def dz_of(c0, width):
        cblock = jnp.reshape(c0 // bv, (1,)).astype(jnp.int32)
        dz = ml.dz_call(x8, wk, rowdat, tgt, cblock, v=v, chunk=-(-width // bv) * bv, cfg=tiles, epilogue=epilogue,
                        interpret=interpret_params(), layout=layout)
        return tk.put_sparse(dz[:n, :width], il - c0, sparse_g)

    dx, dw = chunk_gradients(x2d, w, start, mcfg.chunk, dz_of, layout=layout, dx=dx, dw=dw,
                             refs=(ids, target, rowdat, tgt, sparse_g))
    return dx.astype(x2d.dtype), dw


class MosaicGpuBackend(MosaicGpuBase):
    """The "mosaic_gpu" backend (``contract.TopKBackend``; ``MosaicGpuBase``: SM90, the
    tiles and the backward's chunk)."""

    def why_not(self, x2d_shape, w_shape, dtype, *, softcap, has_bias) -> Optional[str]:
        why = super().why_not(x2d_shape, w_shape, dtype, softcap=softcap, has_bias=has_bias)
        if why is None and (x2d_shape[1] % BLOCK_K or w_shape[0] % 8 or x2d_shape[0] < 1):
            why = f"it needs H % {BLOCK_K} == 0, V % 8 == 0 and tokens; use implementation='xla'"
        return why

    def plan_call(self, x2d_shape, w_shape, dtype, *, budget: int, weight_layout: str = "vh") -> RowsConfig:
        return plan_rows(self, x2d_shape, w_shape, dtype, budget=budget, weight_layout=weight_layout, arrays=2)

    def forward(self, x2d, w, ids, lp, target, config: RowsConfig, *, opts, merge, num_classes: int, grad: bool,
                g_unit=None) -> TopKForward:
        return xla_backend.forward(x2d, w, ids, lp, target, config, opts=opts, merge=merge, num_classes=num_classes,
                                   grad=grad, g_unit=g_unit)

    def backward(self, res: TopKResiduals, g, g_kept, config: RowsConfig, *, opts, merge):
        return backward(res, g, g_kept, config, opts=opts, merge=merge)

