"""Shared Pallas TPU (Mosaic TPU) machinery of the JAX ops' "mosaic_tpu" backends: three
kernel shapes over a grid of (row block, vocabulary tile) with full-H blocks.

``stats_call`` (forward): grid (row blocks "parallel", vocab tiles "arbitrary"). Per
    step: z = x_i @ W_j^T (+ b_j) on the MXU, fp32 (bn, bv); the op's ``fold`` updates
    per-row statistics held in VMEM scratch (bn, 1) fp32 accumulators across the vocab
    axis (online log-sum-exp); on the last vocab tile the op's ``finish`` writes (bn, 1)
    outputs. HBM: x read once, W read once per row block, O(N) outputs.

``dx_call`` (backward, dX): grid (row blocks "parallel", vocab tiles "arbitrary"):
    recompute z, dz = the op's ``epilogue`` (per-row fp32 inputs ``rowdat`` (N, R) and
    the target), dx_i += dz @ W_j into a (bn, H) fp32 VMEM accumulator, cast once.

``dw_call`` (backward, dW and db): grid (vocab tiles "parallel", row blocks
    "arbitrary"): recompute z and dz, dW_j += dz^T @ x_i into a (bv, H) fp32 VMEM
    accumulator (and db_j += sum_rows dz), cast once.

Ragged edges are masked in the kernel, never padded in HBM: the last row block and
the last vocab tile may run past N and V (Pallas reads undefined values there, NaN in
interpret mode); columns >= V are -inf in the statistics and 0 in dz, the rows of W
past V and of x past N are zeroed before the gradient GEMMs (undefined * 0 could be
NaN); writes past the array are dropped. H is never tiled (a block holds whole rows),
so it needs no alignment.

Weight layouts: "vh" (V, H) blocks (bv, H); "hv" (H, V) blocks (H, bv): the GEMMs
contract the matching axes, no transposed copy.

On a platform other than TPU the kernels run in Pallas' TPU interpret mode
(``pltpu.InterpretParams``) on the CPU: slow, for tests only (``INTERPRET`` overrides
the choice). Inside ``jax.shard_map`` with check_vma the outputs are typed as varying
over the inputs' manual axes. Not measured on a TPU: designed, interpreted and lowered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.tpu as pltpu
import jax.numpy as jnp
from jax import lax

from logitless.jax.sharding import typed_like

_F32 = jnp.float32
#: bf16 and f32 (TPUs have no fast f16: f16 inputs take the "xla" backend).
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
#: VMEM the kernels ask for (``vmem_limit_bytes``) and size their tiles to: below the
#: 64 MiB of a v7x TensorCore and the 128 MiB of v5e/v6e, with room for Mosaic's scratch.
VMEM_LIMIT = 48 * 1024 * 1024
#: Tile sizes tried, largest first (MXU-friendly multiples of 128 / 8).
ROW_BLOCKS = (512, 256, 128, 64, 32, 16, 8)
VOCAB_TILES = (1024, 512, 256, 128)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Row block (bn) and vocabulary tile (bv) of the three kernels."""

    bn: int
    bv: int


#: None: TPU interpret mode exactly when jax's default backend is not a TPU; True/False
#: force it (tests set False to lower the real kernels for TPU on a CPU-only machine).
INTERPRET: bool | None = None


def interpret_params():
    """TPU interpret mode (``pltpu.InterpretParams``) unless jax runs on a TPU."""
    interpret = jax.default_backend() != "tpu" if INTERPRET is None else INTERPRET
    return pltpu.InterpretParams() if interpret else None


def vmem_bytes(bn: int, bv: int, h: int, itemsize: int) -> int:
    """VMEM of the largest of the three kernels by design (the dX kernel, or dW's when
    bv > bn), double-buffered inputs and outputs included:
        x block 2 * bn * H * s, W block 2 * bv * H * s, fp32 accumulator max(bn, bv) * H * 4,
        its output block 2 * max(bn, bv) * H * s, logits/dz tile temporaries 4 * bn * bv * 4
    (s = the input itemsize)."""
    big = max(bn, bv)
    return (2 * bn * h * itemsize + 2 * bv * h * itemsize + big * h * 4 + 2 * big * h * itemsize
            + 16 * bn * bv)


def choose_tiles(n: int, v: int, h: int, itemsize: int, budget: int | None) -> Tiles:
    """The (bn, bv) of most logits per step whose ``vmem_bytes`` fits min(budget,
    VMEM_LIMIT), taller row blocks first on ties (each row block streams W once; bn
    is a multiple of 8 or all of N, bv a multiple of 128 or all of V); (8, 128) when
    nothing fits."""
    cap = VMEM_LIMIT if budget is None else min(int(budget), VMEM_LIMIT)
    best = None
    for bn0 in ROW_BLOCKS:
        for bv0 in VOCAB_TILES:
            bn, bv = (n if n <= bn0 else bn0), (v if v <= bv0 else bv0)
            if vmem_bytes(bn, bv, h, itemsize) > cap:
                continue
            key = (bn * bv, bn)
            if best is None or key > best[0]:
                best = (key, Tiles(bn=bn, bv=bv))
    return best[1] if best else Tiles(bn=n if n <= 8 else 8, bv=v if v <= 128 else 128)


