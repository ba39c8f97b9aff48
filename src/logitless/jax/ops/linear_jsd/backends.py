"""The backends of logitless.jax.linear_jsd by name (``BACKENDS``, one table of
``contract.JsdBackend`` classes, each made on first use) and the automatic choice
(``choose_backend``): the JAX ops' shared policy (``logitless/jax/ops/common/choice.py``):
"triton" on an NVIDIA GPU with jax-triton (its kernel recomputes the columns the forward
did not keep), else "xla". "mosaic_gpu" and "mosaic_tpu" refuse every case in
``unsupported`` (their kernels hold one head's tile; the divergence needs both at once),
so the automatic choice passes over them."""

from __future__ import annotations

from logitless.jax.ops.common.contract import BackendTable

BACKENDS = BackendTable(__package__, xla="XlaBackend", triton="TritonBackend", mosaic_gpu="MosaicGpuBackend",
                        mosaic_tpu="MosaicTpuBackend")

#: ``choose_backend(implementation, x2d_shape, w_shape, dtype, softcap, has_bias) -> name``.
choose_backend = BACKENDS.choose
