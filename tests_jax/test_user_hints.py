"""What a new user meets on a CPU: a flax (H, V) kernel passed without
``weight_layout="hv"``, ``implementation="mosaic_gpu"`` without a Hopper GPU, and an
out-of-range label (torch raises on the CPU; JAX checks concrete CPU labels eagerly and
documents NaN under jit)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitless.jax import linear_cross_entropy, linear_log_probs
from logitless.jax.ops.common import choice

ON_CPU = jax.devices()[0].platform == "cpu"


def _inputs(n=6, h=12, v=37, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, h)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((v, h)) / np.sqrt(h), jnp.float32)
    t = jnp.asarray(rng.integers(0, v, size=n), jnp.int32)
    return x, w, t


def test_hv_kernel_without_weight_layout_says_pass_hv():
    x, w, t = _inputs()
    with pytest.raises(ValueError, match="weight_layout='hv'"):
        linear_cross_entropy(x, w.T, t)  # (H, V) kernel read as (V, H)
    with pytest.raises(ValueError, match="weight_layout='vh'"):
        linear_cross_entropy(x, w, t, weight_layout="hv")  # (V, H) read as (H, V)
    with pytest.raises(ValueError, match="weight_layout='hv'"):  # linear_log_probs takes it too
        linear_log_probs(x, w.T, t)
    with pytest.raises(ValueError) as err:  # neither layout fits: no hint
        linear_cross_entropy(x, w[:, :5], t)
    assert "weight_layout" not in str(err.value)
    # the hint is right: with it the call works and equals the (V, H) call
    np.testing.assert_allclose(linear_cross_entropy(x, w.T, t, weight_layout="hv"),
                               linear_cross_entropy(x, w, t), rtol=1e-6)


def test_mosaic_gpu_off_hopper_says_what_it_needs(monkeypatch):
    # a GPU that is not SM90: ValueError naming SM90 and the alternatives
    with pytest.raises(ValueError, match="SM90.*implementation=None"):
        choice.check_mosaic_device(nvidia=lambda: True, sm90=lambda: False)
    choice.check_mosaic_device(nvidia=lambda: True, sm90=lambda: True)  # Hopper: nothing to say
    if not ON_CPU:
        pytest.skip("the interpret-mode warning is for machines without a GPU")
    monkeypatch.setattr(choice, "_WARNED_INTERPRET", [])
    with pytest.warns(RuntimeWarning, match="SM90.*interpret mode"):
        choice.check_mosaic_device(nvidia=lambda: False, sm90=lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice.check_mosaic_device(nvidia=lambda: False, sm90=lambda: False)  # once only


def test_mosaic_gpu_through_the_api_on_cpu_warns(monkeypatch):
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    if not ON_CPU:
        pytest.skip("CPU only")
    monkeypatch.setattr(choice, "_WARNED_INTERPRET", [])
    x, w, t = _inputs(n=8, h=64, v=64)
    with pytest.warns(RuntimeWarning, match="needs an SM90"):
        try:
            jax.eval_shape(lambda x, w: linear_cross_entropy(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), t,
                                                             implementation="mosaic_gpu"), x, w)
        except ValueError:
            pass  # a case the backend refuses: the warning came first


@pytest.mark.parametrize("h, v, dtype, bias, says", [
    (100, 64, jnp.bfloat16, False, "H=100 is not a positive multiple of 64"),
    (64, 37, jnp.bfloat16, False, "V=37 is not a positive multiple of 8"),
    (64, 64, jnp.float32, False, "dtype float32: it takes bfloat16 or float16"),
    (64, 64, jnp.bfloat16, True, "bias is not supported"),
])
def test_mosaic_gpu_refusal_names_the_constraint(monkeypatch, h, v, dtype, bias, says):
    """An explicit implementation="mosaic_gpu" that the kernels cannot run says which of
    their constraints the case breaks (on a Hopper: the device check passes)."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
    from logitless.jax.ops.linear_cross_entropy import backends

    monkeypatch.setattr(choice, "is_nvidia_gpu", lambda: True)
    monkeypatch.setattr(choice, "is_sm90", lambda: True)
    with pytest.raises(ValueError, match=f"{says}; use implementation='xla'"):
        backends.choose_backend("mosaic_gpu", (8, h), (v, h), dtype, None, bias)
    assert backends.choose_backend("mosaic_gpu", (8, 64), (64, 64), jnp.bfloat16, None, False) == "mosaic_gpu"


@pytest.mark.parametrize("op", ["lce", "llp"])
def test_out_of_range_label_raises_eagerly_on_cpu_and_is_nan_under_jit(op):
    if not ON_CPU:
        pytest.skip("the eager check reads CPU values only (no host sync on a GPU)")
    x, w, t = _inputs()
    f = (lambda x, w, t: linear_cross_entropy(x, w, t)) if op == "lce" else \
        (lambda x, w, t: linear_log_probs(x, w, t))
    name = "target" if op == "lce" else "tokens"
    for bad in (37, -1, 1000):
        tb = t.at[2].set(bad)
        with pytest.raises(ValueError, match=f"{name} contains {bad}, outside \\[0, 37\\)"):
            f(x, w, tb)
        with pytest.raises(ValueError, match="outside"):
            f(x, w, np.asarray(tb))  # numpy labels are concrete too
        out = jax.jit(f)(x, w, tb)  # traced: not checked, NaN as documented
        assert np.isnan(np.asarray(out)).any()
    # ignore_index and in-range labels pass
    f(x, w, t.at[2].set(-100))
    f(x, w, t.at[2].set(36))


def test_tokamax_drop_in_keeps_its_out_of_range_semantics():
    from logitless.jax import linear_softmax_cross_entropy_loss

    x, w, t = _inputs()
    loss = linear_softmax_cross_entropy_loss(x, t.at[1].set(-100), w.T)  # padding label: zero loss
    assert np.isfinite(float(loss))


def test_torch_ops_without_torch_say_what_to_install():
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here (tests/test_install_hints.py simulates its absence)")
    import logitless

    with pytest.raises(ModuleNotFoundError, match="pip install torch.*logitless.jax") as err:
        logitless.linear_cross_entropy  # noqa: B018  (the attribute access raises)
    assert err.value.name == "torch"
    with pytest.raises(ImportError, match="logitless.LinearJSDLoss needs PyTorch"):
        from logitless import LinearJSDLoss  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        logitless.nope  # noqa: B018  (the attribute access raises)
