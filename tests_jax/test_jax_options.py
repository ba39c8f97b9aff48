"""``class_weight=`` and ``shift=`` of logitless.jax.linear_cross_entropy, on every backend
this platform runs, against the float64 reference (itself checked by finite differences)."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitless.jax import linear_cross_entropy
from logitless.jax.ops.linear_cross_entropy import api
from logitless.jax.ops.linear_cross_entropy.reference import linear_cross_entropy_ref

from .helpers import argmax_ref, assert_close_to_ref, assert_matches_finite_differences, inputs

HAS_TRITON = importlib.util.find_spec("triton") is not None
ON_GPU = jax.devices()[0].platform == "gpu"


def _backends():
    out = [pytest.param("xla")]
    out.append(pytest.param("triton", marks=pytest.mark.skipif(
        not HAS_TRITON, reason="the triton backend needs the triton package (pip install triton)")))
    return out


def _materialised(x, w, t, b, cw, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                  softcap=None, z_loss=0.0):
    """Plain JAX with the logits in the input dtype and torch's ``weight=`` semantics:
    the baseline error of the criterion."""
    z = jnp.einsum("...h,vh->...v", x, w)
    if b is not None:
        z = z + b
    z = z.astype(jnp.float32)
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    lse = jax.nn.logsumexp(z, axis=-1)
    valid = t != ignore_index
    tc = jnp.where(valid, t, 0)
    zt = jnp.take_along_axis(z, tc[..., None], axis=-1)[..., 0]
    w_t = jnp.where(valid, cw[tc], 0.0)
    eps = label_smoothing
    v = w.shape[0]
    loss = (1 - eps) * w_t * (lse - zt) + eps / v * jnp.sum((lse[..., None] - z) * cw, -1) + z_loss * lse ** 2
    loss = jnp.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / w_t.sum()


def _class_weight(v, seed=3):
    return jnp.asarray(np.random.default_rng(seed).random(v) * 2.0 + 0.05, jnp.float32)


OPTIONS = {
    "plain": {},
    "smooth": dict(label_smoothing=0.15),
    "all": dict(label_smoothing=0.2, z_loss=1e-2, softcap=4.0),
}


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_class_weight_against_float64(backend, dtype, option, reduction):
    # V prime, H not a multiple of 16, ignored tokens, a bias with "all"; a small budget
    # makes several column chunks (with a ragged tail).
    x, w, t, b = inputs(19, 20, 131, dtype, bias=option == "all", ignore=(2, 11), seed=len(option))
    cw = _class_weight(131)
    kw = dict(OPTIONS[option], reduction=reduction)
    g_out = np.arange(1, t.size + 1) / t.size if reduction == "none" else None
    proj = ((lambda loss: jnp.sum(loss * jnp.asarray(g_out, jnp.float32))) if reduction == "none"
            else (lambda loss: loss))
    argnums = (0, 1) if b is None else (0, 1, 2)

    def ours(x, w, b):
        return linear_cross_entropy(x, w, t, b, class_weight=cw, implementation=backend,
                                    memory_budget=20_000, **kw)

    loss, grads = jax.value_and_grad(lambda *a: proj(ours(*a)), argnums=argnums)(x, w, b)
    loss = ours(x, w, b)
    base = lambda x, w, b: _materialised(x, w, t, b, cw, **kw)
    nloss = base(x, w, b)
    ngrads = jax.grad(lambda *a: proj(base(*a)), argnums=argnums)(x, w, b)
    rloss, _, rgrads = linear_cross_entropy_ref(x, w, t, b, class_weight=cw, grad_out=g_out, **kw)
    assert_close_to_ref("loss", loss, nloss, rloss, dtype)
    for name, g, ng, rg, p in zip(("dx", "dw", "db"), grads, ngrads, rgrads, (x, w, b)):
        assert g.dtype == p.dtype and g.shape == p.shape, name
        assert_close_to_ref(name, g, ng, rg, dtype)


@pytest.mark.parametrize("backend", _backends())
def test_class_weight_hv_layout_and_mean_denominator(backend):
    x, w, t, _ = inputs(9, 12, 37, ignore=(4,))
    cw = _class_weight(37)
    loss = linear_cross_entropy(x, w.T, t, class_weight=cw, weight_layout="hv", implementation=backend)
    rl, _, _ = linear_cross_entropy_ref(x, w, t, class_weight=cw)
    np.testing.assert_allclose(float(loss), rl, rtol=2e-5)
    # "mean" divides by the sum of the targets' weights, not by the token count.
    total = float(linear_cross_entropy(x, w, t, class_weight=cw, reduction="sum", implementation=backend))
    wsum = float(jnp.sum(jnp.where(t != -100, cw[jnp.clip(t, 0)], 0.0)))
    np.testing.assert_allclose(float(loss), total / wsum, rtol=2e-5)
    # Uniform weights change nothing; zero weights drop those classes' tokens.
    ones = linear_cross_entropy(x, w, t, class_weight=jnp.ones(37), implementation=backend)
    np.testing.assert_allclose(float(ones), float(linear_cross_entropy(x, w, t, implementation=backend)), rtol=1e-6)


def test_class_weight_gets_no_gradient_and_works_under_jit():
    x, w, t, _ = inputs(6, 8, 23)
    cw = _class_weight(23)
    f = jax.jit(lambda x, cw: linear_cross_entropy(x, w, t, class_weight=cw, label_smoothing=0.1))
    dx, dcw = jax.grad(f, argnums=(0, 1))(x, cw)
    assert np.all(np.asarray(dcw) == 0) and np.isfinite(np.asarray(dx)).all()


def test_class_weight_bad_inputs_raise():
    x, w, t, _ = inputs(4, 8, 23)
    with pytest.raises(ValueError, match="class_weight"):
        linear_cross_entropy(x, w, t, class_weight=jnp.ones(22))
    with pytest.raises(TypeError, match="class_weight"):
        linear_cross_entropy(x, w, t, class_weight=jnp.ones(23, jnp.int32))
    with pytest.raises(TypeError, match="class_weight"):
        linear_cross_entropy(x, w, t, class_weight=[1.0] * 23)


def test_backends_without_class_weights_are_skipped_or_refused():
    # The automatic choice never picks a backend without class_weights for class weights;
    # naming one raises.
    assert api.choose_backend(None, (4, 8), (31, 8), jnp.float32, None, False, True) in ("xla", "triton")
    try:
        api.BACKENDS["mosaic_gpu"]
    except ImportError as exc:
        pytest.skip(f"mosaic_gpu does not import here: {exc}")
    with pytest.raises(ValueError, match="class_weight=True"):
        api.choose_backend("mosaic_gpu", (4, 8), (31, 8), jnp.bfloat16, None, False, True)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_shift_against_float64(backend, reduction):
    x, w, t, b = inputs(0, 12, 53, lead=(2, 7), bias=True)
    t = t.at[1, 3].set(-100)
    cw = _class_weight(53)
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    g_out = np.arange(1, 15).reshape(2, 7) / 14 if reduction == "none" else None
    proj = ((lambda loss: jnp.sum(loss * jnp.asarray(g_out[:, :-1], jnp.float32))) if reduction == "none"
            else (lambda loss: loss))
    f = lambda x, w, b: linear_cross_entropy(x, w, t, b, shift=True, class_weight=cw,
                                             implementation=backend, **kw)
    loss = f(x, w, b)
    grads = jax.grad(lambda *a: proj(f(*a)), argnums=(0, 1, 2))(x, w, b)
    rloss, _, rgrads = linear_cross_entropy_ref(x, w, t, b, shift=True, class_weight=cw, grad_out=g_out, **kw)
    assert np.shape(loss) == np.shape(rloss) == ((2, 6) if reduction == "none" else ())
    np.testing.assert_allclose(np.asarray(loss), rloss, rtol=2e-5, atol=1e-6)
    for g, rg in zip(grads, rgrads):
        np.testing.assert_allclose(np.asarray(g), rg, rtol=2e-4, atol=2e-6)
    # The last position predicts nothing: no gradient reaches it.
    assert np.all(np.asarray(grads[0])[:, -1] == 0)


@pytest.mark.parametrize("backend", _backends())
def test_shift_equals_slicing_by_hand(backend):
    x, w, t, _ = inputs(0, 16, 41, lead=(3, 5), ignore=(2,))
    by_hand = linear_cross_entropy(x[:, :-1], w, t[:, 1:], reduction="sum", implementation=backend)
    shifted, stats = linear_cross_entropy(x, w, t, reduction="sum", shift=True, return_stats=True,
                                          implementation=backend)
    np.testing.assert_allclose(float(shifted), float(by_hand), rtol=1e-6)
    _, hand_stats = linear_cross_entropy(x[:, :-1], w, t[:, 1:], return_stats=True, implementation=backend)
    assert stats.lse.shape == (3, 4)
    np.testing.assert_allclose(np.asarray(stats.lse), np.asarray(hand_stats.lse), rtol=1e-6)
    assert int(stats.num_tokens) == int(hand_stats.num_tokens)


def test_shift_short_sequences_and_errors():
    w = inputs(1, 8, 11)[1]
    for T in (0, 1):
        x = jnp.ones((2, T, 8))
        t = jnp.zeros((2, T), jnp.int32)
        assert linear_cross_entropy(x, w, t, shift=True, reduction="none").shape == (2, 0)
        assert float(linear_cross_entropy(x, w, t, shift=True, reduction="sum")) == 0.0
        assert np.isnan(float(linear_cross_entropy(x, w, t, shift=True)))
    with pytest.raises(ValueError, match="shift"):
        linear_cross_entropy(jnp.ones((8,)), w, jnp.zeros((), jnp.int32), shift=True)
    with pytest.raises(TypeError, match="shift"):
        linear_cross_entropy(jnp.ones((2, 3, 8)), w, jnp.zeros((2, 3), jnp.int32), shift=1)


def test_finite_differences_of_the_weighted_reference():
    # The reference's analytic gradients with class weights and the shift match central
    # differences of its loss.
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 5))
    w = rng.standard_normal((7, 5))
    b = rng.standard_normal(7)
    t = np.array([[0, 6, -100], [3, 2, 5]])
    cw = rng.random(7) + 0.2
    kw = dict(label_smoothing=0.2, z_loss=0.05, softcap=2.5, reduction="mean", class_weight=cw, shift=True)
    _, _, grads = linear_cross_entropy_ref(x, w, t, b, **kw)
    assert_matches_finite_differences(lambda: linear_cross_entropy_ref(x, w, t, b, **kw)[0], (x, w, b), grads,
                                      rtol=1e-6)


def test_triton_without_its_packages_raises_saying_what_to_install(monkeypatch):
    from logitless.jax.ops.common import triton as rt

    monkeypatch.setattr(rt, "has_triton", lambda: False)
    monkeypatch.setattr(rt, "platform", lambda: "cpu")
    x, w, t, _ = inputs(4, 8, 23)
    with pytest.raises(ValueError, match="jax-triton"):
        linear_cross_entropy(x, w, t, implementation="triton")
    if not ON_GPU:
        assert api.choose_backend(None, (4, 8), (23, 8), jnp.float32, None, False) == "xla"


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", ["plain", "bias-softcap-smoothing", "one-token", "3d-shift", "hv", "class-weight"])
def test_stats_argmax_against_float64(backend, case):
    """LossStats.argmax: the first index of the largest (soft-capped) logit, int32, -1 at
    ignored tokens, from the statistics' pass (odd V, H not a multiple of 16, chunks of a
    few columns through a small budget)."""
    lead = {"one-token": (1,), "3d-shift": (3, 5)}.get(case, (23,))
    ignore = () if case == "one-token" else (0, 4)
    x, w, t, b = inputs(0, 20, 211, lead=lead, bias=case == "bias-softcap-smoothing", ignore=ignore, seed=5)
    kw = {"bias-softcap-smoothing": dict(softcap=2.5, label_smoothing=0.1), "3d-shift": dict(shift=True)}.get(case, {})
    weight, layout = (w.T, "hv") if case == "hv" else (w, "vh")
    if case == "class-weight":
        kw["class_weight"] = jnp.linspace(0.5, 1.5, 211, dtype=jnp.float32)
    for budget in (None, 1 << 12):
        loss, st = linear_cross_entropy(x, weight, t, b, return_stats=True, implementation=backend,
                                        memory_budget=budget, weight_layout=layout, **kw)
        xr, tr = (x[..., :-1, :], t[..., 1:]) if kw.get("shift") else (x, t)
        assert st.argmax.dtype == jnp.int32 and st.argmax.shape == tr.shape
        assert np.array_equal(np.asarray(st.argmax), argmax_ref(xr, w, tr, b, **kw))


@pytest.mark.parametrize("backend", _backends())
def test_stats_argmax_ties_take_the_first_index(backend):
    w = np.clip(np.random.default_rng(2).standard_normal((601, 8)), -3, 3).astype(np.float32)
    w[[300, 9, 590]] = 4.0  # equal maximal logits for positive x, in different column chunks (>= 128 wide)
    x = jnp.asarray(np.random.default_rng(3).random((6, 8)) + 0.1, jnp.float32)
    t = jnp.asarray([1, 2, -100, 4, 5, 6], jnp.int32)
    for budget in (None, 1 << 12):
        _, st = linear_cross_entropy(x, jnp.asarray(w), t, return_stats=True, implementation=backend,
                                     memory_budget=budget)
        assert np.asarray(st.argmax).tolist() == [9, 9, -1, 9, 9, 9]


def test_stats_argmax_backend_choice():
    """Backends without the argmax (``argmax`` False: mosaic_gpu, mosaic_tpu) are skipped
    by the automatic choice with return_stats; named, they run (as before the argmax
    existed) and LossStats.argmax is None."""
    from logitless.jax.ops.linear_cross_entropy import backends

    assert backends.BACKENDS["xla"].argmax
    assert not backends.BACKENDS["mosaic_tpu"].argmax
    x, w, t, _ = inputs(4, 8, 13)
    loss, st = linear_cross_entropy(x, w, t, return_stats=True, implementation="mosaic_tpu")
    ref, st_ref = linear_cross_entropy(x, w, t, return_stats=True, implementation="xla")
    assert st.argmax is None and st_ref.argmax is not None
    np.testing.assert_allclose(np.asarray(st.lse), np.asarray(st_ref.lse), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(ref), rtol=1e-5, atol=1e-5)
