"""The "mosaic_gpu" backend kind: Pallas Mosaic GPU kernels on ``logitless.jax.mosaic_lib``
(SM90; Mosaic GPU's interpret mode without a GPU). Its Config, its interpret switch and the
base of every op's ``MosaicGpuBackend`` (imported only by those: it imports Pallas'
Mosaic GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax.numpy as jnp

from logitless.jax import mosaic_lib as ml
from logitless.jax.mosaic_lib import BLOCK_K, FwdConfig
from logitless.jax.ops.common.contract import BackendBase

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
