"""Backend "mosaic_gpu": Pallas Mosaic GPU kernels for SM90 (H100/H200).

Forward (``forward``): one kernel, a GEMM whose epilogue never leaves the chip.
    Grid (token blocks, vocab splits); each CTA owns ``2 * block_n`` rows (two compute
    warpgroups of ``block_n`` rows each) and walks its vocab split in tiles of
    ``block_v`` columns. A third (memory) warpgroup streams x[rows, k] and W[cols, k]
    tiles with TMA into a ``stages``-deep ring of shared-memory slots; the compute
    warpgroups issue WGMMA (x tile @ W tile^T, fp32 accumulator in registers), then
    fold the (block_n, block_v) tile of logits into running per-row statistics:
        m = max(m, max_c z_c);  l = l * exp(m_old - m) + sum_c exp(z_c - m)
        t += z[target];  s += sum_c z_c  (label smoothing only)
    Columns >= V (zero-filled out-of-bounds TMA reads give z = 0 there) are masked to
    -inf before the max/sum and excluded from s (only in the one tile that has them).
    Warpgroup 1 runs ``lag`` ring steps behind warpgroup 0, so that one's epilogue
    overlaps the other's WGMMAs. Exponentials are ex2 of an FMA (approximate ex2/lg2,
    ~2 ulp). Each CTA writes, per row, one
    log-sum-exp partial m + log l, one target-logit partial and one sum partial:
    O(N x splits) floats, merged in JAX (logsumexp over splits, sums).
    Memory traffic: that of one GEMM (x and W tiles, from L2 mostly), no logits.

Kept (``forward_keeping``, the api's forward under ``jax.grad``: ``keep=True``): for the
    first ``MosaicGpuConfig.keep`` columns (``mosaic_lib.keep_plan``: all of them when the
    budget holds them) the same pass also stores K = exp(z - m) in the input dtype, m the
    running maximum after each tile (also stored, M (tiles, N) fp32), since the fold
    computes exp(z - m) anyway. Then dz_c = e_c A exp(m - lse) - B [c == t] - C
    (``formulas.cross_entropy.dlogits_kept``): every column kept, ``common.mosaic_gpu.kept_dz`` writes
    it over K and dx, dW are two GEMMs on the whole W ("3 GEMMs"); part kept, those
    chunks' dz come from K, the others' from the recomputation below. Not with a soft-cap
    (its derivative needs z: recomputed).

Backward (``backward``): "4 GEMMs" where nothing is kept. For each vocab chunk [c0, c0 + C) the kernel
    ``mosaic_lib.dz_call`` (``FwdConfig.dz_tiles`` consecutive column tiles per CTA,
    the chunk offset a kernel input) recomputes the (N, C) logits tile by tile (same
    WGMMA main loop) and
    writes d(logits) in the input dtype:
        dz_c = exp(z_c - lse) * A - B * [c == t] - C    (x (1 - (z_c/s)^2) with a softcap)
    with zeros at columns >= V; XLA GEMMs then take dW[chunk] = dz^T x and
    dx += dz W[chunk] (fp32 accumulation). The chunk is sized from the memory budget
    (``_chunk_columns``: the fp32 dx accumulator, the dz chunk, the W slice and the dW
    chunk) and rounded to a divisor of V when one is near; full chunks run in a
    ``lax.fori_loop`` (one compiled kernel) that writes each dW chunk in place into dW
    (written once, no stacking or concatenation).
    Cost: recompute (1 GEMM) + 2 GEMMs; with the forward, 4 GEMM-equivalents, plus XLA's
    copies of the W slices when there are several chunks.

Weight layouts: W (V, H) or, with ``weight_layout="hv"`` (``native_hv``), a flax-style
(H, V) kernel read in place: the TMA streams (H, V) tiles that WGMMA takes as its B
operand directly (``mosaic_lib``), and dW comes back (H, V); no transposed copy (an
(H, V) weight with V % 64 != 0 gets its columns zero-padded to a multiple of 64, a
copy: ``mosaic_lib.pad_hv``; LM vocabularies are multiples of 64).

Limits (``is_supported``): bf16/f16 inputs, H a multiple of 64, V a multiple of 8 (TMA
into swizzled tiles), no bias (the api falls back to "xla" otherwise). Ragged V (vs the
tiles) is masked in-kernel; N is padded to a multiple of 8 rows (a copy of x only when
N % 8 != 0); W is never copied by the kernels. On a machine without an SM90 GPU the kernels run under Mosaic GPU's
interpret mode (``plgpu.force_gpu_interpret_mode``), which the CPU tests use.

The ring, the main loop and both kernel shapes live in ``logitless.jax.mosaic_lib``
(shared with linear_log_probs' backend); this module holds the cross-entropy fold
(forward statistics) and epilogue (dz).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
from jax import lax

from logitless.jax import mosaic_lib as ml
from logitless.jax.formulas.cross_entropy import dlogits_kept, merge_lse_splits
from logitless.jax.mosaic_lib import BLOCK_K, LN2, LOG2E, FwdConfig
from logitless.jax.ops.common.mosaic_gpu import MosaicGpuBase, MosaicGpuConfig, dz_in_place, kept_dz
from logitless.jax.ops.common.mosaic_gpu import interpret_params as _interpret_params
from logitless.jax.ops.linear_cross_entropy.contract import LceGrads, LceResiduals, LceStats
from logitless.jax.sharding import to_varying, varying

__all__ = ["forward", "backward", "is_supported", "supports", "FwdConfig", "dz_chunk", "MosaicGpuBackend",
           "MosaicGpuConfig"]

_SUPPORTED_DTYPES = ml.SUPPORTED_DTYPES
_pad_rows8 = ml.pad_rows8
_default_config = ml.default_config
_chunk_columns = ml.chunk_columns
_softcapped = ml.softcapped


def why_unsupported(x2d_shape, w_shape, dtype, *, softcap=None, has_bias=False):
    """The constraint this case breaks (a phrase for the refusal), or None when these
    kernels handle it (``w_shape`` is (V, H))."""
    del softcap
    if has_bias:
        return "bias is not supported"
    if jnp.dtype(dtype) not in _SUPPORTED_DTYPES:
        return f"dtype {jnp.dtype(dtype).name}: it takes bfloat16 or float16"
    if len(x2d_shape) != 2 or len(w_shape) != 2:
        return "x and weight must be 2-D"
    n, h = x2d_shape
    v, h2 = w_shape
    if h != h2:
        return f"x has H={h} but weight has H={h2}"
    # TMA into swizzled tiles needs the tiled GMEM dims to be multiples of 8: rows of
    # x are padded in the wrapper (cheap), rows of W never are (a copy of W per step).
    if h <= 0 or h % BLOCK_K:
        return f"H={h} is not a positive multiple of {BLOCK_K}"
    if v < 1 or v % 8:
        return f"V={v} is not a positive multiple of 8"
    if n < 1:
        return "there are no tokens"
    return None


def is_supported(x2d_shape, w_shape, dtype, *, softcap=None, has_bias=False) -> bool:
    """Whether these kernels handle the case (else the api falls back to "xla")."""
    return why_unsupported(x2d_shape, w_shape, dtype, softcap=softcap, has_bias=has_bias) is None


def _vh_shape(w, weight_layout):
    """(V, H) of w in ``weight_layout``."""
    return tuple(w.shape) if weight_layout == "vh" else tuple(w.shape[::-1])


def _check(x2d, w, bias, weight_layout="vh"):
    if bias is not None:
        raise ValueError("mosaic_gpu: bias is not supported (use implementation='xla')")
    why = why_unsupported(x2d.shape, _vh_shape(w, weight_layout), x2d.dtype)
    if why is None and w.dtype != x2d.dtype:
        why = f"x is {x2d.dtype} but w is {w.dtype}"
    if why is not None:
        raise ValueError(
            f"mosaic_gpu: unsupported case x {x2d.shape} {x2d.dtype}, w {w.shape} {w.dtype}: {why} "
            f"(it needs bf16/f16, H % {BLOCK_K} == 0, V % 8 == 0; use implementation='xla')")


supports = is_supported


# ---------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------


def _forward_partials(x, w, target, *, v, softcap, need_smooth, cfg: FwdConfig, layout="vh", keep_tiles=0):
    """Per split: log-sum-exp m + log l, target logit, sum of logits (label smoothing);
    with ``keep_tiles``, also K = exp(z - m) of the first tiles and their m (the running
    maximum after the tile): ``mosaic_lib.stats_partials``' kept outputs."""

    def fold(z, cols, hit, valid, carry):
        m, l, tl, ss = carry
        z = _softcapped(z, softcap)
        if need_smooth:
            ss = ss + (jnp.where(valid, z, 0.0) if valid is not None else z).sum(axis=1)
        tl = tl + jnp.where(hit, z, 0.0).sum(axis=1)
        if valid is not None:
            z = jnp.where(valid, z, -jnp.inf)
        m_new = jnp.maximum(m, z.max(axis=1))
        # exp(z - m) as 2^(z log2 e - m log2 e): one FMA + ex2 per element.
        p = jnp.exp2(z * LOG2E - ml.bcast(m_new * LOG2E, z.shape))
        l = l * jnp.exp2((m - m_new) * LOG2E) + p.sum(axis=1)
        carry = (m_new, l, tl, ss)
        return (carry, (p, m_new)) if keep_tiles else carry

    def finish(carry):
        m, l, tl, ss = carry
        return m + jnp.log2(l) * LN2, tl, (ss if need_smooth else None)

    return ml.stats_partials(x, w, target, v=v, cfg=cfg, n_out=3,
                             init=(-jnp.inf, 0.0, 0.0, 0.0), fold=fold, finish=finish,
                             interpret=_interpret_params(), layout=layout, keep_tiles=keep_tiles)


