"""linear_jsd on the "mosaic_gpu" kind: refused. Its kernels (``mosaic_lib``) compute one
head's logits tile per step and fold it; the divergence's terms and gradient need the
student's and the teacher's tiles of the same columns at once (a main loop over two
operand pairs). The automatic choice passes over it (``unsupported``); naming it raises
ValueError with the reason."""

from __future__ import annotations

from typing import Optional

from logitless.jax.ops.common.mosaic_gpu import MosaicGpuBase

WHY = ("linear_jsd has no Mosaic GPU kernel (it needs the student's and the teacher's logits tiles at once); "
       "use implementation=None, 'triton' or 'xla'")


class MosaicGpuBackend(MosaicGpuBase):
    """Refuses every case (module docstring)."""

    def why_not(self, x2d_shape, w_shape, dtype, *, softcap, has_bias) -> Optional[str]:
        return WHY

    def forward(self, *args, **kwargs):
        raise ValueError(WHY)

    def backward(self, *args, **kwargs):
        raise ValueError(WHY)
