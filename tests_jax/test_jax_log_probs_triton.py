"""The "triton" backend of logitless.jax.linear_log_probs against the float64 reference.

On a machine without GPU the PyTorch op's kernels (``triton_lib/log_probs_kernels.py``)
run on Triton's CPU interpreter (through ``jax.pure_callback``): shapes stay tiny. On an
NVIDIA GPU they run through jax-triton. Needs the triton package (skipped, with the
reason, without it). The criterion is ``helpers.assert_close_to_ref``: |ours - float64|
<= |plain JAX in the same dtype - float64| + tol, for both outputs and every gradient
(random upstream gradients on both outputs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import (
    LOG_PROB_OPTIONS,
    MAX_SHARED,
    assert_jit_matches_eager_and_repeats,
    assert_unsupported_without_jax_triton_on_a_gpu,
    check_log_probs,
    compile_launches_through_jax_triton,
    inputs,
    log_probs_reference64,
    needs_triton,
    run_without_torch,
    upstream,
)

pytestmark = needs_triton

from logitless.jax import linear_log_probs  # noqa: E402
from logitless.jax.formulas import log_probs as lpf  # noqa: E402
from logitless.jax.ops.common import choice  # noqa: E402
from logitless.jax.ops.common import triton as rt  # noqa: E402
from logitless.jax.ops.linear_log_probs import api  # noqa: E402
from logitless.jax.ops.linear_log_probs.reference import linear_log_probs_reference  # noqa: E402
from logitless.jax.planning import triton_plan  # noqa: E402

ON_GPU = jax.devices()[0].platform == "gpu"
OPTIONS = LOG_PROB_OPTIONS
#: Forces several backward column chunks (a fori_loop) and a ragged tail at the test
#: shapes on the interpreter's tiles (block_v = 32: chunks of 64 to 96 columns).
SMALL_BUDGET = 20_000


def _check(x, w, t, b, dtype, kw, budget=SMALL_BUDGET):
    return check_log_probs(x, w, t, b, dtype, kw, budget, implementation="triton")


def test_uses_the_kernels_and_chunks_at_the_small_budget():
    # The test shapes really take the fori_loop over several chunks plus a tail.
    p = triton_plan(29, 211, 20, 4, SMALL_BUDGET, interpret=True)
    assert p.vocab_chunk < 211 and 211 // p.vocab_chunk >= 2 and 211 % p.vocab_chunk, p
    assert p.vocab_splits > 1  # the forward's split merge is exercised


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_against_float64(dtype, option):
    # V prime, H not a multiple of 16, ignored tokens, bias with "plain" and "all".
    x, w, t, b = inputs(29, 20, 211, dtype, seed=len(option), bias=option in ("plain", "all"), ignore=(3, 17))
    if option == "ignore_index":
        t = jnp.where(t == -100, 5, t).at[jnp.array([1, 9])].set(5)  # -100 is out of range here
    _check(x, w, t, b, dtype, OPTIONS[option])


@pytest.mark.parametrize("budget", [None, 1])
def test_budgets(budget):
    # None: one chunk covers V (dx = dz @ w, no accumulator); 1: the smallest chunks.
    x, w, t, b = inputs(11, 16, 131, "bfloat16", seed=2, bias=True, ignore=(5,))
    _check(x, w, t, b, "bfloat16", dict(entropy=True, temperature=0.8), budget=budget)


def test_float16():
    x, w, t, b = inputs(9, 16, 67, "float16", seed=8, bias=True)
    _check(x, w, t, b, "float16", dict(entropy=True, softcap=5.0, temperature=0.9))


@pytest.mark.parametrize("shape", [(1, 16, 7), (3, 7, 1), (2, 8, 40), (17, 13, 97)])
def test_odd_shapes(shape):
    n, h, v = shape
    x, w, t, b = inputs(n, h, v, seed=n, bias=True)
    _check(x, w, t, b, "float32", dict(entropy=True, temperature=0.6))


def test_three_dimensional():
    x, w, t, b = inputs(0, 12, 61, lead=(2, 5), seed=5, bias=True, ignore=(2,))
    (lp, h), _ = _check(x, w, t, b, "float32", dict(entropy=True, softcap=5.0))
    assert lp.shape == h.shape == (2, 5)


def test_empty_inputs():
    x = jnp.zeros((0, 3, 8), jnp.float32)
    w = jnp.ones((11, 8), jnp.float32)
    t = jnp.zeros((0, 3), jnp.int32)
    lp, h = linear_log_probs(x, w, t, entropy=True, implementation="triton")
    assert lp.shape == h.shape == (0, 3) and lp.dtype == jnp.float32
    dx = jax.grad(lambda x: jnp.sum(linear_log_probs(x, w, t, implementation="triton")))(x)
    assert dx.shape == x.shape and not np.asarray(dx).any()


def test_special_values():
    f = lambda x, t, **kw: linear_log_probs(x, w, t, entropy=True, implementation="triton", **kw)
    # ignored tokens: 0 outputs and no gradient, even under an inf upstream gradient
    x, w, t, _ = inputs(6, 8, 31, seed=4, ignore=(0, 4))
    g = jnp.ones(6).at[jnp.array([0, 4])].set(jnp.inf)
    lp, h = f(x, t)
    assert np.all(np.asarray(lp)[[0, 4]] == 0) and np.all(np.asarray(h)[[0, 4]] == 0)
    assert np.all(np.asarray(lp)[[1, 2, 3, 5]] < 0) and np.all(np.asarray(h)[[1, 2, 3, 5]] > 0)
    dx = np.asarray(jax.grad(lambda x: jnp.sum(jnp.where(t == -100, 0.0, f(x, t)[0] * g + f(x, t)[1] * g)))(x))
    assert np.all(dx[[0, 4]] == 0) and np.isfinite(dx).all() and np.abs(dx[[1, 2]]).max() > 0
    # all ignored
    tall = jnp.full((6,), -100)
    assert not np.asarray(f(x, tall)[0]).any()
    assert not np.asarray(jax.grad(lambda x: jnp.sum(f(x, tall)[1]))(x)).any()
    # out of range: NaN for that token only (outputs and gradients)
    bad = t.at[2].set(31).at[3].set(-3)  # traced (a jit argument): concrete CPU tokens would raise
    lp, h = (np.asarray(a) for a in jax.jit(f)(x, bad))
    assert np.isnan(lp[[2, 3]]).all() and np.isnan(h[[2, 3]]).all() and np.isfinite(lp[[1, 5]]).all()
    dx = np.asarray(jax.jit(jax.grad(lambda x, t: jnp.sum(f(x, t)[0])))(x, bad))
    assert np.isnan(dx[[2, 3]]).all() and np.isfinite(dx[[0, 1, 4, 5]]).all()
    # inf / NaN inputs give NaN for their token
    assert np.isnan(np.asarray(f(x.at[1, 0].set(jnp.nan), t)[0])[1])


def test_gradient_of_one_output_alone():
    # entropy only (no cotangent for logp) and logp only with entropy=True
    x, w, t, b = inputs(11, 12, 53, seed=13, bias=True)
    for pick in (0, 1):
        f = lambda x, w, b: jnp.sum(linear_log_probs(x, w, t, b, entropy=True, temperature=0.8,
                                                     memory_budget=SMALL_BUDGET, implementation="triton")[pick])
        r = lambda x, w, b: jnp.sum(linear_log_probs_reference(x, w, t, b, temperature=0.8)[pick])
        for g, gr in zip(jax.grad(f, (0, 1, 2))(x, w, b), jax.grad(r, (0, 1, 2))(x, w, b)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(gr), rtol=1e-4, atol=2e-5)


def test_matches_the_xla_backend():
    x, w, t, b = inputs(19, 24, 157, seed=6, bias=True, ignore=(1,))
    kw = dict(entropy=True, temperature=0.7, softcap=6.0, memory_budget=SMALL_BUDGET)
    g1, g2 = (jnp.asarray(a) for a in upstream(t.shape))

    def loss(impl):
        return lambda x, w, b: sum(jnp.sum(o * g) for o, g in
                                   zip(linear_log_probs(x, w, t, b, implementation=impl, **kw), (g1, g2)))

    for impl_out, xla_out in zip(
            (linear_log_probs(x, w, t, b, implementation="triton", **kw),
             jax.grad(loss("triton"), (0, 1, 2))(x, w, b)),
            (linear_log_probs(x, w, t, b, implementation="xla", **kw),
             jax.grad(loss("xla"), (0, 1, 2))(x, w, b))):
        for a, c in zip(impl_out, xla_out):
            np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-5, atol=2e-6)


def test_jit_vmap_and_bitwise_repeatable():
    x, w, t, b = inputs(10, 16, 83, "bfloat16", seed=1, bias=True, ignore=(1,))
    g1, g2 = (jnp.asarray(a) for a in upstream(t.shape))
    f = lambda x, w, b: linear_log_probs(x, w, t, b, entropy=True, temperature=0.9, implementation="triton",
                                         memory_budget=SMALL_BUDGET)
    step = jax.value_and_grad(lambda *a: jnp.sum(f(*a)[0] * g1) + jnp.sum(f(*a)[1] * g2), argnums=(0, 1, 2))
    assert_jit_matches_eager_and_repeats(step, x, w, b)
    # vmap: the kernels run once per batch element (sequential_vmap)
    xs, ts = inputs(0, 8, 37, lead=(3, 4), seed=3, ignore=(2,))[::2]
    wv = inputs(1, 8, 37, seed=9)[1]
    fv = lambda x, t: linear_log_probs(x, wv, t, entropy=True, implementation="triton")
    lp, h = jax.jit(jax.vmap(fv))(xs, ts)
    gx = jax.grad(lambda x: jnp.sum(jax.vmap(fv)(x, ts)[1]))(xs)
    for i in range(3):
        rlp, rh = linear_log_probs_reference(xs[i], wv, ts[i])
        np.testing.assert_allclose(np.asarray(lp[i]), np.asarray(rlp), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(h[i]), np.asarray(rh), rtol=1e-5, atol=1e-6)
        rgx = jax.grad(lambda x: jnp.sum(linear_log_probs_reference(x, wv, ts[i])[1]))(xs[i])
        np.testing.assert_allclose(np.asarray(gx[i]), np.asarray(rgx), rtol=1e-4, atol=1e-6)


def test_merge_splits_equals_one_pass():
    # The forward's merge of per-split (m, s, u) in float64: equal to the one-pass
    # statistics, also with a split that saw only -inf (a masked part).
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        a = jnp.asarray(rng.standard_normal((5, 40)) * 4)
        parts = [a[:, :7], a[:, 7:19], a[:, 19:]]
        m, s, u = [], [], []
        for p in parts:
            mi, si, ui = lpf.online_update(p, jnp.full((5,), -jnp.inf), jnp.zeros(5), jnp.zeros(5))
            m.append(mi)
            s.append(si)
            u.append(ui)
        m.append(jnp.full((5,), -jnp.inf))
        s.append(jnp.zeros(5))
        u.append(jnp.zeros(5))
        lse, h = lpf.merge_splits(jnp.stack(m), jnp.stack(s), jnp.stack(u))
        ref_lse = jax.nn.logsumexp(a, axis=1)
        lp = jax.nn.log_softmax(a, axis=1)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-13)
        np.testing.assert_allclose(np.asarray(h), np.asarray(-jnp.sum(jnp.exp(lp) * lp, axis=1)), rtol=1e-12)
        lse2, none = lpf.merge_splits(jnp.stack(m), jnp.stack(s), None)
        assert none is None and np.array_equal(np.asarray(lse2), np.asarray(lse))


def test_float64_is_refused():
    assert api.BACKENDS["triton"].unsupported((4, 8), (31, 8), jnp.float64, softcap=None, has_bias=False)
    with pytest.raises(ValueError, match="triton.*float64|float64.*triton"):
        api.choose_backend("triton", (4, 8), (31, 8), jnp.float64, None, False)
    with jax.enable_x64(True):
        x = jnp.ones((2, 4), jnp.float64)
        with pytest.raises(ValueError, match="jax-triton"):
            linear_log_probs(x, x[:1].repeat(5, 0), jnp.array([1, 2]), implementation="triton")


def test_automatic_choice(monkeypatch):
    # The policy of linear_cross_entropy: triton on NVIDIA GPUs (mosaic_gpu first on
    # SM90 once this op has a sharded path: by name only now), never the interpreter; xla elsewhere.
    args = ((4, 8), (31, 8), jnp.bfloat16, None, False)
    if not ON_GPU:
        assert api.choose_backend(None, *args) == "xla"
        x, w, t, _ = inputs(4, 8, 31)
        np.testing.assert_array_equal(np.asarray(linear_log_probs(x, w, t)),
                                      np.asarray(linear_log_probs(x, w, t, implementation="xla")))
    monkeypatch.setattr(choice, "is_nvidia_gpu", lambda: True)
    for sm90 in (False, True):  # A100, L4, RTX; H100 (mosaic_gpu is not automatic for this op)
        monkeypatch.setattr(choice, "is_sm90", lambda: sm90)
        monkeypatch.setattr(rt, "is_supported", lambda *a, **k: True)
        assert api.choose_backend(None, *args) == "triton"
    monkeypatch.setattr(rt, "is_supported", lambda *a, **k: False)  # e.g. no jax-triton, or fp64
    assert api.choose_backend(None, *args) == "xla"


def test_without_jax_triton_on_a_gpu_it_is_unsupported(monkeypatch):
    assert_unsupported_without_jax_triton_on_a_gpu(monkeypatch, api.BACKENDS)
    monkeypatch.setattr(rt, "platform", lambda: "cpu")
    monkeypatch.setattr(rt, "has_triton", lambda: False)
    x, w, t, _ = inputs(4, 8, 23)
    with pytest.raises(ValueError, match="jax-triton"):
        linear_log_probs(x, w, t, implementation="triton")


def test_kernels_import_without_torch():
    # The moved kernels and the backend are framework-free: no torch anywhere.
    out = run_without_torch(
        "import logitless.triton_lib.log_probs_kernels\n"
        "import jax.numpy as jnp\n"
        "from logitless.jax import linear_log_probs\n"
        "x = jnp.ones((2, 4)); w = jnp.ones((5, 4)); t = jnp.array([1, 2])\n"
        "print(float(linear_log_probs(x, w, t, entropy=True, implementation='triton')[1][0]))\n"
        "assert 'torch' not in sys.modules\n"
    )
    assert abs(float(out.strip()) - np.log(5)) < 1e-6


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled kernels through jax-triton)")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_at_a_medium_shape(dtype):
    # GPU tiles (128 x 256 bf16), vocabulary splits, a persistent dlogits, chunks + tail.
    x, w, t, b = inputs(1000, 256, 32003, dtype, seed=12, bias=True, ignore=(7,))
    _check(x, w, t, b, dtype, dict(entropy=True, temperature=0.7, softcap=30.0), budget=8 * 2**20)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled kernels through jax-triton)")
def test_gpu_bf16_temperature_is_exact():
    x, w, t, _ = inputs(512, 128, 5003, "bfloat16", seed=9, scale=2.0)
    lp, h = linear_log_probs(x, w, t, entropy=True, temperature=0.7, implementation="triton")
    (rlp, rh), _ = log_probs_reference64(x, w, t, None, dict(entropy=True, temperature=0.7), *upstream(t.shape))
    assert np.abs(np.asarray(lp, np.float64) - rlp).max() < 1e-4
    assert np.abs(np.asarray(h, np.float64) - rh).max() < 1e-4


@pytest.mark.parametrize("cc", sorted(MAX_SHARED))
def test_kernels_compile_through_jax_triton_and_fit_shared_memory(cc, monkeypatch):
    # jax-triton's own compile path (kernel arguments, constexprs, Triton -> PTX) on the
    # launches the backend makes at an RL shape (qwen3-8b, 8k tokens: entropy, soft-cap,
    # bias, T = 0.7), for A100, RTX 30/40 and H100 targets: no GPU needed.
    from logitless.jax.ops.linear_log_probs import triton_backend as backend
    from logitless.jax.ops.linear_log_probs import triton_kernels
    from logitless.triton_lib import log_probs_kernels

    shared, names = compile_launches_through_jax_triton(monkeypatch, backend, (log_probs_kernels, triton_kernels),
                                                        cc)
    n, h, v = 8192, 4096, 151936
    bf = jnp.bfloat16
    x, w = jax.ShapeDtypeStruct((n, h), bf), jax.ShapeDtypeStruct((v, h), bf)
    b, t = jax.ShapeDtypeStruct((v,), bf), jax.ShapeDtypeStruct((n,), jnp.int32)
    lse, coef = jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((3, n), jnp.float32)
    opts = api.LogProbOptions.checked(temperature=0.7, entropy=True, softcap=30.0, ignore_index=-100)
    kw = dict(opts=opts, budget=256 * 2**20)
    jax.eval_shape(lambda *a: backend.forward(*a, **kw), x, w, b, t)
    jax.eval_shape(lambda *a: backend.backward(*a, **kw), x, w, b, t, lse, coef)
    assert {"logp_forward_kernel", "logp_dlogits_chunk_kernel"} <= set(names), names
    assert len(shared) >= 2 and max(shared) <= MAX_SHARED[cc], shared
