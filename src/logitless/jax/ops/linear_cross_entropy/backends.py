"""The backends of logitless.jax.linear_cross_entropy by name (``BACKENDS``, one table of
``contract.LceBackend`` classes; ``api`` re-exports it), and the automatic choice (used by
``api`` and by ``sharded``, which picks a backend per device shape); the policy is the JAX
ops' shared one (``logitless/jax/ops/common/choice.py``)."""

from __future__ import annotations

from logitless.jax.ops.common import choice
from logitless.jax.ops.common.contract import BackendTable


def _xla():
    from logitless.jax.ops.linear_cross_entropy.xla_backend import XlaBackend

    return XlaBackend()


def _mosaic_gpu():
    from logitless.jax.ops.linear_cross_entropy.mosaic_gpu_backend import MosaicGpuBackend

    return MosaicGpuBackend()


def _triton():
    from logitless.jax.ops.linear_cross_entropy.triton_backend import TritonBackend

    return TritonBackend()


def _mosaic_tpu():
    from logitless.jax.ops.linear_cross_entropy.mosaic_tpu_backend import MosaicTpuBackend

    return MosaicTpuBackend()


#: The implementations of linear_cross_entropy, by ``implementation=`` name, each made on
#: first use ("mosaic_gpu" needs a jax with Mosaic GPU, "triton" jax-triton on a GPU).
BACKENDS = BackendTable(xla=_xla, mosaic_gpu=_mosaic_gpu, triton=_triton, mosaic_tpu=_mosaic_tpu)


def _is_sm90() -> bool:
    return choice.is_sm90()


def _is_nvidia_gpu() -> bool:
    return choice.is_nvidia_gpu()


def choose_backend(implementation, x2d_shape, w_shape, dtype, softcap, has_bias,
                   has_class_weight=False, need_argmax=False) -> str:
    """The backend name: the explicit one (checked), or the first of "mosaic_gpu" (SM90
    GPUs) and "triton" (any NVIDIA GPU, with jax-triton installed) that imports and
    supports the case (class weights and, for return_stats, the argmax included), else "xla"."""
    return choice.choose(implementation, BACKENDS, BACKENDS.names(), x2d_shape, w_shape, dtype, softcap,
                         has_bias, bool(has_class_weight), need_argmax=need_argmax, nvidia=lambda: _is_nvidia_gpu(),
                         sm90=lambda: _is_sm90())
