"""The "mosaic_gpu" backend (Pallas Mosaic GPU kernels) against float64.

On an SM90 GPU the kernels run for real; on a CPU they run under Mosaic GPU's interpret
mode (``plgpu.force_gpu_interpret_mode`` semantics: simulated threads, shared memory,
barriers, TMA and WGMMA), at small shapes with small tiles. ``test_lowers_for_cuda``
also lowers the real kernels for CUDA on a CPU-only machine, which checks layouts,
TMA constraints and the shared-memory budget at the benchmark shapes.
Run: ``PYTHONPATH=src python -m pytest tests_jax/test_mosaic_gpu.py -q``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

pytest.importorskip("jax.experimental.pallas.mosaic_gpu",
                    reason="this jax has no Pallas Mosaic GPU (jax.experimental.pallas.mosaic_gpu)")
from logitless.jax.ops.common import mosaic_gpu as kind  # noqa: E402
from logitless.jax.ops.linear_cross_entropy import mosaic_gpu_backend as mg  # noqa: E402  (a failure here is a bug)

from .helpers import mosaic_platform  # noqa: E402

PLATFORM = mosaic_platform()
pytestmark = pytest.mark.skipif(
    PLATFORM == "other-gpu", reason="mosaic_gpu kernels need an SM90 GPU (or the CPU interpreter)"
)

#: Small tiles keep the interpreter fast and exercise several tiles/splits per CTA.
SMALL = mg.FwdConfig(block_n=64, block_v=64, stages=2, lag=0)
#: Configs under test: on the GPU the production default as well.
CONFIGS = [SMALL, dataclasses.replace(SMALL, lag=1)]
if PLATFORM != "interpret":
    CONFIGS += [mg.FwdConfig(), mg.FwdConfig(block_n=64, block_v=256, lag=0)]


def _inputs(n, h, v, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, h)), dtype)
    w = jnp.asarray(rng.standard_normal((v, h)) * (2.0 / np.sqrt(h)), dtype)
    t = jnp.asarray(rng.integers(0, v, size=n), jnp.int32)
    return x, w, t


def _ref_logits(x, w, softcap):
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    if softcap is not None:
        z = softcap * np.tanh(z / softcap)
    return z


def _ref_lse(z):
    m = z.max(1)
    return m + np.log(np.exp(z - m[:, None]).sum(1))


def _ref_dz(z, lse, coef, t, softcap):
    c = np.asarray(coef, np.float64)
    p = np.exp(z - lse[:, None])
    onehot = np.zeros_like(z)
    onehot[np.arange(z.shape[0]), np.asarray(t)] = 1.0
    dz = p * c[0][:, None] - c[1][:, None] * onehot - c[2][:, None]
    if softcap is not None:
        dz = dz * (1.0 - (z / softcap) ** 2)
    return dz


def _err(a, ref):
    return float(np.abs(np.asarray(jnp.asarray(a, jnp.float32), np.float64) - ref).max())


# (n, h, v, splits, softcap, need_smooth): ragged N (not a multiple of 8 nor of the
# row block) and V (not a multiple of the column tile), several splits and tiles per CTA.
FWD_CASES = [
    (64, 128, 328, None, None, False),
    (77, 128, 520, 3, None, True),
    (130, 192, 600, 2, 30.0, True),
    (1, 64, 136, None, None, True),
    (256, 128, 64, None, 5.0, False),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"n{c.block_n}v{c.block_v}s{c.stages}lag{c.lag}")
@pytest.mark.parametrize("n,h,v,splits,softcap,smooth", FWD_CASES)
def test_forward_matches_float64(n, h, v, splits, softcap, smooth, cfg):
    x, w, t = _inputs(n, h, v, seed=n + v)
    cfg = dataclasses.replace(cfg, splits=splits)
    lse, tl, ss = jax.jit(lambda x, w, t: mg.forward(
        x, w, None, t, softcap=softcap, need_smooth=smooth, budget=None, config=cfg))(x, w, t)
    z = _ref_logits(x, w, softcap)
    assert lse.shape == (n,) and lse.dtype == jnp.float32
    # fp32 statistics of exact bf16 products: errors are fp32 rounding only.
    assert _err(lse, _ref_lse(z)) < 2e-5
    assert _err(tl, z[np.arange(n), np.asarray(t)]) < 2e-5 * max(1.0, np.abs(z).max())
    if smooth:
        assert _err(ss, z.sum(1)) < 2e-6 * v * max(1.0, np.abs(z).max())
    else:
        assert ss is None


def test_forward_float16():
    x, w, t = _inputs(50, 128, 200, dtype=jnp.float16, seed=5)
    lse, tl, ss = mg.forward(x, w, None, t, softcap=None, need_smooth=True, budget=None, config=SMALL)
    z = _ref_logits(x, w, None)
    assert _err(lse, _ref_lse(z)) < 2e-5
    assert _err(tl, z[np.arange(50), np.asarray(t)]) < 2e-5 * max(1.0, np.abs(z).max())
    assert _err(ss, z.sum(1)) < 2e-6 * 200 * max(1.0, np.abs(z).max())


def test_forward_target_outside_vocab_is_finite():
    """Ignored (-100) or out-of-range targets must not fail; their target logit is 0."""
    x, w, t = _inputs(40, 64, 200)
    t = t.at[0].set(-100).at[1].set(10_000)
    lse, tl, _ = mg.forward(x, w, None, t, softcap=None, need_smooth=False, budget=None, config=SMALL)
    assert np.isfinite(np.asarray(lse)).all()
    assert float(tl[0]) == 0.0 and float(tl[1]) == 0.0


# (n, h, v, c0, chunk, softcap)
DZ_CASES = [
    (72, 128, 328, 0, 384, None),
    (77, 64, 328, 256, 128, 30.0),
    (130, 128, 200, 64, 192, None),
]


#: The backward kernel's column tiles per CTA: automatic (one at these sizes), several
#: (the last CTA of a row block with fewer) with and without the warpgroup lag; the
#: tile stored in pieces of 32 (the default) and 16 columns, and whole (FwdConfig.dz_store).
DZ_CONFIGS = [SMALL, dataclasses.replace(SMALL, dz_tiles=2, lag=1), dataclasses.replace(SMALL, dz_tiles=4),
              dataclasses.replace(SMALL, dz_tiles=2, lag=1, dz_store=None), dataclasses.replace(SMALL, dz_store=16)]


@pytest.mark.parametrize("cfg", DZ_CONFIGS, ids=["auto", "tiles2lag1", "tiles4", "whole-tile", "store16"])
@pytest.mark.parametrize("n,h,v,c0,chunk,softcap", DZ_CASES)
def test_dz_chunk_matches_float64(n, h, v, c0, chunk, softcap, cfg):
    """The backward kernel alone: d(logits) of columns [c0, c0+chunk), zero past V."""
    x, w, t = _inputs(n, h, v, seed=3)
    rng = np.random.default_rng(1)
    coef = jnp.asarray(rng.standard_normal((3, n)), jnp.float32)
    z = _ref_logits(x, w, softcap)
    lse = _ref_lse(z)
    x8 = mg._pad_rows8(x)
    n8 = x8.shape[0]
    pad = lambda a, axis=-1: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, n8 - n)])
    dz = mg.dz_chunk(x8, w, pad(t), pad(jnp.asarray(lse, jnp.float32)), pad(coef),
                     c0=c0, chunk=chunk, softcap=softcap, cfg=cfg)
    assert dz.shape == (n8, chunk) and dz.dtype == x.dtype
    ref = np.zeros((n, chunk))
    cw = min(chunk, v - c0)
    ref[:, :cw] = _ref_dz(z, lse, coef, t, softcap)[:, c0:c0 + cw]
    got = np.asarray(dz[:n].astype(jnp.float32), np.float64)
    # One bf16 rounding of an fp32 value: relative 2^-8, plus fp32 noise.
    assert np.all(np.abs(got - ref) <= 2.0 ** -8 * np.abs(ref) + 1e-5 * np.abs(ref).max() + 1e-6)
    assert np.all(got[:, cw:] == 0.0)
    assert np.all(np.asarray(dz[n:].astype(jnp.float32)) == 0.0)  # padded tokens


def _same_dtype_baseline(x, w, t, lse, coef, softcap):
    """The same algorithm in plain XLA: fp32 logits of bf16 inputs, dz rounded to the
    input dtype, GEMMs with fp32 accumulation: the error any bf16 backward has."""
    z = jnp.dot(x, w.T, preferred_element_type=jnp.float32)
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    p = jnp.exp(z - lse[:, None])
    onehot = jax.nn.one_hot(t, w.shape[0], dtype=jnp.float32)
    dz = p * coef[0][:, None] - coef[1][:, None] * onehot - coef[2][:, None]
    if softcap is not None:
        dz = dz * (1 - (z / softcap) ** 2)
    dz = dz.astype(x.dtype)
    dx = jnp.dot(dz, w, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.dot(dz.T, x, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


# (n, h, v, softcap, budget): the budget forces several vocab chunks.
BWD_CASES = [
    (77, 128, 328, None, None),
    (130, 192, 520, 30.0, 40_000),
    (64, 64, 136, None, 1),
]


@pytest.mark.parametrize("cfg", [SMALL, dataclasses.replace(SMALL, dz_tiles=3, lag=1, dz_store=None)],
                         ids=["auto", "tiles3lag1whole"])
@pytest.mark.parametrize("n,h,v,softcap,budget", BWD_CASES)
def test_backward_matches_float64(n, h, v, softcap, budget, cfg):
    x, w, t = _inputs(n, h, v, seed=7)
    rng = np.random.default_rng(2)
    coef = rng.standard_normal((3, n))
    coef[:, 5] = 0.0  # an ignored token: zero row
    coef = jnp.asarray(coef, jnp.float32)
    z = _ref_logits(x, w, softcap)
    lse = _ref_lse(z)
    lse32 = jnp.asarray(lse, jnp.float32)
    dx, dw, db = jax.jit(lambda x, w, t, lse_, c: mg.backward(
        x, w, None, t, lse_, c, softcap=softcap, budget=budget, config=cfg))(x, w, t, lse32, coef)
    assert db is None
    assert dx.shape == x.shape and dx.dtype == x.dtype
    assert dw.shape == w.shape and dw.dtype == w.dtype
    dz = _ref_dz(z, lse, coef, t, softcap)
    dx_ref = dz @ np.asarray(w, np.float64)
    dw_ref = dz.T @ np.asarray(x, np.float64)
    bx, bw = _same_dtype_baseline(x, w, t, lse32, coef, softcap)
    for name, ours, base, ref in (("dx", dx, bx, dx_ref), ("dw", dw, bw, dw_ref)):
        e, eb = _err(ours, ref), _err(base, ref)
        assert e <= eb + 2e-3 * np.abs(ref).max(), f"{name}: {e:.3g} vs same-dtype XLA {eb:.3g}"
    # The ignored token's row of dx is exactly zero.
    assert np.all(np.asarray(dx[5].astype(jnp.float32)) == 0.0)


# (n, h, v, layout, keep tiles, kept chunk tiles): every column kept (dz in one piece: V
# or N ragged against the tiles, or over K itself), a prefix kept in chunks and the rest
# recomputed.
KEPT_CASES = [
    (77, 128, 328, "vh", None, 0),
    (130, 64, 600, "hv", None, 0),
    (128, 64, 512, "vh", None, 0),  # K has the weight's shape: dz written over it (Pallas kernel)
    (256, 128, 384, "hv", None, 0),
    (130, 128, 600, "vh", 4, 2),
    (64, 64, 520, "hv", 2, 1),
    (64, 64, 520, "vh", 3, 2),  # a narrower last kept chunk (a sharded jit's refitted keep)
]


@pytest.mark.parametrize("cfg", [SMALL, dataclasses.replace(SMALL, lag=1, keep_store=None, dz_store=None)],
                         ids=["keep32", "keepwhole_lag1"])
@pytest.mark.parametrize("n,h,v,layout,keep,kc", KEPT_CASES)
def test_backward_from_kept_matches_float64(n, h, v, layout, keep, kc, cfg):
    """The forward keeps exp(z - m) of the first columns (``forward_keeping``), the
    backward takes their dz from it (``formulas.cross_entropy.dlogits_kept``) and
    recomputes the others: the same error as any bf16 backward, an ignored token's row 0."""
    x, w, t = _inputs(n, h, v, seed=n + v)
    wl = w if layout == "vh" else w.T
    bv = cfg.block_v
    keep_cols = v if keep is None else keep * bv
    lse, tl, ss, kept = jax.jit(lambda x, w, t: mg.forward_keeping(
        x, w, None, t, need_smooth=True, config=cfg, weight_layout=layout, keep_cols=keep_cols))(x, wl, t)
    k_buf, tile_max = kept
    tiles = -(-keep_cols // bv)
    n_pad = -(-n // (2 * cfg.block_n)) * 2 * cfg.block_n
    assert k_buf.shape == (n_pad, tiles * bv) and k_buf.dtype == x.dtype and tile_max.shape == (tiles, n_pad)
    z = _ref_logits(x, w, None)
    ref_lse = _ref_lse(z)
    assert _err(lse, ref_lse) < 2e-5
    # K = exp(z - m) with m the running maximum after the tile: in [0, 1], m <= lse.
    e = np.asarray(k_buf[:n].astype(jnp.float32), np.float64)
    m = np.repeat(np.asarray(tile_max[:, :n], np.float64).T, bv, axis=1)[:, :min(tiles * bv, v)]
    cols = m.shape[1]
    assert np.all(e >= 0) and np.all(e <= 1) and np.all(m <= ref_lse[:, None] + 1e-5)
    assert np.abs(e[:, :cols] - np.exp(z[:, :cols] - m)).max() <= 2.0 ** -8
    assert np.all(e[:, cols:] == 0)  # columns >= V
    rng = np.random.default_rng(2)
    coef = rng.standard_normal((3, n))
    coef[:, 5] = 0.0  # an ignored token: zero row
    coef = jnp.asarray(coef, jnp.float32)
    lse32 = jnp.asarray(ref_lse, jnp.float32)
    dx, dw, _ = jax.jit(lambda x, w, t, lse_, c, kept: mg.backward(
        x, w, None, t, lse_, c, config=cfg, weight_layout=layout, chunk=2 * bv, kept=kept, kept_chunk=kc * bv))(
        x, wl, t, lse32, coef, kept)
    assert dx.shape == x.shape and dx.dtype == x.dtype and dw.shape == wl.shape and dw.dtype == w.dtype
    dz = _ref_dz(z, ref_lse, coef, t, None)
    dx_ref = dz @ np.asarray(w, np.float64)
    dw_ref = dz.T @ np.asarray(x, np.float64)
    bx, bw = _same_dtype_baseline(x, w, t, lse32, coef, None)
    dw = dw if layout == "vh" else dw.T
    for name, ours, base, ref in (("dx", dx, bx, dx_ref), ("dw", dw, bw, dw_ref)):
        e_, eb = _err(ours, ref), _err(base, ref)
        assert e_ <= eb + 2e-3 * np.abs(ref).max(), f"{name}: {e_:.3g} vs same-dtype XLA {eb:.3g}"
    assert np.all(np.asarray(dx[5].astype(jnp.float32)) == 0.0)


def test_keep_plan():
    """Every column kept when K, its tile maxima and the row vectors fit the budget;
    else whole kept chunks beside the fp32 dx accumulator and two chunks' temporaries
    (all counted at once: K lives through the backward's loops), within the budget;
    nothing when that keeps under a quarter of the columns; without the in-place dz
    kernel a second logits-sized buffer is counted."""
    from logitless.jax import mosaic_lib as ml

    cfg = ml.FwdConfig()
    n, h, v = 4096, 4096, 128256
    k_bytes = 4096 * 128256 * 2 + 1002 * 4096 * 4 + 64 * 4096
    assert ml.keep_plan(n, v, v, h, 2, k_bytes, cfg) == (128256, 0, 0)
    assert ml.keep_plan(n, v, v, h, 2, k_bytes, cfg, dz_in_place=False)[1] != 0
    keep, kc, chunk = ml.keep_plan(n, v, v, h, 2, k_bytes - 1, cfg)
    assert 0.25 * v < keep < v and kc == chunk and keep % kc == 0 and kc % 128 == 0 and kc >= ml.KEPT_CHUNK_MIN
    used = keep // 128 * (4096 * 128 * 2 + 4096 * 4) + 64 * 4096 + 4 * n * h + 2 * kc * 2 * (n + 2 * h)
    assert used <= k_bytes - 1
    assert ml.keep_plan(n, v, v, h, 2, 256 * 2**20, cfg) == (0, 0, 0)  # 13% of the columns: recompute all
    # N not a multiple of the 256-row block: dz cannot take K's place, one dz more counted.
    assert ml.keep_plan(4000, v, v, h, 2, k_bytes, cfg)[1] != 0
    # The backend's plan: deepseek-v3 on an H100 (1.8 GiB) keeps part, llama all.
    plan = mg.MosaicGpuBackend().plan((8192, 7168), (128256, 7168), jnp.bfloat16, budget=1824 * 2**20)
    assert 0.5 * 128256 < plan.keep < 128256 and plan.keep % plan.kept_chunk == 0 and plan.chunk == plan.kept_chunk
    assert mg.MosaicGpuBackend().plan((n, h), (v, h), jnp.bfloat16, budget=1824 * 2**20, weight_layout="hv").keep == v


def test_keep_plan_of_given_columns():
    """``columns``: exactly that many kept columns where the budget holds them beside two
    chunks and the dx accumulator (the last kept chunk may be narrower), else nothing;
    the backend's ``refit_kept`` turns a sharded jit's slot sizes into such a plan: at 2 x
    16384 tokens of llama3.1-8b's head on 2 H100s, a token split refitted to the
    vocabulary split's kept elements."""
    from logitless.jax import mosaic_lib as ml

    cfg = ml.FwdConfig()
    h, v, budget = 4096, 128256, 1840 * 2**20
    own = ml.keep_plan(8192, v, v, h, 2, budget, cfg)
    assert ml.keep_plan(8192, v, v, h, 2, budget, cfg, columns=own[0]) == own
    keep, kc, chunk = ml.keep_plan(8192, v, v, h, 2, budget, cfg, columns=own[0] - 3 * 128)
    assert keep == own[0] - 3 * 128 and keep % kc != 0 and chunk == kc
    assert ml.keep_plan(8192, v, v, h, 2, budget, cfg, columns=own[0] + own[1]) == (0, 0, 0)  # over the budget
    assert ml.keep_plan(8192, v, v, h, 2, budget, cfg, columns=128 * 10) == (0, 0, 0)  # under KEEP_MIN_SHARE
    assert ml.keep_plan(4096, v, v, h, 2, budget, cfg, columns=v) == (v, 0, 0)
    backend = mg.MosaicGpuBackend()
    tok = backend.plan((8192, h), (v, h), jnp.bfloat16, budget=budget)
    voc = backend.plan((16384, h), (v // 2, h), jnp.bfloat16, budget=budget)
    assert 0 < 16384 * voc.keep < 8192 * tok.keep  # different kept elements: the case
    sizes = (16384 * voc.keep, voc.keep // 128 * 16384)  # K and M of the vocabulary split
    refit = backend.refit_kept(tok, (8192, h), (v, h), jnp.bfloat16, budget=budget, sizes=sizes)
    assert refit.keep == 2 * voc.keep and refit.kept_chunk == tok.kept_chunk and refit.tiles == tok.tiles
    kept = jax.eval_shape(lambda x, w, t: backend.forward(x, w, None, t, refit, softcap=None, need_smooth=False,
                                                           keep=True).kept,
                          *(jax.ShapeDtypeStruct(s, d) for s, d in (((8192, h), jnp.bfloat16),
                                                                  ((v, h), jnp.bfloat16), ((8192,), jnp.int32))))
    assert tuple(np.prod(a.shape) for a in kept) == sizes
    # The other way the budget does not hold it; sizes that are no whole tiles fit nothing.
    tok_sizes = (8192 * tok.keep, tok.keep // 128 * 8192)
    assert backend.refit_kept(voc, (16384, h), (v // 2, h), jnp.bfloat16, budget=budget, sizes=tok_sizes) is None
    assert backend.refit_kept(tok, (8192, h), (v, h), jnp.bfloat16, budget=budget, sizes=(sizes[0] + 8192, 1)) is None


def test_dz_tiles_per_cta():
    """Fewest waves x tiles per CTA; one wave of whole row blocks at the tokamax shapes."""
    from logitless.jax import mosaic_lib as ml

    assert ml.dz_tiles_per_cta(16, 64, 132) == 8  # 128 CTAs: one wave
    assert ml.dz_tiles_per_cta(16, 87, 132) == 11  # 8 CTAs per row block, the last with 10 tiles
    assert ml.dz_tiles_per_cta(32, 6, 132) == 1  # deepseek-v3: 2 tiles would leave 36 SMs idle
    assert ml.dz_tiles_per_cta(4, 106, 132) == 2  # 212 CTAs in 2 waves beat 424 in 4
    assert ml.dz_tiles_per_cta(1, 2, 132) == 1  # few tiles: one per CTA, all in one wave
    assert ml.dz_tiles_per_cta(1, 40, 132, max_tiles=4) == 1
    assert ml.dz_tiles_per_cta(32, 512, 132) == 14  # 9 waves of 14 beat 8 of 16 (the cap)
    with pytest.raises(ValueError, match="dz_tiles"):
        x, w, t = _inputs(8, 64, 128)
        mg.dz_chunk(x, w, t, jnp.zeros(8), jnp.zeros((3, 8)), c0=0, chunk=128,
                    cfg=dataclasses.replace(SMALL, dz_tiles=0))


def test_dz_store_columns():
    """dz store pieces: 32 columns by default (a smaller buffer deepens the ring); None:
    the whole tile."""
    from logitless.jax import mosaic_lib as ml

    bf = jnp.bfloat16
    cfg = ml.FwdConfig()
    assert ml.dz_store_columns(cfg) == 32
    assert ml.dz_store_columns(dataclasses.replace(cfg, dz_store=None)) == 128
    assert ml.dz_store_columns(ml.FwdConfig(block_n=64, block_v=256, dz_store=64)) == 64
    # 256 x 128 tiles, 4 row inputs: a whole-tile buffer (64 KiB) leaves 3 stages, 32 columns 4.
    extra = lambda p: ml.dz_smem_extra(256, p, 2, 4)
    assert ml.fit_stages(4, 512, bf, 256, 128, extra(128)) == 3
    assert ml.fit_stages(4, 512, bf, 256, 128, extra(32)) == 4
    for bad in (0, 8, 48, 96, 256):
        with pytest.raises(ValueError, match="dz_store"):
            ml.dz_store_columns(dataclasses.replace(cfg, dz_store=bad))


def test_is_supported():
    bf = jnp.bfloat16
    assert mg.is_supported((4096, 4096), (128256, 4096), bf, softcap=None, has_bias=False)
    assert mg.is_supported((77, 64), (328, 64), jnp.float16, softcap=30.0, has_bias=False)
    assert not mg.is_supported((8, 64), (328, 64), bf, softcap=None, has_bias=True)
    assert not mg.is_supported((8, 64), (328, 64), jnp.float32, softcap=None, has_bias=False)
    assert not mg.is_supported((8, 100), (328, 100), bf, softcap=None, has_bias=False)  # H % 64
    assert not mg.is_supported((8, 64), (331, 64), bf, softcap=None, has_bias=False)  # V % 8 (TMA)
    x, w, t = _inputs(8, 64, 331)
    with pytest.raises(ValueError, match="unsupported"):
        mg.forward(x, w, None, t, softcap=None, need_smooth=False, budget=None)


@pytest.mark.parametrize("shape", [(4096, 4096, 128256), (4096, 2560, 262144), (1000, 512, 4000)])
@pytest.mark.parametrize("cfg", [mg.FwdConfig(), mg.FwdConfig(block_n=64, block_v=256, lag=2),
                                 mg.FwdConfig(dz_tiles=1, lag=0), mg.FwdConfig(dz_store=32)],
                         ids=["n128v128", "n64v256lag2", "dz1tile", "store32"])
def test_lowers_for_cuda(shape, cfg, monkeypatch):
    """Lower (not run) the real kernels for CUDA: layouts, TMA, shared memory budget."""
    n, h, v = shape
    monkeypatch.setattr(kind, "INTERPRET", False)
    x = jax.ShapeDtypeStruct((n, h), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((v, h), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)
    lse = jax.ShapeDtypeStruct((n,), jnp.float32)
    coef = jax.ShapeDtypeStruct((3, n), jnp.float32)
    for sc in (None, 30.0):
        fwd = jax.jit(lambda x, w, t: mg.forward(x, w, None, t, softcap=sc, need_smooth=True,
                                                 budget=None, config=cfg))
        text = fwd.trace(x, w, t).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        bwd = jax.jit(lambda x, w, t, lse_, c: mg.backward(x, w, None, t, lse_, c, softcap=sc,
                                                        budget=None, config=cfg))
        text = bwd.trace(x, w, t, lse, coef).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
    # The forward that keeps exp(z - m) (all columns, and a prefix), and fwd+bwd through it.
    for keep in (v, v // 3):
        fwd = jax.jit(lambda x, w, t: mg.forward_keeping(x, w, None, t, need_smooth=True, config=cfg,
                                                         keep_cols=keep))
        assert "mosaic_gpu" in fwd.trace(x, w, t).lower(lowering_platforms=("cuda",)).as_text()
    plan = mg.MosaicGpuConfig(cfg, 4096, "vh", keep=v // 3 // 512 * 512, kept_chunk=512)
    backend = mg.MosaicGpuBackend()

    def fb(x, w, t):
        st = backend.forward(x, w, None, t, plan, softcap=None, need_smooth=False, keep=True)
        res = mg.LceResiduals(x, w, None, t, None, st.lse, st.kept)
        return backend.backward(res, jnp.ones((3, x.shape[0]), jnp.float32), plan, softcap=None)[:2]

    assert "mosaic_gpu" in jax.jit(fb).trace(x, w, t).lower(lowering_platforms=("cuda",)).as_text()


def test_public_op_lowers_for_cuda_without_large_constants(monkeypatch):
    """fwd and fwd+bwd of linear_cross_entropy(implementation="mosaic_gpu"), lowered for
    CUDA (runs on a CPU-only machine): no array constants captured (closures over
    arrays, shape-sized host data), with real arrays and with abstract shapes."""
    from logitless.jax import linear_cross_entropy

    from .helpers import captured_constants

    monkeypatch.setattr(kind, "INTERPRET", False)
    n, h, v = 300, 128, 2048 + 56
    x, w, t = _inputs(n, h, v, seed=4)
    abstract = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, w, t))
    for kw in (dict(), dict(label_smoothing=0.1, softcap=20.0, memory_budget=100_000)):
        f = lambda x, w, t: linear_cross_entropy(x, w, t, implementation="mosaic_gpu", **kw)
        for fn in (f, jax.value_and_grad(f, argnums=(0, 1))):
            for args in ((x, w, t), abstract):
                def lower():
                    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
                    assert "mosaic_gpu" in text
                assert captured_constants(lower) == []


@pytest.mark.parametrize("softcap", [None, 20.0])
def test_through_public_api_matches_xla_backend(softcap):
    """linear_cross_entropy(..., implementation="mosaic_gpu") under jit and grad."""
    api = pytest.importorskip("logitless.jax.ops.linear_cross_entropy.api",
                              reason="logitless.jax api not on this branch yet (merged by the lead)")
    from logitless.jax import linear_cross_entropy

    x, w, t = _inputs(77, 128, 328, seed=11)
    t = t.at[3].set(-100)

    def loss(impl):
        f = lambda x, w: linear_cross_entropy(x, w, t, label_smoothing=0.1, softcap=softcap,
                                              implementation=impl)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)

    (l_m, (gx_m, gw_m)) = loss("mosaic_gpu")
    (l_x, (gx_x, gw_x)) = loss("xla")
    assert abs(float(l_m) - float(l_x)) < 1e-5 * max(1.0, abs(float(l_x)))
    for a, b in ((gx_m, gx_x), (gw_m, gw_x)):
        a = np.asarray(a.astype(jnp.float32))
        b = np.asarray(b.astype(jnp.float32))
        assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max()
    assert np.all(np.asarray(gx_m[3].astype(jnp.float32)) == 0.0)
    del api


@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_public_api_keeps_part_under_a_small_budget(layout, monkeypatch):
    """A budget that holds part of exp(z - m): those columns' dz from the kept buffer,
    the others recomputed; loss and gradients as the "xla" backend's, and a call
    without gradients keeps nothing (its value is the same)."""
    from logitless.jax import linear_cross_entropy
    from logitless.jax import mosaic_lib as ml

    monkeypatch.setattr(ml, "KEPT_CHUNK_MIN", 128)  # one-tile kept chunks at this small V
    n, h, v, budget = 256, 64, 1600, 600_000
    plan = mg.MosaicGpuBackend().plan((n, h), (v, h), jnp.bfloat16, budget=budget, weight_layout=layout)
    assert 0 < plan.keep < v and plan.keep % plan.kept_chunk == 0
    x, w, t = _inputs(n, h, v, seed=12)
    t = t.at[7].set(-100)
    wl = w if layout == "vh" else w.T

    def loss(impl):
        f = lambda x, w: linear_cross_entropy(x, w, t, z_loss=1e-3, label_smoothing=0.05, weight_layout=layout,
                                              memory_budget=budget, implementation=impl)
        return jax.jit(f)(x, wl), jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, wl)

    (l0, (l_m, (gx_m, gw_m))), (_, (l_x, (gx_x, gw_x))) = loss("mosaic_gpu"), loss("xla")
    # Per token, the values without gradients are those of the differentiated call, bit for
    # bit; their mean may differ in its last bit (XLA reduced it in another order in each
    # program on an H200: 9.5553026 against 9.5553036).
    tok = lambda x, w: linear_cross_entropy(x, w, t, z_loss=1e-3, label_smoothing=0.05, weight_layout=layout,
                                            memory_budget=budget, implementation="mosaic_gpu", reduction="none")
    with_grad = jax.jit(lambda x, w: (tok(x, w), jax.grad(lambda x, w: tok(x, w).sum(), argnums=(0, 1))(x, w)))
    assert bool(jnp.array_equal(jax.jit(tok)(x, wl), with_grad(x, wl)[0]))
    assert abs(float(l0) - float(l_m)) <= 2 * np.finfo(np.float32).eps * abs(float(l_m))
    assert abs(float(l_m) - float(l_x)) < 1e-5 * max(1.0, abs(float(l_x)))
    for a, b in ((gx_m, gx_x), (gw_m, gw_x)):
        a = np.asarray(a.astype(jnp.float32))
        b = np.asarray(b.astype(jnp.float32))
        assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max()
    assert np.all(np.asarray(gx_m[7].astype(jnp.float32)) == 0.0)