def forward(x2d, w, bias, target, *, softcap=None, need_smooth=False, budget=None, config: FwdConfig | None = None,
            weight_layout: str = "vh"):
    """(lse, target_logit, smooth_sum|None), each (N,) float32; see the package docstring.
    ``weight_layout="hv"``: w is (H, V), read in place."""
    return forward_keeping(x2d, w, bias, target, softcap=softcap, need_smooth=need_smooth, config=config,
                           weight_layout=weight_layout)[:3]


def forward_keeping(x2d, w, bias, target, *, softcap=None, need_smooth=False, config: FwdConfig | None = None,
                    weight_layout: str = "vh", keep_cols: int = 0):
    """``forward``'s statistics and what it kept for the backward: (K, M) of the first
    ``keep_cols`` columns (rounded up to whole tiles; ``Kept`` in the package docstring),
    or None (``keep_cols`` 0, or a soft-cap: then the backward recomputes)."""
    _check(x2d, w, bias, weight_layout)
    n, h = x2d.shape
    v = _vh_shape(w, weight_layout)[0]
    cfg = config or _default_config(n, v, h)
    if weight_layout == "hv":
        w = ml.pad_hv(w)
    keep_tiles = -(-keep_cols // cfg.block_v) if softcap is None else 0
    out = _forward_partials(_pad_rows8(x2d), w, target, v=v, softcap=softcap, need_smooth=need_smooth,
                            cfg=cfg, layout=weight_layout, keep_tiles=keep_tiles)
    lse_p, tl_p, ss_p = out[:3]
    lse = merge_lse_splits(lse_p)
    tl = tl_p.sum(axis=0)
    ss = ss_p.sum(axis=0) if need_smooth else None
    return lse, tl, ss, (tuple(out[3:]) if keep_tiles else None)


# ---------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------


def _row_inputs(target, lse, coef, n_pad):
    """Per-row inputs of the dz kernel, padded to whole row blocks: [lse log2(e), A, B, C]
    (f32) and the target (int32). Built once per backward, shared by every chunk."""
    rows = jnp.concatenate([lse[None].astype(jnp.float32) * LOG2E, coef.astype(jnp.float32)], axis=0)
    return ml.row_inputs(target, rows, n_pad)


def _epilogue(softcap):
    """dz_c = exp(z_c - lse) * A - B * [c == t] - C  (x (1 - (z_c/s)^2) with a softcap)."""

    def epilogue(z, rows, hit):
        lse_r, a_r, b_r, c_r = rows  # lse_r holds lse * log2(e)
        z = _softcapped(z, softcap)
        bc = lambda r: ml.bcast(r, z.shape)
        p = jnp.exp2(z * LOG2E - bc(lse_r))
        dz = p * bc(a_r) - jnp.where(hit, bc(b_r), 0.0) - bc(c_r)
        if softcap is not None:
            zs = z * (1.0 / softcap)
            dz = dz * (1.0 - zs * zs)
        return dz

    return epilogue


def dz_chunk(x, w, target, lse, coef, *, c0, chunk: int, softcap=None, cfg: FwdConfig | None = None,
             weight_layout: str = "vh"):
    """d(logits) for columns [c0, c0 + chunk) of all N rows: (N, chunk) in x.dtype (w in
    ``weight_layout``).

    Columns >= V are zero. ``chunk`` and ``c0`` must be multiples of ``cfg.block_v``;
    ``c0`` may be a traced int32 scalar (one compiled kernel serves every chunk).
    N must be a multiple of 8 (``_pad_rows8``).
    """
    n, h = x.shape
    v = _vh_shape(w, weight_layout)[0]
    cfg = cfg or _default_config(n, v, h)
    if isinstance(c0, int) and c0 % cfg.block_v:
        raise ValueError(f"offset {c0} must be a multiple of block_v={cfg.block_v}")
    rowdat, tgt = _row_inputs(target, lse, coef, ml.rows_padded(n, cfg))
    if weight_layout == "hv":
        w = ml.pad_hv(w)
    cblock = (jnp.asarray(c0, jnp.int32) // cfg.block_v).reshape(1)
    return ml.dz_call(x, w, rowdat, tgt, cblock, v=v, chunk=chunk, cfg=cfg, epilogue=_epilogue(softcap),
                      interpret=_interpret_params(), layout=weight_layout)


def _kept_dz(kept, target, lse, coef, *, v: int, vw: int, block_v: int, n8: int, dtype):
    """``chunked_backward``'s kept_dz: dz of kept columns [c0, c0 + width) from (K, M),
    rows [0, n8), in ``dtype``; zero at columns >= v and at padded rows (their
    coefficients are 0). All of K when its shape is the weight's (``vw`` columns, ``n8``
    rows): ``common.mosaic_gpu.kept_dz`` (in place where it can); else
    ``formulas.cross_entropy.dlogits_kept`` of the chunk."""
    k_buf, tile_max = kept
    n_pad = k_buf.shape[0]
    pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, n_pad - a.shape[-1])])
    target, lse, coef = pad(target), pad(lse), pad(coef)

    def dz(c0, width):
        if isinstance(c0, int) and c0 == 0 and width == vw == k_buf.shape[1] and n8 == n_pad:
            return kept_dz(k_buf, tile_max, lse, coef, target, v=v, block_v=block_v, dtype=dtype)
        tiles = -(-width // block_v)
        if isinstance(c0, int):  # static: the whole of K or a part
            e = k_buf[:, c0:c0 + tiles * block_v]
            m = tile_max[c0 // block_v:c0 // block_v + tiles]
        else:  # inside K (the plan's kept chunks)
            e = lax.dynamic_slice_in_dim(k_buf, c0, tiles * block_v, axis=1)
            m = lax.dynamic_slice_in_dim(tile_max, c0 // block_v, tiles, axis=0)
        out = dlogits_kept(e, m, lse, coef, target, c0, v)
        out = out if width == out.shape[1] else out[:, :width]
        return (out if n8 == n_pad else out[:n8]).astype(dtype)

    return dz


def backward(x2d, w, bias, target, lse, coef, *, softcap=None, budget=None, config: FwdConfig | None = None,
             weight_layout: str = "vh", chunk: Optional[int] = None, kept=None, kept_chunk: int = 0):
    """(dx, dw, None): d(logits) chunks from ``dz_chunk`` feeding XLA GEMMs; dw in w's layout.
    ``chunk``: the columns per chunk (``MosaicGpuBackend.plan``'s); None: from ``budget``.
    ``kept``: (K, M) from ``forward_keeping`` (its columns' dz from them, in chunks of
    ``kept_chunk`` columns unless every column was kept), or None."""
    _check(x2d, w, bias, weight_layout)
    n, h = x2d.shape
    v = _vh_shape(w, weight_layout)[0]
    cfg = config or _default_config(n, v, h)
    # Padded token rows (x = 0, coef = 0) get dz = 0, so they add nothing to dW.
    x8 = _pad_rows8(x2d)
    n8 = x8.shape[0]
    if n8 != n:
        target = jnp.pad(target, (0, n8 - n))
        lse = jnp.pad(lse, (0, n8 - n))
        coef = jnp.pad(coef, ((0, 0), (0, n8 - n)))
    rowdat, tgt = _row_inputs(target, lse, coef, ml.rows_padded(n8, cfg))
    wk = ml.pad_hv(w) if weight_layout == "hv" else w

    def vary(dx, dw):
        # Inside shard_map (check_vma): the carries vary over the axes the inputs vary over.
        axes = tuple(sorted(varying(x8) | varying(w) | varying(rowdat) | varying(tgt)))
        return to_varying(dx, axes), to_varying(dw, axes)

    kept_kw = {}
    if kept is not None:
        vw = wk.shape[ml.w_axis(weight_layout)]
        kept_kw = dict(kept_dz=_kept_dz(kept, target, lse, coef, v=v, vw=vw, block_v=cfg.block_v, n8=n8,
                                        dtype=x2d.dtype),
                       kept_cols=min(kept[0].shape[1], vw), kept_chunk=kept_chunk)
    dx, dw = ml.chunked_backward(x8, wk, rowdat, tgt, n=n, v=v, cfg=cfg, budget=budget, epilogue=_epilogue(softcap),
                                 interpret=_interpret_params(), vary=vary, layout=weight_layout, chunk=chunk,
                                 **kept_kw)
    if wk is not w:
        dw = dw[:, :v]
    return dx[:n].astype(x2d.dtype), dw, None


class MosaicGpuBackend(MosaicGpuBase):
    """The "mosaic_gpu" backend (``contract.LceBackend``; ``MosaicGpuBase``: SM90, the tiles
    and the backward's chunk): the cases of ``why_unsupported`` (no bias, H % 64 == 0,
    V % 8 == 0); no class weights or argmax; keeps exp(z - m) where the budget holds it."""

    keeps = True

    def why_not(self, x2d_shape, w_shape, dtype, *, softcap, has_bias) -> Optional[str]:
        why = why_unsupported(x2d_shape, w_shape, dtype, softcap=softcap, has_bias=has_bias)
        return None if why is None else f"{why}; use implementation='xla'"

    def plan(self, x2d_shape, w_shape, dtype, *, budget: int, weight_layout: str = "vh",
             has_bias: bool = False) -> MosaicGpuConfig:
        """The kind's tiles and chunk, with the columns whose exp(z - m) the forward keeps for
        the backward and the kept chunk (``mosaic_lib.keep_plan``; the recomputed columns'
        chunk when it keeps part)."""
        base = super().plan(x2d_shape, w_shape, dtype, budget=budget, weight_layout=weight_layout,
                            has_bias=has_bias)
        n, h = x2d_shape
        v = w_shape[0]
        vw = v if weight_layout == "vh" else ml.hv_columns(v)  # the (H, V) weight's padded columns
        keep, kept_chunk, chunk = ml.keep_plan(n, v, vw, h, jnp.dtype(dtype).itemsize, budget, base.tiles,
                                               dz_in_place())
        # (no chunk: nothing kept, every chunk recomputed, or everything: the kind's chunk)
        return dataclasses.replace(base, chunk=chunk or base.chunk, keep=keep, kept_chunk=kept_chunk)

    def refit_kept(self, config: MosaicGpuConfig, x2d_shape, w_shape, dtype, *, budget: int,
                   sizes: tuple) -> Optional[MosaicGpuConfig]:
        """K (rows, C) and M (C / block_v, rows) of ``sizes`` elements: C kept columns, if the
        budget holds them (``mosaic_lib.keep_plan``'s ``columns``), else None."""
        n, h = x2d_shape
        v = w_shape[0]
        tiles = config.tiles
        rows = ml.rows_padded(-(-n // 8) * 8, tiles)
        if len(sizes) != 2 or sizes[0] % rows:
            return None
        cols = sizes[0] // rows
        if cols % tiles.block_v or sizes[1] != cols // tiles.block_v * rows:
            return None
        vw = v if config.weight_layout == "vh" else ml.hv_columns(v)
        keep, kept_chunk, chunk = ml.keep_plan(n, v, vw, h, jnp.dtype(dtype).itemsize, budget, tiles, dz_in_place(),
                                               columns=cols)
        return dataclasses.replace(config, chunk=chunk or config.chunk, keep=keep, kept_chunk=kept_chunk) \
            if keep else None

    def forward(self, x2d, w, bias, target, config: MosaicGpuConfig, *, softcap, need_smooth, class_weight=None,
                need_argmax=False, keep=False) -> LceStats:
        lse, tl, ss, kept = forward_keeping(x2d, w, bias, target, softcap=softcap, need_smooth=need_smooth,
                                            config=config.tiles, weight_layout=config.weight_layout,
                                            keep_cols=config.keep if keep else 0)
        return LceStats(lse, tl, ss, kept=kept)

    def backward(self, res: LceResiduals, coef, config: MosaicGpuConfig, *, softcap) -> LceGrads:
        return LceGrads(*backward(res.x2d, res.w, res.bias, res.target, res.lse, coef, softcap=softcap,
                                  config=config.tiles, weight_layout=config.weight_layout, chunk=config.chunk,
                                  kept=res.kept, kept_chunk=config.kept_chunk))
