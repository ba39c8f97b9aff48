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

Backward (``backward``): "4 GEMMs". For each vocab chunk [c0, c0 + C) the kernel
    ``_dz_call`` (one tile per CTA, the chunk offset a kernel input) recomputes the (N, C) logits tile by tile (same WGMMA main loop) and
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

Limits (``is_supported``): bf16/f16 inputs, H a multiple of 64, V a multiple of 8 (TMA
into swizzled tiles), no bias (the api falls back to "xla" otherwise). Ragged V (vs the
tiles) is masked in-kernel; N is padded to a multiple of 8 rows (a copy of x only when
N % 8 != 0); W is never copied by the kernels. On a machine without an SM90 GPU the kernels run under Mosaic GPU's
interpret mode (``plgpu.force_gpu_interpret_mode``), which the CPU tests use.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from logitless.jax.formulas import merge_lse_splits
from logitless.jax.ops.linear_cross_entropy.sharded import to_varying, varying

__all__ = ["forward", "backward", "is_supported", "supports", "FwdConfig", "dz_chunk"]

BLOCK_K = 64  # 64 bf16 = 128 bytes: one 128-byte swizzle row.
_NUM_COMPUTE_WGS = 2
# Register split of the 64K-register file (setmaxnreg): 2 x 128 x 232 + 128 x 40 <= 65536.
_COMPUTE_REGS, _MEMORY_REGS = 232, 40
_SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """Tile sizes of the kernels (heuristics; ``_default_config`` picks them)."""

    block_n: int = 128  # rows per compute warpgroup (a CTA has two)
    block_v: int = 128  # vocab columns per tile
    stages: int = 4  # depth of the TMA ring
    splits: int | None = None  # vocab splits of the forward grid (None: automatic)
    # Forward only: warpgroup 1 starts ``lag`` ring steps after warpgroup 0 (< stages),
    # so that one's epilogue (softmax statistics) overlaps the other's WGMMAs.
    lag: int = 2


def is_supported(x2d_shape, w_shape, dtype, *, softcap=None, has_bias=False) -> bool:
    """Whether these kernels handle the case (else the api falls back to "xla")."""
    del softcap
    if has_bias:
        return False
    if jnp.dtype(dtype) not in _SUPPORTED_DTYPES:
        return False
    if len(x2d_shape) != 2 or len(w_shape) != 2:
        return False
    n, h = x2d_shape
    v, h2 = w_shape
    # TMA into swizzled tiles needs the tiled GMEM dims to be multiples of 8: rows of
    # x are padded in the wrapper (cheap), rows of W never are (a copy of W per step).
    return h == h2 and h % BLOCK_K == 0 and h > 0 and n >= 1 and v >= 1 and v % 8 == 0


