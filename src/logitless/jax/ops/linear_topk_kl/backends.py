"""The backends of logitless.jax.linear_topk_kl by name (``BACKENDS``, one table of
``contract.TopKBackend`` classes, each made on first use) and the automatic choice
(``choose_backend``): the JAX ops' shared policy (``logitless/jax/ops/common/choice.py``):
"mosaic_gpu" on an SM90 GPU where it takes the case (its kernel recomputes the columns
the forward did not keep), else "xla". "triton" and "mosaic_tpu" refuse every case in
``unsupported`` (their modules say why), so the automatic choice passes over them."""

from __future__ import annotations

from logitless.jax.ops.common.contract import BackendTable

BACKENDS = BackendTable(__package__, xla="XlaBackend", mosaic_gpu="MosaicGpuBackend", triton="TritonBackend",
                        mosaic_tpu="MosaicTpuBackend")

#: ``choose_backend(implementation, x2d_shape, w_shape, dtype, softcap, has_bias) -> name``.
choose_backend = BACKENDS.choose
