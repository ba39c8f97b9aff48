"""The automatic backend choice of the JAX ops, one policy for all of them.

``implementation=None``: on an NVIDIA GPU the first of "mosaic_gpu" (SM90 only) and
"triton" that the op's table lets the automatic choice pick, that imports and whose
``unsupported`` accepts the case (``contract.Backend``); on a TPU "mosaic_tpu" under the
same conditions; otherwise, and on every other platform (CPU, ROCm), "xla". An explicit
name is checked the same way and refused with a ValueError that says why.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

#: Accelerated backends in the order the automatic choice tries them.
PREFERENCE = ("mosaic_gpu", "triton")


def is_sm90() -> bool:
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    if dev.platform != "gpu":
        return False
    return str(getattr(dev, "compute_capability", "")).startswith("9")


def is_tpu() -> bool:
    """jax's default backend is a TPU."""
    try:
        return jax.default_backend() == "tpu"
    except RuntimeError:
        return False


def is_nvidia_gpu() -> bool:
    """The default device is a CUDA GPU (a numeric compute capability; ROCm's is not)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "x"))[:1].isdigit()


#: The interpret-mode warning is given once per process.
_WARNED_INTERPRET: list = []

MOSAIC_NEEDS = ("implementation='mosaic_gpu' needs an SM90 (Hopper, e.g. H100/H200) NVIDIA GPU; use "
                "implementation=None (automatic: the best backend this device has), 'xla' (any device) "
                "or 'triton' (any NVIDIA GPU, with jax-triton installed)")


def check_mosaic_device(nvidia=None, sm90=None) -> None:
    """An explicit "mosaic_gpu" on the wrong device: a GPU that is not SM90 raises
    ValueError (its kernels would not compile); a machine without a GPU gets ONE
    RuntimeWarning, as the kernels then run in Mosaic GPU's interpret mode (simulated
    threads on the CPU: correct, very slow, for tests only). ``nvidia``/``sm90``: the
    device predicates (None: ``is_nvidia_gpu``/``is_sm90``)."""
    if (sm90 or is_sm90)():
        return
    try:
        platform = jax.devices()[0].platform
    except RuntimeError:
        platform = "none"
    if platform == "gpu" or (nvidia or is_nvidia_gpu)():
        raise ValueError(f"{MOSAIC_NEEDS}; this GPU is not SM90")
    if not _WARNED_INTERPRET:
        _WARNED_INTERPRET.append(True)
        warnings.warn(f"{MOSAIC_NEEDS}. There is no GPU here ({platform}): the kernels run in Mosaic "
                      "GPU's interpret mode on the CPU (very slow: tests only)", RuntimeWarning, stacklevel=4)


def choose(implementation, table, x2d_shape, w_shape, dtype, softcap, has_bias, has_class_weight=None, *,
           need_argmax=False) -> str:
    """The backend name (the module docstring's policy). ``table``: the op's
    ``BackendTable`` (``table.automatic``: the names the automatic choice may pick);
    ``has_class_weight``: None for ops without class weights (not in the error);
    ``need_argmax``: the automatic choice takes only backends that compute the argmax
    (return_stats). The device predicates (``is_nvidia_gpu``, ``is_sm90``, ``is_tpu``) are
    this module's, looked up per call."""
    case = dict(softcap=softcap, has_bias=has_bias, has_class_weight=bool(has_class_weight),
                need_argmax=bool(need_argmax))
    x2d_shape, w_shape = tuple(x2d_shape), tuple(w_shape)
    if implementation == "mosaic_gpu":
        check_mosaic_device()
    if implementation is not None:
        why = table[implementation].unsupported(x2d_shape, w_shape, dtype, **case)
        if why is not None:
            raise ValueError(
                f"implementation {implementation!r} does not support x {x2d_shape}, weight "
                f"{w_shape} (V, H), dtype {jnp.dtype(dtype).name}, softcap={softcap}, bias={has_bias}"
                + ("" if has_class_weight is None else f", class_weight={has_class_weight}")
                + (f": {why}" if why else ""))
        return implementation
    if is_tpu():
        names = ("mosaic_tpu",)
    elif is_nvidia_gpu():
        names = [n for n in PREFERENCE if n != "mosaic_gpu" or is_sm90()]
    else:
        return "xla"
    for name in names:  # the first that the automatic choice may pick, that imports and takes the case
        if name not in table.automatic:
            continue
        backend = table.usable(name, stacklevel=5)
        if backend is not None and backend.unsupported(x2d_shape, w_shape, dtype, **case) is None:
            return name
    return "xla"
