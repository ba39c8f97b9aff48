"""logitless.jax as a flax user calls it: the LM head is an ``nnx.Linear(H, V)`` whose kernel
is (H, V) (``weight_layout="hv"``); the loss and the log-probs take the kernel (and bias)
as they are, under ``nnx.jit`` / ``jax.jit`` and ``nnx.value_and_grad`` / ``jax.grad``.
Every gradient of the model (LM head kernel and bias, and the layers below it) against
float64 with the logits materialised, then one optax step. Needs flax (skips without).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitless.jax import linear_cross_entropy, linear_log_probs

nnx = pytest.importorskip("flax.nnx")

B, T, D, H, V = 2, 5, 12, 16, 37  # V prime: no chunk divides it
TEMPERATURE = 0.7


class TinyLM(nnx.Module):
    def __init__(self, use_bias: bool, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.body = nnx.Linear(D, H, rngs=rngs)
        self.lm_head = nnx.Linear(H, V, use_bias=use_bias, rngs=rngs)
        if use_bias:  # flax initialises the bias to zeros: a nonzero one is a real test
            self.lm_head.bias[...] = jax.random.normal(jax.random.key(3), (V,)) * 0.5

    def hidden(self, tokens):
        return jnp.tanh(self.body(self.embed(tokens)))


def batch():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    labels = np.asarray(rng.integers(0, V, (B, T)), np.int32)
    labels[0, 1] = labels[1, 3] = -100
    return tokens, jnp.asarray(labels)


def head_args(model):
    bias = model.lm_head.bias[...] if model.lm_head.use_bias else None
    return model.lm_head.kernel[...], bias


def ce_loss(model, tokens, labels):
    kernel, bias = head_args(model)
    return linear_cross_entropy(model.hidden(tokens), kernel, labels, bias, weight_layout="hv", z_loss=1e-3)


def lp_loss(model, tokens, labels):
    """A policy-gradient-style scalar of both outputs of linear_log_probs."""
    kernel, bias = head_args(model)
    logp, ent = linear_log_probs(model.hidden(tokens), kernel, labels, bias, weight_layout="hv",
                                 temperature=TEMPERATURE, entropy=True)
    adv = jnp.linspace(-1.0, 1.0, logp.size).reshape(logp.shape)
    return -(adv * logp).sum() - 0.01 * ent.sum()


def plain_ce(hidden, kernel, bias, labels):
    """The formula with the logits materialised: mean CE over non-ignored tokens + z-loss."""
    z = hidden @ kernel + (0.0 if bias is None else bias)
    lse = jax.nn.logsumexp(z, axis=-1)
    keep = labels != -100
    zt = jnp.take_along_axis(z, jnp.where(keep, labels, 0)[..., None], axis=-1)[..., 0]
    tok = jnp.where(keep, lse - zt + 1e-3 * lse**2, 0.0)
    return tok.sum() / keep.sum()


def plain_lp(hidden, kernel, bias, labels):
    z = (hidden @ kernel + (0.0 if bias is None else bias)) / TEMPERATURE
    logp_all = jax.nn.log_softmax(z, axis=-1)
    keep = labels != -100
    logp = jnp.take_along_axis(logp_all, jnp.where(keep, labels, 0)[..., None], axis=-1)[..., 0]
    logp = jnp.where(keep, logp, 0.0)
    ent = jnp.where(keep, -(jnp.exp(logp_all) * logp_all).sum(-1), 0.0)
    adv = jnp.linspace(-1.0, 1.0, logp.size).reshape(logp.shape)
    return -(adv * logp).sum() - 0.01 * ent.sum()


def reference64(model, tokens, labels, plain):
    """(loss, grads) of ``plain`` in float64: the model's parameters widened, the same
    forward (embed -> tanh(Linear) -> materialised logits), differentiated by jax.grad."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), params)

        def f(p):
            emb = p["embed"]["embedding"][tokens]
            hidden = jnp.tanh(emb @ p["body"]["kernel"] + p["body"]["bias"])
            head = p["lm_head"]
            return plain(hidden, head["kernel"], head["bias"] if "bias" in head else None, labels)

        loss, grads = jax.value_and_grad(f)(p64)
        return float(loss), jax.tree.map(lambda g: np.asarray(g, np.float64), grads)


def assert_grads_close(grads, ref, rtol=2e-5):
    """Every gradient (an nnx State) within rtol of the largest element of its float64 reference."""
    flat = flat_dict(nnx.to_pure_dict(grads))
    ref = flat_dict(ref)
    assert set(flat) == set(ref) and "lm_head/kernel" in ref, (sorted(flat), sorted(ref))
    for name, r in ref.items():
        g = np.asarray(flat[name], np.float64)
        assert g.shape == r.shape, f"{name}: shape {g.shape} != {r.shape}"
        err = float(np.abs(g - r).max())
        assert err <= rtol * max(float(np.abs(r).max()), 1e-3), f"{name}: max error {err:.3g}"


def flat_dict(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k, simple=True, separator="/"): v for k, v in leaves}


@pytest.mark.parametrize("use_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("op", ["cross_entropy", "log_probs"])
def test_nnx_value_and_grad_matches_float64(op, use_bias):
    model = TinyLM(use_bias, nnx.Rngs(0))
    tokens, labels = batch()
    assert model.lm_head.kernel[...].shape == (H, V)  # flax's (in, out): "hv"
    ours, plain = (ce_loss, plain_ce) if op == "cross_entropy" else (lp_loss, plain_lp)

    loss, grads = nnx.jit(nnx.value_and_grad(ours))(model, tokens, labels)
    ref_loss, ref_grads = reference64(model, tokens, labels, plain)
    assert abs(float(loss) - ref_loss) <= 2e-5 * max(abs(ref_loss), 1.0), (float(loss), ref_loss)
    assert_grads_close(grads, ref_grads)

    # the functional route: jax.jit(jax.grad) over the split state gives the same gradients
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def pure(p, tokens, labels):
        return ours(nnx.merge(graphdef, p, rest), tokens, labels)

    g2 = jax.jit(jax.grad(pure))(params, tokens, labels)
    assert_grads_close(g2, ref_grads)


def test_optax_step_lowers_the_loss():
    optax = pytest.importorskip("optax")
    model = TinyLM(True, nnx.Rngs(1))
    tokens, labels = batch()
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    kernel0 = np.asarray(model.lm_head.kernel[...])

    @nnx.jit
    def step(model, optimizer, tokens, labels):
        loss, grads = nnx.value_and_grad(ce_loss)(model, tokens, labels)
        optimizer.update(model, grads)
        return loss, grads

    loss0, grads = step(model, optimizer, tokens, labels)
    # plain SGD: the kernel moved by exactly -lr * its gradient, in its (H, V) layout
    np.testing.assert_allclose(np.asarray(model.lm_head.kernel[...]),
                               kernel0 - 0.5 * np.asarray(grads["lm_head"]["kernel"][...]), rtol=1e-6, atol=1e-7)
    loss1 = ce_loss(model, tokens, labels)
    assert float(loss1) < float(loss0)