@dataclasses.dataclass(frozen=True)
class MosaicTpuConfig:
    """The "mosaic_tpu" backends' Config (both ops): the kernels' tiles (``choose_tiles``)
    and the weight's layout."""

    tiles: Tiles
    weight_layout: str = "vh"


def plan_config(x2d_shape, w_shape, dtype, budget, weight_layout: str = "vh") -> MosaicTpuConfig:
    """The backends' ``plan``: x2d (N, H), ``w_shape`` (V, H), from the budget."""
    n, h = x2d_shape
    return MosaicTpuConfig(choose_tiles(n, w_shape[0], h, jnp.dtype(dtype).itemsize, budget), weight_layout)


def _z_dims(layout):
    # z = x @ w^T: w tile (bv, H) "vh" or (H, bv) "hv".
    return (((1,), (1,)), ((), ())) if layout == "vh" else (((1,), (0,)), ((), ()))


def _w_spec(layout, bv, h, index):
    """BlockSpec of W: ``index(i, j) -> vocab tile``."""
    if layout == "vh":
        return pl.BlockSpec((bv, h), lambda *g: (index(*g), 0))
    return pl.BlockSpec((h, bv), lambda *g: (0, index(*g)))


def _vec_spec(bv, index):
    """BlockSpec of a (1, V) row (bias, class weights)."""
    return pl.BlockSpec((1, bv), lambda *g: (0, index(*g)))


def _logits(x, w, b, layout):
    z = lax.dot_general(x, w, _z_dims(layout), preferred_element_type=_F32)
    if b is not None:
        z = z + b.astype(_F32)
    return z


def _compiler_params(semantics):
    # The interpreter (jax 0.11) does not extend dimension_semantics by the grid axis
    # that jax.vmap of a pallas_call adds (Mosaic's lowering does): there, leave every
    # axis "arbitrary" (sequential; the same results).
    if interpret_params() is not None:
        semantics = None
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=VMEM_LIMIT)


def _row_spec(bn, width, row_index):
    return pl.BlockSpec((bn, width), lambda *g: (row_index(*g), 0))


def _optional_inputs(bias, cw, bv, col_index):
    """(arrays, specs) of the optional (1, V) inputs, in the order bias, class weights."""
    arrays, specs = [], []
    for a in (bias, cw):
        if a is not None:
            arrays.append(a.reshape(1, -1))
            specs.append(_vec_spec(bv, col_index))
    return arrays, specs


def _unpack(refs, has_bias, has_cw):
    refs = list(refs)
    b = refs.pop(0) if has_bias else None
    c = refs.pop(0) if has_cw else None
    return b, c, refs


def _tile_context(i, j, bn, bv, n, v, target_ref):
    """Column ids (1, bv), target hit mask (bn, bv), valid-column mask or None."""
    cols = j * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
    hit = cols == target_ref[...]
    valid = (cols < v) if v % bv else None
    return cols, hit, valid


