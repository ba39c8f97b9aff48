"""Reference of linear_log_probs in plain jnp: logits materialised, then
``jax.nn.log_softmax`` (independent of ``formulas.log_probs``); differentiable with
jax.grad. Run it on float64 arrays under ``jax.enable_x64(True)`` for the float64
reference, or on the inputs' dtype for "plain JAX in the same dtype". Test sizes only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _logits(x, weight, bias, softcap, dtype):
    """softcap(x W^T + b) in ``dtype`` (default: x's)."""
    dtype = x.dtype if dtype is None else dtype
    z = jnp.einsum("...h,vh->...v", x.astype(dtype), weight.astype(dtype))
    if bias is not None:
        z = z + bias.astype(dtype)
    return z if softcap is None else softcap * jnp.tanh(z / softcap)


def linear_log_probs_reference(x, weight, tokens, bias=None, *, temperature=1.0, softcap=None,
                               ignore_index=-100, dtype=None):
    """(log p(token), entropy) of softmax(softcap(x W^T + b) / T) per token in ``dtype``
    (default: x's dtype), tokens' shape, 0 at ignored tokens."""
    z = _logits(x, weight, bias, softcap, dtype)
    lp = jax.nn.log_softmax(z / temperature, axis=-1)
    valid = tokens != ignore_index
    picked = jnp.take_along_axis(lp, jnp.where(valid, tokens, 0)[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
    zero = jnp.zeros((), lp.dtype)
    return jnp.where(valid, picked, zero), jnp.where(valid, ent, zero)


def truncated_keep_reference(a, top_k=None, top_p=1.0, min_p=0.0):
    """Kept mask (N, V) of scaled logits ``a`` (N, V), numpy float64, written plainly
    after vLLM's sampler: min-p (probs < min_p * max prob masked), top-k (sorted
    ascending, below the k-th largest masked), top-p (ascending cumsum of the renormalised
    probs ``<= 1 - p`` masked, the largest kept). Parameters: numbers or per-row arrays."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    n, v = a.shape

    def per_row(val, i, off):
        if val is None:
            return off
        arr = np.asarray(val)
        return arr.reshape(-1)[i].item() if arr.ndim else arr.item()

    keep = np.ones_like(a, dtype=bool)
    for i in range(n):
        row = a[i].copy()
        mp, k, p = per_row(min_p, i, 0.0), int(per_row(top_k, i, 0)), per_row(top_p, i, 1.0)
        if mp > 0:
            probs = np.exp(row - row.max())
            probs /= probs.sum()
            row = np.where(probs < mp * probs.max(), -np.inf, row)
        order = np.argsort(row, kind="stable")
        srt = row[order]
        if 0 < k < v:
            srt = np.where(srt < srt[v - k], -np.inf, srt)
        if p < 1:
            e = np.exp(srt - srt.max())
            drop = np.cumsum(e / e.sum()) <= 1 - p
            drop[-1] = False
            srt = np.where(drop, -np.inf, srt)
        out = np.empty_like(row)
        out[order] = srt
        keep[i] = out > -np.inf
    return keep


def truncated_log_probs_reference(x, weight, tokens, bias=None, *, temperature=1.0, softcap=None,
                                  ignore_index=-100, top_k=None, top_p=1.0, min_p=0.0, dtype=None):
    """(log p(token), entropy) of the truncated distribution (``truncated_keep_reference``'s
    set, renormalised) in ``dtype``, tokens' shape: -inf outside the set, 0 at ignored
    tokens; differentiable by jax.grad (the set held fixed)."""
    import numpy as np

    z = _logits(x, weight, bias, softcap, dtype)
    a = (z / temperature).reshape(-1, z.shape[-1])
    keep = jnp.asarray(truncated_keep_reference(np.asarray(jax.lax.stop_gradient(a)), top_k, top_p, min_p))
    lse = jax.nn.logsumexp(jnp.where(keep, a, -jnp.inf), axis=-1, keepdims=True)
    lp = jnp.where(keep, a - lse, 0.0)
    flat = tokens.reshape(-1)
    valid = flat != ignore_index
    idx = jnp.where(valid, flat, 0)[:, None]
    picked = jnp.take_along_axis(lp, idx, axis=-1)[:, 0]
    picked = jnp.where(jnp.take_along_axis(keep, idx, axis=-1)[:, 0], picked, -jnp.inf)
    ent = -jnp.sum(jnp.exp(lp) * keep * lp, axis=-1)
    zero = jnp.zeros((), lp.dtype)
    return (jnp.where(valid, picked, zero).reshape(tokens.shape), jnp.where(valid, ent, zero).reshape(tokens.shape))
