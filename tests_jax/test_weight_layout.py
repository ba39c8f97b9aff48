"""The (H, V) weight layout (``weight_layout="hv"``, a flax ``Dense``/``nnx.Linear`` kernel)
read in place by every JAX backend of linear_cross_entropy and linear_log_probs.

For each backend ("xla", "triton" on Triton's CPU interpreter, "mosaic_tpu" and
"mosaic_gpu" in their interpret modes off their hardware): values and gradients of the
"hv" call with ``w.T`` equal those of the "vh" call with ``w`` (the same arithmetic up to
the summation order of XLA's GEMMs: bitwise for the kernels' forward statistics where the
products are the same, else within a few fp32 ulps), dW comes back (H, V), the backend
is handed the (H, V) array itself (no ``weight.T`` in the api), under jit, grad, vmap and
sharding (8 CPU host devices, conftest.py). The compiled HLO of the "xla" backend has no
transposed copy of the weight and no more temporary memory than the (V, H) call.
Run: ``PYTHONPATH=src python -m pytest tests_jax/test_weight_layout.py -q``.
GPU (H100) counterpart: tests_jax/test_weight_layout_gpu.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitless.jax import linear_cross_entropy, linear_log_probs
from logitless.jax.ops.linear_cross_entropy import backends as lce_backends
from logitless.jax.ops.linear_log_probs import backends as llp_backends

from .helpers import (
    LAYOUTS,
    backend_module,
    hlo_collectives,
    make_mesh,
    mosaic_platform,
    needs_devices,
    put,
    upstream,
)

BACKENDS = ["xla", "triton", "mosaic_tpu", "mosaic_gpu"]
#: Forces several vocabulary chunks (and row chunks) at the test shapes.
SMALL_BUDGET = 40_000


def _skip_unavailable(backend):
    if backend == "mosaic_gpu":
        pytest.importorskip("jax.experimental.pallas.mosaic_gpu", reason="this jax has no Pallas Mosaic GPU")
        if mosaic_platform() == "other-gpu":
            pytest.skip("mosaic_gpu needs an SM90 GPU (or the CPU interpreter)")
    if backend == "mosaic_tpu":
        pytest.importorskip("jax.experimental.pallas.tpu", reason="this jax has no Pallas TPU")
    if backend == "triton":
        if lce_backends.BACKENDS["triton"].unsupported((8, 8), (8, 8), jnp.float32, softcap=None,
                                                       has_bias=False) is not None:
            pytest.skip("triton backend unavailable here (needs triton on a CPU, jax-triton on a GPU)")


def _inputs(n, h, v, dtype, *, bias=False, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, h)), dtype)
    w = jnp.asarray(rng.standard_normal((v, h)) * (2.0 / np.sqrt(h)), dtype)
    t = np.asarray(rng.integers(0, v, size=n), np.int32)
    t[min(3, n - 1)] = -100
    b = jnp.asarray(rng.standard_normal(v) * 0.5, dtype) if bias else None
    return x, w, jnp.asarray(t), b


def _case(backend):
    """(n, h, v, dtype) per backend: mosaic_gpu needs 16-bit inputs and H % 64 == 0; its
    V = 200 is not a multiple of 64 (the (H, V) weight's padded-columns path)."""
    if backend == "mosaic_gpu":
        return 77, 128, 200, jnp.bfloat16
    return 37, 40, 101, jnp.float32


def _assert_same(name, hv, vh, dtype, transpose=False, ulps=8):
    """hv (from the "hv" call) equals vh (from the "vh" call) up to XLA GEMM summation
    order: ``ulps`` ulps of the dtype relative to the largest magnitude."""
    a = np.asarray(jnp.asarray(hv, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(vh, jnp.float32), np.float64)
    if transpose:
        a = a.T
    assert a.shape == b.shape, f"{name}: {a.shape} != {b.shape}"
    assert not np.isnan(a).any() and not np.isnan(b).any(), name
    eps = float(jnp.finfo(dtype).eps)
    bound = ulps * eps * max(1.0, float(np.abs(b).max()))
    err = float(np.abs(a - b).max()) if b.size else 0.0
    assert err <= bound, f"{name}: hv vs vh differ by {err:.3g} > {bound:.3g}"


# ------------------------------------------------------------------------------------------
# The backends take (H, V) natively
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_log_probs"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_takes_hv_natively(op, backend):
    backends = lce_backends if op == "linear_cross_entropy" else llp_backends
    try:
        impl = backends.BACKENDS[backend]
    except ImportError as e:  # an optional dependency of the backend
        pytest.skip(f"{backend} does not import here: {e}")
    assert impl.native_hv, f"{op}'s {backend} backend passes (H, V) weights as weight.T"


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_log_probs"])
@pytest.mark.parametrize("backend", ["xla", "triton", "mosaic_tpu"])
def test_backend_receives_the_hv_array_itself(op, backend, monkeypatch):
    """The api hands the backend the caller's (H, V) array with weight_layout="hv" (a
    spy on the backend's forward and backward, eager and under jit)."""
    _skip_unavailable(backend)
    backends = lce_backends if op == "linear_cross_entropy" else llp_backends
    module = backend_module(backends, backend)
    seen = []
    for fname in ("forward", "backward"):
        orig = getattr(module, fname)

        def spy(x2d, w, *a, _orig=orig, _name=fname, **kw):
            seen.append((_name, tuple(w.shape), kw.get("weight_layout", "vh")))
            return _orig(x2d, w, *a, **kw)

        monkeypatch.setattr(module, fname, spy)
    x, w, t, _ = _inputs(9, 16, 24, jnp.float32)
    fn = linear_cross_entropy if op == "linear_cross_entropy" else linear_log_probs
    f = lambda x, k: jnp.sum(fn(x, k, t, weight_layout="hv", implementation=backend))
    jax.jit(jax.grad(f, argnums=(0, 1)))(x, w.T)
    assert ("forward", (16, 24), "hv") in seen and ("backward", (16, 24), "hv") in seen, seen
    assert all(s == (16, 24) for _, s, _ in seen), seen


# ------------------------------------------------------------------------------------------
# Values and gradients: "hv" with w.T == "vh" with w
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_cross_entropy_hv_matches_vh(backend):
    _skip_unavailable(backend)
    n, h, v, dtype = _case(backend)
    bias = backend != "mosaic_gpu"  # mosaic_gpu's cross-entropy has no bias
    x, w, t, b = _inputs(n, h, v, dtype, bias=bias, seed=1)
    kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=20.0, memory_budget=SMALL_BUDGET, implementation=backend,
              return_stats=True)
    argnums = (0, 1, 2) if bias else (0, 1)

    def run(layout, wl):
        def f(x, w, b):
            loss, stats = linear_cross_entropy(x, w, t, b, weight_layout=layout, **kw)
            return loss, stats.lse

        return jax.jit(jax.value_and_grad(f, argnums=argnums, has_aux=True))(x, wl, b)

    (l_vh, lse_vh), g_vh = run("vh", w)
    (l_hv, lse_hv), g_hv = run("hv", w.T)
    _assert_same("loss", l_hv, l_vh, jnp.float32)
    _assert_same("lse", lse_hv, lse_vh, jnp.float32)
    if backend in ("mosaic_gpu", "triton"):  # the same kernel products: forward statistics bitwise
        np.testing.assert_array_equal(np.asarray(lse_hv), np.asarray(lse_vh))
    assert g_hv[1].shape == (h, v) and g_hv[1].dtype == w.dtype
    _assert_same("dx", g_hv[0], g_vh[0], dtype)
    _assert_same("dw", g_hv[1], g_vh[1], dtype, transpose=True)
    if bias:
        _assert_same("db", g_hv[2], g_vh[2], dtype)
    assert np.all(np.asarray(g_hv[0][3], np.float32) == 0.0)  # the ignored token


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_log_probs_hv_matches_vh(backend, bias):
    _skip_unavailable(backend)
    n, h, v, dtype = _case(backend)
    if backend == "mosaic_gpu" and not bias:
        v = 192  # aligned: the (H, V) weight is read without any padded copy
    x, w, t, b = _inputs(n, h, v, dtype, bias=bias, seed=2)
    g1, g2 = (jnp.asarray(g) for g in upstream(t.shape))
    kw = dict(temperature=0.7, entropy=True, softcap=5.0, memory_budget=SMALL_BUDGET, implementation=backend)
    argnums = (0, 1, 2) if bias else (0, 1)

    def run(layout, wl):
        def f(x, w, b):
            lp, ent = linear_log_probs(x, w, t, b, weight_layout=layout, **kw)
            return jnp.sum(lp * g1) + jnp.sum(ent * g2), (lp, ent)

        return jax.jit(jax.value_and_grad(f, argnums=argnums, has_aux=True))(x, wl, b)

    (_, (lp_vh, e_vh)), g_vh = run("vh", w)
    (_, (lp_hv, e_hv)), g_hv = run("hv", w.T)
    _assert_same("logp", lp_hv, lp_vh, jnp.float32)
    _assert_same("entropy", e_hv, e_vh, jnp.float32)
    if backend in ("mosaic_gpu", "triton"):
        np.testing.assert_array_equal(np.asarray(lp_hv), np.asarray(lp_vh))
    assert g_hv[1].shape == (h, v) and g_hv[1].dtype == w.dtype
    _assert_same("dx", g_hv[0], g_vh[0], dtype)
    _assert_same("dw", g_hv[1], g_vh[1], dtype, transpose=True)
    if bias:
        _assert_same("db", g_hv[2], g_vh[2], dtype)


def test_llp_hv_against_float64():
    """The "hv" op against the float64 reference (with the transposed weight), so that
    "hv" == "vh" is not two equal wrong answers."""
    from .helpers import assert_close_to_ref, log_probs_reference64

    x, w, t, b = _inputs(21, 24, 67, jnp.float32, bias=True, seed=4)
    g1, g2 = upstream(t.shape)
    kw = dict(temperature=1.3, entropy=True, softcap=4.0)

    def f(x, k, b):
        lp, ent = linear_log_probs(x, k, t, b, weight_layout="hv", memory_budget=SMALL_BUDGET, **kw)
        return jnp.sum(lp * g1) + jnp.sum(ent * g2), (lp, ent)

    (_, outs), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(x, w.T, b)
    routs, rgrads = log_probs_reference64(x, w, t, b, kw, g1, g2)
    for name, o, r in zip(("logp", "entropy"), outs, routs):
        assert_close_to_ref(name, o, None, r, "float32")
    assert_close_to_ref("dx", grads[0], None, rgrads[0], "float32")
    assert_close_to_ref("dw", grads[1].T, None, rgrads[1], "float32")
    assert_close_to_ref("db", grads[2], None, rgrads[2], "float32")


def test_llp_hv_errors_name_the_layout():
    x, w, t, _ = _inputs(5, 16, 24, jnp.float32)
    with pytest.raises(ValueError, match="weight_layout='hv'"):
        linear_log_probs(x, w.T, t)  # an (H, V) kernel passed as (V, H)
    with pytest.raises(ValueError, match="weight_layout"):
        linear_log_probs(x, w, t, weight_layout="vhh")


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_log_probs"])
def test_hv_under_vmap(op):
    x, w, t, _ = _inputs(12, 24, 50, jnp.float32, seed=6)
    xb, tb = x.reshape(3, 4, 24), t.reshape(3, 4)
    fn = linear_cross_entropy if op == "linear_cross_entropy" else linear_log_probs
    kw = dict(reduction="sum") if op == "linear_cross_entropy" else {}

    def per(layout, wl):
        f = lambda x, w, t: jnp.sum(fn(x, w, t, weight_layout=layout, memory_budget=SMALL_BUDGET, **kw))
        return jax.jit(jax.vmap(jax.value_and_grad(f, argnums=(0, 1)), in_axes=(0, None, 0)))(xb, wl, tb)

    v_vh, (gx_vh, gw_vh) = per("vh", w)
    v_hv, (gx_hv, gw_hv) = per("hv", w.T)
    assert gw_hv.shape == (3, 24, 50)
    _assert_same("value", v_hv, v_vh, jnp.float32)
    _assert_same("dx", gx_hv, gx_vh, jnp.float32)
    _assert_same("dw", np.swapaxes(np.asarray(gw_hv), 1, 2), gw_vh, jnp.float32)


# ------------------------------------------------------------------------------------------
# Sharding (8 CPU host devices)
# ------------------------------------------------------------------------------------------

def _hv_spec(ws):
    """The PartitionSpec entries of an (H, V) weight from those of the (V, H) layout."""
    ws = tuple(ws) + (None,) * (2 - len(tuple(ws)))
    return ws[::-1]


@needs_devices
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
@pytest.mark.parametrize("layout", ["data", "tensor", "2d", "fsdp"])
@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_log_probs"])
def test_sharded_hv_matches_unsharded_vh(op, layout, mesh_kind):
    mesh = make_mesh(mesh_kind, layout)
    x, w, t, b = _inputs(32, 24, 268, jnp.float32, bias=True, seed=8)
    xs_spec, ws_spec = LAYOUTS[layout]
    tok = xs_spec[0] if len(xs_spec) else None
    xs, ts = put(mesh, x, *xs_spec), put(mesh, t, tok)
    ks = put(mesh, w.T, *_hv_spec(ws_spec))
    bs = put(mesh, b, ws_spec[0] if len(ws_spec) else None)
    g1, g2 = (jnp.asarray(g) for g in upstream(t.shape))
    if op == "linear_cross_entropy":
        def f(x, w, b, t, layout):
            loss = linear_cross_entropy(x, w, t, b, reduction="none", weight_layout=layout, z_loss=1e-3,
                                        memory_budget=SMALL_BUDGET)
            return jnp.sum(loss * g1)
    else:
        def f(x, w, b, t, layout):
            lp, ent = linear_log_probs(x, w, t, b, weight_layout=layout, entropy=True, temperature=0.8,
                                       memory_budget=SMALL_BUDGET)
            return jnp.sum(lp * g1) + jnp.sum(ent * g2)

    vg = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)), static_argnums=4)
    if layout in ("tensor", "2d"):  # the vocabulary split: the (H, V) kernel is never gathered
        text = vg.lower(xs, ks, bs, ts, "hv").compile().as_text()
        gathered = [c for c in hlo_collectives(text) if c[0] == "all-gather" and (24, 268) in c[1]]
        assert not gathered, gathered
    val, (gx, gk, gb) = vg(xs, ks, bs, ts, "hv")
    rval, (rgx, rgw, rgb) = vg(x, w, b, t, "vh")
    assert gk.shape == (24, 268)
    # Sharded vs unsharded: also the order of the per-device partial sums differs.
    _assert_same("value", val, rval, jnp.float32, ulps=64)
    _assert_same("dx", gx, rgx, jnp.float32, ulps=64)
    _assert_same("dw", gk, rgw, jnp.float32, transpose=True, ulps=64)
    _assert_same("db", gb, rgb, jnp.float32, ulps=64)


