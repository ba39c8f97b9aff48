"""The "mosaic_gpu" backend of linear_topk_kl (SM90; Mosaic GPU's interpret mode without a
GPU).

Forward (``fused_forward``, where ``fused`` says: its buffers fit the plan):
    linear_cross_entropy's Mosaic GPU kernel (``mosaic_lib.stats_partials``) with each
    row's K ids excluded from every tile (``exclude``: a bitmap of the ids built by XLA,
    whose words each tile TMA-loads, ``mosaic_lib.other_columns``: the cost does not grow
    with K) and this op's fold: the online log-sum-exp of a = z / T over the columns
    outside the ids (lse_tail, exact however much mass the ids hold) and, with hard
    labels at T != 1, the tail's log-sum-exp of z itself; z at the ids (and at the
    target: a select and a row sum per element less in the kernel) from XLA, x . W[id]
    in fp32 (a gather of K rows of W per token, in the plan's row chunks; of a (V, H)
    copy of an (H, V) weight, since a gather of its columns reads 32 bytes per element:
    H200, 15.6 ms against 0.5 at K = 20).
    Differentiated, the same pass keeps e = exp(a - m) of the leading whole tiles the
    budget holds, and dz is written over it
    (``common.mosaic_gpu.kept_dz``: c_r e exp(m - lse_tail) - c_b [j == t], plus
    c_q e^T exp(T m - lse1) at T != 1: e^T in fp32 from the kept e, T x its rounding),
    then the K sparse values at the ids (an XLA scatter): the backward's kept columns
    are two GEMMs, as linear_cross_entropy's. Otherwise (a budget too small for the
    bitmap or the weight's copies) the "xla" backend's forward: XLA's GEMMs per row
    chunk, the ids masked by a scatter.

Backward: the kept columns' GEMMs; the others recomputed by ``mosaic_lib.dz_call``, the
Mosaic GPU kernel of linear_cross_entropy's backward with this op's epilogue:

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
from jax import lax

from logitless.jax import mosaic_lib as ml
from logitless.jax.formulas import topk_kl as tk
from logitless.jax.formulas.cross_entropy import logsumexp_rows, merge_lse_splits
from logitless.jax.mosaic_lib import BLOCK_K, LN2, LOG2E
from logitless.jax.ops.common.chunks import chunk_loop, put, take
from logitless.jax.ops.common.mosaic_gpu import MosaicGpuBase, SecondSoftmax, dz_in_place, interpret_params, kept_dz
from logitless.jax.ops.common.rows import W_AXIS, RowsConfig, chunk_gradients, kept_gradients, plan_rows, varying_like
from logitless.jax.ops.linear_topk_kl import xla_backend
from logitless.jax.ops.linear_topk_kl.contract import TopKForward, TopKResiduals
from logitless.jax.planning import ROW_BYTES_PER_ELEM

#: The fp32 arrays of a forward chunk's full rows the plan counts (``plan_rows``' arrays):
#: the "xla" forward's logits and their masked copy.
CHUNK_ARRAYS = 2

def fused(config: RowsConfig, n: int, w_shape: tuple, itemsize: int) -> bool:
    """Whether ``fused_forward`` takes the call (module docstring), else the "xla" forward:
    where its buffers fit in the bytes the plan gives the "xla" forward's chunk of fp32
    logits, which it does not use: the bitmap of the ids (N V / 8 bytes,
    ``mosaic_lib.excluded_words``) and, for an (H, V) weight, its (V, H) copy and, where
    V is not a multiple of 64, its padded copy."""
    v = w_shape[W_AXIS[config.weight_layout]]
    need = n * v // 8
    if config.weight_layout == "hv":
        h = w_shape[0]
        need += (h * v + (h * ml.hv_columns(v) if ml.hv_columns(v) != v else 0)) * itemsize
    return need <= config.grad.rows * CHUNK_ARRAYS * ROW_BYTES_PER_ELEM * v


def _fold(opts, keep: bool):
    """``stats_partials``' fold: (m, s) the online log-sum-exp of a = z / T over the
    columns that count (``valid``: the ids excluded) and, with hard labels at T != 1, s1:
    that of z itself, shifted by T m (the maximum of z: T > 0; exp(z - T m) = e^T,
    products at T = 2, 3, 4: ``mosaic_lib.unit_power``); with ``keep``: e = exp(a - m)
    (0 at excluded columns) and m, taken as 0 while a row has no column yet (a tile of
    its ids only). z at the target is not summed here (a select and a row sum per
    element) but gathered with the ids' (``ids_logits``)."""
    inv_t = 1.0 / opts.temperature
    scale = LOG2E * inv_t
    t_log2e = opts.temperature * LOG2E

    def fold(z, cols, hit, valid, carry):
        m, s = carry[:2]
        z = z if valid is None else jnp.where(valid, z, -jnp.inf)
        m_new = jnp.maximum(m, z.max(axis=1) * inv_t)
        ms = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        e = jnp.exp2(z * scale - ml.bcast(ms * LOG2E, z.shape))
        new = (m_new, s * jnp.exp2((m - ms) * LOG2E) + e.sum(axis=1))
        if opts.hard_at_other_temperature:  # the log-sum-exp of z (T = 1): exp(z - T m) = e^T
            s1 = carry[2] * jnp.exp2((m - ms) * t_log2e)
            e1 = (ml.unit_power(e, opts.temperature) if opts.temperature in ml.INT_POWERS
                  else jnp.exp2(z * LOG2E - ml.bcast(ms * t_log2e, z.shape)))
            new += (s1 + e1.sum(axis=1),)
        return (new, (e, ms)) if keep else new

    return fold


