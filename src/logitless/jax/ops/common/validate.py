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
