"""Shared JAX test tools: random inputs and the accuracy criterion against float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

#: Extra allowance over XLA's own (materialised, same dtype) error, relative to the
#: largest reference value.
TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}


def inputs(n, h, v, dtype="float32", *, seed=0, bias=False, ignore=(), scale=1.0, lead=None):
    """x (n, h) or (*lead, h), weight (v, h), target, bias: random, in ``dtype``."""
    rng = np.random.default_rng(seed)
    shape = (n,) if lead is None else tuple(lead)
    x = (rng.standard_normal(shape + (h,)) * scale).astype(np.float32)
    w = (rng.standard_normal((v, h)) / np.sqrt(h) * 2.0).astype(np.float32)
    t = rng.integers(0, v, size=shape).astype(np.int32)
    flat = t.reshape(-1)
    for i in ignore:
        flat[i] = -100
    b = (rng.standard_normal(v) * 0.5).astype(np.float32) if bias else None
    cast = lambda a: None if a is None else jnp.asarray(a, dtype)
    return cast(x), cast(w), jnp.asarray(t), cast(b)


def max_err(a, ref) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max()) if ref.size else 0.0


def assert_close_to_ref(name, ours, xla_same_dtype, ref, dtype):
    """|ours - ref| <= |XLA in the same dtype - ref| + tol * max(max|ref|, 0.01); NaN never passes."""
    ours = np.asarray(jnp.asarray(ours, jnp.float32))
    ref = np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{name}: shape {ours.shape} != {ref.shape}"
    if ref.size == 0:
        return
    assert not np.isnan(ours).any(), f"{name}: NaN"
    e_ours = max_err(ours, ref)
    e_xla = max_err(xla_same_dtype, ref) if xla_same_dtype is not None else 0.0
    if e_xla != e_xla:
        e_xla = 0.0
    scale = float(np.abs(ref).max())
    bound = e_xla + TOL[str(dtype)] * max(scale, 1e-2)
    assert e_ours <= bound, f"{name}: error {e_ours:.3g} > bound {bound:.3g} (xla {e_xla:.3g})"


def xla_materialised(x, w, t, b=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                     softcap=None, z_loss=0.0):
    """The plain-JAX loss with the logits materialised in the input dtype (what a user
    would write); the baseline error of the criterion."""
    logits = jnp.einsum("...h,vh->...v", x, w)
    if b is not None:
        logits = logits + b
    z = logits.astype(jnp.float32)
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    lse = jax.nn.logsumexp(z, axis=-1)
    valid = t != ignore_index
    zt = jnp.take_along_axis(z, jnp.where(valid, t, 0)[..., None], axis=-1)[..., 0]
    v = w.shape[0]
    eps = label_smoothing
    loss = (1 - eps) * (lse - zt) + eps / v * (v * lse - z.sum(-1)) + z_loss * lse ** 2
    loss = jnp.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


def captured_constants(lower, threshold=4096):
    """Messages of jax's "large amount of constants were captured" warnings while
    ``lower()`` runs, with the threshold lowered to ``threshold`` bytes. A jitted
    function that closes over an array (or builds shape-sized host data) embeds it in
    the program: gigabytes at real shapes, and minutes of compile time."""
    import warnings

    old = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", threshold)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lower()
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", old)
    return [str(w.message)[:300] for w in caught if "constants were captured" in str(w.message)]
