"""logitless.jax.maxtext against MaxText's formulas, written here from their definitions
(MaxText is not installed: ``maxtext/utils/vocabulary_tiling.py`` with T5X's
``cross_entropy_with_logits``, and the offline branch of ``CombinedDistillationStrategy.
compute_loss``): materialised fp32 logits, one-hot targets, the segmentation / pad masks."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitless.jax.maxtext import sparse_distillation_loss, vocab_tiling_loss

B, L, E, V, K = 2, 5, 24, 53, 6


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((B, L, E)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((E, V)) * 2 / np.sqrt(E), jnp.float32)  # logits_dense (embed, vocab)
    targets = jnp.asarray(rng.integers(1, V, (B, L)), jnp.int32)
    seg = jnp.asarray(np.array([[1, 1, 1, 0, 0], [1, 2, 2, 2, 0]]), jnp.int32)
    return x, kernel, targets, seg


def maxtext_vocab_tiling(x, kernel, targets, seg, config):
    """MaxText: logits of the output head, T5X's cross_entropy_with_logits on one-hot
    targets, masked by segmentation != 0, summed: (xent_sum, total_z_loss)."""
    if config.logits_via_embedding:
        logits = x @ kernel.T  # attend on the (vocab, embed) table
        if config.normalize_embedding_logits:
            logits = logits / jnp.sqrt(x.shape[-1])
        if config.final_logits_soft_cap:
            logits = jnp.tanh(logits / config.final_logits_soft_cap) * config.final_logits_soft_cap
    else:
        logits = x @ kernel
    onehot = jax.nn.one_hot(targets, V)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    loss = -jnp.sum(onehot * (logits - log_z[..., None]), axis=-1)
    z_loss = config.z_loss_multiplier * jnp.square(log_z)
    loss = loss + z_loss
    m = seg != 0
    return jnp.sum(loss * m), jnp.sum(z_loss * m)


@pytest.mark.parametrize("config", [
    SimpleNamespace(z_loss_multiplier=0.0, logits_via_embedding=False),
    SimpleNamespace(z_loss_multiplier=1e-3, logits_via_embedding=False),
    SimpleNamespace(z_loss_multiplier=1e-4, logits_via_embedding=True, normalize_embedding_logits=True,
                    final_logits_soft_cap=5.0),
])
def test_vocab_tiling_loss_matches_maxtexts_formula(config):
    x, kernel, targets, seg = _inputs()
    head = kernel.T if config.logits_via_embedding else kernel
    data = {"targets": targets, "targets_segmentation": seg}
    f = lambda a, b: vocab_tiling_loss(a, b, data, config)
    ours, oz = f(x, head)
    ref, rz = maxtext_vocab_tiling(x, head, targets, seg, config)
    np.testing.assert_allclose(float(ours), float(ref), rtol=2e-5)
    np.testing.assert_allclose(float(oz), float(rz), rtol=2e-5, atol=1e-9)
    # gradients of xent_sum (MaxText differentiates the loss with the z-loss folded in)
    g = jax.grad(lambda a, b: f(a, b)[0], argnums=(0, 1))(x, head)
    rg = jax.grad(lambda a, b: maxtext_vocab_tiling(a, b, targets, seg, config)[0], argnums=(0, 1))(x, head)
    for a, b in zip(g, rg):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


def maxtext_sparse_distillation(s_logits, top_k_indices, top_k_logits, targets, seg, temperature, alpha, pad_id):
    """MaxText's offline branch: teacher softmax over its K logits, student log-softmax over
    its logits at the K ids, KL * T**2, plus the hard CE, both over max(count, 1)."""
    labels = jax.nn.one_hot(targets, V) * ((targets != pad_id) & (seg != 0))[..., None]
    mask = jnp.any(labels != 0, axis=-1).astype(jnp.float32)
    safe = jnp.maximum(jnp.sum(mask), 1.0)
    t_p = jax.nn.softmax(top_k_logits / temperature, axis=-1)
    log_t = jax.nn.log_softmax(top_k_logits / temperature, axis=-1)
    log_s = jax.nn.log_softmax(jnp.take_along_axis(s_logits, top_k_indices, axis=-1) / temperature, axis=-1)
    kl = jnp.sum(t_p * (log_t - log_s), axis=-1)
    soft = jnp.sum(kl * mask) * temperature**2 / safe
    ce = -jnp.sum(labels * jax.nn.log_softmax(s_logits, axis=-1), axis=-1)
    hard = jnp.sum(ce * mask) / safe
    return alpha * soft + (1 - alpha) * hard


@pytest.mark.parametrize("alpha,temperature", [(0.5, 2.0), (1.0, 1.0), (0.0, 3.0), (0.3, 0.7)])
def test_sparse_distillation_loss_matches_maxtexts_formula(alpha, temperature):
    x, kernel, targets, seg = _inputs(1)
    targets = targets.at[0, 1].set(0)  # a pad_id target inside a segment
    rng = np.random.default_rng(2)
    ids = jnp.asarray(np.stack([rng.permutation(V)[:K] for _ in range(B * L)]).reshape(B, L, K), jnp.int32)
    tlog = jnp.asarray(rng.standard_normal((B, L, K)) * 3, jnp.float32)
    f = lambda a, b: sparse_distillation_loss(a, b, ids, tlog, targets, seg, temperature=temperature, alpha=alpha)
    r = lambda a, b: maxtext_sparse_distillation(a @ b, ids, tlog, targets, seg, temperature, alpha, 0)
    np.testing.assert_allclose(float(f(x, kernel)), float(r(x, kernel)), rtol=2e-5)
    for a, b in zip(jax.grad(f, argnums=(0, 1))(x, kernel), jax.grad(r, argnums=(0, 1))(x, kernel)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)


def test_all_padding_is_zero_not_nan():
    x, kernel, targets, seg = _inputs()
    ids = jnp.tile(jnp.arange(K, dtype=jnp.int32), (B, L, 1))
    loss = sparse_distillation_loss(x, kernel, ids, jnp.zeros((B, L, K)), jnp.zeros_like(targets), seg)
    assert float(loss) == 0.0