def _pad_rows8(x):
    """x with its rows zero-padded to a multiple of 8 (a TMA constraint); no-op if aligned."""
    n = x.shape[0]
    n8 = -(-n // 8) * 8
    return x if n8 == n else jnp.pad(x, ((0, n8 - n), (0, 0)))


def _check(x2d, w, bias):
    if bias is not None:
        raise ValueError("mosaic_gpu: bias is not supported (use implementation='xla')")
    if not is_supported(x2d.shape, w.shape, x2d.dtype) or w.dtype != x2d.dtype:
        raise ValueError(
            f"mosaic_gpu: unsupported case x {x2d.shape} {x2d.dtype}, w {w.shape} {w.dtype} "
            f"(needs bf16/f16, H % {BLOCK_K} == 0, V % 8 == 0; use implementation='xla')")


supports = is_supported


def _num_sms() -> int:
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu":
            return int(getattr(dev, "core_count", 132) or 132)
    except Exception:  # pragma: no cover - no devices
        pass
    return 132


def _default_config(n: int, v: int, h: int) -> FwdConfig:
    """256-row CTA tiles (2 x 128 x 128 accumulators); 128-row tiles for few tokens."""
    if n <= 128:
        return FwdConfig(block_n=64, block_v=256)
    return FwdConfig()


def _smem_transforms(dtype):
    swizzle = plgpu.find_swizzle(BLOCK_K * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


_SMEM_BYTES = 220 * 1024  # of the H100's 227 KiB per block, with room for barriers


def _fit_stages(stages: int, steps: int, dtype, block_rows: int, block_v: int, extra: int) -> int:
    """Deepest ring (<= stages, <= steps) whose slots plus ``extra`` bytes fit in SMEM."""
    per_stage = (block_rows + block_v) * BLOCK_K * jnp.dtype(dtype).itemsize
    fit = (_SMEM_BYTES - extra) // per_stage
    if fit < 1:
        raise ValueError(f"mosaic_gpu: tiles {block_rows}x{block_v} do not fit in shared memory")
    return int(max(1, min(stages, steps, fit)))


#: None: Mosaic GPU's interpret mode exactly when jax's default backend is not a GPU;
#: True/False force it (tests set False to lower for CUDA on a CPU-only machine).
INTERPRET: bool | None = None


def can_partition() -> bool:
    """Whether the kernels may run inside ``custom_partitioning`` (the api's sharded jit
    path): not under the interpreter, whose ordered io_callbacks cannot be partitioned
    (the api then runs the unpartitioned program)."""
    return _interpret_params() is None


def _interpret_params():
    """Interpret mode when there is no GPU (CPU tests); None on a GPU."""
    use = INTERPRET if INTERPRET is not None else jax.default_backend() != "gpu"
    return plgpu.InterpretGPUParams() if use else None


LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _softcapped(z, softcap):
    """s * tanh(z / s), with tanh(u) = 1 - 2 / (exp(2u) + 1) on the exact-enough ex2
    (Mosaic's approximate tanh has ~1e-3 relative error; this form is within a few
    fp32 ulps of s, i.e. ~1e-6 absolute for s = 30)."""
    if softcap is None:
        return z
    e = jnp.exp2(z * (2.0 * LOG2E / softcap))
    return softcap - (2.0 * softcap) / (e + 1.0)


# ---------------------------------------------------------------------------------
# Shared main loop: one (block_n, block_v) tile of logits of one compute warpgroup.
# ---------------------------------------------------------------------------------


def _tile_logits(x_smem, w_smem, produced, consumed, wg, step0, *, k_iters, stages, block_n, block_v,
                 go=None, go_step=-1):
    """z = x[rows] @ W[cols]^T for one tile; ring steps step0 .. step0 + k_iters - 1.

    The WGMMA of step k is in flight while we wait for step k+1's data; the slot of
    step k-1 is released once at most one WGMMA is pending.
    """

    def compute(acc_ref):
        def k_body(k, _):
            step = step0 + k
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(produced.at[slot])
            plgpu.wgmma(
                acc_ref,
                x_smem.at[slot, pl.ds(wg * block_n, block_n)],
                w_smem.at[slot].transpose((1, 0)),
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


def _memory_loop(x_ref, w_ref, x_smem, w_smem, produced, consumed, row0, vb0, num_vb, *, k_iters, stages, block_rows, block_v):
    """Memory warpgroup: streams (x, W) tiles for vocab tiles vb0 .. vb0+num_vb-1."""
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
        plgpu.copy_gmem_to_smem(
            w_ref.at[pl.ds(vb * block_v, block_v), pl.ds(k * BLOCK_K, BLOCK_K)],
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


def _scratch(dtype, block_rows, block_v, stages):
    transforms = _smem_transforms(dtype)
    return dict(
        x_smem=plgpu.SMEM((stages, block_rows, BLOCK_K), dtype, transforms=transforms),
        w_smem=plgpu.SMEM((stages, block_v, BLOCK_K), dtype, transforms=transforms),
        produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        consumed=plgpu.Barrier(num_arrivals=_NUM_COMPUTE_WGS, num_barriers=stages),
    )


# ---------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------


def _forward_partials(x, w, target, *, softcap, need_smooth, cfg: FwdConfig):
    n, h = x.shape
    v = w.shape[0]
    block_n, block_v, stages = cfg.block_n, cfg.block_v, cfg.stages
    block_rows = _NUM_COMPUTE_WGS * block_n
    k_iters = h // BLOCK_K
    num_nb = pl.cdiv(n, block_rows)
    num_vb_total = pl.cdiv(v, block_v)
    splits = cfg.splits
    if splits is None:
        # One wave: token blocks x splits <= number of SMs (one CTA per SM: the ring
        # takes most of the shared memory); a partial second wave would cost up to 2x.
        splits = max(1, min(num_vb_total, _num_sms() // num_nb))
    vb_per_split = pl.cdiv(num_vb_total, splits)
    splits = pl.cdiv(num_vb_total, vb_per_split)
    n_pad = num_nb * block_rows
    stages = _fit_stages(stages, k_iters * vb_per_split, x.dtype, block_rows, block_v,
                         extra=_NUM_COMPUTE_WGS * block_n * 16)
    # The go signal is sent at ring step lag - 1 of warpgroup 0, which every CTA reaches.
    lag = max(0, min(cfg.lag, stages - 1, k_iters * (num_vb_total - (splits - 1) * vb_per_split)))
    tgt = jnp.pad(target.astype(jnp.int32), (0, n_pad - target.shape[0]))

    def kernel(x_ref, w_ref, t_ref, lse_out, tl_out, ss_out, x_smem, w_smem, produced, consumed, stat_smem, t_smem, t_bar, go_bar):
        nb = lax.axis_index("n")
        sp = lax.axis_index("s")
        wg = lax.axis_index("wg")
        row0 = nb * block_rows
        vb0 = sp * vb_per_split
        num_vb = jnp.minimum(vb_per_split, num_vb_total - vb0)

        @pl.when(wg < _NUM_COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(_COMPUTE_REGS, action="increase")
            rows = pl.ds(row0 + wg * block_n, block_n)
            plgpu.copy_gmem_to_smem(t_ref.at[rows], t_smem.at[wg], t_bar.at[wg])
            plgpu.barrier_wait(t_bar.at[wg])
            tgt_rows = plgpu.load(t_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))

            red = plgpu.Layout.WGMMA.reduce(1)
            m0 = plgpu.layout_cast(jnp.full((block_n,), -jnp.inf, jnp.float32), red)
            zero = plgpu.layout_cast(jnp.full((block_n,), 0.0, jnp.float32), red)

            def v_body(j, carry, masked):
                m, l, tl, ss = carry
                vb = vb0 + j
                z = _tile_logits(x_smem, w_smem, produced, consumed, wg, j * k_iters,
                                 k_iters=k_iters, stages=stages, block_n=block_n, block_v=block_v,
                                 go=go_bar.at[0] if lag else None, go_step=lag - 1)
                z = _softcapped(z, softcap)
                cols = plgpu.broadcasted_iota(jnp.int32, (block_n, block_v), 1, layout=plgpu.Layout.WGMMA)
                bc = lambda r: lax.broadcast_in_dim(r, z.shape, [0])
                if masked:  # only the tile holding column V - 1 has columns >= V
                    valid = cols < (v - vb * block_v)
                if need_smooth:
                    ss = ss + (jnp.where(valid, z, 0.0) if masked else z).sum(axis=1)
                tl = tl + jnp.where(cols == bc(tgt_rows - vb * block_v), z, 0.0).sum(axis=1)
                if masked:
                    z = jnp.where(valid, z, -jnp.inf)
                m_new = jnp.maximum(m, z.max(axis=1))
                # exp(z - m) as 2^(z log2 e - m log2 e): one FMA + ex2 per element.
                p = jnp.exp2(z * LOG2E - bc(m_new * LOG2E))
                l = l * jnp.exp2((m - m_new) * LOG2E) + p.sum(axis=1)
                return m_new, l, tl, ss

            if lag:
                @pl.when(wg == 1)
                def _wait_go():
                    plgpu.barrier_wait(go_bar.at[0])

            # Full tiles first (no column mask), then at most one ragged tile.
            num_full = jnp.clip(v // block_v - vb0, 0, num_vb)
            carry = (m0, zero, zero, zero)
            carry = lax.fori_loop(0, num_full, functools.partial(v_body, masked=False), carry)
            m, l, tl, ss = lax.fori_loop(num_full, num_vb, functools.partial(v_body, masked=True), carry)
            out_rows = pl.ds(row0 + wg * block_n, block_n)
            stat_smem[wg, 0] = m + jnp.log2(l) * LN2
            stat_smem[wg, 1] = tl
            if need_smooth:
                stat_smem[wg, 2] = ss
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stat_smem.at[wg, 0], lse_out.at[sp, out_rows])
            plgpu.copy_smem_to_gmem(stat_smem.at[wg, 1], tl_out.at[sp, out_rows])
            if need_smooth:
                plgpu.copy_smem_to_gmem(stat_smem.at[wg, 2], ss_out.at[sp, out_rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == _NUM_COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(_MEMORY_REGS, action="decrease")
            _memory_loop(x_ref, w_ref, x_smem, w_smem, produced, consumed, row0, vb0, num_vb,
                         k_iters=k_iters, stages=stages, block_rows=block_rows, block_v=block_v)

    def entry(x_ref, w_ref, t_ref, lse_out, tl_out, ss_out):
        scratch = _scratch(x.dtype, block_rows, block_v, stages)
        pl.run_scoped(
            lambda x_smem, w_smem, produced, consumed, stat_smem, t_smem, t_bar, go_bar: kernel(
                x_ref, w_ref, t_ref, lse_out, tl_out, ss_out, x_smem, w_smem, produced, consumed, stat_smem, t_smem, t_bar, go_bar),
            scratch["x_smem"], scratch["w_smem"], scratch["produced"], scratch["consumed"],
            plgpu.SMEM((_NUM_COMPUTE_WGS, 3, block_n), jnp.float32),
            plgpu.SMEM((_NUM_COMPUTE_WGS, block_n), jnp.int32),
            plgpu.Barrier(num_barriers=_NUM_COMPUTE_WGS),
            plgpu.Barrier(num_barriers=1),
            collective_axes="wg",
        )

    part = jax.ShapeDtypeStruct((splits, n_pad), jnp.float32)
    lse_p, tl_p, ss_p = plgpu.kernel(
        entry,
        out_type=(part, part, part),
        grid=(num_nb, splits),
        grid_names=("n", "s"),
        num_threads=_NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_params(),
    )(x, w, tgt)
    n = target.shape[0]
    return lse_p[:, :n], tl_p[:, :n], ss_p[:, :n]


def forward(x2d, w, bias, target, *, softcap=None, need_smooth=False, budget=None, config: FwdConfig | None = None):
    """(lse, target_logit, smooth_sum|None), each (N,) float32; see the package docstring."""
    _check(x2d, w, bias)
    n, h = x2d.shape
    cfg = config or _default_config(n, w.shape[0], h)
    lse_p, tl_p, ss_p = _forward_partials(_pad_rows8(x2d), w, target, softcap=softcap, need_smooth=need_smooth, cfg=cfg)
    lse = merge_lse_splits(lse_p)
    tl = tl_p.sum(axis=0)
    ss = ss_p.sum(axis=0) if need_smooth else None
    return lse, tl, ss


# ---------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------


def _row_inputs(target, lse, coef, n_pad):
    """Per-row inputs of the dz kernel, padded to whole row blocks: [lse log2(e), A, B, C]
    (f32) and the target (int32). Built once per backward, shared by every chunk."""
    n = target.shape[0]
    rowdat = jnp.concatenate([lse[None].astype(jnp.float32) * LOG2E, coef.astype(jnp.float32)], axis=0)
    return (jnp.pad(rowdat, ((0, 0), (0, n_pad - n))),
            jnp.pad(target.astype(jnp.int32), (0, n_pad - n)))


def _rows_padded(n, cfg):
    block_rows = _NUM_COMPUTE_WGS * cfg.block_n
    return pl.cdiv(n, block_rows) * block_rows


def dz_chunk(x, w, target, lse, coef, *, c0, chunk: int, softcap=None, cfg: FwdConfig | None = None):
    """d(logits) for columns [c0, c0 + chunk) of all N rows: (N, chunk) in x.dtype.

    Columns >= V are zero. ``chunk`` and ``c0`` must be multiples of ``cfg.block_v``;
    ``c0`` may be a traced int32 scalar (one compiled kernel serves every chunk).
    N must be a multiple of 8 (``_pad_rows8``).
    """
    n, h = x.shape
    cfg = cfg or _default_config(n, w.shape[0], h)
    if isinstance(c0, int) and c0 % cfg.block_v:
        raise ValueError(f"offset {c0} must be a multiple of block_v={cfg.block_v}")
    rowdat, tgt = _row_inputs(target, lse, coef, _rows_padded(n, cfg))
    cblock = (jnp.asarray(c0, jnp.int32) // cfg.block_v).reshape(1)
    return _dz_call(x, w, rowdat, tgt, cblock, chunk=chunk, softcap=softcap, cfg=cfg)


def _dz_call(x, w, rowdat, tgt, cblock, *, chunk: int, softcap, cfg: FwdConfig):
    n, h = x.shape
    v = w.shape[0]
    block_n, block_v, stages = cfg.block_n, cfg.block_v, cfg.stages
    if chunk % block_v:
        raise ValueError(f"chunk {chunk} must be a multiple of block_v={block_v}")
    block_rows = _NUM_COMPUTE_WGS * block_n
    k_iters = h // BLOCK_K
    num_nb = pl.cdiv(n, block_rows)
    num_cb = chunk // block_v
    dtype = x.dtype
    stages = _fit_stages(stages, k_iters, dtype, block_rows, block_v,
                         extra=_NUM_COMPUTE_WGS * block_n * (block_v * jnp.dtype(dtype).itemsize + 20))
    out_transforms = _smem_transforms(dtype)

    def kernel(c_ref, x_ref, w_ref, r_ref, t_ref, dz_ref, x_smem, w_smem, produced, consumed, r_smem, t_smem, bar, o_smem):
        nb = lax.axis_index("n")
        cb = lax.axis_index("c")
        wg = lax.axis_index("wg")
        row0 = nb * block_rows
        vb = c_ref[0] + cb  # vocab tile of this CTA (the chunk offset is a kernel input)

        @pl.when(wg < _NUM_COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(_COMPUTE_REGS, action="increase")
            rows = pl.ds(row0 + wg * block_n, block_n)
            for i in range(4):
                plgpu.copy_gmem_to_smem(r_ref.at[i, rows], r_smem.at[wg, i], bar.at[wg])
            plgpu.copy_gmem_to_smem(t_ref.at[rows], t_smem.at[wg], bar.at[wg])
            # The row inputs arrive while the main loop runs; waited for after it.
            z = _tile_logits(x_smem, w_smem, produced, consumed, wg, 0,
                             k_iters=k_iters, stages=stages, block_n=block_n, block_v=block_v)
            plgpu.barrier_wait(bar.at[wg])
            red = plgpu.Layout.WGMMA.reduce(1)
            lse_r = plgpu.load(r_smem.at[wg, 0], layout=red)
            a_r = plgpu.load(r_smem.at[wg, 1], layout=red)
            b_r = plgpu.load(r_smem.at[wg, 2], layout=red)
            c_r = plgpu.load(r_smem.at[wg, 3], layout=red)
            t_r = plgpu.load(t_smem.at[wg], layout=red)
            z = _softcapped(z, softcap)
            shape = (block_n, block_v)
            bc = lambda r: lax.broadcast_in_dim(r, shape, [0])
            cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
            valid = cols < (v - vb * block_v)
            p = jnp.exp2(z * LOG2E - bc(lse_r))  # lse_r holds lse * log2(e)
            dz = p * bc(a_r) - jnp.where(cols == bc(t_r - vb * block_v), bc(b_r), 0.0) - bc(c_r)
            if softcap is not None:
                zs = z * (1.0 / softcap)
                dz = dz * (1.0 - zs * zs)
            dz = jnp.where(valid, dz, 0.0)
            o_smem[wg] = dz.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[wg], dz_ref.at[rows, pl.ds(cb * block_v, block_v)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == _NUM_COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(_MEMORY_REGS, action="decrease")
            _memory_loop(x_ref, w_ref, x_smem, w_smem, produced, consumed, row0, vb, 1,
                         k_iters=k_iters, stages=stages, block_rows=block_rows, block_v=block_v)

    def entry(c_ref, x_ref, w_ref, r_ref, t_ref, dz_ref):
        s = _scratch(dtype, block_rows, block_v, stages)
        pl.run_scoped(
            lambda *refs: kernel(c_ref, x_ref, w_ref, r_ref, t_ref, dz_ref, *refs),
            s["x_smem"], s["w_smem"], s["produced"], s["consumed"],
            plgpu.SMEM((_NUM_COMPUTE_WGS, 4, block_n), jnp.float32),
            plgpu.SMEM((_NUM_COMPUTE_WGS, block_n), jnp.int32),
            plgpu.Barrier(num_arrivals=5, num_barriers=_NUM_COMPUTE_WGS),
            plgpu.SMEM((_NUM_COMPUTE_WGS, block_n, block_v), dtype, transforms=out_transforms),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((n, chunk), dtype),
        grid=(num_nb, num_cb),
        grid_names=("n", "c"),
        num_threads=_NUM_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_params(),
    )(cblock, x, w, rowdat, tgt)


def _chunk_columns(n: int, v: int, h: int, itemsize: int, budget, block_v: int) -> int:
    """Columns of one backward chunk, from the budget. Temporaries of the backward
    (bytes; dW and dx themselves are outputs, written in place chunk by chunk):
        4 n h                 the fp32 dx accumulator (fixed)
        itemsize n C          the dz chunk
        itemsize C h          the W slice the dx GEMM reads
        itemsize C h          the dW chunk before its in-place update into dW
    so C = (budget - 4 n h) / (itemsize (n + 2 h)), at least a quarter of the budget
    for the chunk terms and at least one tile of columns."""
    budget = 256 * 2**20 if budget is None else int(budget)
    avail = max(budget - 4 * n * h, budget // 4)
    c = avail // max(1, itemsize * (n + 2 * h))
    c = max(block_v, c // block_v * block_v)
    return min(c, pl.cdiv(v, block_v) * block_v)


def backward(x2d, w, bias, target, lse, coef, *, softcap=None, budget=None, config: FwdConfig | None = None):
    """(dx, dw, None): d(logits) chunks from ``dz_chunk`` feeding XLA GEMMs."""
    _check(x2d, w, bias)
    n, h = x2d.shape
    v = w.shape[0]
    cfg = config or _default_config(n, v, h)
    chunk = _chunk_columns(n, v, h, jnp.dtype(x2d.dtype).itemsize, budget, cfg.block_v)
    # Padded token rows (x = 0, coef = 0) get dz = 0, so they add nothing to dW.
    x8 = _pad_rows8(x2d)
    n8 = x8.shape[0]
    if n8 != n:
        target = jnp.pad(target, (0, n8 - n))
        lse = jnp.pad(lse, (0, n8 - n))
        coef = jnp.pad(coef, ((0, 0), (0, n8 - n)))
    rowdat, tgt = _row_inputs(target, lse, coef, _rows_padded(n8, cfg))
    bv = cfg.block_v
    # Prefer a chunk that divides the vocabulary (in column tiles): then the dW chunks
    # stack into dW with a free reshape instead of a concatenation (a copy of dW).
    nblk = pl.cdiv(v, bv)
    cb = chunk // bv
    for d in range(cb, max(1, cb // 2) - 1, -1):
        if nblk % d == 0:
            cb = d
            break
    chunk = cb * bv
    nfull = v // chunk
    rem = v - nfull * chunk

    def one_chunk(dx, dw, c0, width, cw):
        # The offset is an input of the kernel, so one compiled kernel serves every chunk.
        cblock = jnp.reshape(c0 // bv, (1,)).astype(jnp.int32)
        dz = _dz_call(x8, w, rowdat, tgt, cblock, chunk=width, softcap=softcap, cfg=cfg)
        if cw != width:
            dz = dz[:, :cw]
        w_c = lax.dynamic_slice_in_dim(w, c0, cw, axis=0)
        dx = dx + jnp.dot(dz, w_c, preferred_element_type=jnp.float32)
        # One GEMM with fp32 accumulation writes the chunk in w.dtype (no fp32 dW chunk);
        # the update is in place in the loop's carry: no stacking, no concatenation.
        dw_c = lax.dot_general(dz, x8, (((0,), (0,)), ((), ())), preferred_element_type=w.dtype)
        return dx, lax.dynamic_update_slice_in_dim(dw, dw_c, c0, axis=0)

    dx = jnp.zeros((n8, h), jnp.float32)
    dw = jnp.zeros(w.shape, w.dtype)
    # Inside shard_map (check_vma): the carries vary over the axes the inputs vary over.
    axes = tuple(sorted(varying(x8) | varying(w) | varying(rowdat) | varying(tgt)))
    dx, dw = to_varying(dx, axes), to_varying(dw, axes)
    if nfull == 1:
        dx, dw = one_chunk(dx, dw, jnp.int32(0), chunk, chunk)
    elif nfull:
        # A loop (not unrolled): one Mosaic kernel to compile however many chunks.
        dx, dw = lax.fori_loop(0, nfull, lambda i, c: one_chunk(*c, i * chunk, chunk, chunk), (dx, dw))
    if rem:
        dx, dw = one_chunk(dx, dw, jnp.int32(nfull * chunk), pl.cdiv(rem, bv) * bv, rem)
    return dx[:n].astype(x2d.dtype), dw, None
