"""Shared Pallas Mosaic GPU machinery (SM90) of the JAX ops' "mosaic_gpu" backends:
the warp-specialised GEMM-tile main loop and the two kernel shapes built on it.

``stats_partials`` (forward): one kernel, a GEMM whose epilogue never leaves the chip.
    Grid (token blocks, vocab splits); each CTA owns ``2 * block_n`` rows (two compute
    warpgroups of ``block_n`` rows each) and walks its vocab split in tiles of
    ``block_v`` columns. A third (memory) warpgroup streams x[rows, k] and W[cols, k]
    tiles with TMA into a ``stages``-deep ring of shared-memory slots; the compute
    warpgroups issue WGMMA (x tile @ W tile^T, fp32 accumulator in registers) and hand
    each (block_n, block_v) tile of logits to the op's ``fold``, which updates running
    per-row statistics (row vectors in registers). Warpgroup 1 runs ``lag`` ring steps
    behind warpgroup 0, so that one's epilogue overlaps the other's WGMMAs. Columns
    >= v occur only in the last tile of the vocabulary; ``fold`` gets a ``valid`` mask
    there (None elsewhere). Each CTA writes, per row, ``n_out`` fp32 partials:
    O(N x splits) floats, merged by the op in JAX. Memory traffic: that of one GEMM.

``dz_call`` (backward): ``dz_tiles`` consecutive column tiles per CTA over a chunk of
    vocab columns (the chunk offset is a kernel input; a tile's epilogue and store overlap
    the next tile's loads): recompute the logits tile (same main loop), turn it into
    d(logits) with the op's ``epilogue`` (per-row fp32 inputs ``rowdat`` and the target),
    zero columns >= v, write it in the input dtype. ``chunked_backward`` drives it:
    per vocab chunk, XLA GEMMs take dW[chunk] = dz^T x and dx += dz W[chunk] (fp32
    accumulation); "4 GEMMs" with the forward.

Weight layouts (``layout``): "vh", W (V, H) as a torch ``nn.Linear``: the TMA reads
(block_v, BLOCK_K) tiles and the WGMMA takes the transposed view of the tile as its B
operand; "hv", W (H, V) as a flax ``Dense`` kernel: the TMA reads (BLOCK_K, block_v)
tiles, which are WGMMA's B operand as they are (K-major and MN-major B are both native
for 16-bit types). Same arithmetic either way (the same products summed in the same
k order); no transposed copy of W, and dW comes back in W's layout.

Limits: bf16/f16, H a multiple of 64, V a multiple of 8 for a (V, H) weight and of 64
for an (H, V) one (TMA into 128-byte swizzled tiles tiles the minor dimension by 64
elements: ``pad_hv`` pads the columns of an (H, V) weight otherwise, a copy), N a
multiple of 8 (``pad_rows8``). Under ``interpret`` (Mosaic
GPU's interpret mode, ``plgpu.InterpretGPUParams``) the kernels run on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from logitless.jax.budget import default_memory_budget

BLOCK_K = 64  # 64 bf16 = 128 bytes: one 128-byte swizzle row.
NUM_COMPUTE_WGS = 2
# Register split of the 64K-register file (setmaxnreg): 2 x 128 x 232 + 128 x 40 <= 65536.
COMPUTE_REGS, MEMORY_REGS = 232, 40
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SMEM_BYTES = 220 * 1024  # of the H100's 227 KiB per block, with room for barriers
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """Tile sizes of the kernels (heuristics; ``default_config`` picks them)."""

    block_n: int = 128  # rows per compute warpgroup (a CTA has two)
    block_v: int = 128  # vocab columns per tile
    stages: int = 4  # depth of the TMA ring
    splits: int | None = None  # vocab splits of the forward grid (None: automatic)
    # Warpgroup 1 starts ``lag`` ring steps after warpgroup 0 (< stages), so that one's
    # epilogue (softmax statistics, or dz) overlaps the other's WGMMAs.
    lag: int = 2
    # Backward (``dz_call``): consecutive column tiles per CTA, so that a tile's epilogue
    # and store overlap the next tile's loads (with the lag). None: ``dz_tiles_per_cta``
    # picks it; 1: one tile per CTA, no lag (the earlier kernel).
    dz_tiles: int | None = None
    # Backward: columns of the dz tile per TMA store (``dz_store_columns``). None: the
    # whole tile (at 256 x 128 bf16 its 64 KiB buffer leaves a 3-stage ring); 16, 32 or a
    # multiple of 64 dividing block_v: pieces through one smaller buffer (32: 16 KiB, 4
    # stages). H100: 32 made one recomputed chunk 9-11% faster (deepseek-v3, gemma3-4b
    # chunks; f+b -1.5% at deepseek-v3, within noise where fewer columns are recomputed:
    # docs/design.md).
    dz_store: int | None = 32
    # Forward that keeps exp(z - m) (``stats_partials``' keep_tiles): columns of the kept
    # tile per TMA store, as dz_store. 32: a 16 KiB buffer, the ring keeps 4 stages (the
    # whole tile's 64 KiB leaves 3); H100, llama3.1-8b f+b -3.8% ("vh") and -1.7% ("hv")
    # (docs/design.md).
    keep_store: int | None = 32


def default_config(n: int, v: int, h: int) -> FwdConfig:
    """256-row CTA tiles (2 x 128 x 128 accumulators); 128-row tiles for few tokens."""
    if n <= 128:
        return FwdConfig(block_n=64, block_v=256)
    return FwdConfig()


def num_sms() -> int:
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(getattr(dev, "core_count", 132) or 132)
    except Exception:  # pragma: no cover - no devices
        pass
    return 132


def interpret_params(flag: bool | None):
    """Mosaic GPU's interpret mode when ``flag`` (None: when jax's default backend is
    not a GPU); None (compile for the GPU) otherwise."""
    use = flag if flag is not None else jax.default_backend() != "gpu"
    return plgpu.InterpretGPUParams() if use else None


def pad_rows8(x):
    """x with its rows zero-padded to a multiple of 8 (a TMA constraint); no-op if aligned."""
    n = x.shape[0]
    n8 = -(-n // 8) * 8
    return x if n8 == n else jnp.pad(x, ((0, n8 - n), (0, 0)))


def hv_columns(v: int) -> int:
    """Columns an (H, V) weight needs for the TMA (its minor dimension is tiled by 64
    elements): V itself when V <= 64 or V % 64 == 0, else V rounded up to 64."""
    return v if v <= BLOCK_K or v % BLOCK_K == 0 else -(-v // BLOCK_K) * BLOCK_K


def pad_hv(w):
    """An (H, V) weight with zero columns up to ``hv_columns(V)`` (no-op, no copy, when
    V already tiles; the kernels mask columns >= V)."""
    v = w.shape[1]
    vp = hv_columns(v)
    return w if vp == v else jnp.pad(w, ((0, 0), (0, vp - v)))


def rows_padded(n, cfg: FwdConfig):
    block_rows = NUM_COMPUTE_WGS * cfg.block_n
    return pl.cdiv(n, block_rows) * block_rows


def bcast(r, shape):
    """A per-row vector (WGMMA row layout) broadcast along the columns of a tile."""
    return lax.broadcast_in_dim(r, shape, [0])


#: The powers ``unit_power`` takes as products (distillation's usual temperatures).
INT_POWERS = (2.0, 3.0, 4.0)


def unit_power(e, p: float):
    """e^p for e in [0, 1] and a static p > 0: products where p is in ``INT_POWERS`` (no
    special-function unit), else 2^(p log2 e) (0 at e = 0)."""
    if p in INT_POWERS:
        out = e
        for _ in range(int(p) - 1):
            out = out * e
        return out
    return jnp.exp2(p * jnp.log2(e))


def softcapped(z, softcap):
    """s * tanh(z / s), with tanh(u) = 1 - 2 / (exp(2u) + 1) on the exact-enough ex2
    (Mosaic's approximate tanh has ~1e-3 relative error; this form is within a few
    fp32 ulps of s, i.e. ~1e-6 absolute for s = 30)."""
    if softcap is None:
        return z
    e = jnp.exp2(z * (2.0 * LOG2E / softcap))
    return softcap - (2.0 * softcap) / (e + 1.0)


def smem_transforms(dtype, cols: int = BLOCK_K):
    """Tiling and swizzle of an SMEM tile whose rows hold ``cols`` elements (>= 32 bytes):
    the widest swizzle (<= 128 bytes) that a row covers."""
    swizzle = plgpu.find_swizzle(min(cols, BLOCK_K) * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def dz_tiles_per_cta(num_nb: int, num_cb: int, sms: int, max_tiles: int = 16) -> int:
    """Column tiles per CTA of ``dz_call``: the fewest waves of CTAs times tiles per CTA,
    plus a tenth of a tile per CTA (its pipeline fill and last epilogue, not overlapped);
    ties go to more tiles. Several tiles only while the CTAs still fill 90% of the SMs:
    at deepseek-v3's shape (32 row blocks x 6 tiles) 96 CTAs of 2 tiles ran 1.6% slower
    than 192 of one (H100)."""
    def cost(t):
        waves = -(-num_nb * (-(-num_cb // t)) // sms)
        return waves * (t + 0.1)

    fill = [t for t in range(min(max_tiles, num_cb), 1, -1) if num_nb * -(-num_cb // t) >= 0.9 * sms]
    return min(fill + [1], key=cost)


def dz_store_columns(cfg: FwdConfig, field: str = "dz_store") -> int:
    """Columns per dz store (``FwdConfig.dz_store``, or the kept tile's ``keep_store``;
    None: block_v, the whole tile)."""
    p = getattr(cfg, field)
    p = cfg.block_v if p is None else p
    if p not in (16, 32) and (p < 1 or p % BLOCK_K) or cfg.block_v % p:
        raise ValueError(f"{field} must divide block_v={cfg.block_v} and be 16, 32 or a multiple "
                         f"of 64 elements, got {p}")
    return p


def dz_smem_extra(block_rows: int, store_cols: int, itemsize: int, n_rows: int) -> int:
    """SMEM bytes of ``dz_call`` beside the ring: the store buffers and the row inputs."""
    return block_rows * (store_cols * itemsize + 4 * n_rows + 4)


def fit_stages(stages: int, steps: int, dtype, block_rows: int, block_v: int, extra: int) -> int:
    """Deepest ring (<= stages, <= steps) whose slots plus ``extra`` bytes fit in SMEM."""
    per_stage = (block_rows + block_v) * BLOCK_K * jnp.dtype(dtype).itemsize
    fit = (SMEM_BYTES - extra) // per_stage
    if fit < 1:
        raise ValueError(f"mosaic_gpu: tiles {block_rows}x{block_v} do not fit in shared memory")
    return int(max(1, min(stages, steps, fit)))


# ---------------------------------------------------------------------------------
# Shared main loop: one (block_n, block_v) tile of logits of one compute warpgroup.
# ---------------------------------------------------------------------------------


def tile_logits(x_smem, w_smem, produced, consumed, wg, step0, *, k_iters, stages, block_n, block_v,
                go=None, go_step=-1, layout="vh"):
    """z = x[rows] @ W[cols]^T for one tile; ring steps step0 .. step0 + k_iters - 1.
    A W slot is (block_v, BLOCK_K) for ``layout`` "vh" (B is its transposed view) and
    (BLOCK_K, block_v) for "hv" (B as it is).

    The WGMMA of step k is in flight while we wait for step k+1's data; the slot of
    step k-1 is released once at most one WGMMA is pending.
    """

    def compute(acc_ref):
        def k_body(k, _):
            step = step0 + k
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(produced.at[slot])
            w_tile = w_smem.at[slot]
            plgpu.wgmma(
                acc_ref,
                x_smem.at[slot, pl.ds(wg * block_n, block_n)],
                w_tile.transpose((1, 0)) if layout == "vh" else w_tile,
            )
            if go is not None:  # warpgroup 0 lets warpgroup 1 start (see FwdConfig.lag)
                @pl.when(jnp.logical_and(wg == 0, step == go_step))
                def _go():
                    plgpu.barrier_arrive(go)

            plgpu.wgmma_wait(1)

            @pl.when(k > 0)
            def _release_prev():
                plgpu.barrier_arrive(consumed.at[lax.rem(step - 1 + stages, stages)])

            return None

        lax.fori_loop(0, k_iters, k_body, None)
        z = acc_ref[...]  # waits for every outstanding WGMMA
        plgpu.barrier_arrive(consumed.at[lax.rem(step0 + k_iters - 1, stages)])
        return z

    return pl.run_scoped(compute, plgpu.ACC((block_n, block_v), jnp.float32))


def memory_loop(x_ref, w_ref, x_smem, w_smem, produced, consumed, row0, vb0, num_vb, *, k_iters, stages,
                block_rows, block_v, layout="vh"):
    """Memory warpgroup: streams (x, W) tiles for vocab tiles vb0 .. vb0+num_vb-1 (W
    tiles (block_v, BLOCK_K) of a (V, H) weight for ``layout`` "vh", (BLOCK_K, block_v)
    of an (H, V) one for "hv")."""
    total = num_vb * k_iters

    def body(step, _):
        slot = lax.rem(step, stages)
        vb = vb0 + lax.div(step, k_iters)
        k = lax.rem(step, k_iters)

        @pl.when(step >= stages)
        def _wait_free():
            plgpu.barrier_wait(consumed.at[slot])

        plgpu.copy_gmem_to_smem(
            x_ref.at[pl.ds(row0, block_rows), pl.ds(k * BLOCK_K, BLOCK_K)],
            x_smem.at[slot],
            produced.at[slot],
        )
        cols, ks = pl.ds(vb * block_v, block_v), pl.ds(k * BLOCK_K, BLOCK_K)
        plgpu.copy_gmem_to_smem(
            w_ref.at[cols, ks] if layout == "vh" else w_ref.at[ks, cols],
            w_smem.at[slot],
            produced.at[slot],
        )
        return None

    lax.fori_loop(0, total, body, None)

    # Drain: wait for the last uses of every slot so that no barrier is left mid-phase.
    def drain(step, _):
        @pl.when(step >= 0)
        def _():
            plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

        return None

    lax.fori_loop(total - jnp.minimum(total, stages), total, drain, None)


def w_axis(layout: str) -> int:
    """The vocabulary axis of a weight in ``layout`` ("vh": 0, "hv": 1)."""
    if layout not in ("vh", "hv"):
        raise ValueError(f'layout must be "vh" or "hv", got {layout!r}')
    return 0 if layout == "vh" else 1


def scratch(dtype, block_rows, block_v, stages, layout="vh"):
    transforms = smem_transforms(dtype)
    w_tile = (block_v, BLOCK_K) if layout == "vh" else (BLOCK_K, block_v)
    return dict(
        x_smem=plgpu.SMEM((stages, block_rows, BLOCK_K), dtype, transforms=transforms),
        w_smem=plgpu.SMEM((stages,) + w_tile, dtype, transforms=transforms),
        produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        consumed=plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=stages),
    )


# ---------------------------------------------------------------------------------
# Forward: per-row statistics over vocab splits
# ---------------------------------------------------------------------------------


def excluded_words(exclude, v: int, n_pad: int, num_vb: int, block_v: int):
    """The bitmap of each row's excluded columns (``stats_partials``' ``exclude`` (N, E):
    distinct ids per row, those outside [0, v) dropped), word-major for the kernel's TMA:
    (num_vb * block_v / 32, n_pad) int32, bit c % 32 of word c // 32 set for column c. An
    XLA scatter-add of one bit per id (distinct ids: a sum of distinct bits is their OR);
    its N V / 8 bytes replace a loop over the ids in every tile, whose cost grew with E."""
    ex = exclude.astype(jnp.int32)
    words = num_vb * block_v // 32
    word = jnp.where((ex >= 0) & (ex < v), lax.shift_right_arithmetic(ex, 5), words)
    bit = lax.shift_left(jnp.ones_like(ex), ex & 31)
    rows = jnp.broadcast_to(jnp.arange(ex.shape[0], dtype=jnp.int32)[:, None], ex.shape)
    return jnp.zeros((words, n_pad), jnp.int32).at[word, rows].add(bit, mode="drop")


def other_columns(words_smem, cols):
    """The (block_n, block_v) mask of a tile's columns (``cols``: their iota) that are not
    excluded: each column reads its bit of the tile's words (``words_smem`` (block_v /
    32, block_n) int32, ``excluded_words``), ~10 operations per element."""
    red = plgpu.Layout.WGMMA.reduce(1)
    word = lambda q: bcast(plgpu.load(words_smem.at[q], layout=red), cols.shape)
    sel = word(0)
    for q in range(1, cols.shape[1] // 32):
        sel = jnp.where(cols >= 32 * q, word(q), sel)
    return (lax.shift_right_logical(sel, cols & 31) & 1) == 0


def stats_partials(x, w, target, *, v: int, cfg: FwdConfig, n_out: int, init: tuple, fold, finish,
                   interpret=None, layout="vh", keep_tiles: int = 0, exclude=None):
    """Per-row partial statistics of z = x W^T over vocab splits: ``n_out`` arrays
    (splits, N) fp32 (rows of a split that ``finish`` leaves as None are not written).

    x (N, H) with N % 8 == 0, w (Vw, H) (``layout`` "vh") or (H, Vw) ("hv") with
    Vw % 8 == 0 (``hv_columns`` for "hv") and v <= Vw the columns that count; target
    (N,) int. Per compute warpgroup the carry is a tuple of per-row fp32 vectors,
    initialised to the floats ``init``; for each tile of logits,
    ``fold(z, cols, hit, valid, carry) -> carry`` with z the fp32 (block_n, block_v)
    tile, cols its column iota (tile-relative), hit = (cols == target column), valid the
    column mask (cols < v - tile start) in the vocabulary's last tile, else None.
    ``finish(carry)`` gives the ``n_out`` row vectors to write (None: skip).

    ``exclude`` (N, E) int32: per row, E distinct columns that do not count (a value
    outside [0, v) excludes nothing): ``valid`` is then every tile's mask of the columns
    that count (< v and none of the row's E). The kernel reads a bitmap of them
    (``excluded_words``): each compute warpgroup TMA-loads its rows' words of the next
    tile into one of two SMEM slots (block_v / 4 bytes per row) while it folds this one;
    ``other_columns`` masks a tile. The cost does not depend on E.

    ``keep_tiles`` > 0 (kept columns, the gradient's input kept from the forward): ``fold``
    returns ``(carry, (e, m))`` with e an fp32 tile in [0, 1] and m a per-row fp32
    vector (the op's own scale of it, e.g. exp(z - m) and the running maximum m); for the
    vocabulary's first ``keep_tiles`` tiles the kernel stores e in x.dtype and m, and two
    more arrays are returned: K (rows_padded, keep_tiles * block_v) in x.dtype (tile j in
    columns [j block_v, (j + 1) block_v)) and M (keep_tiles, rows_padded) fp32. The tile
    leaves through one SMEM buffer per warpgroup in pieces of ``FwdConfig.keep_store``
    columns (TMA stores, overlapped with the next tile's WGMMAs), as ``dz_call``'s dz.
    """
    n, h = x.shape
    vw = w.shape[w_axis(layout)]
    block_n, block_v, stages = cfg.block_n, cfg.block_v, cfg.stages
    block_rows = NUM_COMPUTE_WGS * block_n
    k_iters = h // BLOCK_K
    num_nb = pl.cdiv(n, block_rows)
    num_vb_total = pl.cdiv(v, block_v)
    splits = cfg.splits
    if splits is None:
        # One wave: token blocks x splits <= number of SMs (one CTA per SM: the ring
        # takes most of the shared memory); a partial second wave would cost up to 2x.
        splits = max(1, min(num_vb_total, num_sms() // num_nb))
    vb_per_split = pl.cdiv(num_vb_total, splits)
    splits = pl.cdiv(num_vb_total, vb_per_split)
    n_pad = num_nb * block_rows
    keep_tiles = max(0, min(int(keep_tiles), num_vb_total))
    store = dz_store_columns(cfg, "keep_store") if keep_tiles else 0
    dtype = x.dtype
    excluding = exclude is not None
    n_words = block_v // 32
    extra = NUM_COMPUTE_WGS * block_n * (4 * n_out + 4 + (2 * 4 * n_words if excluding else 0))
    if keep_tiles:  # the kept tile's store buffer and the row vector's
        extra += dz_smem_extra(block_rows, store, jnp.dtype(dtype).itemsize, 0)
    stages = fit_stages(stages, k_iters * vb_per_split, x.dtype, block_rows, block_v, extra=extra)
    # The go signal is sent at ring step lag - 1 of warpgroup 0, which every CTA reaches.
    lag = max(0, min(cfg.lag, stages - 1, k_iters * (num_vb_total - (splits - 1) * vb_per_split)))
    tgt = jnp.pad(target.astype(jnp.int32), (0, n_pad - target.shape[0]))[None]
    ins = (x, w, tgt) + ((excluded_words(exclude, v, n_pad, num_vb_total, block_v),) if excluding else ())
    del vw

    def kernel(x_ref, w_ref, t_ref, b_ref, outs, x_smem, w_smem, produced, consumed, stat_smem, t_smem, t_bar,
               go_bar, b_smem=None, b_bar=None, o_smem=None, m_smem=None):
        if keep_tiles:
            outs, (k_ref, m_ref) = outs[:n_out], outs[n_out:]
        nb = lax.axis_index("n")
        sp = lax.axis_index("s")
        wg = lax.axis_index("wg")
        row0 = nb * block_rows
        vb0 = sp * vb_per_split
        num_vb = jnp.minimum(vb_per_split, num_vb_total - vb0)

        @pl.when(wg < NUM_COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGS, action="increase")
            rows = pl.ds(row0 + wg * block_n, block_n)
            plgpu.copy_gmem_to_smem(t_ref.at[:, rows], t_smem.at[wg], t_bar.at[wg])
            plgpu.barrier_wait(t_bar.at[wg])
            tgt_rows = plgpu.load(t_smem.at[wg, 0], layout=plgpu.Layout.WGMMA.reduce(1))

            red = plgpu.Layout.WGMMA.reduce(1)
            carry0 = tuple(plgpu.layout_cast(jnp.full((block_n,), val, jnp.float32), red) for val in init)

            def load_words(j):  # tile j's excluded words of this warpgroup's rows, into slot j % 2
                slot = lax.rem(j, 2)
                plgpu.copy_gmem_to_smem(b_ref.at[pl.ds((vb0 + j) * n_words, n_words), rows], b_smem.at[wg, slot],
                                        b_bar.at[wg * 2 + slot])

            if excluding:
                pl.when(num_vb > 0)(lambda: load_words(0))

            def v_body(j, carry, masked):
                vb = vb0 + j
                z = tile_logits(x_smem, w_smem, produced, consumed, wg, j * k_iters,
                                k_iters=k_iters, stages=stages, block_n=block_n, block_v=block_v,
                                go=go_bar.at[0] if lag else None, go_step=lag - 1, layout=layout)
                cols = plgpu.broadcasted_iota(jnp.int32, (block_n, block_v), 1, layout=plgpu.Layout.WGMMA)
                # only the tile holding column v - 1 has columns >= v
                valid = (cols < (v - vb * block_v)) if masked else None
                hit = cols == bcast(tgt_rows - vb * block_v, z.shape)
                if excluding:
                    # The next tile's words go into the other slot, which tile j - 1 read: every
                    # warp of the warpgroup has passed this tile's WGMMAs, so it is free.
                    pl.when(j + 1 < num_vb)(lambda: load_words(j + 1))
                    slot = lax.rem(j, 2)
                    plgpu.barrier_wait(b_bar.at[wg * 2 + slot])
                    counts = other_columns(b_smem.at[wg, slot], cols)
                    valid = counts if valid is None else valid & counts
                out = fold(z, cols, hit, valid, carry)
                if not keep_tiles:
                    return tuple(out)
                carry, (e, m) = out

                def store_kept():
                    rows = pl.ds(row0 + wg * block_n, block_n)
                    for q in range(block_v // store):
                        # The previous stores must have read the buffers before they are overwritten.
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        o_smem[wg] = (e if store == block_v else e[:, q * store:(q + 1) * store]).astype(dtype)
                        if q == 0:
                            m_smem[wg] = m
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_smem.at[wg], k_ref.at[rows, pl.ds(vb * block_v + q * store, store)])
                        if q == 0:
                            plgpu.copy_smem_to_gmem(m_smem.at[wg], m_ref.at[vb, rows])

                if keep_tiles >= num_vb_total:
                    store_kept()
                else:
                    pl.when(vb < keep_tiles)(store_kept)
                return tuple(carry)

            if lag:
                @pl.when(wg == 1)
                def _wait_go():
                    plgpu.barrier_wait(go_bar.at[0])

            # Full tiles first (no column mask), then at most one ragged tile.
            num_full = jnp.clip(v // block_v - vb0, 0, num_vb)
            carry = lax.fori_loop(0, num_full, functools.partial(v_body, masked=False), carry0)
            carry = lax.fori_loop(num_full, num_vb, functools.partial(v_body, masked=True), carry)
            out_rows = pl.ds(row0 + wg * block_n, block_n)
            vals = finish(carry)
            for i, val in enumerate(vals):
                if val is not None:
                    stat_smem[wg, i] = val
            plgpu.commit_smem()
            for i, val in enumerate(vals):
                if val is not None:
                    plgpu.copy_smem_to_gmem(stat_smem.at[wg, i], outs[i].at[sp, out_rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == NUM_COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGS, action="decrease")
            memory_loop(x_ref, w_ref, x_smem, w_smem, produced, consumed, row0, vb0, num_vb,
                        k_iters=k_iters, stages=stages, block_rows=block_rows, block_v=block_v, layout=layout)

    def entry(x_ref, w_ref, t_ref, *rest):
        b_ref, outs = (rest[0], rest[1:]) if excluding else (None, rest)
        s = scratch(x.dtype, block_rows, block_v, stages, layout)
        words = dict(b_smem=plgpu.SMEM((NUM_COMPUTE_WGS, 2, n_words, block_n), jnp.int32),
                     b_bar=plgpu.Barrier(num_barriers=2 * NUM_COMPUTE_WGS)) if excluding else {}
        kept = dict(o_smem=plgpu.SMEM((NUM_COMPUTE_WGS, block_n, store), dtype,
                                      transforms=smem_transforms(dtype, store)),
                    m_smem=plgpu.SMEM((NUM_COMPUTE_WGS, block_n), jnp.float32)) if keep_tiles else {}
        pl.run_scoped(
            lambda *refs, **named: kernel(x_ref, w_ref, t_ref, b_ref, outs, *refs, **named),
            s["x_smem"], s["w_smem"], s["produced"], s["consumed"],
            plgpu.SMEM((NUM_COMPUTE_WGS, n_out, block_n), jnp.float32),
            plgpu.SMEM((NUM_COMPUTE_WGS, 1, block_n), jnp.int32),
            plgpu.Barrier(num_barriers=NUM_COMPUTE_WGS),
            plgpu.Barrier(num_barriers=1),
            **words, **kept,
            collective_axes="wg",
        )

    part = jax.ShapeDtypeStruct((splits, n_pad), jnp.float32)
    kept_types = ((jax.ShapeDtypeStruct((n_pad, keep_tiles * block_v), dtype),
                   jax.ShapeDtypeStruct((keep_tiles, n_pad), jnp.float32)) if keep_tiles else ())
    parts = plgpu.kernel(
        entry,
        out_type=(part,) * n_out + kept_types,
        grid=(num_nb, splits),
        grid_names=("n", "s"),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(*ins)
    n = target.shape[0]
    return tuple(p[:, :n] for p in parts[:n_out]) + tuple(parts[n_out:])


# ---------------------------------------------------------------------------------
# Backward: d(logits) chunks + XLA GEMMs
# ---------------------------------------------------------------------------------


def dz_call(x, w, rowdat, tgt, cblock, *, v: int, chunk: int, cfg: FwdConfig, epilogue, interpret=None,
            layout="vh"):
    """d(logits) of columns [cblock[0] * block_v, ... + chunk) of all rows: (N, chunk) in
    x.dtype, zero at columns >= v. rowdat (R, rows_padded) fp32 and tgt (rows_padded,)
    int32 are per-row inputs; ``epilogue(z, rows, hit) -> dz`` (fp32 tile) with z the
    fp32 logits tile, rows the R per-row vectors, hit = (cols == target column). w in
    ``layout`` ("vh": (Vw, H), "hv": (H, Vw)).

    Each CTA owns a row block and ``cfg.dz_tiles`` consecutive column tiles (the last
    CTA of a row block fewer): the memory warpgroup streams the next tile's operands
    while the compute warpgroups finish a tile (epilogue, store); warpgroup 1 runs
    ``cfg.lag`` ring steps behind warpgroup 0, as in the forward. The dz tile goes out in
    pieces of ``dz_store_columns`` columns through one SMEM buffer per warpgroup (a
    smaller buffer leaves a deeper ring)."""
    w_axis(layout)
    n, h = x.shape
    n_rows = rowdat.shape[0]
    block_n, block_v, stages = cfg.block_n, cfg.block_v, cfg.stages
    if chunk % block_v:
        raise ValueError(f"chunk {chunk} must be a multiple of block_v={block_v}")
    block_rows = NUM_COMPUTE_WGS * block_n
    k_iters = h // BLOCK_K
    num_nb = pl.cdiv(n, block_rows)
    num_cb = chunk // block_v
    tiles = cfg.dz_tiles if cfg.dz_tiles is not None else dz_tiles_per_cta(num_nb, num_cb, num_sms())
    if tiles < 1:
        raise ValueError(f"dz_tiles must be >= 1, got {tiles}")
    tiles = min(tiles, num_cb)
    num_cg = pl.cdiv(num_cb, tiles)
    dtype = x.dtype
    store = dz_store_columns(cfg)
    stages = fit_stages(stages, k_iters * tiles, dtype, block_rows, block_v,
                        extra=dz_smem_extra(block_rows, store, jnp.dtype(dtype).itemsize, n_rows))
    # The go signal is sent at ring step lag - 1 of warpgroup 0's first tile; one tile
    # per CTA runs without the lag (the kernel measured as "old").
    lag = max(0, min(cfg.lag, stages - 1, k_iters)) if tiles > 1 else 0
    out_transforms = smem_transforms(dtype, store)

    def kernel(c_ref, x_ref, w_ref, r_ref, t_ref, dz_ref, x_smem, w_smem, produced, consumed, r_smem, t_smem, bar,
               go_bar, o_smem):
        nb = lax.axis_index("n")
        cg = lax.axis_index("c")
        wg = lax.axis_index("wg")
        row0 = nb * block_rows
        cb0 = cg * tiles  # first column tile of this CTA within the chunk
        num_t = jnp.minimum(tiles, num_cb - cb0)
        vb0 = c_ref[0] + cb0  # its vocab tile (the chunk offset is a kernel input)

        @pl.when(wg < NUM_COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGS, action="increase")
            rows = pl.ds(row0 + wg * block_n, block_n)
            for i in range(n_rows):
                plgpu.copy_gmem_to_smem(r_ref.at[i, rows], r_smem.at[wg, i], bar.at[wg])
            plgpu.copy_gmem_to_smem(t_ref.at[rows], t_smem.at[wg], bar.at[wg])
            if lag:
                @pl.when(wg == 1)
                def _wait_go():
                    plgpu.barrier_wait(go_bar.at[0])

            def t_body(j, _):
                vb = vb0 + j
                z = tile_logits(x_smem, w_smem, produced, consumed, wg, j * k_iters,
                                k_iters=k_iters, stages=stages, block_n=block_n, block_v=block_v,
                                go=go_bar.at[0] if lag else None, go_step=lag - 1, layout=layout)

                # The row inputs arrive while the first main loop runs; waited for after it.
                @pl.when(j == 0)
                def _rows_arrived():
                    plgpu.barrier_wait(bar.at[wg])

                red = plgpu.Layout.WGMMA.reduce(1)
                row_vals = [plgpu.load(r_smem.at[wg, i], layout=red) for i in range(n_rows)]
                t_r = plgpu.load(t_smem.at[wg], layout=red)
                shape = (block_n, store)
                cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
                # The tile in pieces of ``store`` columns, each through the one store
                # buffer (a smaller buffer, a deeper ring; fewer live registers).
                for q in range(block_v // store):
                    c0 = vb * block_v + q * store  # first vocab column of the piece
                    zq = z if store == block_v else z[:, q * store:(q + 1) * store]
                    dz = epilogue(zq, row_vals, cols == bcast(t_r - c0, shape))
                    dz = jnp.where(cols < (v - c0), dz, 0.0)
                    # The previous store must have read o_smem before it is overwritten.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    o_smem[wg] = dz.astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem.at[wg],
                                            dz_ref.at[rows, pl.ds((cb0 + j) * block_v + q * store, store)])
                return None

            lax.fori_loop(0, num_t, t_body, None)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == NUM_COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGS, action="decrease")
            memory_loop(x_ref, w_ref, x_smem, w_smem, produced, consumed, row0, vb0, num_t,
                        k_iters=k_iters, stages=stages, block_rows=block_rows, block_v=block_v, layout=layout)

    def entry(c_ref, x_ref, w_ref, r_ref, t_ref, dz_ref):
        s = scratch(dtype, block_rows, block_v, stages, layout)
        pl.run_scoped(
            lambda *refs: kernel(c_ref, x_ref, w_ref, r_ref, t_ref, dz_ref, *refs),
            s["x_smem"], s["w_smem"], s["produced"], s["consumed"],
            plgpu.SMEM((NUM_COMPUTE_WGS, n_rows, block_n), jnp.float32),
            plgpu.SMEM((NUM_COMPUTE_WGS, block_n), jnp.int32),
            plgpu.Barrier(num_arrivals=n_rows + 1, num_barriers=NUM_COMPUTE_WGS),
            plgpu.Barrier(num_barriers=1),
            plgpu.SMEM((NUM_COMPUTE_WGS, block_n, store), dtype, transforms=out_transforms),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((n, chunk), dtype),
        grid=(num_nb, num_cg),
        grid_names=("n", "c"),
        num_threads=NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(cblock, x, w, rowdat, tgt)


def chunk_columns(n: int, v: int, h: int, itemsize: int, budget, block_v: int) -> int:
    """Columns of one backward chunk, from the budget. Temporaries of the backward
    (bytes; dW and dx themselves are outputs, written in place chunk by chunk):
        4 n h                 the fp32 dx accumulator (fixed)
        itemsize n C          the dz chunk
        itemsize C h          the W slice the dx GEMM reads
        itemsize C h          the dW chunk before its in-place update into dW
    so C = (budget - 4 n h) / (itemsize (n + 2 h)), at least a quarter of the budget
    for the chunk terms and at least one tile of columns. ``budget`` None: the device's
    default (``logitless.jax.budget.default_memory_budget``)."""
    budget = default_memory_budget() if budget is None else int(budget)
    avail = max(budget - 4 * n * h, budget // 4)
    c = avail // max(1, itemsize * (n + 2 * h))
    c = max(block_v, c // block_v * block_v)
    return min(c, pl.cdiv(v, block_v) * block_v)


def backward_chunk(n: int, vw: int, h: int, itemsize: int, budget, bv: int) -> int:
    """``chunked_backward``'s chunk: ``chunk_columns``, lowered (by at most half) to a
    divisor of the vocabulary's column tiles where one exists, so that chunks end on the
    vocabulary's last tile."""
    cb = chunk_columns(n, vw, h, itemsize, budget, bv) // bv
    nblk = pl.cdiv(vw, bv)
    for d in range(cb, max(1, cb // 2) - 1, -1):
        if nblk % d == 0:
            return d * bv
    return cb * bv


#: When not every column is kept, the backward's chunks (kept and recomputed alike: their
#: dz, W slice and dW chunk) take this share of the budget, at least KEPT_CHUNK_MIN
#: columns (fewer, wider chunks: each costs launches and a W slice); the kept columns the
#: rest, beside the fp32 dx accumulator.
CHUNK_SHARE = 8
KEPT_CHUNK_MIN = 2048
#: Below this share of the columns, keeping saves less than its chunks cost: recompute all.
KEEP_MIN_SHARE = 0.25


def keep_plan(n: int, v: int, vw: int, h: int, itemsize: int, budget: int, cfg: FwdConfig,
              dz_in_place: bool = True, columns: int | None = None) -> tuple[int, int, int]:
    """(kept columns, kept chunk columns, recomputed chunk columns) of a backward that
    takes dz from what the forward kept (``stats_partials``' keep_tiles).

    Every column when they fit ``budget`` with the row vectors: (columns, 0, 0); dz is
    then one piece over K's own buffer when K's shape is the weight's (N a multiple of the
    row block, V of block_v) and ``dz_in_place`` (the op has a kernel that writes it over
    K), else one dz more is counted. Else chunks of C columns (``CHUNK_SHARE`` of the
    budget, at least ``KEPT_CHUNK_MIN``) for both the kept and the recomputed columns,
    and as many whole kept chunks as fit beside two chunks' temporaries (XLA may hold the
    next chunk's W slice while the last one's GEMMs run: measured 3% over with one) and
    the fp32 dx accumulator (4 N H bytes): XLA keeps a while loop's operands for the whole
    backward (K lives until the last chunk), so everything is counted at once. (0, 0, 0)
    when that keeps less than ``KEEP_MIN_SHARE`` of the columns. Bytes counted:
        K   rows_padded x block_v x itemsize + rows_padded x 4 (the tile maxima) per tile
        the row vectors (lse, coefficients, target, scales): 64 bytes per row
        per chunk column: itemsize x (N + 2 H) (``chunk_columns``' dz, W slice, dW chunk)
    ``vw``: the weight's columns as the kernels see them (``hv_columns`` for (H, V)).

    ``columns`` (a multiple of block_v): keep exactly that many columns (what another
    split of the same problem keeps: a sharded jit's residual slots), counted as above
    but in any number of tiles (the last kept chunk may be narrower); (0, 0, 0) when the
    budget does not hold them or they are under ``KEEP_MIN_SHARE``."""
    bv = cfg.block_v
    n8 = -(-n // 8) * 8
    n_pad = rows_padded(n8, cfg)
    tiles = pl.cdiv(v, bv)
    per_tile = n_pad * bv * itemsize + n_pad * 4
    rows = 64 * n_pad
    copy = 0 if (dz_in_place and n8 == n_pad and tiles * bv == vw) else n8 * vw * itemsize  # dz beside K
    every = tiles * per_tile + rows + copy <= budget
    if columns is None and every:
        return tiles * bv, 0, 0
    if columns is not None and columns >= tiles * bv:  # every column, or nothing
        return (tiles * bv, 0, 0) if every else (0, 0, 0)
    per_col = itemsize * (n8 + 2 * h)
    kc = max(min(KEPT_CHUNK_MIN, vw) // bv, (budget // CHUNK_SHARE) // per_col // bv, 1) * bv
    avail = budget - rows - 4 * n8 * h - 2 * kc * per_col
    if columns is None:
        keep = max(0, avail) // per_tile * bv // kc * kc
        keep = min(keep, vw // kc * kc)
    else:
        fits = columns % bv == 0 and columns // bv * per_tile <= avail
        keep, kc = (columns, min(kc, columns)) if fits else (0, kc)
    return (keep, kc, kc) if keep and keep >= KEEP_MIN_SHARE * v else (0, 0, 0)


def row_inputs(target, rows, n_pad):
    """Per-row inputs of ``dz_call``, padded (with zeros) to ``n_pad`` rows: the (R, N)
    fp32 rows and the target (int32). Built once per backward, shared by every chunk."""
    n = target.shape[0]
    rowdat = rows.astype(jnp.float32)
    return (jnp.pad(rowdat, ((0, 0), (0, n_pad - n))),
            jnp.pad(target.astype(jnp.int32), (0, n_pad - n)))


def kept_gemms(dz, x8, w, layout: str):
    """(dx, dW) of a whole dz (N8, Vw) against the whole W, one GEMM each, no slice of W:
    dx = dz W (x's dtype), dW = dz^T x ("vh") or x^T dz ("hv") in W's dtype; fp32
    accumulation inside the GEMMs, one rounding at their output."""
    if layout == "vh":
        dx = lax.dot_general(dz, w, (((1,), (0,)), ((), ())), preferred_element_type=x8.dtype)
        dw = lax.dot_general(dz, x8, (((0,), (0,)), ((), ())), preferred_element_type=w.dtype)
    else:
        dx = lax.dot_general(dz, w, (((1,), (1,)), ((), ())), preferred_element_type=x8.dtype)
        dw = lax.dot_general(x8, dz, (((0,), (0,)), ((), ())), preferred_element_type=w.dtype)
    return dx, dw


def chunked_backward(x8, w, rowdat, tgt, *, n: int, v: int, cfg: FwdConfig, budget, epilogue, interpret=None,
                     vary=None, layout="vh", chunk=None, kept_dz=None, kept_cols: int = 0, kept_chunk=None):
    """(dx (N8, H), dW in w.dtype and w's layout): d(logits) chunks feeding XLA GEMMs. x8
    (N8, H) row-padded; w (Vw, H) for ``layout`` "vh" or (H, Vw) for "hv", columns >= v
    masked to zero; n the unpadded token count (sizes the chunk from ``budget``, see
    ``chunk_columns``). ``vary(dx, dw)``: the carries marked as varying like the inputs
    (inside shard_map). ``chunk``: the recomputed columns per chunk as the backend's plan
    made it (``backward_chunk``); None: from ``budget`` here.

    Kept columns (``kept_dz(c0, width) -> dz (N8, width)`` in x's dtype, from what the
    forward kept, for columns [0, ``kept_cols``)): every column kept (``kept_cols`` >= Vw):
    dz in one piece and ``kept_gemms``, dx in x's dtype (3 GEMMs in all with the forward;
    dz can take the kept buffer's place). Else the kept columns in chunks of
    ``kept_chunk`` (the last one narrower where it does not divide ``kept_cols``), then
    the others recomputed by ``dz_call`` in chunks of ``chunk``; dx accumulated in fp32
    and returned so."""
    _, h = x8.shape
    vaxis = w_axis(layout)
    vw = w.shape[vaxis]
    bv = cfg.block_v
    kept_cols = min(int(kept_cols), vw) if kept_dz is not None else 0
    if kept_cols and kept_cols >= vw:
        return kept_gemms(kept_dz(0, vw), x8, w, layout)
    if chunk is None:
        chunk = backward_chunk(n, vw - kept_cols, h, jnp.dtype(x8.dtype).itemsize, budget, bv)

    def gemms(dx, dw, dz, c0, cw):
        w_c = lax.dynamic_slice_in_dim(w, c0, cw, axis=vaxis)
        # dx += dz @ W[chunk] ("vh": W[chunk] (cw, H); "hv": (H, cw), contracted on its columns).
        if layout == "vh":
            dx = dx + jnp.dot(dz, w_c, preferred_element_type=jnp.float32)
        else:
            dx = dx + lax.dot_general(dz, w_c, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        # One GEMM with fp32 accumulation writes the chunk in w.dtype (no fp32 dW chunk);
        # the update is in place in the loop's carry: no stacking, no concatenation.
        # "vh": dz^T x (cw, H); "hv": x^T dz (H, cw).
        pair = (dz, x8) if layout == "vh" else (x8, dz)
        dw_c = lax.dot_general(*pair, (((0,), (0,)), ((), ())), preferred_element_type=w.dtype)
        return dx, lax.dynamic_update_slice_in_dim(dw, dw_c, c0, axis=vaxis)

    def recomputed(c0, width, cw):
        # The offset is an input of the kernel, so one compiled kernel serves every chunk.
        cblock = jnp.reshape(c0 // bv, (1,)).astype(jnp.int32)
        dz = dz_call(x8, w, rowdat, tgt, cblock, v=v, chunk=width, cfg=cfg, epilogue=epilogue,
                     interpret=interpret, layout=layout)
        return dz if cw == width else dz[:, :cw]

    def loop(carry, count, start, width, dz_of):
        # A loop (not unrolled): one Mosaic kernel to compile however many chunks.
        if count == 1:
            c0 = jnp.int32(start)
            return gemms(*carry, dz_of(c0), c0, width)
        if count:
            return lax.fori_loop(0, count, lambda i, c: gemms(*c, dz_of(start + i * width), start + i * width,
                                                              width), carry)
        return carry

    carry = (jnp.zeros(x8.shape, jnp.float32),
             # Every chunk writes its columns of dW, so dW starts uninitialised (on a GPU: no
             # 1 GB memset at llama3.1-8b, 0.6 ms; on a CPU lax.empty is zeros). lax.empty itself:
             # every jax with these Mosaic GPU kernels has it (ops.common.chunks.uninitialised
             # stands in for the other backends, which run on older jax too).
             lax.empty(w.shape, w.dtype))
    if vary is not None:
        carry = vary(*carry)
    if kept_cols:
        kc = kept_chunk or kept_cols
        carry = loop(carry, kept_cols // kc, 0, kc, lambda c0: kept_dz(c0, kc))
        if kept_cols % kc:  # a narrower last kept chunk (``keep_plan``'s ``columns``)
            c0 = kept_cols // kc * kc
            carry = gemms(*carry, kept_dz(c0, kept_cols - c0), jnp.int32(c0), kept_cols - c0)
    rest = vw - kept_cols
    nfull = rest // chunk
    carry = loop(carry, nfull, kept_cols, chunk, lambda c0: recomputed(c0, chunk, chunk))
    rem = rest - nfull * chunk
    if rem:
        c0 = kept_cols + nfull * chunk
        carry = gemms(*carry, recomputed(jnp.int32(c0), pl.cdiv(rem, bv) * bv, rem), jnp.int32(c0), rem)
    return carry
