"""linear_log_probs(implementation="mosaic_gpu") (Pallas Mosaic GPU kernels) against float64.

On an SM90 GPU the kernels run for real (the whole matrix). On a CPU they run under
Mosaic GPU's interpret mode (simulated warpgroups, TMA, WGMMA): a smaller set of cases
with small tiles, the rest skip with a reason. ``test_lowers_for_cuda*`` lower the real
kernels for CUDA on any machine (layouts, TMA, shared memory at the RL shapes).
Run: ``PYTHONPATH=src python -m pytest tests_jax/test_jax_log_probs_mosaic.py -q``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

pytest.importorskip("jax.experimental.pallas.mosaic_gpu",
                    reason="this jax has no Pallas Mosaic GPU (jax.experimental.pallas.mosaic_gpu)")
from logitless.jax import linear_log_probs  # noqa: E402
from logitless.jax.ops.common import mosaic_gpu as kind  # noqa: E402
from logitless.jax.ops.linear_log_probs import mosaic_gpu_backend as mg  # noqa: E402  (a failure here is a bug)
from logitless.jax.ops.linear_log_probs.reference import linear_log_probs_reference  # noqa: E402
from logitless.options import LogProbOptions  # noqa: E402

from .helpers import (  # noqa: E402
    LOG_PROB_OPTIONS,
    assert_close_to_ref,
    captured_constants,
    check_log_probs,
    inputs,
    log_prob_reference_kw,
    log_probs_reference64,
    mosaic_platform,
    project,
    upstream,
)

PLATFORM = mosaic_platform()
pytestmark = pytest.mark.skipif(
    PLATFORM == "other-gpu", reason="mosaic_gpu kernels need an SM90 GPU (or the CPU interpreter)")
gpu_only = pytest.mark.skipif(
    PLATFORM != "sm90", reason="larger case: too slow for Mosaic GPU's CPU interpreter; runs on an SM90 GPU")

OPTIONS = LOG_PROB_OPTIONS
#: Small tiles: several tiles, splits and chunks at small shapes (fast in the interpreter).
SMALL = mg.FwdConfig(block_n=64, block_v=64, stages=2, lag=0)


def _check(x, w, t, b, dtype, kw, budget=None):
    """Outputs and gradients (random upstream on both outputs, the op under jax.jit) of
    the mosaic_gpu backend vs float64, plain JAX in the same dtype as the yardstick."""
    return check_log_probs(x, w, t, b, dtype, kw, budget, implementation="mosaic_gpu", jit=True)


# -------------------------------------------------------------------------- the public op


CPU_OPTIONS = ("plain", "all")


@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_against_float64(option):
    """Each option alone and all combined (bias with "plain" and "all"); V prime, H = 64."""
    if PLATFORM == "interpret" and option not in CPU_OPTIONS:
        pytest.skip("interpreter: only 'plain' and 'all' on the CPU; every option runs on an SM90 GPU")
    kw = OPTIONS[option]
    x, w, t, b = inputs(37, 64, 307, "bfloat16", seed=3, bias=option in ("plain", "all"), ignore=(4, 20))
    if option == "ignore_index":
        t = jnp.where(t == -100, 5, t).at[jnp.array([1, 9])].set(5)  # -100 is out of range here
    outs, _ = _check(x, w, t, b, "bfloat16", kw)
    ignored = np.asarray(t) == kw.get("ignore_index", -100)
    assert np.all(np.asarray(outs[0])[ignored] == 0.0)


GPU_CASES = [(opt, False, None) for opt in OPTIONS] + [("plain", True, 40_000), ("entropy", True, 40_000),
                                                         ("all", True, None), ("all", False, 40_000)]


@gpu_only
@pytest.mark.parametrize("option,bias,budget", GPU_CASES)
def test_options_gpu(option, bias, budget):
    """Every option; with bias; one and several backward chunks (budget); 300 tokens."""
    kw = OPTIONS[option]
    x, w, t, b = inputs(300, 128, 1031, "bfloat16", seed=5, bias=bias, ignore=(4, 20, 299))
    if option == "ignore_index":
        t = jnp.where(t == -100, 5, t).at[jnp.array([1, 9])].set(5)
    _check(x, w, t, b, "bfloat16", kw, budget)


@gpu_only
@pytest.mark.parametrize("shape", [(1, 64, 8), (3, 100, 131), (40, 72, 1031), (17, 192, 2), (513, 256, 4096 + 8)])
def test_odd_shapes(shape):
    """One token, H not a multiple of 16/64, V prime or tiny, ragged token blocks."""
    n, h, v = shape
    x, w, t, b = inputs(n, h, v, "bfloat16", seed=n, bias=True)
    _check(x, w, t, b, "bfloat16", dict(entropy=True, temperature=0.6), budget=40_000)


@gpu_only
def test_float16_and_three_dimensional():
    x, w, t, b = inputs(0, 128, 509, "float16", lead=(3, 7), seed=5, ignore=(2,))
    (lp, h), _ = _check(x, w, t, b, "float16", dict(entropy=True, softcap=5.0))
    assert lp.shape == h.shape == (3, 7)


def test_empty_and_unsupported_inputs():
    x = jnp.zeros((0, 3, 64), jnp.bfloat16)
    w = jnp.ones((11, 64), jnp.bfloat16)
    t = jnp.zeros((0, 3), jnp.int32)
    lp, h = linear_log_probs(x, w, t, entropy=True, implementation="mosaic_gpu")
    assert lp.shape == h.shape == (0, 3)
    x32, w32, t32, _ = inputs(4, 64, 16, "float32")
    with pytest.raises(ValueError, match="mosaic_gpu.*bfloat16"):
        linear_log_probs(x32, w32, t32, implementation="mosaic_gpu")
    with pytest.raises(ValueError, match="unsupported"):
        mg.forward(x32, w32, None, t32, opts=LogProbOptions())


def test_out_of_range_token_gives_nan_only_there():
    x, w, t, _ = inputs(16, 64, 96, "bfloat16", seed=2)
    t = t.at[3].set(500).at[5].set(-100)
    # traced tokens (a jit argument): concrete CPU tokens would raise ValueError instead
    lp, h = jax.jit(lambda x, t: linear_log_probs(x, w, t, entropy=True, implementation="mosaic_gpu"))(x, t)
    lp, h = np.asarray(lp), np.asarray(h)
    assert np.isnan(lp[3]) and np.isnan(h[3])
    assert lp[5] == 0.0 and h[5] == 0.0
    others = np.ones(16, bool)
    others[[3, 5]] = False
    assert np.isfinite(lp[others]).all() and (lp[others] < 0).all() and (h[others] > 0).all()


# -------------------------------------------------------------------------- the kernels alone


def _ref_stats(x, w, b, t, opts):
    with jax.enable_x64(True):
        as64 = lambda a: None if a is None else jnp.asarray(np.asarray(jnp.asarray(a, jnp.float32), np.float64))
        z = as64(x) @ as64(w).T
        if b is not None:
            z = z + as64(b)
        if opts.softcap is not None:
            z = opts.softcap * jnp.tanh(z / opts.softcap)
        a = z / opts.temperature
        lse = jax.nn.logsumexp(a, axis=1)
        lp = a - lse[:, None]
        ent = -(jnp.exp(lp) * lp).sum(1)
        tt = np.asarray(t)
        ok = (tt >= 0) & (tt < w.shape[0])
        at = np.where(ok, np.asarray(a)[np.arange(len(tt)), np.clip(tt, 0, w.shape[0] - 1)], 0.0)
        return np.asarray(lse), at, np.asarray(ent)


# (n, h, v, splits, temperature, softcap, bias): several splits (the entropy merge),
# ragged N, V and H, one token.
FWD_CASES = [
    (64, 128, 328, 3, 0.7, None, False),
    (77, 100, 331, 2, 1.3, 3.0, True),
    (1, 64, 136, None, 1.0, None, True),
]


@pytest.mark.parametrize("cfg", [SMALL, dataclasses.replace(SMALL, lag=1)], ids=["lag0", "lag1"])
@pytest.mark.parametrize("n,h,v,splits,temp,softcap,bias", FWD_CASES)
def test_forward_statistics_match_float64(n, h, v, splits, temp, softcap, bias, cfg):
    x, w, t, b = inputs(n, h, v, "bfloat16", seed=n + v, bias=bias)
    t = t.at[0].set(-100)
    opts = LogProbOptions.checked(temperature=temp, entropy=True, softcap=softcap)
    cfg = dataclasses.replace(cfg, splits=splits)
    lse, at, ent = jax.jit(lambda x, w, b, t: mg.forward(x, w, b, t, opts=opts, config=cfg))(x, w, b, t)
    r_lse, r_at, r_ent = _ref_stats(x, w, b, t, opts)
    assert lse.shape == at.shape == ent.shape == (n,) and lse.dtype == jnp.float32
    # fp32 statistics of exact bf16 products: errors are fp32 rounding only.
    scale = max(1.0, float(np.abs(r_lse).max()))
    assert np.abs(np.asarray(lse, np.float64) - r_lse).max() < 2e-5 * scale
    assert np.abs(np.asarray(at, np.float64) - r_at).max() < 2e-5 * scale
    assert np.abs(np.asarray(ent, np.float64) - r_ent).max() < 2e-5 * scale
    assert float(at[0]) == 0.0  # an ignored token never matches a column


@pytest.mark.parametrize("entropy", [False, True])
def test_backward_small_tiles_several_chunks(entropy):
    """The dz kernel + XLA GEMMs with 64-column tiles and a budget of one tile per chunk
    (several chunks, a ragged last one), bias and softcap: vs float64 gradients."""
    n, h, v = 70, 64, 200
    x, w, t, b = inputs(n, h, v, "bfloat16", seed=9, bias=True, ignore=(5,))
    opts = LogProbOptions.checked(temperature=0.8, entropy=entropy, softcap=6.0)
    kw = dict(temperature=0.8, entropy=entropy, softcap=6.0)
    g1, g2 = upstream((n,))

    from logitless.jax.formulas import log_probs as lpf

    lse, at, ent = mg.forward(x, w, b, t, opts=opts, config=SMALL)
    coef = lpf.grad_coefficients(ent, t, jnp.asarray(g1), jnp.asarray(g2) if entropy else None, v, opts)
    dx, dw, db = jax.jit(lambda x, w, b: mg.backward(x, w, b, t, lse, coef, opts=opts, budget=1, config=SMALL))(x, w, b)
    _, (rdx, rdw, rdb) = log_probs_reference64(x, w, t, b, kw, g1, g2)
    plain = lambda x, w, b: linear_log_probs_reference(x, w, t, b, dtype=x.dtype, **log_prob_reference_kw(kw))
    pgrads = jax.grad(lambda *a: project(plain(*a)[: 2 if entropy else 1], g1, g2), argnums=(0, 1, 2))(x, w, b)
    for name, g, p, r, a in zip(("dx", "dw", "db"), (dx, dw, db), pgrads, (rdx, rdw, rdb), (x, w, b)):
        assert g.dtype == a.dtype and g.shape == a.shape, name
        assert_close_to_ref(name, g, p, r, "bfloat16")
    assert np.all(np.asarray(dx[5].astype(jnp.float32)) == 0.0)  # the ignored token


def test_is_supported():
    bf = jnp.bfloat16
    assert mg.is_supported((8192, 4096), (151936, 4096), bf) and mg.is_fast((8192, 4096), (151936, 4096), bf)
    assert mg.is_supported((77, 100), (331, 100), jnp.float16, has_bias=True)
    assert not mg.is_fast((77, 100), (331, 100), jnp.float16)
    assert not mg.is_fast((8, 64), (328, 64), bf, has_bias=True)
    assert not mg.is_supported((8, 64), (328, 64), jnp.float32)
    assert not mg.is_supported((8, 64), (328, 32), bf)


# -------------------------------------------------------------------------- lowering for CUDA


RL_SHAPES = [(8192, 4096, 151936), (16384, 3584, 152064), (8192, 4096, 128256)]


@pytest.mark.parametrize("shape", RL_SHAPES, ids=["qwen3-8b-8k", "qwen2.5-7b-16k", "llama3.1-8b-8k"])
def test_lowers_for_cuda_at_rl_shapes(shape, monkeypatch):
    """fwd and fwd+bwd (both outputs) through the public op, lowered (not run) for CUDA on
    any machine: two Mosaic kernels (statistics, dz), no captured constants, no padded
    copy of W at these aligned shapes."""
    n, h, v = shape
    monkeypatch.setattr(kind, "INTERPRET", False)
    x = jax.ShapeDtypeStruct((n, h), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((v, h), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)

    def f(x, w, t):
        lp, ent = linear_log_probs(x, w, t, temperature=0.7, entropy=True, implementation="mosaic_gpu")
        return jnp.sum(lp) + jnp.sum(ent)

    for fn in (f, jax.value_and_grad(f, argnums=(0, 1))):
        def lower():
            text = jax.jit(fn).trace(x, w, t).lower(lowering_platforms=("cuda",)).as_text()
            calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
            # forward: the statistics kernel; backward: the dz kernel (a second
            # compiled width for a ragged last chunk)
            assert len(calls) == 1 if fn is f else 2 <= len(calls) <= 3, len(calls)
            assert f"tensor<{v}x{h + 64}xbf16>" not in text  # no padded W
        assert captured_constants(lower) == []


@pytest.mark.parametrize("kw", [dict(softcap=30.0), dict(entropy=True, temperature=0.6), dict(bias=True)],
                         ids=["softcap", "entropy", "bias"])
def test_lowers_for_cuda_options(kw, monkeypatch):
    monkeypatch.setattr(kind, "INTERPRET", False)
    kw = dict(kw)
    n, h, v = 1000, 512, 4000 + 3
    x = jax.ShapeDtypeStruct((n, h), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((v, h), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)
    b = jax.ShapeDtypeStruct((v,), jnp.bfloat16) if kw.pop("bias", False) else None
    ent = kw.get("entropy", False)

    def f(x, w, b):
        out = linear_log_probs(x, w, jnp.zeros((n,), jnp.int32), b, implementation="mosaic_gpu", **kw)
        return jnp.sum(out[0]) + jnp.sum(out[1]) if ent else jnp.sum(out)

    del t
    argnums = (0, 1) if b is None else (0, 1, 2)
    text = jax.jit(jax.value_and_grad(f, argnums=argnums)).trace(x, w, b).lower(
        lowering_platforms=("cuda",)).as_text()
    assert 2 <= text.count("custom_call @mosaic_gpu") <= 3


def test_vmap_matches_per_example_calls():
    """jax.vmap over a batch of (x, tokens): the Mosaic kernels under the batching rule."""
    x, w, t, _ = inputs(16, 64, 96, "bfloat16", seed=13)
    xs, ts = jnp.stack([x, (2 * x).astype(x.dtype)]), jnp.stack([t, t[::-1]])
    f = lambda x, t: linear_log_probs(x, w, t, entropy=True, temperature=0.9, implementation="mosaic_gpu")
    lp_b, h_b = jax.jit(jax.vmap(f))(xs, ts)
    for i in range(2):
        lp, h = f(xs[i], ts[i])
        np.testing.assert_allclose(np.asarray(lp_b[i]), np.asarray(lp), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(h_b[i]), np.asarray(h), rtol=1e-6, atol=1e-6)
