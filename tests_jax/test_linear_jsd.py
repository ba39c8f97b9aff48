"""logitless.jax.linear_jsd against the float64 reference (``ops/linear_jsd/reference.py``):
every option alone and combined, fp32 and bf16, both weight layouts, the kept-dz
forward (every column, some, none) and the recomputing backward, odd sizes (V prime, H
not a multiple of 16, one token, empty, 3-D), float64 with finite differences, the
teacher as a constant, jit / vmap, sharded jit (tokens, vocabulary, both; Auto and
Explicit meshes) and shard_map with vocabulary and token axes, and the errors."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from logitless.jax import linear_jsd
from logitless.jax.ops.linear_jsd.reference import linear_jsd_ref
from logitless.jax.planning import ROW_BYTES_PER_ELEM

from .helpers import (
    DATA,
    LAYOUTS,
    MODEL,
    assert_close_to_ref,
    assert_matches_finite_differences,
    make_mesh,
    needs_devices,
    needs_sm90_gpus,
    put,
)

KEEP_SHAPE = dict(n=12, hs=20, ht=28, v=601)
#: A forward chunk of 8 rows of both heads at KEEP_SHAPE (``planning.rows_plan``).
_CHUNK = 8 * 2 * ROW_BYTES_PER_ELEM * 601
#: Budgets at KEEP_SHAPE: every column kept, 256 of 601, none (``test_the_plans``).
BUDGETS = {"keep_all": 1 << 22, "keep_some": _CHUNK + 300 * 12 * 4, "recompute": _CHUNK - 1000}


def heads(n=12, hs=20, ht=28, v=37, dtype="float32", seed=0, lead=None, ignore=(3,)):
    """Student and teacher inputs (x ~ N(0, 1), W ~ N(0, 4/H)) and a target with ``ignore``
    positions at -100."""
    rng = np.random.default_rng(seed)
    shape = (n,) if lead is None else tuple(lead)
    xs = rng.standard_normal(shape + (hs,)).astype(np.float32)
    ws = (rng.standard_normal((v, hs)) * 2 / np.sqrt(hs)).astype(np.float32)
    xt = rng.standard_normal(shape + (ht,)).astype(np.float32)
    wt = (rng.standard_normal((v, ht)) * 2 / np.sqrt(ht)).astype(np.float32)
    t = rng.integers(0, v, shape).astype(np.int32)
    for i in ignore:
        t.reshape(-1)[i] = -100
    cast = lambda a: jnp.asarray(a, dtype)
    return cast(xs), cast(ws), cast(xt), cast(wt), jnp.asarray(t)


def check(xs, ws, xt, wt, t, dtype, kw, budget=None, layout="vh", implementation=None, jit=True):
    """Loss and the student's gradients (upstream 1..n / n for "none") vs float64."""
    red = kw.get("reduction", "mean")
    if "ignore_index" in kw:  # the ignored positions carry that value
        t = jnp.where(t == -100, kw["ignore_index"], t)
    g_out = np.arange(1, t.size + 1).reshape(t.shape) / t.size if red == "none" else None
    wsl, wtl = (ws, wt) if layout == "vh" else (ws.T, wt.T)

    def f(a, b):
        loss = linear_jsd(a, b, xt, wtl, t, memory_budget=budget, weight_layout=layout,
                          implementation=implementation, **kw)
        return jnp.sum(loss * jnp.asarray(g_out, jnp.float32)) if red == "none" else loss, loss

    run = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)
    (_, loss), (dx, dw) = (jax.jit(run) if jit else run)(xs, wsl)
    as64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    rloss, (rdx, rdw) = linear_jsd_ref(as64(xs), as64(wsl), as64(xt), as64(wtl), t, weight_layout=layout,
                                       grad_out=g_out, **kw)
    assert loss.dtype == jnp.float32 and loss.shape == np.shape(rloss)
    assert_close_to_ref("loss", loss, None, rloss, dtype)
    for name, g, r, p in (("dx", dx, rdx, xs), ("dw", dw, rdw, wsl)):
        assert g.dtype == p.dtype and g.shape == p.shape, name
        assert_close_to_ref(name, g, None, r, dtype)
    return loss, (dx, dw)


