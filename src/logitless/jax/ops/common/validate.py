"""Input checks shared by the JAX ops' public functions (trace-time, no host sync)."""

from __future__ import annotations

import jax.numpy as jnp

#: Floating dtypes the JAX ops take for x, weight and bias.
FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)


def check_float(name, a) -> None:
    """TypeError naming ``name`` unless ``a`` is an array of one of ``FLOAT_DTYPES``."""
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{name} must be a jax or numpy array, got {type(a).__name__}")
    if jnp.dtype(a.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"{name} must be bfloat16, float16, float32 or float64, got {jnp.dtype(a.dtype).name}")


def check_linear_inputs(x, weight, labels, bias, *, labels_name: str, weight_layout: str = "vh",
                        vocab_shards: int = 1) -> tuple[int, int, int]:
    """The checks every fused linear op makes of x (..., H), weight ((V, H) for
    ``weight_layout="vh"``, (H, V) for "hv"), the integer labels (``labels_name``:
    "target", "tokens"; shape x.shape[:-1]) and the optional bias (V_local,): float
    dtypes, ranks, matching hidden sizes and dtypes, a non-empty vocabulary. TypeError or
    ValueError naming the argument, at trace time (shapes and dtypes only, no values).
    ``vocab_shards``: how many shards the weight is of (a vocabulary split inside
    shard_map). Returns (local_classes, num_classes = local x shards, hidden)."""
    check_float("x", x)
    check_float("weight", weight)
    layouts = {"vh": "(V, H)", "hv": "(H, V)"}
    if weight_layout not in layouts:
        raise ValueError(f'weight_layout must be "vh" (V, H) or "hv" (H, V), got {weight_layout!r}')
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension (..., H)")
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D {layouts[weight_layout]}, got shape {tuple(weight.shape)}")
    local_classes, hidden = weight.shape if weight_layout == "vh" else weight.shape[::-1]
    num_classes = local_classes * vocab_shards
    if num_classes == 0:
        raise ValueError("weight has no classes: the vocabulary is empty")
    if x.shape[-1] != hidden:
        raise ValueError(f"x has hidden size {x.shape[-1]} but weight is {tuple(weight.shape)} "
                         f"{layouts[weight_layout]}")
    if jnp.dtype(x.dtype) != jnp.dtype(weight.dtype):
        raise TypeError(f"x is {jnp.dtype(x.dtype).name} but weight is {jnp.dtype(weight.dtype).name}; they must match")
    if not hasattr(labels, "dtype") or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{labels_name} must be an integer array, got "
                        f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{labels_name} has shape {tuple(labels.shape)}, expected {tuple(x.shape[:-1])} "
                         "(the leading dimensions of x)")
    if bias is not None:
        check_float("bias", bias)
        if tuple(bias.shape) != (local_classes,):
            raise ValueError(f"bias must have shape ({local_classes},), got {tuple(bias.shape)}")
        if jnp.dtype(bias.dtype) != jnp.dtype(weight.dtype):
            raise TypeError(f"bias is {jnp.dtype(bias.dtype).name} but weight is "
                            f"{jnp.dtype(weight.dtype).name}; they must match")
    return local_classes, num_classes, hidden
