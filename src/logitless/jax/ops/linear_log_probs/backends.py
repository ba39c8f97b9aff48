"""The backends of logitless.jax.linear_log_probs by name (``BACKENDS``, one table of
``contract.LlpBackend`` classes; ``api`` re-exports it), and the automatic choice: the JAX
ops' shared policy (``logitless/jax/ops/common/choice.py``): on an NVIDIA GPU "triton"
(jax-triton installed), on a TPU "mosaic_tpu", else "xla". "mosaic_gpu" (SM90) is
selectable by name but not automatic (``AUTOMATIC``)."""

from __future__ import annotations

from logitless.jax.ops.common import choice
from logitless.jax.ops.common.contract import BackendTable


def _xla():
    from logitless.jax.ops.linear_log_probs.xla_backend import XlaBackend

    return XlaBackend()


def _triton():
    from logitless.jax.ops.linear_log_probs.triton_backend import TritonBackend

    return TritonBackend()


def _mosaic_gpu():
    from logitless.jax.ops.linear_log_probs.mosaic_gpu_backend import MosaicGpuBackend

    return MosaicGpuBackend()


def _mosaic_tpu():
    from logitless.jax.ops.linear_log_probs.mosaic_tpu_backend import MosaicTpuBackend

    return MosaicTpuBackend()


#: The implementations of linear_log_probs, by ``implementation=`` name, each made on
#: first use ("triton" needs jax-triton on a GPU, "mosaic_gpu" a jax with Mosaic GPU).
BACKENDS = BackendTable(xla=_xla, triton=_triton, mosaic_gpu=_mosaic_gpu, mosaic_tpu=_mosaic_tpu)
#: The ones the automatic choice may pick.
AUTOMATIC = ("xla", "triton", "mosaic_tpu")


def _is_sm90() -> bool:
    return choice.is_sm90()


def _is_nvidia_gpu() -> bool:
    return choice.is_nvidia_gpu()


def choose_backend(implementation, x2d_shape, w_shape, dtype, softcap, has_bias) -> str:
    """The explicit backend (checked: ValueError saying why it does not fit), or the
    automatic one (the module docstring's policy)."""
    return choice.choose(implementation, BACKENDS, AUTOMATIC, x2d_shape, w_shape, dtype, softcap,
                         has_bias, nvidia=lambda: _is_nvidia_gpu(), sm90=lambda: _is_sm90())
