"""The backends of logitless.jax.linear_cross_entropy by name, and the automatic choice
(used by ``api`` and by ``sharded``, which picks a backend per device shape)."""

from __future__ import annotations

import importlib
import warnings

import jax
import jax.numpy as jnp

#: Backends by name: module path (relative to this package). "mosaic_gpu" is optional.
BACKENDS = {
    "xla": ".xla",
    "mosaic_gpu": ".mosaic_gpu",
    "triton": ".triton",
}


def backend_module(name: str):
    if name not in BACKENDS:
        raise ValueError(f"implementation must be None or one of {tuple(BACKENDS)}, got {name!r}")
    return importlib.import_module(BACKENDS[name], __package__)


def _is_sm90() -> bool:
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    if dev.platform != "gpu":
        return False
    return str(getattr(dev, "compute_capability", "")).startswith("9")


def _is_nvidia_gpu() -> bool:
    """The default device is a CUDA GPU (a numeric compute capability; ROCm's is not)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "x"))[:1].isdigit()


def _supported(module, x2d_shape, w_shape, dtype, softcap, has_bias, has_class_weight=False) -> bool:
    if has_class_weight and not getattr(module, "CLASS_WEIGHTS", False):
        return False
    check = getattr(module, "is_supported", None)
    return True if check is None else bool(
        check(x2d_shape, w_shape, dtype, softcap=softcap, has_bias=has_bias))


def choose_backend(implementation, x2d_shape, w_shape, dtype, softcap, has_bias,
                   has_class_weight=False) -> str:
    """The backend name: the explicit one (checked), or the first of "mosaic_gpu" (SM90
    GPUs) and "triton" (any NVIDIA GPU, with jax-triton installed) that imports and
    supports the case (class weights included), else "xla"."""
    if implementation is not None:
        module = backend_module(implementation)
        if not _supported(module, x2d_shape, w_shape, dtype, softcap, has_bias, has_class_weight):
            raise ValueError(
                f"implementation {implementation!r} does not support x {x2d_shape}, weight "
                f"{w_shape} (V, H), dtype {jnp.dtype(dtype).name}, softcap={softcap}, bias={has_bias}, "
                f"class_weight={has_class_weight}"
                + (f": {module.UNSUPPORTED_HINT}" if getattr(module, "UNSUPPORTED_HINT", None) else ""))
        return implementation
    if not _is_nvidia_gpu():
        return "xla"
    for name in (("mosaic_gpu",) if _is_sm90() else ()) + ("triton",):
        try:
            module = backend_module(name)
        except ImportError:
            continue
        except Exception as exc:  # e.g. a jax without Mosaic GPU: say so, keep working
            warnings.warn(f"logitless.jax: the {name} backend failed to import ({exc!r}); trying the next",
                          RuntimeWarning, stacklevel=3)
            continue
        if _supported(module, x2d_shape, w_shape, dtype, softcap, has_bias, has_class_weight):
            return name
    return "xla"
