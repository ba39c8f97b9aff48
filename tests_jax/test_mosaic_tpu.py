"""The "mosaic_tpu" backends (Pallas Mosaic TPU kernels) against float64 and "xla".

Off a TPU the kernels run in Pallas' TPU interpret mode (``pltpu.InterpretParams``:
simulated VMEM and DMAs, undefined memory filled with NaN, so every unmasked ragged
edge shows up), at tiny shapes; small memory budgets force several row blocks and
vocabulary tiles with ragged last ones. tokamax is not installed in the test venv: the
comparison with its TPU kernel is skipped without it.
Run: ``PYTHONPATH=src python -m pytest tests_jax/test_mosaic_tpu.py -q``.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

pytest.importorskip("jax.experimental.pallas.tpu", reason="this jax has no Pallas TPU")
from logitless.jax import linear_cross_entropy, linear_log_probs, linear_softmax_cross_entropy_loss  # noqa: E402
from logitless.jax import mosaic_tpu_lib as tl  # noqa: E402
from logitless.jax.ops.common import choice  # noqa: E402
from logitless.jax.ops.linear_cross_entropy import backends as ce_backends  # noqa: E402
from logitless.jax.ops.linear_cross_entropy.reference import linear_cross_entropy_ref  # noqa: E402
from logitless.jax.ops.linear_log_probs import backends as lp_backends  # noqa: E402
from logitless.jax.ops.linear_log_probs.reference import linear_log_probs_reference  # noqa: E402

from .helpers import inputs  # noqa: E402

#: Tests that execute the kernels: on a TPU for real, on a CPU in TPU interpret mode;
#: not on a GPU machine (TPU interpret mode there is untested: the lowering tests run).
runs_kernels = pytest.mark.skipif(jax.default_backend() == "gpu",
                                  reason="mosaic_tpu's kernels are tested on a CPU (interpret mode) or a TPU")

#: Forces tiles of 8 rows x 128 columns at H <= 48 (fp32): several of each, ragged.
SMALL_BUDGET = 150_000
TOL = {"float32": 2e-5, "bfloat16": 3e-2}


def _close(name, ours, ref, dtype):
    ours = np.asarray(jnp.asarray(ours, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{name}: shape {ours.shape} != {ref.shape}"
    assert np.isfinite(ours).all(), f"{name}: not finite"
    bound = TOL[dtype] * max(float(np.abs(ref).max()), 1e-2)
    err = float(np.abs(ours - ref).max())
    assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g}"


def _ce_loss_and_grads(x, w, t, b, impl, **kw):
    def f(x, w, b):
        return jnp.sum(linear_cross_entropy(x, w, t, b, implementation=impl, **kw))

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2) if b is not None else (0, 1)))(x, w, b)


CE_CASES = {
    # name: (lead shape, V, H, dtype, options, budget)
    "plain_3d_prime_v": ((2, 9), 131, 40, "float32", {}, SMALL_BUDGET),
    "one_token_bf16": ((1,), 97, 24, "bfloat16", {}, None),
    "bias": ((13,), 131, 20, "float32", dict(bias=True), SMALL_BUDGET),
    "softcap": ((13,), 131, 20, "float32", dict(softcap=2.0), None),
    "smooth": ((13,), 131, 20, "float32", dict(label_smoothing=0.1), None),
    "class_weight": ((13,), 131, 20, "float32", dict(class_weight=True), None),
    "hv": ((13,), 131, 20, "float32", dict(weight_layout="hv"), SMALL_BUDGET),
    "z_loss_sum": ((13,), 131, 20, "float32", dict(z_loss=1e-3, reduction="sum"), None),
    "all_hv_bf16": ((3, 7), 257, 36, "bfloat16",
                    dict(bias=True, softcap=3.0, label_smoothing=0.2, class_weight=True, z_loss=1e-3,
                         weight_layout="hv", ignore=(1, 5)), SMALL_BUDGET),
    "all_vh_f32": ((19,), 263, 44, "float32",
                   dict(bias=True, softcap=3.0, label_smoothing=0.2, class_weight=True, z_loss=1e-3,
                        ignore=(0, 18)), SMALL_BUDGET),
}


@pytest.mark.parametrize("case", list(CE_CASES))
@runs_kernels
def test_linear_cross_entropy_vs_float64_and_xla(case):
    lead, v, h, dtype, opts, budget = CE_CASES[case]
    opts = dict(opts)
    layout = opts.get("weight_layout", "vh")
    ignore = opts.pop("ignore", ())
    x, w, t, b = inputs(None, h, v, dtype, seed=list(CE_CASES).index(case), bias=opts.pop("bias", False), ignore=ignore,
                        lead=lead)
    cw = None
    if opts.pop("class_weight", False):
        cw = jnp.asarray(np.random.default_rng(3).uniform(0.2, 2.0, v), jnp.float32)
        opts["class_weight"] = cw
    if layout == "hv":
        w = w.T
    kw = dict(opts, memory_budget=budget)
    loss, grads = _ce_loss_and_grads(x, w, t, b, "mosaic_tpu", **kw)
    loss_x, grads_x = _ce_loss_and_grads(x, w, t, b, "xla", **kw)
    ref_kw = {k: val for k, val in opts.items() if k != "class_weight"}
    ref_kw["reduction"] = opts.get("reduction", "mean")
    r_loss, _, (rdx, rdw, rdb) = linear_cross_entropy_ref(x, w, t, b, class_weight=cw, **ref_kw)
    _close("loss", loss, np.sum(r_loss), dtype)
    refs = (rdx, rdw) + ((rdb,) if b is not None else ())
    for name, g, gx, r in zip(("dx", "dw", "db"), grads, grads_x, refs):
        assert g.dtype == gx.dtype and g.shape == gx.shape
        _close(name, g, r, dtype)
        _close(name + " vs xla", g, np.asarray(jnp.asarray(gx, jnp.float32)), dtype)


@runs_kernels
def test_tokamax_drop_in():
    x, w, t, _ = inputs(10, 24, 139, "float32", seed=5)
    t = t.at[3].set(-100)
    for red in ("sum", "mean"):
        f = lambda x, w, impl: linear_softmax_cross_entropy_loss(x, t, w.T, reduction=red, implementation=impl)
        ours = jax.jit(jax.value_and_grad(lambda x, w: f(x, w, "mosaic_tpu"), argnums=(0, 1)))(x, w)
        xla = jax.jit(jax.value_and_grad(lambda x, w: f(x, w, "xla"), argnums=(0, 1)))(x, w)
        for a, c in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(xla)):
            _close(f"tokamax {red}", a, np.asarray(c), "float32")


@runs_kernels
def test_against_tokamax_tpu_kernel_in_interpret_mode():
    tokamax = pytest.importorskip("tokamax", reason="tokamax is not installed here")
    x, w, t, _ = inputs(16, 128, 256, "float32", seed=6)
    ref = tokamax.linear_softmax_cross_entropy_loss(x, t, w.T, implementation="mosaic_tpu")
    ours = linear_softmax_cross_entropy_loss(x, t, w.T, implementation="mosaic_tpu")
    _close("vs tokamax", ours, np.asarray(ref), "float32")


@pytest.mark.parametrize("dtype,opts,budget", [
    ("float32", dict(entropy=True, temperature=0.7, softcap=2.5, bias=True), SMALL_BUDGET),
    ("bfloat16", dict(entropy=False), None),
])
@runs_kernels
def test_linear_log_probs_vs_float64(dtype, opts, budget):
    opts = dict(opts)
    x, w, t, b = inputs(None, 28, 131, dtype, seed=7, bias=opts.pop("bias", False), ignore=(2,), lead=(3, 7))
    g1 = jnp.asarray(np.random.default_rng(1).standard_normal((3, 7)), jnp.float32)
    g2 = jnp.asarray(np.random.default_rng(2).standard_normal((3, 7)), jnp.float32)
    entropy = opts.pop("entropy")

    def f(x, w, b, impl):
        out = linear_log_probs(x, w, t, b, entropy=entropy, memory_budget=budget, implementation=impl, **opts)
        lp, h = out if entropy else (out, None)
        return jnp.sum(lp * g1) + (jnp.sum(h * g2) if entropy else 0.0), (lp, h)

    argn = (0, 1, 2) if b is not None else (0, 1)
    (val, outs), grads = jax.jit(jax.value_and_grad(lambda *a: f(*a, "mosaic_tpu"), argnums=argn, has_aux=True))(
        x, w, b)
    with jax.enable_x64(True):
        c = lambda a: None if a is None else jnp.asarray(np.asarray(jnp.asarray(a, jnp.float32)), jnp.float64)

        def r(x, w, b):
            lp, h = linear_log_probs_reference(x, w, t, b, **opts)
            return jnp.sum(lp * c(g1)) + (jnp.sum(h * c(g2)) if entropy else 0.0), (lp, h)

        (rval, routs), rgrads = jax.value_and_grad(r, argnums=argn, has_aux=True)(c(x), c(w), c(b))
        rgrads, routs = [np.asarray(g) for g in rgrads], [np.asarray(o) for o in routs]
    _close("value", val, np.asarray(rval), dtype)
    _close("logp", outs[0], routs[0], dtype)
    if entropy:
        _close("entropy", outs[1], routs[1], dtype)
    for name, g, rg in zip(("dx", "dw", "db"), grads, rgrads):
        _close(name, g, rg, dtype)


def test_tiles_follow_the_budget():
    big = tl.choose_tiles(4096, 32000, 4096, 2, None)
    assert big.bn % 8 == 0 and big.bv % 128 == 0 and big.bn >= 256
    assert tl.vmem_bytes(big.bn, big.bv, 4096, 2) <= tl.VMEM_LIMIT
    small = tl.choose_tiles(19, 263, 44, 4, SMALL_BUDGET)
    assert (small.bn, small.bv) == (8, 128)  # several ragged row blocks and vocab tiles
    assert tl.vmem_bytes(8, 128, 44, 4) <= SMALL_BUDGET
    whole = tl.choose_tiles(5, 100, 16, 4, None)
    assert (whole.bn, whole.bv) == (5, 100)  # full-dimension blocks for small arrays


def test_automatic_choice(monkeypatch):
    args = ((64, 128), (1000, 128), jnp.bfloat16, None, False)
    if jax.default_backend() == "cpu":  # never chosen automatically off a TPU
        assert ce_backends.choose_backend(None, *args) == "xla"
        assert lp_backends.choose_backend(None, *args) == "xla"
    monkeypatch.setattr(choice, "is_tpu", lambda: True)
    assert ce_backends.choose_backend(None, *args) == "mosaic_tpu"
    assert ce_backends.choose_backend(None, *args, has_class_weight=True) == "mosaic_tpu"
    assert lp_backends.choose_backend(None, *args) == "mosaic_tpu"
    # float64 (log-probs) and float16 have no TPU kernel: xla, and an explicit request says why.
    for dt in (jnp.float64, jnp.float16):
        other = ((64, 128), (1000, 128), dt, None, False)
        assert lp_backends.choose_backend(None, *other) == "xla"
        with pytest.raises(ValueError, match="bf16/f32"):
            lp_backends.choose_backend("mosaic_tpu", *other)
    assert ce_backends.choose_backend(None, (8, 16), (32, 16), jnp.float16, None, False) == "xla"


@runs_kernels
def test_empty_inputs():
    x, w, t, _ = inputs(0, 16, 37, "float32")
    loss = linear_cross_entropy(x, w, t, reduction="none", implementation="mosaic_tpu")
    assert loss.shape == (0,)
    lp, h = linear_log_probs(x, w, t, entropy=True, implementation="mosaic_tpu")
    assert lp.shape == h.shape == (0,)


@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_lowers_for_tpu(monkeypatch, layout):
    """The real kernels (not the interpreter) lower to Mosaic TPU at a production shape
    on this CPU-only machine: block shapes, layouts of the in-kernel ops and the grid
    are accepted by Pallas' TPU lowering (Mosaic's own compiler, in libtpu, is not run)."""
    monkeypatch.setattr(tl, "INTERPRET", False)
    n, v, h = 4096, 32003, 4096
    sds = jax.ShapeDtypeStruct
    w = sds((v, h) if layout == "vh" else (h, v), jnp.bfloat16)

    def ce(x, w, b, t):
        return linear_cross_entropy(x, w, t, b, softcap=30.0, label_smoothing=0.1, weight_layout=layout,
                                    implementation="mosaic_tpu")

    args = (sds((n, h), jnp.bfloat16), w, sds((v,), jnp.bfloat16), sds((n,), jnp.int32))
    text = jax.jit(jax.grad(ce, argnums=(0, 1, 2))).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3  # forward, dX, dW

    def lp(x, w, t):
        out, ent = linear_log_probs(x, w, t, entropy=True, temperature=0.7, weight_layout=layout,
                                    implementation="mosaic_tpu")
        return out.sum() + ent.sum()

    text = jax.jit(jax.grad(lp, argnums=(0, 1))).trace(args[0], w, args[3]).lower(
        lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3


@runs_kernels
def test_vmap_and_out_of_range_targets():
    x, w, t, _ = inputs(None, 16, 37, "float32", seed=9, lead=(2, 6))
    t = t.at[0, 2].set(40)  # outside [0, V): NaN loss for that token only
    ce = lambda impl: jax.vmap(lambda x, t: linear_cross_entropy(x, w, t, reduction="none",
                                                                 implementation=impl))(x, t)
    ours, xla = np.asarray(ce("mosaic_tpu")), np.asarray(ce("xla"))
    assert np.isnan(ours[0, 2]) and np.isfinite(np.delete(ours.reshape(-1), 2)).all()
    np.testing.assert_allclose(ours, xla, rtol=1e-5, atol=1e-5)
    lp = lambda impl: jax.vmap(lambda x, t: linear_log_probs(x, w, t, entropy=True, implementation=impl))(x, t)
    for a, c in zip(lp("mosaic_tpu"), lp("xla")):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-5)


def test_vmap_lowers_for_tpu(monkeypatch):
    """Under jax.vmap the real kernels get a batch grid axis; Mosaic's lowering extends
    dimension_semantics for it."""
    monkeypatch.setattr(tl, "INTERPRET", False)
    sds = jax.ShapeDtypeStruct
    f = jax.vmap(lambda x, w, t: linear_cross_entropy(x, w, t, implementation="mosaic_tpu"), in_axes=(0, None, 0))
    args = (sds((2, 256, 256), jnp.bfloat16), sds((1000, 256), jnp.bfloat16), sds((2, 256), jnp.int32))
    text = jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1))).trace(*args).lower(
        lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3


@runs_kernels
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (conftest's host devices)")
def test_inside_shard_map_check_vma():
    """Per device inside jax.shard_map (check_vma=True), tokens and vocabulary split:
    the kernels' outputs are typed as varying like their inputs."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    x, w, t, b = inputs(32, 24, 134, "float32", seed=11, bias=True, ignore=(3,))
    kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0)

    def local(x, w, t, b):
        return linear_cross_entropy(x, w, t, b, token_axis_name="data", vocab_axis_name="model",
                                    implementation="mosaic_tpu", **kw)

    sm = jax.shard_map(local, mesh=mesh, in_specs=(P("data", None), P("model", None), P("data"), P("model")),
                       out_specs=P(), check_vma=True)
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
    ts = put(t, "data")
    loss, grads = jax.jit(jax.value_and_grad(lambda x, w, b: sm(x, w, ts, b), argnums=(0, 1, 2)))(
        put(x, "data", None), put(w, "model", None), put(b, "model"))
    r_loss, _, rgrads = linear_cross_entropy_ref(x, w, t, b, **kw)
    _close("loss", loss, r_loss, "float32")
    for name, g, rg in zip(("dx", "dw", "db"), grads, rgrads):
        _close(name, g, rg, "float32")
