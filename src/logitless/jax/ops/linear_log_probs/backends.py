"""The backends of logitless.jax.linear_log_probs by name, and the automatic choice: the
JAX ops' shared policy (``logitless/jax/ops/common/choice.py``): on an NVIDIA GPU
"triton" (jax-triton installed), on a TPU "mosaic_tpu", else "xla". "mosaic_gpu" (SM90)
is selectable by name but not automatic (``AUTOMATIC``): it has no per-device (sharded) path yet."""

from __future__ import annotations

from logitless.jax.ops.common import choice

#: Backends by name: module path (relative to this package).
BACKENDS = {"xla": ".xla_backend", "triton": ".triton_backend", "mosaic_gpu": ".mosaic_gpu_backend",
            "mosaic_tpu": ".mosaic_tpu_backend"}
#: The ones the automatic choice may pick.
AUTOMATIC = ("xla", "triton", "mosaic_tpu")
#: Backends of linear_cross_entropy not written for this op yet.
NOT_YET = ()


def backend_module(name: str):
    if name in NOT_YET:
        raise ValueError(f"implementation {name!r} is not available for linear_log_probs yet; "
                         f"use implementation=None or one of {tuple(BACKENDS)}")
    return choice.import_backend(BACKENDS, name, __package__)


def _is_sm90() -> bool:
    return choice.is_sm90()


def _is_nvidia_gpu() -> bool:
    return choice.is_nvidia_gpu()


def choose_backend(implementation, x2d_shape, w_shape, dtype, softcap, has_bias) -> str:
    """The explicit backend (checked: ValueError saying why it does not fit), or the
    automatic one (the module docstring's policy)."""
    return choice.choose(implementation, backend_module, AUTOMATIC, x2d_shape, w_shape, dtype, softcap,
                         has_bias, nvidia=lambda: _is_nvidia_gpu(), sm90=lambda: _is_sm90())
