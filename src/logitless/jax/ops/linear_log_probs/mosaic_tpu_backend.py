"""Backend "mosaic_tpu" of linear_log_probs: Pallas Mosaic TPU kernels
(``logitless.jax.mosaic_tpu_lib``, shared with linear_cross_entropy's backend).

Forward: grid (row blocks "parallel", vocab tiles "arbitrary"); per step
    a = cap(x_i @ W_j^T + b_j) / T (fp32, MXU), folded into (bn, 1) fp32 VMEM
    accumulators: m, s = sum e^(a - m), u = sum e^(a - m)(a - m) (entropy only; the
    online update of ``formulas.log_probs``), a_t += a[c == t]; columns >= V masked.
Backward: the dX and dW kernels of the library with the epilogue
    dz = p (A + C log p) - B [c == t]  (x (1 - (z/s)^2) with a softcap).
bf16/f32 inputs (no fp64: TPUs have none), any N, V, H; every option (bias,
softcap, temperature, entropy). HBM temporaries: O(N) only; the budget caps VMEM.
On a platform other than TPU the kernels run in Pallas' TPU interpret mode.
Weight layouts: (V, H), or (H, V) with ``weight_layout="hv"`` (``native_hv``): (H, bv)
blocks of the library's "hv" layout, dW in w's layout; no transposed copy.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from logitless.jax import mosaic_tpu_lib as tl
from logitless.jax.mosaic_tpu_lib import MosaicTpuConfig
from logitless.jax.ops.common.mosaic_tpu import MosaicTpuBase
from logitless.jax.ops.linear_log_probs.contract import LlpGrads, LlpResiduals, LlpStats
from logitless.options import LogProbOptions

_F32 = jnp.float32


def _scaled(z, opts: LogProbOptions):
    if opts.softcap is not None:
        z = opts.softcap * jnp.tanh(z * (1.0 / opts.softcap))
    if opts.temperature != 1.0:
        z = z * (1.0 / opts.temperature)
    return z


def _tiles(x2d, w, budget, weight_layout="vh"):
    n, h = x2d.shape
    v = w.shape[0] if weight_layout == "vh" else w.shape[1]
    return tl.choose_tiles(n, v, h, jnp.dtype(x2d.dtype).itemsize, budget)


def forward(x2d, w, bias, tokens, *, opts: LogProbOptions, budget=None, weight_layout: str = "vh",
            tiles: Optional[tl.Tiles] = None):
    """(lse, a_t, H|None), each (N,) float32. ``tiles``: the kernels' tiles
    (``MosaicTpuBackend.plan``'s); None: chosen here from ``budget``."""
    ent = bool(opts.entropy)

    def fold(z, hit, valid, cwt, stats):
        m, s, u, at = stats
        a = _scaled(z, opts)
        at = at + jnp.sum(jnp.where(hit, a, 0.0), axis=1, keepdims=True)
        if valid is not None:
            a = jnp.where(valid, a, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(a, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        d = m - m_safe
        scale = jnp.exp(d)
        a = a - m_safe
        e = jnp.exp(a)
        s_new = s * scale + jnp.sum(e, axis=1, keepdims=True)
        if ent:
            corr = jnp.where(s > 0, d * s, 0.0)
            u = scale * (u + corr) + jnp.sum(jnp.where(e > 0, e * a, 0.0), axis=1, keepdims=True)
        return m_new, s_new, u, at

    def finish(stats):
        m, s, u, at = stats
        log_s = jnp.log(s)
        return jnp.where(m == -jnp.inf, 0.0, m) + log_s, at, (log_s - u / s if ent else at)

    lse, at, h = tl.stats_call(x2d, w, bias, None, tokens, layout=weight_layout,
                               tiles=_tiles(x2d, w, budget, weight_layout) if tiles is None else tiles,
                               n_stats=4,
                               init=(-jnp.inf, 0.0, 0.0, 0.0), fold=fold, finish=finish, n_out=3)
    return lse, at, (h if ent else None)


def _epilogue(opts: LogProbOptions):
    def epilogue(z, hit, rows, cwt):
        del cwt
        lse, a_c, b, c = rows
        a = _scaled(z, opts)
        logp = a - lse
        p = jnp.exp(logp)
        dz = jnp.where(p > 0, p * (a_c + c * logp), 0.0) if opts.entropy else p * a_c
        dz = dz - jnp.where(hit, b, 0.0)
        if opts.softcap is not None:
            capped = a * (opts.temperature / opts.softcap)
            dz = dz * (1.0 - capped * capped)
        return dz

    return epilogue


def backward(x2d, w, bias, tokens, lse, coef, *, opts: LogProbOptions, budget=None, weight_layout: str = "vh",
             tiles: Optional[tl.Tiles] = None):
    """(dx, dw, db) in the inputs' dtypes (db None without bias), dw in w's layout;
    ``tiles`` as for ``forward``."""
    rowdat = jnp.concatenate([lse[None].astype(_F32), coef.astype(_F32)], axis=0).T  # (N, 4)
    tiles = _tiles(x2d, w, budget, weight_layout) if tiles is None else tiles
    kw = dict(layout=weight_layout, tiles=tiles, epilogue=_epilogue(opts))
    dx = tl.dx_call(x2d, w, bias, None, tokens, rowdat, **kw)
    dw, db = tl.dw_call(x2d, w, bias, None, tokens, rowdat, **kw)
    return dx, dw, db


class MosaicTpuBackend(MosaicTpuBase):
    """The "mosaic_tpu" backend (``contract.LlpBackend``; ``MosaicTpuBase``: bf16/f32, the
    tiles, ``mosaic_tpu_lib.MosaicTpuConfig``)."""

    def forward(self, x2d, w, bias, tokens, config: MosaicTpuConfig, *, opts: LogProbOptions) -> LlpStats:
        return LlpStats(*forward(x2d, w, bias, tokens, opts=opts, weight_layout=config.weight_layout,
                                 tiles=config.tiles))

    def backward(self, res: LlpResiduals, coef, config: MosaicTpuConfig, *, opts: LogProbOptions) -> LlpGrads:
        return LlpGrads(*backward(res.x2d, res.w, res.bias, res.tokens, res.lse, coef, opts=opts,
                                  weight_layout=config.weight_layout, tiles=config.tiles))
