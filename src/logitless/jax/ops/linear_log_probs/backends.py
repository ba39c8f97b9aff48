"""The backends of logitless.jax.linear_log_probs by name (``BACKENDS``, one table of
``contract.LlpBackend`` classes, each made on first use: "triton" needs jax-triton on a
GPU, "mosaic_gpu" a jax with Mosaic GPU; ``api`` re-exports it), and the automatic choice
(``choose_backend``): the JAX ops' shared policy (``logitless/jax/ops/common/choice.py``):
on an NVIDIA GPU "triton" (jax-triton installed), on a TPU "mosaic_tpu", else "xla".
"mosaic_gpu" (SM90) is selectable by name but not automatic (``BACKENDS.automatic``)."""

from __future__ import annotations

from logitless.jax.ops.common.contract import BackendTable

BACKENDS = BackendTable(__package__, automatic=("xla", "triton", "mosaic_tpu"), xla="XlaBackend",
                        triton="TritonBackend", mosaic_gpu="MosaicGpuBackend", mosaic_tpu="MosaicTpuBackend")

#: ``choose_backend(implementation, x2d_shape, w_shape, dtype, softcap, has_bias) -> name``
#: (``BackendTable.choose``).
choose_backend = BACKENDS.choose
