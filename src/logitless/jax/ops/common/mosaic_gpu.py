"""The "mosaic_gpu" backend kind: Pallas Mosaic GPU kernels on ``logitless.jax.mosaic_lib``
(SM90; Mosaic GPU's interpret mode without a GPU). Its Config, its interpret switch and the
base of every op's ``MosaicGpuBackend`` (imported only by those: it imports Pallas'
Mosaic GPU)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax import mosaic_lib as ml
from logitless.jax.formulas.cross_entropy import dlogits_kept, dlogits_of_scaled, kept_scale, per_column
from logitless.jax.mosaic_lib import BLOCK_K, FwdConfig
from logitless.jax.ops.common.contract import BackendBase
from logitless.jax.sharding import typed_like

#: None: Mosaic GPU's interpret mode exactly when jax's default backend is not a GPU;
#: True/False force it (tests set False to lower for CUDA on a CPU-only machine).
INTERPRET: bool | None = None


def interpret_params():
    """Interpret mode when there is no GPU (CPU tests; ``INTERPRET`` forces it); None on a GPU."""
    return ml.interpret_params(INTERPRET)


def why_unsupported(x2d_shape, w_shape, dtype) -> Optional[str]:
    """What every Mosaic GPU kernel here needs, or None: bf16/f16, 2-D, matching H
    (``w_shape`` (V, H)); an op whose kernels need more says so in its ``why_not``."""
    if jnp.dtype(dtype) not in ml.SUPPORTED_DTYPES:
        return f"dtype {jnp.dtype(dtype).name}: it takes bfloat16 or float16"
    if len(x2d_shape) != 2 or len(w_shape) != 2:
        return "x and weight must be 2-D"
    if x2d_shape[1] != w_shape[1]:
        return f"x has H={x2d_shape[1]} but weight has H={w_shape[1]}"
    if x2d_shape[1] <= 0 or w_shape[0] < 1:
        return "the hidden size and the vocabulary must not be empty"
    return None


def aligned_shape(h: int, v: int, has_bias: bool, weight_layout: str) -> tuple:
    """(H', columns of W') of the operands the kernels read for x (N, h) and W with v
    classes: as they are when aligned (no bias, h % 64 == 0, v % 8 == 0, an (H, V)
    weight's columns a multiple of 64: ``mosaic_lib.hv_columns``), else padded to that,
    plus one 64-column block for a bias column (linear_log_probs' ``_aligned``)."""
    if not has_bias and h % BLOCK_K == 0 and (v % 8 == 0 if weight_layout == "vh" else ml.hv_columns(v) == v):
        return h, v
    hp = -(-h // BLOCK_K) * BLOCK_K
    if has_bias:
        hp += BLOCK_K if hp == h else 0
    vp = -(-v // 8) * 8 if weight_layout == "vh" else ml.hv_columns(-(-v // 8) * 8)
    return hp, vp


@dataclass(frozen=True)
class MosaicGpuConfig:
    """The "mosaic_gpu" backends' Config: the kernels' tiles (``mosaic_lib.default_config``),
    the backward's columns per chunk (``mosaic_lib.backward_chunk`` for the operands of
    ``aligned_shape``, from the budget), the weight's layout, and, for a backend that
    keeps (linear_cross_entropy's), the columns whose exp(z - m) the forward keeps for the
    backward and the kept chunk (``mosaic_lib.keep_plan``; 0: none, recompute all)."""

    tiles: FwdConfig
    chunk: int
    weight_layout: str = "vh"
    keep: int = 0
    kept_chunk: int = 0


class MosaicGpuBase(BackendBase):
    """The "mosaic_gpu" kind: ``why_unsupported``'s cases (an op narrows them in its
    ``why_not``), not partitioned under the interpreter, plans tiles and the backward's chunk."""

    name = "mosaic_gpu"

    def why_not(self, x2d_shape, w_shape, dtype, *, softcap, has_bias) -> Optional[str]:
        why = why_unsupported(x2d_shape, w_shape, dtype)
        return None if why is None else f"{why}; use implementation='xla'"

    def can_partition(self) -> bool:
        """Not under the interpreter, whose ordered io_callbacks cannot be partitioned
        (the api then runs the unpartitioned program)."""
        return interpret_params() is None

    def plan(self, x2d_shape, w_shape, dtype, *, budget: int, weight_layout: str = "vh",
             has_bias: bool = False) -> MosaicGpuConfig:
        n, h = x2d_shape
        v = w_shape[0]
        tiles = ml.default_config(n, v, h)
        hk, vk = aligned_shape(h, v, has_bias, weight_layout)
        return MosaicGpuConfig(tiles, ml.backward_chunk(n, vk, hk, jnp.dtype(dtype).itemsize, budget, tiles.block_v),
                               weight_layout)


#: Rows per program of the in-place dz kernel (``dz_over_kept``).
_DZ_ROWS = 64


@functools.cache
def _pallas_triton():
    """jax's Pallas Triton backend (``jax.experimental.pallas.triton``), or None where this
    jax has none (jax deprecates it: the dz is then an XLA fusion, which may not reuse K's
    buffer, and the plan counts a second logits-sized buffer)."""
    try:
        from jax.experimental.pallas import triton as pl_triton
    except ImportError:
        return None
    return pl_triton


def dz_in_place() -> bool:
    """Whether ``dz_over_kept`` can write the kept columns' dz over K."""
    return _pallas_triton() is not None


class SecondSoftmax(NamedTuple):
    """A kept dz's second term c exp(p a - lse) over e = exp(a - m) kept (a the scaled
    logit whose exp the forward kept): c e^p exp(p m - lse), ``power`` p static (> 0).
    linear_topk_kl's hard labels at T != 1: a = z / T, p = T, lse = log sum exp(z)."""

    lse: jax.Array  # (rows,) fp32, finite
    coef: jax.Array  # (rows,) fp32
    power: float


def _second_scale(tile_max, second: SecondSoftmax):
    """c exp(p m - lse) per row and tile (rows, tiles) fp32."""
    return kept_scale(tile_max * second.power, second.lse, second.coef[None])


def kept_dz(k_buf, tile_max, lse, coef, target, *, v: int, block_v: int, dtype, second: SecondSoftmax | None = None):
    """dz of every kept column, (rows, columns) of K in ``dtype``: p A - B [c == t] - C
    (+ ``second``'s term) from K = exp(z - m) and M (``mosaic_lib.stats_partials``' kept
    outputs; coef (3, rows) = (A, B, C), all row arrays padded to K's rows). Written over
    K where ``dz_in_place()`` (``dz_over_kept``); else an XLA fusion
    (``formulas.cross_entropy.dlogits_kept``), which may write a second logits-sized
    buffer: the plans count it then (``mosaic_lib.keep_plan``'s ``dz_in_place``)."""
    if dz_in_place():
        return dz_over_kept(k_buf, tile_max, lse, coef, target, v=v, block_v=block_v, second=second)
    dz = dlogits_kept(k_buf, tile_max, lse, coef, target, 0, v)
    if second is not None:
        s2 = per_column(_second_scale(tile_max, second), k_buf.shape[1])
        dz = dz + ml.unit_power(k_buf.astype(jnp.float32), second.power) * s2
    return dz.astype(dtype)


def dz_over_kept(k_buf, tile_max, lse, coef, target, *, v: int, block_v: int, second: SecondSoftmax | None = None):
    """dz = p A - B [c == t] - C (+ ``second``'s term) of every kept column written over
    K = exp(z - m) (``kept_dz``'s arguments; ``input_output_aliases``: no second
    logits-sized buffer, whatever XLA's fusion heuristics would do: at gpt-oss-120b's
    shape XLA's own fusion wrote a new one): one Pallas (Triton) program per ``_DZ_ROWS``
    rows and tile, ``formulas.cross_entropy.dlogits_of_scaled`` of e times the tile's
    ``kept_scale``. (Mosaic GPU's pallas_call, the supported path, has no interpreter for
    windowed blocks to test it on a CPU.) Only where ``dz_in_place()``."""
    import jax.experimental.pallas as pl

    pl_triton = _pallas_triton()

    n_pad, cols = k_buf.shape
    scales = [kept_scale(tile_max, lse, coef)]  # (n_pad, tiles)
    if second is not None:
        scales.append(_second_scale(tile_max, second))
    rows = (coef[1][:, None], coef[2][:, None], target[:, None].astype(jnp.int32))
    # Inside jax.shard_map (check_vma) the output says over which axes it varies: K's.
    n_s = len(scales)
    (k_buf, *rest), struct = typed_like(k_buf, *scales, *rows)
    scales, rows = rest[:n_s], rest[n_s:]

    def kernel(k_ref, *refs):
        s_refs, (b_ref, c_ref, t_ref, o_ref) = refs[:n_s], refs[n_s:]
        idx = pl.program_id(1) * block_v + lax.broadcasted_iota(jnp.int32, (_DZ_ROWS, block_v), 1)
        e = k_ref[...].astype(jnp.float32)
        p_a = e * s_refs[0][...]
        if second is not None:
            p_a = p_a + ml.unit_power(e, second.power) * s_refs[1][...]
        o_ref[...] = dlogits_of_scaled(p_a, b_ref[...], c_ref[...], t_ref[...], idx, v).astype(o_ref.dtype)

    tile = pl.BlockSpec((_DZ_ROWS, block_v), lambda i, j: (i, j))
    row = pl.BlockSpec((_DZ_ROWS, 1), lambda i, j: (i, 0))
    scale = pl.BlockSpec((_DZ_ROWS, 1), lambda i, j: (i, j))
    return pl.pallas_call(
        kernel, out_shape=struct(k_buf.shape, k_buf.dtype), grid=(n_pad // _DZ_ROWS, cols // block_v),
        in_specs=[tile, *[scale] * n_s, row, row, row], out_specs=tile,
        input_output_aliases={0: 0}, compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret_params() is not None,
    )(k_buf, *scales, *rows)
