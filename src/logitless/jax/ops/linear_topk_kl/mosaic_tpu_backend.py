"""linear_topk_kl on the "mosaic_tpu" kind: refused. Its kernels (``mosaic_tpu_lib``) fuse
the gradient GEMMs with the dz epilogue in VMEM, where the K sparse values at the ids
would need a compare with every id per element; the forward here is XLA's anyway. The
automatic choice passes over it (``unsupported``: a TPU runs "xla"); naming it raises
ValueError with the reason."""

from __future__ import annotations

from logitless.jax.ops.common.contract import Refused
from logitless.jax.ops.common.mosaic_tpu import MosaicTpuBase


class MosaicTpuBackend(Refused, MosaicTpuBase):
    """Refuses every case (module docstring)."""

    why = "linear_topk_kl has no Mosaic TPU kernel; use implementation=None or 'xla'"
