"""The backends of logitless.jax.linear_cross_entropy by name, and the automatic choice
(used by ``api`` and by ``sharded``, which picks a backend per device shape); the policy
is the JAX ops' shared one (``logitless/jax/ops/common/choice.py``)."""

from __future__ import annotations

from logitless.jax.ops.common import choice
from logitless.jax.ops.common.choice import supported as _supported  # noqa: F401 (re-exported)

#: Backends by name: module path (relative to this package). "mosaic_gpu" is optional.
BACKENDS = {
    "xla": ".xla_backend",
    "mosaic_gpu": ".mosaic_gpu_backend",
    "triton": ".triton_backend",
    "mosaic_tpu": ".mosaic_tpu_backend",
}


def backend_module(name: str):
    return choice.import_backend(BACKENDS, name, __package__)


def _is_sm90() -> bool:
    return choice.is_sm90()


def _is_nvidia_gpu() -> bool:
    return choice.is_nvidia_gpu()


def choose_backend(implementation, x2d_shape, w_shape, dtype, softcap, has_bias,
                   has_class_weight=False, need_argmax=False) -> str:
    """The backend name: the explicit one (checked), or the first of "mosaic_gpu" (SM90
    GPUs) and "triton" (any NVIDIA GPU, with jax-triton installed) that imports and
    supports the case (class weights and, for return_stats, the argmax included), else "xla"."""
    return choice.choose(implementation, backend_module, BACKENDS, x2d_shape, w_shape, dtype, softcap,
                         has_bias, bool(has_class_weight), need_argmax=need_argmax, nvidia=lambda: _is_nvidia_gpu(),
                         sm90=lambda: _is_sm90())