def ids_logits(x2d, w, il, rows: int):
    """z at each row's ids (``il``: this device's column ids) in fp32, 0 at ids outside
    its columns: x . W[id], K rows of W gathered per token, ``rows`` tokens at a time."""
    n, k = il.shape
    v = w.shape[0]
    f32 = jnp.float32

    def step(r0, nr, out):
        i = take(il, r0, nr)
        wr = jnp.take(w, jnp.clip(i, 0, v - 1), axis=0).astype(f32)  # (nr, K, H)
        z = (take(x2d, r0, nr).astype(f32)[:, None, :] * wr).sum(axis=-1)
        return put(out, jnp.where((i >= 0) & (i < v), z, 0.0), r0)

    return chunk_loop(n, rows, step, varying_like(jnp.zeros((n, k), f32), x2d, w, il))


def fused_forward(x2d, w, ids, lp, target, config: RowsConfig, *, opts, merge, num_classes: int, grad: bool,
                  g_unit=None) -> TopKForward:
    """The contract's forward in one Mosaic GPU pass (module docstring; ``fused``'s cases).
    The kept dz has the kernel's padded rows (zero) and whole tiles of columns."""
    n = x2d.shape[0]
    layout = config.weight_layout
    v = w.shape[W_AXIS[layout]]
    w_rows = w  # (V, H): the ids' rows of W for their logits
    if layout == "hv":  # the TMA's padded columns; a (V, H) copy (``fused``: its bytes fit the plan)
        w_rows = lax.optimization_barrier(w.T)  # materialised: a gather through the transpose reads columns
        w = ml.pad_hv(w)
    tiles = config.recompute.tiles
    bv = tiles.block_v
    off = merge.offset(v)
    il, tl = ids - off, target - off
    keep_tiles = (config.grad.keep if g_unit is not None else 0) // bv
    other = opts.hard_at_other_temperature
    lse_of = lambda m, s: m + jnp.log2(s) * LN2

    def finish(c):  # lse_tail, the tail's lse of z (hard labels at T != 1)
        return (lse_of(c[0], c[1]),) + ((lse_of(c[0] * opts.temperature, c[2]),) if other else ())

    n_out = 2 if other else 1
    out = ml.stats_partials(ml.pad_rows8(x2d), w, tl, v=v, cfg=tiles, n_out=n_out,
                            init=(-jnp.inf, 0.0) + ((0.0,) if other else ()),
                            fold=_fold(opts, keep_tiles > 0), finish=finish, interpret=interpret_params(),
                            layout=layout, keep_tiles=keep_tiles, exclude=il)
    lses = merge.lse(*(merge_lse_splits(o) for o in out[:n_out]))
    # z at the ids and, with hard labels, at the target: one gather (0 outside this device's columns)
    z = ids_logits(x2d, w_rows, jnp.concatenate([il, tl[:, None]], axis=1) if opts.hard else il, config.plain.rows)
    k = il.shape[1]
    sums = merge.sum(z[:, :k], *([z[:, k]] if opts.hard else []))
    lse1 = jnp.logaddexp(lses[1], logsumexp_rows(sums[0])) if other else None  # the tail's and the ids'
    st = tk.TopKStats(lses[0], sums[0], sums[1] if opts.hard else None, lse1)
    terms = tk.token_terms(st, lp, ids, target, opts, num_classes, grad=grad)
    kept = None
    if keep_tiles:
        k_buf, tile_max = out[n_out:]
        rows = k_buf.shape[0]
        pad = lambda a, fill=0: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, rows - n)], constant_values=fill)
        lse_t = pad(jnp.where(st.lse_tail == -jnp.inf, 0.0, st.lse_tail))
        c = terms.coef * g_unit[None, :]
        abc = pad(jnp.stack([c[0], c[2], jnp.zeros_like(c[0])]))  # dz = A e exp(m - lse_tail) - B [j == t] - C
        second = SecondSoftmax(pad(lse1), pad(c[1]), opts.temperature) if other else None  # + c_q exp(z - lse1)
        dz = kept_dz(k_buf, tile_max, lse_t, abc, pad(tl), v=v, block_v=bv, dtype=x2d.dtype, second=second)
        kept = tk.put_sparse(dz, pad(il.T, -1).T, pad((terms.sparse * g_unit[:, None]).T).T)
    return TopKForward(terms.loss, st.lse_tail, lse1, terms.coef, terms.sparse, kept)


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
        """``plan_rows``; the kept dz beside the fused forward's K where it cannot be
        written over it (``kept_dz``: no Pallas Triton)."""
        return plan_rows(self, x2d_shape, w_shape, dtype, budget=budget, weight_layout=weight_layout,
                         arrays=CHUNK_ARRAYS, kept_copies=1 if dz_in_place() else 2)

    def forward(self, x2d, w, ids, lp, target, config: RowsConfig, *, opts, merge, num_classes: int, grad: bool,
                g_unit=None) -> TopKForward:
        fwd = fused_forward if fused(config, x2d.shape[0], w.shape, w.dtype.itemsize) else xla_backend.forward
        return fwd(x2d, w, ids, lp, target, config, opts=opts, merge=merge, num_classes=num_classes, grad=grad,
                   g_unit=g_unit)

    def backward(self, res: TopKResiduals, g, g_kept, config: RowsConfig, *, opts, merge):
        return backward(res, g, g_kept, config, opts=opts, merge=merge)