# ------------------------------------------------------------------------------------------
# Compiled HLO of the "xla" backend: no transposed copy of the weight
# ------------------------------------------------------------------------------------------

_OP_LINE = re.compile(r"=\s*[a-z0-9]+\[([0-9,]*)\]\S*\s+(transpose|copy)\(")


def _weight_transposes(text, h, v):
    """HLO instructions that transpose or copy an array of the weight's size."""
    return [ln.strip()[:160] for ln in text.splitlines()
            if (m := _OP_LINE.search(ln)) and m.group(1) in (f"{v},{h}", f"{h},{v}")]


def _compiled(op, layout, grad, n=512, h=256, v=4160, budget=None):
    x = jax.ShapeDtypeStruct((n, h), jnp.float32)
    w = jax.ShapeDtypeStruct((v, h) if layout == "vh" else (h, v), jnp.float32)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)
    if op == "linear_cross_entropy":
        f = lambda x, w, t: linear_cross_entropy(x, w, t, weight_layout=layout, implementation="xla",
                                                 memory_budget=budget)
    else:
        f = lambda x, w, t: jnp.sum(linear_log_probs(x, w, t, weight_layout=layout, implementation="xla",
                                                     entropy=True, memory_budget=budget)[0])
    fn = jax.value_and_grad(f, argnums=(0, 1)) if grad else f
    return jax.jit(fn).lower(x, w, t).compile()


