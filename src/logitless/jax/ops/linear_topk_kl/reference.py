"""Float64 reference of the JAX linear_topk_kl: the plain definition (``formulas/topk_kl.py``'s
docstring) on the materialised logits, written independently of that module, in jax.numpy
so that ``jax.grad`` of it is the reference gradient (call it with x64 enabled:
``with jax.enable_x64(True)``). 1 - Q is the sum of q over the columns outside the ids (a
masked log-sum-exp, as the definition reads), 1 - P is 1 - sum exp(lp). Test sizes only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _terms(w, d):
    """w d where w > 0, else 0 (0 log 0 = 0), with a finite gradient there too."""
    return jnp.where(w > 0, w * jnp.where(w > 0, d, 0.0), 0.0)


def linear_topk_kl_ref(x, weight, teacher_ids, teacher_log_probs, target=None, *, direction="forward", tail="bucket",
                       temperature=1.0, ignore_index=-100, reduction="mean", hard_label_weight=0.0,
                       weight_layout="vh"):
    """The loss in float64 (x and weight are cast), differentiable in x and weight."""
    f = jnp.float64
    w = jnp.asarray(weight, f)
    if weight_layout == "hv":
        w = w.T
    z = jnp.asarray(x, f) @ w.T
    ids = jnp.asarray(teacher_ids)
    lp = jnp.asarray(teacher_log_probs, f)
    if target is None:
        target = jnp.zeros(ids.shape[:-1], jnp.int32)
    logq = jax.nn.log_softmax(z / temperature, axis=-1)
    lq = jnp.take_along_axis(logq, ids, axis=-1)
    inside = jnp.any(jnp.arange(z.shape[-1])[None, :] == ids.reshape(-1, ids.shape[-1])[:, :, None], axis=1)
    inside = inside.reshape(z.shape)
    log_tail_q = jax.nn.logsumexp(jnp.where(inside, -jnp.inf, logq), axis=-1)  # log(1 - Q)
    p, q = jnp.exp(lp), jnp.exp(lq)
    big_p = p.sum(-1)
    if tail == "renormalize":
        lp = lp - jnp.log(big_p)[..., None]
        lq = lq - jax.nn.logsumexp(lq, axis=-1, keepdims=True)
        p, q = jnp.exp(lp), jnp.exp(lq)
    loss = _terms(p, lp - lq).sum(-1) if direction == "forward" else _terms(q, lq - lp).sum(-1)
    if tail == "bucket":
        tail_p = jnp.clip(1.0 - big_p, 0.0)
        log_tail_p = jnp.log(tail_p)
        if direction == "forward":
            loss = loss + _terms(tail_p, log_tail_p - log_tail_q)
        else:
            loss = loss + _terms(jnp.exp(log_tail_q), log_tail_q - log_tail_p)
    valid = target != ignore_index
    if hard_label_weight:
        logp1 = jax.nn.log_softmax(z, axis=-1)
        ce = -jnp.take_along_axis(logp1, jnp.clip(target, 0, z.shape[-1] - 1)[..., None], axis=-1)[..., 0]
        loss = loss + hard_label_weight * ce
    loss = jnp.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()