def stats_call(x, w, bias, cw, target, *, layout: str, tiles: Tiles, n_stats: int, init: tuple,
               fold: Callable, finish: Callable, n_out: int):
    """Per-row fp32 statistics over all V columns: ``n_out`` arrays (N,).

    ``fold(z, hit, valid, cw_tile, stats) -> stats``: z (bn, bv) fp32 logits (bias
    added), hit the target mask, valid None or the (1, bv) mask of columns < V,
    cw_tile (1, bv) fp32 or None, stats a tuple of ``n_stats`` (bn, 1) fp32 values.
    ``finish(stats) -> n_out`` (bn, 1) values. ``init``: the stats' initial floats.
    """
    n, h = x.shape
    v = w.shape[0] if layout == "vh" else w.shape[1]
    bn, bv = tiles.bn, tiles.bv
    grid = (pl.cdiv(n, bn), pl.cdiv(v, bv))
    has_b, has_c = bias is not None, cw is not None
    (x, w, target, bias, cw), struct = typed_like(x, w, target, bias, cw)
    opt, opt_specs = _optional_inputs(bias, cw, bv, lambda i, j: j)

    def kernel(x_ref, w_ref, t_ref, *refs):
        b_ref, c_ref, refs = _unpack(refs, has_b, has_c)
        outs, scratch = refs[:n_out], refs[n_out:]
        i, j = pl.program_id(0), pl.program_id(1)

        @pl.when(j == 0)
        def _():
            for s, val in zip(scratch, init):
                s[...] = jnp.full(s.shape, val, _F32)

        z = _logits(x_ref[...], w_ref[...], None if b_ref is None else b_ref[...], layout)
        _, hit, valid = _tile_context(i, j, bn, bv, n, v, t_ref)
        cwt = None if c_ref is None else c_ref[...].astype(_F32)
        if valid is not None and cwt is not None:
            cwt = jnp.where(valid, cwt, 0.0)
        new = fold(z, hit, valid, cwt, tuple(s[...] for s in scratch))
        for s, val in zip(scratch, new):
            s[...] = val

        @pl.when(j == pl.num_programs(1) - 1)
        def _():
            for o, val in zip(outs, finish(tuple(s[...] for s in scratch))):
                o[...] = val

    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((bn, h), lambda i, j: (i, 0)), _w_spec(layout, bv, h, lambda i, j: j),
                  _row_spec(bn, 1, lambda i, j: i)] + opt_specs,
        out_specs=[_row_spec(bn, 1, lambda i, j: i)] * n_out,
        out_shape=[struct((n, 1), _F32)] * n_out,
        scratch_shapes=[pltpu.VMEM((bn, 1), _F32)] * n_stats,
        compiler_params=_compiler_params(("parallel", "arbitrary")),
        interpret=interpret_params(),
    )(x, w, target.reshape(n, 1).astype(jnp.int32), *opt)
    return tuple(o[:, 0] for o in out)


def _dz_tile(x_ref, w_ref, b_ref, c_ref, t_ref, r_ref, i, j, *, bn, bv, n, v, layout, epilogue,
             mask_rows):
    z = _logits(x_ref[...], w_ref[...], None if b_ref is None else b_ref[...], layout)
    _, hit, valid = _tile_context(i, j, bn, bv, n, v, t_ref)
    cwt = None if c_ref is None else c_ref[...].astype(_F32)
    rows = r_ref[...]
    dz = epilogue(z, hit, tuple(rows[:, k:k + 1] for k in range(rows.shape[1])), cwt)
    if valid is not None:
        dz = jnp.where(valid, dz, 0.0)
    if mask_rows and n % bn:
        row_ok = i * bn + lax.broadcasted_iota(jnp.int32, (bn, 1), 0) < n
        dz = jnp.where(row_ok, dz, 0.0)
    return dz


def _backward_operands(x, w, bias, cw, target, rowdat, layout: str, tiles: Tiles, col_index: Callable):
    """What dx_call and dw_call start from: the sizes (n, h, v, bn, bv), whether bias and
    class weights are given, the number R of rowdat's columns, the operands typed by
    ``typed_like`` (x, w, target, rowdat, bias, cw), its ``struct``, and the optional
    inputs with their specs (``col_index``: the grid indices to the vocabulary tile)."""
    sizes = (*x.shape, w.shape[0] if layout == "vh" else w.shape[1], tiles.bn, tiles.bv)
    flags = (bias is not None, cw is not None, rowdat.shape[1])
    arrays, struct = typed_like(x, w, target, rowdat, bias, cw)
    return sizes, flags, arrays, struct, _optional_inputs(arrays[4], arrays[5], tiles.bv, col_index)


def dx_call(x, w, bias, cw, target, rowdat, *, layout: str, tiles: Tiles, epilogue: Callable):
    """dx = dz @ W (N, H) in x.dtype; ``epilogue(z, hit, rows, cw_tile) -> dz`` (fp32,
    (bn, bv)), rows: tuple of the (bn, 1) columns of ``rowdat`` (N, R) fp32."""
    (n, h, v, bn, bv), (has_b, has_c, r), (x, w, target, rowdat, bias, cw), struct, (opt, opt_specs) = \
        _backward_operands(x, w, bias, cw, target, rowdat, layout, tiles, lambda i, j: j)
    grid = (pl.cdiv(n, bn), pl.cdiv(v, bv))

    def kernel(x_ref, w_ref, t_ref, r_ref, *refs):
        b_ref, c_ref, (dx_ref, acc) = _unpack(refs, has_b, has_c)
        i, j = pl.program_id(0), pl.program_id(1)

        @pl.when(j == 0)
        def _():
            acc[...] = jnp.zeros(acc.shape, _F32)

        dz = _dz_tile(x_ref, w_ref, b_ref, c_ref, t_ref, r_ref, i, j, bn=bn, bv=bv, n=n, v=v,
                      layout=layout, epilogue=epilogue, mask_rows=False)
        wt = w_ref[...]
        if v % bv:  # rows of W past V hold undefined values: zero them (0 * NaN = NaN)
            if layout == "vh":
                ok = j * bv + lax.broadcasted_iota(jnp.int32, (bv, 1), 0) < v
            else:
                ok = j * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1) < v
            wt = jnp.where(ok, wt, jnp.zeros_like(wt))
        dims = (((1,), (0,)), ((), ())) if layout == "vh" else (((1,), (1,)), ((), ()))
        acc[...] += lax.dot_general(dz.astype(x_ref.dtype), wt, dims, preferred_element_type=_F32)

        @pl.when(j == pl.num_programs(1) - 1)
        def _():
            dx_ref[...] = acc[...].astype(dx_ref.dtype)

    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((bn, h), lambda i, j: (i, 0)), _w_spec(layout, bv, h, lambda i, j: j),
                  _row_spec(bn, 1, lambda i, j: i), _row_spec(bn, r, lambda i, j: i)] + opt_specs,
        out_specs=pl.BlockSpec((bn, h), lambda i, j: (i, 0)),
        out_shape=struct((n, h), x.dtype),
        scratch_shapes=[pltpu.VMEM((bn, h), _F32)],
        compiler_params=_compiler_params(("parallel", "arbitrary")),
        interpret=interpret_params(),
    )(x, w, target.reshape(n, 1).astype(jnp.int32), rowdat, *opt)


