"""A per-token loss's reduction over the tokens of every device, and its transpose: the
api's part of the loss ops whose statistics need full rows (linear_jsd,
linear_topk_kl). ``token_axes``: inside ``jax.shard_map``, the mesh axes that split the
tokens (sums then run over every device's tokens); () elsewhere."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def total(a, token_axes: tuple):
    """sum(a) over this call's tokens: all devices' along ``token_axes``."""
    s = jnp.sum(a)
    return lax.psum(s, token_axes) if token_axes else s


def count(target, ignore_index: int, token_axes: tuple):
    """The counted tokens (target != ignore_index) of every device, fp32: "mean"'s divisor."""
    return total((target != ignore_index).astype(jnp.float32), token_axes)


def reduce(loss_tok, reduction: str, count, token_axes: tuple):
    """The loss of ``reduction`` from the per-token loss (0 at ignored tokens): "none" as it
    is, "sum" the total, "mean" the total divided by ``count``."""
    if reduction == "none":
        return loss_tok
    if reduction == "sum":
        return total(loss_tok, token_axes)
    return total(loss_tok, token_axes) / count


def unit_gradient(target, ignore_index: int, reduction: str, count):
    """Each token's upstream gradient (N,) fp32 for a unit gradient of the reduced loss
    ("mean": 1 / count, "sum": 1; 0 at ignored tokens): what a forward that keeps dz scales it by."""
    valid = target != ignore_index
    return jnp.where(valid, 1.0 / count if reduction == "mean" else 1.0, 0.0).astype(jnp.float32)


def upstream(g_loss, target, ignore_index: int, reduction: str, count):
    """The per-token upstream gradient g (fp32, 0 at ignored tokens) from the reduced
    loss's gradient ``g_loss``; ``count``: "mean"'s divisor (the counted tokens, over every device)."""
    valid = target != ignore_index
    g = jnp.asarray(g_loss, jnp.float32)
    if reduction == "none":
        g = jnp.reshape(g, target.shape)
    elif reduction == "mean":
        g = jnp.broadcast_to(g / count, target.shape)
    else:
        g = jnp.broadcast_to(g, target.shape)
    return jnp.where(valid, g, 0.0)
