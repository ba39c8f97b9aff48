"""The backends of logitless.jax.linear_cross_entropy by name (``BACKENDS``, one table of
``contract.LceBackend`` classes, each made on first use: "mosaic_gpu" needs a jax with
Mosaic GPU, "triton" jax-triton on a GPU; ``api`` re-exports it), and the automatic choice
(``choose_backend``, used by ``api``): the JAX ops' shared policy
(``logitless/jax/ops/common/choice.py``): the first of "mosaic_gpu" (SM90 GPUs) and
"triton" (any NVIDIA GPU, with jax-triton installed) that imports and supports the case
(class weights and, for return_stats, the argmax included), "mosaic_tpu" on a TPU, else "xla"."""

from __future__ import annotations

from logitless.jax.ops.common.contract import BackendTable

BACKENDS = BackendTable(__package__, xla="XlaBackend", mosaic_gpu="MosaicGpuBackend", triton="TritonBackend",
                        mosaic_tpu="MosaicTpuBackend")

#: ``choose_backend(implementation, x2d_shape, w_shape, dtype, softcap, has_bias,
#: has_class_weight=None, need_argmax=False) -> name`` (``BackendTable.choose``).
choose_backend = BACKENDS.choose