def dw_call(x, w, bias, cw, target, rowdat, *, layout: str, tiles: Tiles, epilogue: Callable):
    """(dw in w's layout and dtype, db (V,) in bias.dtype or None): dW_j = dz^T @ x,
    db_j = sum over rows of dz; grid (vocab tiles, row blocks)."""
    (n, h, v, bn, bv), (has_b, has_c, r), (x, w, target, rowdat, bias, cw), struct, (opt, opt_specs) = \
        _backward_operands(x, w, bias, cw, target, rowdat, layout, tiles, lambda j, i: j)
    grid = (pl.cdiv(v, bv), pl.cdiv(n, bn))

    def kernel(x_ref, w_ref, t_ref, r_ref, *refs):
        b_ref, c_ref, refs = _unpack(refs, has_b, has_c)
        if has_b:
            dw_ref, db_ref, acc, bacc = refs
        else:
            (dw_ref, acc), db_ref, bacc = refs, None, None
        j, i = pl.program_id(0), pl.program_id(1)

        @pl.when(i == 0)
        def _():
            acc[...] = jnp.zeros(acc.shape, _F32)
            if bacc is not None:
                bacc[...] = jnp.zeros(bacc.shape, _F32)

        dz = _dz_tile(x_ref, w_ref, b_ref, c_ref, t_ref, r_ref, i, j, bn=bn, bv=bv, n=n, v=v,
                      layout=layout, epilogue=epilogue, mask_rows=True)
        xt = x_ref[...]
        if n % bn:  # rows of x past N hold undefined values
            ok = i * bn + lax.broadcasted_iota(jnp.int32, (bn, 1), 0) < n
            xt = jnp.where(ok, xt, jnp.zeros_like(xt))
        dzl = dz.astype(x_ref.dtype)
        if layout == "vh":
            acc[...] += lax.dot_general(dzl, xt, (((0,), (0,)), ((), ())), preferred_element_type=_F32)
        else:
            acc[...] += lax.dot_general(xt, dzl, (((0,), (0,)), ((), ())), preferred_element_type=_F32)
        if bacc is not None:
            bacc[...] += jnp.sum(dz, axis=0, keepdims=True)

        @pl.when(i == pl.num_programs(1) - 1)
        def _():
            dw_ref[...] = acc[...].astype(dw_ref.dtype)
            if db_ref is not None:
                db_ref[...] = bacc[...].astype(db_ref.dtype)

    acc_shape = (bv, h) if layout == "vh" else (h, bv)
    out_specs = [_w_spec(layout, bv, h, lambda j, i: j)]
    out_shape = [struct(w.shape, w.dtype)]
    scratch = [pltpu.VMEM(acc_shape, _F32)]
    if has_b:
        out_specs.append(_vec_spec(bv, lambda j, i: j))
        out_shape.append(struct((1, v), bias.dtype))
        scratch.append(pltpu.VMEM((1, bv), _F32))
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((bn, h), lambda j, i: (i, 0)), _w_spec(layout, bv, h, lambda j, i: j),
                  _row_spec(bn, 1, lambda j, i: i), _row_spec(bn, r, lambda j, i: i)] + opt_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=_compiler_params(("parallel", "arbitrary")),
        interpret=interpret_params(),
    )(x, w, target.reshape(n, 1).astype(jnp.int32), rowdat, *opt)
    return out[0], (out[1][0] if has_b else None)


__all__ = ["Tiles", "choose_tiles", "vmem_bytes", "stats_call", "dx_call", "dw_call", "interpret_params",
           "SUPPORTED_DTYPES", "VMEM_LIMIT"]
