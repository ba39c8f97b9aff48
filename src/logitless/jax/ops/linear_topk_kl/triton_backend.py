"""linear_topk_kl on the "triton" kind: refused. The PyTorch op's Triton kernels (the id
mask in the GEMM pass, the dense dz and the patch at the ids) are not launched from JAX;
the forward here is XLA's on every backend and the recomputed columns have the Mosaic GPU
kernel on SM90. The automatic choice passes over it (``unsupported``); naming it raises
ValueError with the reason."""

from __future__ import annotations

from logitless.jax.ops.common.contract import Refused
from logitless.jax.ops.common.triton import TritonBase


class TritonBackend(Refused, TritonBase):
    """Refuses every case (module docstring)."""

    why = ("linear_topk_kl has no JAX Triton backend (its Triton kernels are launched from PyTorch only); use "
           "implementation=None, 'mosaic_gpu' (SM90) or 'xla'")
