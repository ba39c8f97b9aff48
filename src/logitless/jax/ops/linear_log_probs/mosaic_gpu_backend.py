"""Backend "mosaic_gpu" of linear_log_probs: Pallas Mosaic GPU kernels for SM90 (H100/H200),
on the GEMM-tile machinery of ``logitless.jax.mosaic_lib`` (shared with
linear_cross_entropy's backend: TMA ring, warp-specialised WGMMA main loop).

Forward (``forward``): one kernel, a GEMM whose epilogue never leaves the chip. Per
    tile of fp32 logits z (rows: tokens, columns: a vocab tile of one split),
        a = softcap(z) * (1/T)
        m' = max(m, max_c a_c);  s <- s e^(m - m') + sum_c e^(a_c - m')
        u  <- e^(m - m') (u + (m - m') s) + sum_c e^(a_c - m') (a_c - m')   (entropy only)
        a_t += a[c == t]
    (exponentials as ex2 of an FMA, approximate ex2/lg2: ~2 ulp). Each CTA writes per
    row and split: lse_k = m + log s, H_k = log s - u / s (the split's own entropy) and
    the target partial; JAX merges them: lse = logsumexp_k lse_k, and with
    w_k = exp(lse_k - lse), H = sum_k w_k (H_k + lse - lse_k) (every term >= 0: no
    cancellation), a_t = sum_k a_t,k. O(N x splits) floats; no logits in memory.
    Memory traffic: one GEMM's (x and W tiles, from L2 mostly).

Backward (``backward``): "4 GEMMs" (recompute + 2 XLA GEMMs, plus the forward). Per vocab
    chunk the dz kernel recomputes the logits tile and writes, in the input dtype,
        dz_c = p_c (A + C log p_c) - B [c == t],   log p_c = a_c - lse
    times (1 - (softcap(z_c)/s)^2) with a soft-cap ((A, B, C) per token from
    ``formulas.log_probs.grad_coefficients``, 1/T folded in; C = 0 term skipped without
    entropy); zero at columns >= V. XLA then takes dW[chunk] = dz^T x, dx += dz W[chunk]
    (fp32 accumulation). Temporaries: the fp32 dx accumulator, one dz chunk, one W
    slice and one dW chunk, sized from the memory budget (``mosaic_lib.chunk_columns``).

Weight layouts: W (V, H), or with ``weight_layout="hv"`` (``native_hv``) a flax-style
(H, V) kernel read in place (``mosaic_lib``: (H, V) tiles are WGMMA's B operand as
they are); dW comes back in W's layout, no transposed copy. The padding below applies
to an (H, V) weight also when V % 64 != 0 (``mosaic_lib.hv_columns``).

Bias, H not a multiple of 64, V not a multiple of 8: W (and x) are padded once per call
to [W | b | 0] (H rounded up to a multiple of 64 plus one 64-column block for the bias
column, V to a multiple of 8) and x to [x | 1 | 0]: the GEMM then adds the bias, the
padded columns are masked, and db is the bias column of dW (fp32 accumulation). This
costs a copy of W per call (and ~64/H more GEMM work): correct everywhere,
fastest on the aligned, bias-free LM heads (``is_fast``). Inputs must be bf16/f16
(``is_supported``; fp32 and fp64 stay on "xla"). Off a GPU the kernels run in Mosaic
GPU's interpret mode (the CPU tests).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from logitless.jax import mosaic_lib as ml
from logitless.jax.formulas.cross_entropy import merge_lse_splits
from logitless.jax.mosaic_lib import BLOCK_K, LN2, LOG2E, FwdConfig
from logitless.jax.ops.common import mosaic_gpu as kind
from logitless.jax.ops.common.mosaic_gpu import MosaicGpuBase, MosaicGpuConfig
from logitless.jax.ops.common.mosaic_gpu import interpret_params as _interpret_params
from logitless.jax.ops.linear_log_probs.contract import LlpGrads, LlpResiduals, LlpStats
from logitless.options import LogProbOptions

__all__ = ["forward", "backward", "is_supported", "is_fast", "FwdConfig", "MosaicGpuBackend", "MosaicGpuConfig"]

UNSUPPORTED_HINT = "mosaic_gpu needs bfloat16 or float16 x and weight (use implementation='xla')"


def is_supported(x2d_shape, w_shape, dtype, *, softcap=None, has_bias=False) -> bool:
    """Whether the kernels run this case: the kind's (``common.mosaic_gpu.why_unsupported``:
    bf16/f16, 2-D, matching H); any H, V, bias (``_aligned`` pads them)."""
    del softcap, has_bias
    return kind.why_unsupported(x2d_shape, w_shape, dtype) is None


def is_fast(x2d_shape, w_shape, dtype, *, softcap=None, has_bias=False) -> bool:
    """Supported without the per-call padded copy of W: no bias, H % 64 == 0, V % 8 == 0."""
    return (is_supported(x2d_shape, w_shape, dtype, softcap=softcap, has_bias=has_bias) and not has_bias
            and x2d_shape[1] % BLOCK_K == 0 and w_shape[0] % 8 == 0)


def _vocab(w, weight_layout):
    return w.shape[ml.w_axis(weight_layout)]


def _check(x2d, w, bias, weight_layout="vh"):
    vh = tuple(w.shape) if weight_layout == "vh" else tuple(w.shape[::-1])
    if not is_supported(x2d.shape, vh, x2d.dtype) or w.dtype != x2d.dtype:
        raise ValueError(f"mosaic_gpu: unsupported case x {x2d.shape} {x2d.dtype}, w {w.shape} {w.dtype} "
                         f"({weight_layout}): {UNSUPPORTED_HINT}")
    if bias is not None and (bias.shape != (vh[0],) or bias.dtype != w.dtype):
        raise ValueError(f"mosaic_gpu: bias must be ({vh[0]},) {w.dtype}, got {bias.shape} {bias.dtype}")


def _aligned(x2d, w, bias, weight_layout="vh"):
    """(x, W) the kernels can read: rows of x padded to 8; with a bias or unaligned H or
    V, [x | 1 | 0] and [W | b | 0] (see the module docstring; for "hv" the bias is row h
    of the padded (H', V') weight)."""
    x8 = ml.pad_rows8(x2d)
    n, h = x2d.shape
    v = _vocab(w, weight_layout)
    if bias is None and h % BLOCK_K == 0 and (v % 8 == 0 if weight_layout == "vh" else ml.hv_columns(v) == v):
        return x8, w
    hp = -(-h // BLOCK_K) * BLOCK_K
    if bias is not None:
        hp += BLOCK_K if hp == h else 0  # room for the bias column at index h
    vp = -(-v // 8) * 8 if weight_layout == "vh" else ml.hv_columns(-(-v // 8) * 8)
    xp = jnp.pad(x8, ((0, 0), (0, hp - h)))
    if weight_layout == "vh":
        wp = jnp.pad(w, ((0, vp - v), (0, hp - h)))
        if bias is not None:
            wp = wp.at[:v, h].set(bias)
    else:
        wp = jnp.pad(w, ((0, hp - h), (0, vp - v)))
        if bias is not None:
            wp = wp.at[h, :v].set(bias)
    if bias is not None:
        xp = xp.at[:n, h].set(jnp.ones((), x2d.dtype))
    return xp, wp


def _config(n, v, h, config):
    return config or ml.default_config(n, v, h)


def forward(x2d, w, bias, tokens, *, opts: LogProbOptions, budget=None, config: FwdConfig | None = None,
            weight_layout: str = "vh"):
    """(lse, a_t, H or None), each (N,) fp32, of a = softcap(x w^T + b) / T (w (H, V)
    with ``weight_layout="hv"``)."""
    del budget  # the forward's temporaries are O(N x splits)
    _check(x2d, w, bias, weight_layout)
    n, h = x2d.shape
    v = _vocab(w, weight_layout)
    xk, wk = _aligned(x2d, w, bias, weight_layout)
    cfg = _config(n, v, h, config)
    softcap, inv_t, entropy = opts.softcap, 1.0 / opts.temperature, opts.entropy

    def fold(z, cols, hit, valid, carry):
        m, s, u, at = carry
        a = ml.softcapped(z, softcap)
        if inv_t != 1.0:
            a = a * inv_t
        at = at + jnp.where(hit, a, 0.0).sum(axis=1)
        if valid is not None:
            a = jnp.where(valid, a, -jnp.inf)
        m_new = jnp.maximum(m, a.max(axis=1))
        scale = jnp.exp2((m - m_new) * LOG2E)
        if entropy:
            # d = a - m' first, so that a is dead while p and p d are formed (registers).
            d = a - ml.bcast(m_new, a.shape)
            p = jnp.exp2(d * LOG2E)
            pd = p * d
            if valid is not None:
                pd = jnp.where(valid, pd, 0.0)  # 0 * -inf in masked columns
            corr = jnp.where(s > 0.0, (m - m_new) * s, 0.0)  # -inf * 0 on the first tile
            u = scale * (u + corr) + pd.sum(axis=1)
        else:
            # e^(a - m') as 2^(a log2 e - m' log2 e): one FMA + ex2 per element.
            p = jnp.exp2(a * LOG2E - ml.bcast(m_new * LOG2E, a.shape))
        s = s * scale + p.sum(axis=1)
        return m_new, s, u, at

    def finish(carry):
        m, s, u, at = carry
        log_s = jnp.log2(s) * LN2
        return m + log_s, (log_s - u / s if entropy else None), at

    lse_p, h_p, at_p = ml.stats_partials(xk, wk, tokens, v=v, cfg=cfg, n_out=3, init=(-jnp.inf, 0.0, 0.0, 0.0),
                                         fold=fold, finish=finish, interpret=_interpret_params(),
                                         layout=weight_layout)
    lse = merge_lse_splits(lse_p)
    ent = None
    if entropy:
        wts = jnp.exp(lse_p - lse[None])
        ent = jnp.sum(wts * (h_p + (lse[None] - lse_p)), axis=0)
    return lse, at_p.sum(axis=0), ent


def _epilogue(opts: LogProbOptions):
    """dz = p (A + C log p) - B [c == t], log p = a - lse, times 1 - (softcap(z)/s)^2."""
    softcap, inv_t, entropy = opts.softcap, 1.0 / opts.temperature, opts.entropy

    def epilogue(z, rows, hit):
        lse_r, a_r, b_r, c_r = rows
        bc = lambda r: ml.bcast(r, z.shape)
        capped = ml.softcapped(z, softcap)
        a = capped * inv_t if inv_t != 1.0 else capped
        logp = a - bc(lse_r)
        p = jnp.exp2(logp * LOG2E)
        coef = bc(a_r) + bc(c_r) * logp if entropy else bc(a_r)
        dz = p * coef - jnp.where(hit, bc(b_r), 0.0)
        if softcap is not None:
            zs = capped * (1.0 / softcap)
            dz = dz * (1.0 - zs * zs)
        return dz

    return epilogue


def backward(x2d, w, bias, tokens, lse, coef, *, opts: LogProbOptions, budget=None, config: FwdConfig | None = None,
             weight_layout: str = "vh", chunk: Optional[int] = None):
    """(dx, dw, db or None) in the inputs' dtypes, dw in w's layout; see the module docstring.
    ``chunk``: the columns per chunk (``MosaicGpuBackend.plan``'s); None: from ``budget``."""
    _check(x2d, w, bias, weight_layout)
    n, h = x2d.shape
    v = _vocab(w, weight_layout)
    xk, wk = _aligned(x2d, w, bias, weight_layout)
    cfg = _config(n, v, h, config)
    # Padded token rows (x = 0, coefficients 0) get dz = 0: nothing added to dW.
    rows = jnp.concatenate([lse[None].astype(jnp.float32), coef.astype(jnp.float32)], axis=0)
    rowdat, tgt = ml.row_inputs(tokens, rows, ml.rows_padded(xk.shape[0], cfg))
    dx, dw = ml.chunked_backward(xk, wk, rowdat, tgt, n=n, v=v, cfg=cfg, budget=budget, epilogue=_epilogue(opts),
                                 interpret=_interpret_params(), layout=weight_layout, chunk=chunk)
    dx = dx[:n, :h].astype(x2d.dtype)
    db = None
    if wk is not w:
        if weight_layout == "vh":
            db = None if bias is None else dw[:v, h].astype(bias.dtype)
            dw = dw[:v, :h]
        else:
            db = None if bias is None else dw[h, :v].astype(bias.dtype)
            dw = dw[:h, :v]
    return dx, dw, db


class MosaicGpuBackend(MosaicGpuBase):
    """The "mosaic_gpu" backend (``contract.LlpBackend``; ``MosaicGpuBase``: SM90, bf16/f16,
    the tiles and the backward's chunk for ``_aligned``'s operands)."""

    def forward(self, x2d, w, bias, tokens, config: MosaicGpuConfig, *, opts: LogProbOptions) -> LlpStats:
        return LlpStats(*forward(x2d, w, bias, tokens, opts=opts, config=config.tiles,
                                 weight_layout=config.weight_layout))

    def backward(self, res: LlpResiduals, coef, config: MosaicGpuConfig, *, opts: LogProbOptions) -> LlpGrads:
        return LlpGrads(*backward(res.x2d, res.w, res.bias, res.tokens, res.lse, coef, opts=opts,
                                  config=config.tiles, weight_layout=config.weight_layout, chunk=config.chunk))
