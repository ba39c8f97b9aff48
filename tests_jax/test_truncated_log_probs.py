"""logitless.jax.linear_log_probs with top_k / top_p / min_p and batch_invariant=True
("xla" backend) against a float64 numpy/jnp reference after vLLM's sampler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitless.jax import linear_log_probs
from logitless.jax.ops.linear_log_probs import truncation as trunc_op
from logitless.jax.ops.linear_log_probs.reference import truncated_keep_reference, truncated_log_probs_reference

CASES = {
    "top_k": dict(top_k=7),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.05),
    "all": dict(top_k=20, top_p=0.9, min_p=0.02),
}


def _inputs(n, h, v, seed, scale=3.0, bias=False, trunc=None, temperature=1.0, softcap=None, share=0.6):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, h))
    w = rng.standard_normal((v, h)) * h ** -0.5 * scale
    b = rng.standard_normal(v) * 0.5 if bias else None
    t = rng.integers(0, v, n)
    if trunc is not None:
        z = x @ w.T + (b if b is not None else 0)
        if softcap is not None:
            z = softcap * np.tanh(z / softcap)
        keep = truncated_keep_reference(z / temperature, **trunc)
        for i in range(n):
            if rng.random() < share:
                t[i] = rng.choice(np.flatnonzero(keep[i]))
    return x, w, b, t


def _check(lp, ent, rl, re, tol=1e-4):
    lp, rl = np.asarray(lp, np.float64), np.asarray(rl, np.float64)
    fin = np.isfinite(rl)
    assert (np.isfinite(lp) == fin).all(), (lp, rl)
    assert (lp[~fin] == -np.inf).all()
    if fin.any():
        assert np.abs(lp[fin] - rl[fin]).max() <= tol
    if ent is not None:
        assert np.abs(np.asarray(ent, np.float64) - np.asarray(re, np.float64)).max() <= tol


def _ref(x, w, t, b=None, **kw):
    with jax.enable_x64(True):
        f = lambda a: None if a is None else jnp.asarray(a, jnp.float64)  # noqa: E731
        rl, re = truncated_log_probs_reference(f(x), f(w), jnp.asarray(t), f(b), **kw)
        return np.asarray(rl), np.asarray(re)


@pytest.mark.parametrize("case", list(CASES))
def test_alone_and_combined(case):
    tr = CASES[case]
    x, w, b, t = _inputs(9, 21, 97, seed=len(case), trunc=tr, bias=True, temperature=0.7, softcap=4.0)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    lp, ent = linear_log_probs(f32(x), f32(w), jnp.asarray(t), f32(b), entropy=True, temperature=0.7, softcap=4.0,
                               **tr)
    rl, re = _ref(x, w, t, b, temperature=0.7, softcap=4.0, **tr)
    _check(lp, ent, rl, re)


def test_per_token_arrays_and_jit():
    rng = np.random.default_rng(3)
    n = 8
    tr = dict(top_k=rng.integers(0, 12, n).astype(np.int32), top_p=np.where(rng.random(n) < 0.3, 1.0,
                                                                             rng.random(n) * 0.5 + 0.45),
              min_p=np.where(rng.random(n) < 0.5, 0.0, rng.random(n) * 0.1))
    x, w, b, t = _inputs(n, 19, 101, seed=4, trunc=tr)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    fn = jax.jit(lambda x, w, t, k, p, mp: linear_log_probs(x, w, t, entropy=True, top_k=k, top_p=p, min_p=mp))
    lp, ent = fn(f32(x), f32(w), jnp.asarray(t), jnp.asarray(tr["top_k"]), f32(tr["top_p"]), f32(tr["min_p"]))
    rl, re = _ref(x, w, t, **tr)
    _check(lp, ent, rl, re)


@pytest.mark.parametrize("tr", [dict(top_p=0.97), dict(min_p=0.2), dict(min_p=0.1, top_p=0.99),
                                dict(top_k=400), dict(top_k=300, top_p=0.995)])
def test_bisection_fallback(tr, monkeypatch):
    """Kept sets past the candidates (flat rows; a per-token top_k above the array
    candidates, made 65 here): the bisection passes."""
    from logitless.jax.formulas import truncation as tf

    monkeypatch.setattr(tf, "ARRAY_TOP_K_CANDIDATES", 65)
    x, w, b, t = _inputs(4, 17, 1009, seed=11, scale=0.3, trunc=tr)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    kw = dict(tr, top_k=jnp.full((4,), tr["top_k"], jnp.int32)) if "top_k" in tr else tr
    lp, ent = linear_log_probs(f32(x), f32(w), jnp.asarray(t), entropy=True, **kw)
    rl, re = _ref(x, w, t, **tr)
    _check(lp, ent, rl, re)
    assert truncated_keep_reference(x @ w.T, **tr).sum(1).min() > 65


def test_gradients_against_reference():
    tr = dict(top_k=6, top_p=0.9, min_p=0.01)
    x, w, b, t = _inputs(5, 7, 31, seed=2, bias=True, trunc=tr, temperature=0.7, softcap=3.0, share=0.7)
    rng = np.random.default_rng(0)
    g1, g2 = rng.standard_normal(5), rng.standard_normal(5)
    with jax.enable_x64(True):
        f64 = lambda a: jnp.asarray(a, jnp.float64)  # noqa: E731

        def loss(fn):
            def f(x, w, b):
                lp, ent = fn(x, w, b)
                return jnp.sum(jnp.where(jnp.isinf(lp), 0.0, lp) * g1) + jnp.sum(ent * g2)
            return f

        ours = jax.grad(loss(lambda x, w, b: linear_log_probs(x, w, jnp.asarray(t), b, entropy=True,
                                                               temperature=0.7, softcap=3.0, **tr)),
                        argnums=(0, 1, 2))(f64(x), f64(w), f64(b))
        ref = jax.grad(loss(lambda x, w, b: truncated_log_probs_reference(x, w, jnp.asarray(t), b, temperature=0.7,
                                                                           softcap=3.0, **tr)),
                       argnums=(0, 1, 2))(f64(x), f64(w), f64(b))
        for a, r in zip(ours, ref):
            assert np.abs(np.asarray(a) - np.asarray(r)).max() < 1e-10


def test_bad_values_and_backends():
    x, w, b, t = _inputs(3, 5, 7, seed=1)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    for kw, msg in [(dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"), (dict(min_p=1.5), "min_p"),
                    (dict(top_p=np.array([0.5, 2.0, 0.5])), "top_p"), (dict(top_k=np.array([1, 2])), "shape")]:
        with pytest.raises(ValueError, match=msg):
            linear_log_probs(f32(x), f32(w), jnp.asarray(t), **kw)
    with pytest.raises(ValueError, match="xla"):
        linear_log_probs(f32(x), f32(w), jnp.asarray(t), top_k=3, implementation="triton")


def test_batch_invariant_rows():
    r = trunc_op.INVARIANT_ROWS.get(jax.default_backend(), 1024)
    x, w, b, t = _inputs(r + 8, 19, 67, seed=5, bias=True)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    X, W, B, T = f32(x), f32(w), f32(b), jnp.asarray(t)
    for tr in ({}, dict(top_k=5, top_p=0.9)):
        def call(idx):
            idx = np.asarray(idx)
            return linear_log_probs(X[idx], W, T[idx], B, entropy=True, batch_invariant=True, **tr)

        alone = [call([i]) for i in range(3)]
        for order in ([0, 1, 2, 5], [7, 2, 1, 0], list(range(3, r + 8)) + [0, 1, 2]):
            lp, ent = call(order)
            for pos, row in enumerate(order):
                if row < 3:
                    assert np.array_equal(np.asarray(lp[pos]), np.asarray(alone[row][0][0]))
                    assert np.array_equal(np.asarray(ent[pos]), np.asarray(alone[row][1][0]))
