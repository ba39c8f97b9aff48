"""linear_jsd on the "mosaic_tpu" kind: refused. Its kernels (``mosaic_tpu_lib``) hold one
head's (row block x vocabulary tile) of logits; the divergence's terms and gradient need
the student's and the teacher's tiles at once. The automatic choice passes over it
(``unsupported``: a TPU runs "xla"); naming it raises ValueError with the reason."""

from __future__ import annotations

from typing import Optional

from logitless.jax.ops.common.mosaic_tpu import MosaicTpuBase

WHY = ("linear_jsd has no Mosaic TPU kernel (it needs the student's and the teacher's logits tiles at once); "
       "use implementation=None or 'xla'")


class MosaicTpuBackend(MosaicTpuBase):
    """Refuses every case (module docstring)."""

    def why_not(self, x2d_shape, w_shape, dtype, *, softcap, has_bias) -> Optional[str]:
        return WHY

    def forward(self, *args, **kwargs):
        raise ValueError(WHY)

    def backward(self, *args, **kwargs):
        raise ValueError(WHY)
