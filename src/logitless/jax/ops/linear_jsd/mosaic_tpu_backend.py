"""linear_jsd on the "mosaic_tpu" kind: refused. Its kernels (``mosaic_tpu_lib``) hold one
head's (row block x vocabulary tile) of logits; the divergence's terms and gradient need
the student's and the teacher's tiles at once. The automatic choice passes over it
(``unsupported``: a TPU runs "xla"); naming it raises ValueError with the reason."""

from __future__ import annotations

from logitless.jax.ops.common.contract import Refused
from logitless.jax.ops.common.mosaic_tpu import MosaicTpuBase


class MosaicTpuBackend(Refused, MosaicTpuBase):
    """Refuses every case (module docstring)."""

    why = ("linear_jsd has no Mosaic TPU kernel (it needs the student's and the teacher's logits tiles at once); "
           "use implementation=None or 'xla'")