@pytest.mark.parametrize("budget", [None, 2 * 2**20], ids=["default", "2MiB"])
@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_log_probs"])
def test_xla_hv_has_no_weight_transpose(op, grad, budget):
    n, h, v = 512, 256, 4160
    hv = _compiled(op, "hv", grad, n, h, v, budget)
    vh = _compiled(op, "vh", grad, n, h, v, budget)
    assert _weight_transposes(hv.as_text(), h, v) == []
    t_hv = hv.memory_analysis().temp_size_in_bytes
    t_vh = vh.memory_analysis().temp_size_in_bytes
    # A transposed copy of the weight would be h * v * 4 bytes (4.3 MB) more.
    assert t_hv <= t_vh + 64 * 1024, f"hv temporaries {t_hv} > vh {t_vh} (+64 KiB)"


# ------------------------------------------------------------------------------------------
# Mosaic GPU: the (H, V) kernels lower for CUDA (TMA tiling, WGMMA B layout, shared memory)
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(4096, 4096, 128256), (1000, 512, 4000)], ids=["llama", "v%64!=0"])
@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_log_probs"])
def test_mosaic_gpu_hv_lowers_for_cuda(op, shape, monkeypatch):
    """fwd+bwd through the public op with an (H, V) kernel, lowered (not run) for CUDA on
    any machine: the (BLOCK_K, block_v) TMA tiles and the MN-major WGMMA B operand pass
    Mosaic GPU's lowering checks; V = 4000 (not a multiple of 64) takes the padded path."""
    pytest.importorskip("jax.experimental.pallas.mosaic_gpu", reason="this jax has no Pallas Mosaic GPU")
    from logitless.jax.ops.common import mosaic_gpu as kind

    monkeypatch.setattr(kind, "INTERPRET", False)
    n, h, v = shape
    x = jax.ShapeDtypeStruct((n, h), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((h, v), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)
    if op == "linear_cross_entropy":
        f = lambda x, k, t: linear_cross_entropy(x, k, t, weight_layout="hv", implementation="mosaic_gpu",
                                                 label_smoothing=0.1)
    else:
        f = lambda x, k, t: jnp.sum(linear_log_probs(x, k, t, weight_layout="hv", implementation="mosaic_gpu",
                                                     entropy=True)[1])
    text = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).trace(x, k, t).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
