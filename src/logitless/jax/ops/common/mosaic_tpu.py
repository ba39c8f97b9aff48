"""The "mosaic_tpu" backend kind: Pallas Mosaic TPU kernels on ``logitless.jax.mosaic_tpu_lib``
(TPU interpret mode elsewhere). The base of every op's ``MosaicTpuBackend`` (imported only
by those: it imports Pallas' TPU); its Config is ``mosaic_tpu_lib.MosaicTpuConfig``."""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from logitless.jax import mosaic_tpu_lib as tl
from logitless.jax.mosaic_tpu_lib import MosaicTpuConfig
from logitless.jax.ops.common.contract import BackendBase

UNSUPPORTED_HINT = "mosaic_tpu takes bf16/f32 inputs; use implementation='xla'"


def is_supported(x2d_shape, w_shape, dtype) -> bool:
    """bf16/f32, 2-D, matching H, at least one token and one class (``w_shape`` (V, H))."""
    return (jnp.dtype(dtype) in tl.SUPPORTED_DTYPES and len(x2d_shape) == 2 and len(w_shape) == 2
            and x2d_shape[1] == w_shape[1] and x2d_shape[0] >= 1 and w_shape[0] >= 1)


class MosaicTpuBase(BackendBase):
    """The "mosaic_tpu" kind: ``is_supported``'s cases, not partitioned under the
    interpreter, plans the kernels' tiles (``mosaic_tpu_lib.plan_config``)."""

    name = "mosaic_tpu"

    def why_not(self, x2d_shape, w_shape, dtype, *, softcap, has_bias) -> Optional[str]:
        return None if is_supported(x2d_shape, w_shape, dtype) else UNSUPPORTED_HINT

    def can_partition(self) -> bool:
        """Not under the interpreter (its io_callbacks cannot be partitioned)."""
        return tl.interpret_params() is None

    def plan(self, x2d_shape, w_shape, dtype, *, budget: int, weight_layout: str = "vh",
             has_bias: bool = False) -> MosaicTpuConfig:
        return tl.plan_config(x2d_shape, w_shape, dtype, budget, weight_layout)
