"""linear_jsd on the "mosaic_gpu" kind: refused. Its kernels (``mosaic_lib``) compute one
head's logits tile per step and fold it; the divergence's terms and gradient need the
student's and the teacher's tiles of the same columns at once (a main loop over two
operand pairs). The automatic choice passes over it (``unsupported``); naming it raises
ValueError with the reason."""

from __future__ import annotations

from logitless.jax.ops.common.contract import Refused
from logitless.jax.ops.common.mosaic_gpu import MosaicGpuBase


class MosaicGpuBackend(Refused, MosaicGpuBase):
    """Refuses every case (module docstring)."""

    why = ("linear_jsd has no Mosaic GPU kernel (it needs the student's and the teacher's logits tiles at once); "
           "use implementation=None, 'triton' or 'xla'")
