"""Reference of linear_log_probs in plain jnp: logits materialised, then
``jax.nn.log_softmax`` (independent of ``formulas.log_probs``); differentiable with
jax.grad. Run it on float64 arrays under ``jax.enable_x64(True)`` for the float64
reference, or on the inputs' dtype for "plain JAX in the same dtype". Test sizes only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def linear_log_probs_reference(x, weight, tokens, bias=None, *, temperature=1.0, softcap=None,
                               ignore_index=-100, dtype=None):
    """(log p(token), entropy) of softmax(softcap(x W^T + b) / T) per token in ``dtype``
    (default: x's dtype), tokens' shape, 0 at ignored tokens."""
    dtype = x.dtype if dtype is None else dtype
    z = jnp.einsum("...h,vh->...v", x.astype(dtype), weight.astype(dtype))
    if bias is not None:
        z = z + bias.astype(dtype)
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    lp = jax.nn.log_softmax(z / temperature, axis=-1)
    valid = tokens != ignore_index
    picked = jnp.take_along_axis(lp, jnp.where(valid, tokens, 0)[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
    zero = jnp.zeros((), lp.dtype)
    return jnp.where(valid, picked, zero), jnp.where(valid, ent, zero)
