"""The chunk loop of the JAX ops' chunked backends (the "xla" backends' loops over
column and row chunks, the "triton" backends' dz-chunk GEMMs): one ``lax.fori_loop``
over the full chunks, then the ragged last chunk as its own statically shaped step,
so that no padded row or column is ever computed."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def chunk_loop(total: int, size: int, body, carry):
    """``body(start, size, carry)`` over [0, total) in steps of ``size`` (static ints):
    a ``lax.fori_loop`` over the full steps (a single full step is called directly, no
    loop), then one step of ``total % size`` for the remainder. Returns the carry."""
    n_full, tail = divmod(total, size)
    if n_full == 1:
        carry = body(0, size, carry)
    elif n_full > 1:
        carry = lax.fori_loop(0, n_full, lambda i, c: body(i * size, size, c), carry)
    if tail:
        carry = body(n_full * size, tail, carry)
    return carry


def take(a, start, size, axis=0):
    """``a[start:start + size]`` along ``axis`` (``start`` may be traced)."""
    return lax.dynamic_slice_in_dim(a, start, size, axis)


def put(a, part, start, axis=0):
    """``a`` with ``part`` written at ``start`` along ``axis`` (``start`` may be traced)."""
    return lax.dynamic_update_slice_in_dim(a, part, start, axis)


def uninitialised(shape, dtype):
    """An array whose every element the caller overwrites (a chunk loop's dW): left
    uninitialised where ``lax.empty`` does so (GPU, TPU: no memset of the whole array),
    zeros elsewhere and on jax without ``lax.empty``."""
    empty = getattr(lax, "empty", None)
    return empty(shape, dtype) if empty is not None else jnp.zeros(shape, dtype)