OPTIONS = {
    "plain": {},
    "forward_kl": dict(beta=0.0),
    "reverse_kl": dict(beta=1.0),
    "temperature": dict(temperature=1.7),
    "hard": dict(hard_label_weight=0.4),
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "all": dict(beta=0.3, temperature=0.6, hard_label_weight=0.7, reduction="sum", ignore_index=5),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_each_option_fp32(option):
    check(*heads(), "float32", OPTIONS[option], budget=10_000)


@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_kept_and_recomputed_columns_both_layouts(budget, layout):
    kw = dict(beta=0.3, temperature=1.3, hard_label_weight=0.5)
    check(*heads(**KEEP_SHAPE), "float32", kw, budget=BUDGETS[budget], layout=layout)


def test_the_plans_keep_all_some_and_no_columns():
    from logitless.jax.ops.linear_jsd.backends import BACKENDS

    xla = BACKENDS["xla"]
    keeps = {name: xla.plan_call((12, 20), (601, 20), jnp.dtype(jnp.float32), budget=b).grad.keep
             for name, b in BUDGETS.items()}
    assert keeps == {"keep_all": 601, "keep_some": 256, "recompute": 0}


@pytest.mark.parametrize("kw", [dict(beta=0.5), dict(beta=1.0, hard_label_weight=0.3, temperature=2.0)])
def test_bf16(kw):
    check(*heads(n=40, hs=64, ht=96, v=211, dtype="bfloat16"), "bfloat16", kw)


@pytest.mark.parametrize("case", ["one_token", "3d", "odd"])
def test_odd_sizes(case):
    shapes = {"one_token": dict(n=1, ignore=()), "3d": dict(lead=(2, 3, 5)),
              "odd": dict(n=17, hs=13, ht=30, v=101)}
    check(*heads(**shapes[case]), "float32", dict(hard_label_weight=0.2, reduction="none"), budget=10_000)


def test_empty_and_all_ignored():
    xs, ws, xt, wt, t = heads(n=0, ignore=())
    assert float(linear_jsd(xs, ws, xt, wt, t, reduction="sum")) == 0.0
    assert linear_jsd(xs, ws, xt, wt, t, reduction="none").shape == (0,)
    assert np.isnan(float(linear_jsd(xs, ws, xt, wt, t)))
    xs, ws, xt, wt, t = heads(n=4, ignore=(0, 1, 2, 3))
    loss, (dx, dw) = jax.value_and_grad(lambda a, b: linear_jsd(a, b, xt, wt, t), argnums=(0, 1))(xs, ws)
    assert np.isnan(float(loss)) and not np.abs(np.asarray(dx)).max() and not np.abs(np.asarray(dw)).max()


def test_no_target_counts_every_token():
    xs, ws, xt, wt, t = heads(ignore=())
    np.testing.assert_allclose(float(linear_jsd(xs, ws, xt, wt)), float(linear_jsd(xs, ws, xt, wt, t)), rtol=1e-6)


def test_float64_matches_finite_differences():
    with jax.enable_x64(True):
        xs, ws, xt, wt, t = heads(n=5, hs=6, ht=7, v=11, dtype="float64")
        kw = dict(beta=0.4, temperature=1.3, hard_label_weight=0.5)
        for budget in (1 << 20, 200):  # kept and recomputed
            dx, dw = jax.grad(lambda a, b: linear_jsd(a, b, xt, wt, t, memory_budget=budget, **kw),
                              argnums=(0, 1))(xs, ws)
            assert dx.dtype == jnp.float64
            a, b = np.array(xs), np.array(ws)
            loss = lambda: float(linear_jsd_ref(a, b, xt, wt, t, **kw)[0])
            assert_matches_finite_differences(loss, [a, b], [np.asarray(dx), np.asarray(dw)], rtol=1e-6, atol=1e-9)


def test_the_teacher_is_a_constant():
    xs, ws, xt, wt, t = heads()
    f = lambda a, b, c, d: linear_jsd(a, b, c, d, t, hard_label_weight=0.3)
    dxt, dwt = jax.grad(f, argnums=(2, 3))(xs, ws, xt, wt)
    assert not np.abs(np.asarray(dxt)).max() and not np.abs(np.asarray(dwt)).max()


def test_vmap_matches_a_loop():
    xs, ws, xt, wt, t = heads(lead=(3, 6))
    f = lambda a, c, tt: linear_jsd(a, ws, c, wt, tt, beta=0.2)
    np.testing.assert_allclose(np.asarray(jax.vmap(f)(xs, xt, t)),
                               np.asarray([f(xs[i], xt[i], t[i]) for i in range(3)]), rtol=1e-5)


@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_triton_recomputes_the_columns_not_kept(layout):
    """The PyTorch op's two-head dz kernel (Triton's interpreter on a CPU) on the columns
    the forward did not keep (256 of 601), in chunks of its tiles."""
    pytest.importorskip("triton", reason="the triton backend needs the triton package (its interpreter here)")
    kw = dict(beta=0.0, temperature=1.5, hard_label_weight=0.4, reduction="sum")
    check(*heads(**KEEP_SHAPE), "float32", kw, budget=BUDGETS["keep_some"], layout=layout, implementation="triton")


@pytest.mark.parametrize("impl", ["mosaic_gpu", "mosaic_tpu"])
def test_mosaic_kinds_refuse_with_a_reason(impl):
    xs, ws, xt, wt, t = heads(dtype="bfloat16")
    with pytest.raises(ValueError, match="no Mosaic"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # mosaic_gpu off a GPU: its interpret-mode notice
        linear_jsd(xs, ws, xt, wt, t, implementation=impl)


def test_errors_name_the_argument():
    xs, ws, xt, wt, t = heads()
    with pytest.raises(ValueError, match="vocabularies differ"):
        linear_jsd(xs, ws, xt, wt[:-1], t)
    with pytest.raises(ValueError, match="teacher_x has leading shape"):
        linear_jsd(xs, ws, xt[:-1], wt, t)
    with pytest.raises(ValueError, match="weight_layout='hv'"):
        linear_jsd(xs, ws.T, xt, wt, t)
    with pytest.raises(TypeError, match="share one dtype"):
        linear_jsd(xs, ws, xt.astype(jnp.bfloat16), wt.astype(jnp.bfloat16), t)
    with pytest.raises(ValueError, match="needs a target"):
        linear_jsd(xs, ws, xt, wt, hard_label_weight=0.1)
    with pytest.raises(ValueError, match="beta"):
        linear_jsd(xs, ws, xt, wt, t, beta=1.5)
    with pytest.raises(ValueError, match="outside"):
        linear_jsd(xs, ws, xt, wt, t.at[0].set(99), hard_label_weight=0.1)
    with pytest.raises(ValueError, match="implementation"):
        linear_jsd(xs, ws, xt, wt, t, implementation="cuda")


# ------------------------------------------------------------------------------------
# several devices
# ------------------------------------------------------------------------------------

SHARDED_KW = dict(beta=0.3, temperature=1.3, hard_label_weight=0.5)


@needs_sm90_gpus
@pytest.mark.parametrize("layout", ["data", "tensor"])
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
@pytest.mark.parametrize("budget", [None, 6 * 2**20], ids=["default", "small_budget"])
def test_sharded_on_gpus(layout, mesh_kind, budget):
    """The automatic backend on 2 GPUs in bf16 against float64 (linear_jsd has no Mosaic GPU
    kernel): sharded jit over an Auto mesh (custom_partitioning) and an Explicit one
    (shard_map), at the default budget and a small one."""
    xs, ws, xt, wt, t = heads(n=2048, hs=256, ht=512, v=4608, dtype="bfloat16", ignore=(3, 9))
    mesh = make_mesh(mesh_kind, layout)
    xspec, wspec = LAYOUTS[layout]
    args = (put(mesh, xs, *xspec), put(mesh, ws, *wspec), put(mesh, xt, *xspec), put(mesh, wt, *wspec),
            put(mesh, t, *xspec))
    f = lambda a, b, c, d, tt: linear_jsd(a, b, c, d, tt, memory_budget=budget, **SHARDED_KW)
    loss, (dx, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(*args)
    f64 = lambda a: np.asarray(a, np.float64)
    rloss, (rdx, rdw) = linear_jsd_ref(f64(xs), f64(ws), f64(xt), f64(wt), t, **SHARDED_KW)
    for name, ours, ref in (("loss", loss, rloss), ("dx", dx, rdx), ("dw", dw, rdw)):
        assert_close_to_ref(name, ours, None, ref, "bfloat16")


@needs_devices
@pytest.mark.parametrize("layout,mesh_kind", [("data", "auto"), ("tensor", "auto"), ("2d", "auto"),
                                              ("2d", "explicit"), ("fsdp", "auto")])
def test_sharded_jit(layout, mesh_kind):
    specs = {"data": (P(DATA), P()), "tensor": (P(), P(MODEL)), "2d": (P(DATA), P(MODEL)), "fsdp": (P(DATA), P(DATA))}
    xs, ws, xt, wt, t = heads(n=16, v=40, ignore=(3, 9))
    mesh = make_mesh(mesh_kind, layout)
    xspec, wspec = specs[layout]
    args = (put(mesh, xs, *xspec), put(mesh, ws, *wspec), put(mesh, xt, *xspec), put(mesh, wt, *wspec),
            put(mesh, t, *xspec))
    f = lambda a, b, c, d, tt: linear_jsd(a, b, c, d, tt, memory_budget=3_000, **SHARDED_KW)
    loss, (dx, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(*args)
    rloss, (rdx, rdw) = linear_jsd_ref(np.float64(xs), np.float64(ws), np.float64(xt), np.float64(wt), t,
                                       **SHARDED_KW)
    assert_close_to_ref("loss", loss, None, rloss, "float32")
    assert_close_to_ref("dx", dx, None, rdx, "float32")
    assert_close_to_ref("dw", dw, None, rdw, "float32")


@needs_devices
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_shard_map_vocabulary_and_token_axes(reduction):
    """Inside a user's shard_map: weights split over "t" (the vocabulary), tokens over "d";
    the kept dz (budget) and the recomputed columns both cross the vocabulary merge."""
    xs, ws, xt, wt, t = heads(n=16, v=40, ignore=(3, 9))
    mesh = make_mesh("auto")
    kw = dict(SHARDED_KW, reduction=reduction)

    def local(a, b, c, d, tt):
        return linear_jsd(a, b, c, d, tt, vocab_axis_name=MODEL, token_axis_name=DATA,
                          memory_budget=30_000, **kw)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(DATA), P(MODEL), P(DATA), P(MODEL), P(DATA)),
                       out_specs=P(DATA) if reduction == "none" else P())
    g_out = np.arange(1, 17) / 16.0
    proj = (lambda loss: jnp.sum(loss * g_out)) if reduction == "none" else (lambda loss: loss)
    loss, (dx, dw) = jax.jit(jax.value_and_grad(lambda a, b: proj(fn(a, b, xt, wt, t)), argnums=(0, 1)))(xs, ws)
    rloss, (rdx, rdw) = linear_jsd_ref(np.float64(xs), np.float64(ws), np.float64(xt), np.float64(wt), t,
                                       grad_out=g_out if reduction == "none" else None, **kw)
    assert_close_to_ref("loss", loss, None, np.sum(rloss * g_out) if reduction == "none" else rloss, "float32")
    assert_close_to_ref("dx", dx, None, rdx, "float32")
    assert_close_to_ref("dw", dw, None, rdw, "float32")


def test_fp32_inputs_with_x64_on():
    with jax.enable_x64(True):
        check(*heads(), "float32", dict(beta=0.3, hard_label_weight=0.3, temperature=1.5), budget=10_000)
