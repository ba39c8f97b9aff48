"""logitless.jax.linear_log_probs (xla backend) against a float64 jnp reference with the
logits materialised (``jax.nn.log_softmax``, differentiated by jax.grad)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import logitless.jax as lj
from logitless.jax import linear_log_probs
from logitless.jax.ops.linear_log_probs.reference import linear_log_probs_reference

from .helpers import LOG_PROB_OPTIONS, check_log_probs, inputs, log_probs_reference64, run_without_torch, upstream

OPTIONS = LOG_PROB_OPTIONS
#: Forces several column *and* row chunks with ragged tails at the test shapes.
SMALL_BUDGET = 40_000


def _check(x, w, t, b, dtype, kw, budget=None):
    return check_log_probs(x, w, t, b, dtype, kw, budget)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("budget", [None, SMALL_BUDGET])
def test_options_against_float64(dtype, option, budget):
    kw = OPTIONS[option]
    x, w, t, b = inputs(37, 24, 307, dtype, seed=3, bias=option in ("plain", "all"), ignore=(4, 20))
    if option == "ignore_index":
        t = jnp.where(t == -100, 5, t).at[jnp.array([1, 9])].set(5)  # -100 is out of range here
    _check(x, w, t, b, dtype, kw, budget)


@pytest.mark.parametrize("shape", [(1, 8, 5), (3, 13, 131), (40, 33, 1031), (17, 16, 2)])
def test_odd_shapes(shape):
    n, h, v = shape
    x, w, t, b = inputs(n, h, v, "float32", seed=n, bias=True)
    _check(x, w, t, b, "float32", dict(entropy=True, temperature=0.6), budget=SMALL_BUDGET)


def test_three_dimensional():
    x, w, t, b = inputs(0, 20, 211, "float32", lead=(3, 7), seed=5, ignore=(2,))
    (lp, h), _ = _check(x, w, t, b, "float32", dict(entropy=True, softcap=5.0), budget=SMALL_BUDGET)
    assert lp.shape == h.shape == (3, 7)


def test_empty_inputs():
    x = jnp.zeros((0, 3, 8), jnp.float32)
    w = jnp.ones((11, 8), jnp.float32)
    t = jnp.zeros((0, 3), jnp.int32)
    lp, h = linear_log_probs(x, w, t, entropy=True)
    assert lp.shape == h.shape == (0, 3) and lp.dtype == jnp.float32
    dx = jax.grad(lambda x: jnp.sum(linear_log_probs(x, w, t)))(x)
    assert dx.shape == x.shape


def test_ignored_tokens_give_zero_outputs_and_gradients():
    x, w, t, b = inputs(9, 16, 97, "float32", seed=11, bias=True, ignore=(0, 4, 8))
    lp, h = linear_log_probs(x, w, t, b, entropy=True)
    assert np.all(np.asarray(lp)[[0, 4, 8]] == 0) and np.all(np.asarray(h)[[0, 4, 8]] == 0)
    assert np.all(np.asarray(lp)[[1, 2, 3]] < 0) and np.all(np.asarray(h)[[1, 2, 3]] > 0)
    # inf upstream gradient at the ignored tokens must not leak
    g = jnp.ones(9).at[jnp.array([0, 4, 8])].set(jnp.inf)

    def f(x):
        lp, h = linear_log_probs(x, w, t, b, entropy=True)
        return jnp.sum(jnp.where(t == -100, 0.0, lp * g + h * g)) + 0 * jnp.sum(lp)

    dx = np.asarray(jax.grad(f)(x))
    assert np.all(dx[[0, 4, 8]] == 0) and np.all(np.isfinite(dx))
    assert np.abs(dx[[1, 2, 3]]).max() > 0
    # all ignored: zeros and zero gradients
    tall = jnp.full((9,), -100)
    lp, h = linear_log_probs(x, w, tall, entropy=True)
    assert not np.asarray(lp).any() and not np.asarray(h).any()
    assert not np.asarray(jax.grad(lambda x: jnp.sum(linear_log_probs(x, w, tall)))(x)).any()


def test_out_of_range_token_is_nan_when_traced():
    x, w, t, _ = inputs(6, 8, 31, "float32", seed=2)
    t = t.at[2].set(31).at[4].set(-3)
    if jax.devices()[0].platform == "cpu":  # concrete CPU tokens are checked (tests_jax/test_user_hints.py)
        with pytest.raises(ValueError, match="tokens contains 31"):
            linear_log_probs(x, w, t, entropy=True)
    # traced tokens (a jit argument): never read on the host, NaN for that token
    lp, h = jax.jit(lambda x, t: linear_log_probs(x, w, t, entropy=True))(x, t)
    lp, h = np.asarray(lp), np.asarray(h)
    assert np.isnan(lp[[2, 4]]).all() and np.isnan(h[[2, 4]]).all()
    assert np.isfinite(lp[[0, 1, 3, 5]]).all()
    dx = np.asarray(jax.jit(jax.grad(lambda x, t: jnp.sum(linear_log_probs(x, w, t))))(x, t))
    assert np.isnan(dx[2]).all() and np.isfinite(dx[[0, 1, 3, 5]]).all()


def test_gradient_of_one_output_alone():
    # entropy only (zero upstream gradient of logp) and logp only with entropy=True
    x, w, t, b = inputs(11, 12, 53, "float32", seed=13, bias=True)
    for pick in (0, 1):
        f = lambda x, w, b: jnp.sum(linear_log_probs(x, w, t, b, entropy=True, temperature=0.8,
                                                     memory_budget=SMALL_BUDGET)[pick])
        r = lambda x, w, b: jnp.sum(linear_log_probs_reference(x, w, t, b, temperature=0.8)[pick])
        for g, gr in zip(jax.grad(f, (0, 1, 2))(x, w, b), jax.grad(r, (0, 1, 2))(x, w, b)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(gr), rtol=1e-4, atol=2e-5)


def test_finite_differences_in_float64():
    # Our op in float64 (x64): hand-written backward vs central differences.
    with jax.enable_x64(True):
        rng = np.random.default_rng(21)
        x = jnp.asarray(rng.standard_normal((5, 6)))
        w = jnp.asarray(rng.standard_normal((23, 6)) / 2)
        b = jnp.asarray(rng.standard_normal(23) * 0.3)
        t = jnp.asarray([3, 22, -100, 0, 7])
        g1, g2 = jnp.asarray(rng.standard_normal(5)), jnp.asarray(rng.standard_normal(5))
        kw = dict(entropy=True, temperature=0.7, softcap=2.5, memory_budget=2000)

        def f(x, w, b):
            lp, h = linear_log_probs(x, w, t, b, **kw)
            assert lp.dtype == jnp.float64
            return jnp.sum(lp * g1) + jnp.sum(h * g2)

        grads = jax.grad(f, (0, 1, 2))(x, w, b)
        eps = 1e-6
        for k, arr in enumerate((x, w, b)):
            flat = np.asarray(arr).reshape(-1)
            for i in rng.choice(flat.size, size=min(12, flat.size), replace=False):
                d = np.zeros_like(flat)
                d[i] = eps
                args = [x, w, b]
                args[k] = arr + jnp.asarray(d.reshape(arr.shape))
                fp = float(f(*args))
                args[k] = arr - jnp.asarray(d.reshape(arr.shape))
                fm = float(f(*args))
                fd = (fp - fm) / (2 * eps)
                assert abs(fd - float(np.asarray(grads[k]).reshape(-1)[i])) < 1e-6 * max(1.0, abs(fd)), (k, i)


def test_jit_vmap_and_static_options():
    x, w, t, b = inputs(12, 16, 67, "float32", seed=4, bias=True)
    eager = linear_log_probs(x, w, t, b, entropy=True, temperature=0.9)
    jitted = jax.jit(lambda x, w, t, b: linear_log_probs(x, w, t, b, entropy=True, temperature=0.9))(x, w, t, b)
    for a, c in zip(eager, jitted):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-6)
    step = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(linear_log_probs(x, w, t, softcap=3.0)), (0, 1)))
    v, (dx, dw) = step(x, w)
    assert np.isfinite(float(v)) and dx.shape == x.shape and dw.shape == w.shape
    xs = jnp.stack([x, 2 * x])
    ts = jnp.stack([t, t])
    batched = jax.vmap(lambda x, t: linear_log_probs(x, w, t))(xs, ts)
    np.testing.assert_allclose(np.asarray(batched[1]), np.asarray(linear_log_probs(2 * x, w, t)), rtol=1e-5, atol=1e-6)


def test_bf16_temperature_is_exact():
    # a = z / T on the fp32 logits: the error vs float64 of the bf16 inputs stays at fp32
    # rounding (dividing x by T in bf16 first would cost ~1e-2).
    x, w, t, _ = inputs(64, 64, 509, "bfloat16", seed=9, scale=2.0)
    lp, h = linear_log_probs(x, w, t, entropy=True, temperature=0.7, memory_budget=SMALL_BUDGET)
    (rlp, rh), _ = log_probs_reference64(x, w, t, None, dict(entropy=True, temperature=0.7), *upstream(t.shape))
    assert np.abs(np.asarray(lp, np.float64) - rlp).max() < 1e-4
    assert np.abs(np.asarray(h, np.float64) - rh).max() < 1e-4


def test_bad_inputs_raise_clear_errors():
    x, w, t, b = inputs(4, 8, 13, "float32", bias=True)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            linear_log_probs(x, w, t, temperature=bad)
    with pytest.raises(TypeError, match="temperature"):
        linear_log_probs(x, w, t, temperature=True)
    with pytest.raises((TypeError, ValueError), match="entropy"):
        linear_log_probs(x, w, t, entropy="yes")
    with pytest.raises(ValueError, match="softcap"):
        linear_log_probs(x, w, t, softcap=-1.0)
    with pytest.raises(ValueError, match="memory_budget"):
        linear_log_probs(x, w, t, memory_budget=-5)
    with pytest.raises(ValueError, match="mosaic_gpu.*xla"):
        linear_log_probs(x, w, t, implementation="mosaic_gpu")
    with pytest.raises(ValueError, match="implementation"):
        linear_log_probs(x, w, t, implementation="cuda")
    with pytest.raises(ValueError, match="tokens"):
        linear_log_probs(x, w, t[:3])
    with pytest.raises(TypeError, match="tokens"):
        linear_log_probs(x, w, t.astype(jnp.float32))
    with pytest.raises(ValueError, match="hidden size"):
        linear_log_probs(x, w[:, :7], t)
    with pytest.raises(ValueError, match="weight"):
        linear_log_probs(x, w[None], t)
    with pytest.raises(TypeError, match="weight"):
        linear_log_probs(x, w.astype(jnp.bfloat16), t)
    with pytest.raises(ValueError, match="bias"):
        linear_log_probs(x, w, t, b[:5])
    with pytest.raises(TypeError, match="x"):
        linear_log_probs(x.astype(jnp.int32), w, t)
    with pytest.raises(ValueError, match="vocabulary"):
        linear_log_probs(x, w[:0], t)


def test_memory_stays_within_the_budget():
    # Compiled only: fp32 logits would take 1 GiB.
    n, h, v = 4096, 512, 65536
    budget = 64 * 2**20
    x = jax.ShapeDtypeStruct((n, h), jnp.float32)
    w = jax.ShapeDtypeStruct((v, h), jnp.float32)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)

    def both(x, w, t):
        lp, hh = linear_log_probs(x, w, t, entropy=True, temperature=0.7, memory_budget=budget)
        return jnp.sum(lp) + jnp.sum(hh)

    step = jax.value_and_grad(both, argnums=(0, 1))
    slack = 2 * 2**20 if jax.devices()[0].platform == "cpu" else 96 * 2**20
    for fn in (both, step):
        mem = jax.jit(fn).lower(x, w, t).compile().memory_analysis()
        if mem is None:
            pytest.skip("this backend gives no memory analysis")
        assert mem.temp_size_in_bytes <= budget + slack, (fn, mem.temp_size_in_bytes)


def test_exported_and_never_imports_torch():
    assert "linear_log_probs" in lj.__all__
    out = run_without_torch(
        "import jax.numpy as jnp\n"
        "import logitless.jax as lj\n"
        "assert 'torch' not in sys.modules\n"
        "x = jnp.zeros((2, 4)); w = jnp.zeros((5, 4)); t = jnp.array([1, 2])\n"
        "print(float(lj.linear_log_probs(x, w, t, entropy=True)[1][0]))\n"
    )
    assert abs(float(out.strip()) - np.log(5)) < 1e-6
