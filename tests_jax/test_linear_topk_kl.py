"""logitless.jax.linear_topk_kl against the float64 reference (``ops/linear_topk_kl/reference.py``,
differentiated by jax.grad): every direction and tail, temperature, hard labels,
reductions, ignored tokens, fp32 and bf16, both weight layouts, the kept-dz forward
(every column, some, none), odd sizes (V prime, H not a multiple of 16, one token, empty,
3-D), a top-k that holds nearly all of the student's mass, float64 with finite
differences, the Mosaic GPU recompute in interpret mode, sharded jit and shard_map, and
the bad-input errors of issue 64."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from logitless.jax import linear_topk_kl
from logitless.jax.ops.linear_topk_kl.reference import linear_topk_kl_ref
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

KEEP_SHAPE = dict(n=12, h=20, v=601, k=7)
#: A forward chunk of 8 rows at KEEP_SHAPE (the logits and their masked copy: ``planning.rows_plan``).
_CHUNK = 8 * 2 * ROW_BYTES_PER_ELEM * 601
#: Budgets at KEEP_SHAPE: every column kept, 256 of 601, none.
BUDGETS = {"keep_all": 1 << 22, "keep_some": _CHUNK + 300 * 12 * 4, "recompute": _CHUNK - 1000}


def teacher(n=12, h=20, v=37, k=5, dtype="float32", seed=0, lead=None, ignore=(3,), scale=2.0):
    """x, W (V, H), the teacher's distinct top-k ids and their log-probs under a random
    full teacher distribution (P < 1), and a target with ``ignore`` positions at -100."""
    rng = np.random.default_rng(seed)
    shape = (n,) if lead is None else tuple(lead)
    m = int(np.prod(shape))
    x = rng.standard_normal(shape + (h,)).astype(np.float32)
    w = (rng.standard_normal((v, h)) * scale / np.sqrt(h)).astype(np.float32)
    ids = np.stack([rng.permutation(v)[:k] for _ in range(m)]).astype(np.int32) if m else np.zeros((0, k), np.int32)
    tl = rng.standard_normal((m, v)) * 2
    lp = np.take_along_axis(tl - np.log(np.exp(tl).sum(1, keepdims=True)), ids, 1).astype(np.float32)
    t = rng.integers(0, v, shape).astype(np.int32)
    for i in ignore:
        t.reshape(-1)[i] = -100
    cast = lambda a: jnp.asarray(a, dtype)
    return cast(x), cast(w), jnp.asarray(ids.reshape(shape + (k,))), jnp.asarray(lp.reshape(shape + (k,))), \
        jnp.asarray(t)


def reference(x, w, ids, lp, t, kw, layout="vh", g_out=None):
    """(loss, (dx, dw)) in float64: the reference and jax.grad of it."""
    with jax.enable_x64(True):
        as64 = lambda a: jnp.asarray(np.asarray(jnp.asarray(a, jnp.float32), np.float64))
        f = lambda a, b: linear_topk_kl_ref(a, b, jnp.asarray(np.asarray(ids)), as64(lp), jnp.asarray(np.asarray(t)),
                                            weight_layout=layout, **kw)
        proj = (lambda loss: jnp.sum(loss * g_out)) if g_out is not None else (lambda loss: loss)
        run = jax.jit(lambda a, b: (f(a, b), jax.grad(lambda a, b: proj(f(a, b)), argnums=(0, 1))(a, b)))
        loss, grads = run(as64(x), as64(w))
        return np.asarray(loss), tuple(np.asarray(g) for g in grads)


def check(x, w, ids, lp, t, dtype, kw, budget=None, layout="vh", implementation=None):
    """Loss and gradients (upstream 1..n / n for "none") vs float64."""
    red = kw.get("reduction", "mean")
    g_out = np.arange(1, t.size + 1).reshape(t.shape) / t.size if red == "none" else None
    wl = w if layout == "vh" else w.T

    def f(a, b):
        loss = linear_topk_kl(a, b, ids, lp, t, memory_budget=budget, weight_layout=layout,
                              implementation=implementation, **kw)
        return jnp.sum(loss * jnp.asarray(g_out, jnp.float32)) if red == "none" else loss, loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # mosaic_gpu's interpret-mode notice
        (_, loss), (dx, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, wl)
    rloss, (rdx, rdw) = reference(x, wl, ids, lp, t, kw, layout, g_out)
    assert loss.dtype == jnp.float32 and loss.shape == rloss.shape
    assert_close_to_ref("loss", loss, None, rloss, dtype)
    for name, g, r, p in (("dx", dx, rdx, x), ("dw", dw, rdw, wl)):
        assert g.dtype == p.dtype and g.shape == p.shape, name
        assert_close_to_ref(name, g, None, r, dtype)
    return loss, (dx, dw)


@pytest.mark.parametrize("tail", ["bucket", "renormalize", "none"])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_every_direction_and_tail(direction, tail):
    check(*teacher(), "float32", dict(direction=direction, tail=tail, temperature=1.4), budget=10_000)


OPTIONS = {
    "hard": dict(hard_label_weight=0.5),
    "hard_temperature": dict(hard_label_weight=0.5, temperature=0.7),
    "sum": dict(reduction="sum", tail="renormalize"),
    "none": dict(reduction="none", direction="reverse"),
    "all": dict(direction="reverse", tail="bucket", temperature=1.9, hard_label_weight=0.3, reduction="sum"),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_options(option):
    check(*teacher(), "float32", OPTIONS[option], budget=10_000)


@pytest.mark.parametrize("budget", sorted(BUDGETS))
@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_kept_and_recomputed_columns_both_layouts(budget, layout):
    kw = dict(direction="forward", tail="bucket", temperature=1.3, hard_label_weight=0.4)
    check(*teacher(**KEEP_SHAPE), "float32", kw, budget=BUDGETS[budget], layout=layout)


def test_the_plans_keep_all_some_and_no_columns():
    from logitless.jax.ops.linear_topk_kl.backends import BACKENDS

    xla = BACKENDS["xla"]
    keeps = {name: xla.plan_call((12, 20), (601, 20), jnp.dtype(jnp.float32), budget=b).grad.keep
             for name, b in BUDGETS.items()}
    assert keeps == {"keep_all": 601, "keep_some": 256, "recompute": 0}


def test_bf16():
    check(*teacher(n=40, h=64, v=211, k=20, dtype="bfloat16"), "bfloat16",
          dict(direction="reverse", tail="bucket", hard_label_weight=0.2))


@pytest.mark.parametrize("case", ["one_token", "3d", "odd", "ids_cover_the_vocabulary"])
def test_odd_sizes(case):
    shapes = {"one_token": dict(n=1, ignore=()), "3d": dict(lead=(2, 3, 5)), "odd": dict(n=17, h=13, v=101, k=9),
              "ids_cover_the_vocabulary": dict(n=6, v=11, k=11)}
    check(*teacher(**shapes[case]), "float32", dict(hard_label_weight=0.2, reduction="none"), budget=10_000)


def test_empty():
    x, w, ids, lp, t = teacher(n=0, ignore=())
    assert float(linear_topk_kl(x, w, ids, lp, t, reduction="sum")) == 0.0
    assert linear_topk_kl(x, w, ids, lp, t, reduction="none").shape == (0,)
    assert np.isnan(float(linear_topk_kl(x, w, ids, lp, t)))


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_a_top_k_with_nearly_all_of_the_students_mass_stays_exact(direction):
    """The student's own top-5 at large logits: 1 - Q ~ 1e-13, lost to rounding in fp32
    (and in fp64: 1 - sum q) but not in the tail's log-sum-exp."""
    x, w, _, lp, t = teacher(n=8, v=37, k=5, scale=25.0)
    z = np.asarray(x) @ np.asarray(w).T
    ids = jnp.asarray(np.argsort(-z, axis=1)[:, :5].astype(np.int32))
    q = np.exp(z - z.max(1, keepdims=True))
    q /= q.sum(1, keepdims=True)
    assert np.max(1 - np.take_along_axis(q, np.asarray(ids), 1).sum(1)) < 1e-6
    check(x, w, ids, lp, t, "float32", dict(direction=direction, tail="bucket"), budget=10_000)


def test_float64_matches_finite_differences():
    with jax.enable_x64(True):
        x, w, ids, lp, t = teacher(n=5, h=6, v=13, k=4, dtype="float64")
        kw = dict(direction="reverse", tail="bucket", temperature=1.3, hard_label_weight=0.5)
        for budget in (1 << 20, 300):  # kept and recomputed
            dx, dw = jax.grad(lambda a, b: linear_topk_kl(a, b, ids, lp, t, memory_budget=budget, **kw),
                              argnums=(0, 1))(x, w)
            assert dx.dtype == jnp.float64
            a, b = np.array(x), np.array(w)
            ref = jax.jit(lambda a, b: linear_topk_kl_ref(a, b, ids, lp, t, **kw))
            loss = lambda: float(ref(a, b))
            assert_matches_finite_differences(loss, [a, b], [np.asarray(dx), np.asarray(dw)], rtol=1e-6, atol=1e-9)


def test_the_teachers_arrays_get_no_gradient():
    x, w, ids, lp, t = teacher()
    g = jax.grad(lambda a, b, c: linear_topk_kl(a, b, ids, c, t), argnums=2)(x, w, lp)
    assert not np.abs(np.asarray(g)).max()


def test_vmap_matches_a_loop():
    x, w, ids, lp, t = teacher(lead=(3, 6))
    f = lambda a, i, p, tt: linear_topk_kl(a, w, i, p, tt, tail="renormalize")
    np.testing.assert_allclose(np.asarray(jax.vmap(f)(x, ids, lp, t)),
                               np.asarray([f(x[i], ids[i], lp[i], t[i]) for i in range(3)]), rtol=1e-5)


@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_mosaic_gpu_recomputes_the_columns_not_kept(layout):
    """The Mosaic GPU dz kernel (interpret mode on a CPU) on the columns the forward did not
    keep: 256 kept of 600, the rest in chunks of the kernel's tiles."""
    kw = dict(direction="forward", tail="bucket", temperature=1.3, hard_label_weight=0.4, reduction="sum")
    x, w, ids, lp, t = teacher(n=12, h=64, v=600, k=7, dtype="bfloat16")
    budget = 8 * 2 * ROW_BYTES_PER_ELEM * 600 + 300 * 12 * 2
    check(x, w, ids, lp, t, "bfloat16", kw, budget=budget, layout=layout, implementation="mosaic_gpu")


_FUSED_CASES = {
    "keep_all_hard": (dict(n=12, h=64, v=600, k=7), dict(hard_label_weight=0.4), 1 << 22),
    "keep_some_reverse_renormalize": (dict(n=12, h=64, v=600, k=7),
                                      dict(direction="reverse", tail="renormalize", temperature=1.3),
                                      8 * 2 * ROW_BYTES_PER_ELEM * 600 + 300 * 12 * 2),
    "recompute_temperature": (dict(n=12, h=64, v=600, k=7), dict(temperature=0.8, reduction="sum"), 1000),
    "none_hard": (dict(n=9, h=128, v=264, k=32), dict(hard_label_weight=0.3, reduction="none"), None),
    "ids_cover_the_vocabulary": (dict(n=5, h=64, v=16, k=16), dict(hard_label_weight=0.2, tail="none"), None),
    "keep_all_hard_at_t2": (dict(n=12, h=64, v=600, k=7), dict(hard_label_weight=0.5, temperature=2.0), 1 << 22),
    "keep_some_hard_at_t07_reverse": (dict(n=12, h=64, v=600, k=7),
                                      dict(direction="reverse", hard_label_weight=0.3, temperature=0.7),
                                      8 * 2 * ROW_BYTES_PER_ELEM * 600 + 300 * 12 * 2),
    "recompute_hard_at_t13_none": (dict(n=9, h=128, v=264, k=5),
                                   dict(hard_label_weight=0.6, temperature=1.3, reduction="none"), 1000),
    "many_ids_keep_some_hard_at_t2": (dict(n=12, h=64, v=600, k=130), dict(hard_label_weight=0.5, temperature=2.0),
                                      8 * 2 * ROW_BYTES_PER_ELEM * 600 + 300 * 12 * 2),
}


@pytest.mark.parametrize("case", sorted(_FUSED_CASES))
def test_mosaic_gpu_fused_forward(case, monkeypatch):
    """The Mosaic GPU forward (interpret mode on a CPU): the kernel with each row's ids
    excluded from its tiles, the kept e = exp(a - m) turned into dz; V not a multiple of
    the tile (600, 264), rows not of 8, K = 32 and 130 (more ids than a tile's columns),
    no column outside the ids,
    hard labels at T != 1 (the second log-sum-exp, the kept dz's second term)."""
    from logitless.jax.ops.linear_topk_kl import mosaic_gpu_backend as mb

    calls = []
    fused = mb.fused_forward
    monkeypatch.setattr(mb, "fused_forward", lambda *a, **k: calls.append(1) or fused(*a, **k))
    shape, kw, budget = _FUSED_CASES[case]
    x, w, ids, lp, t = teacher(**shape, dtype="bfloat16")
    check(x, w, ids, lp, t, "bfloat16", kw, budget=budget, implementation="mosaic_gpu")
    assert calls, "the fused forward did not run"


@pytest.mark.parametrize("budget,temperature", [(1 << 22, 3.0), (8 * 2 * ROW_BYTES_PER_ELEM * 600 + 300 * 12 * 4, 1.7)])
def test_mosaic_gpu_kept_dz_without_pallas_triton(budget, temperature, monkeypatch):
    """Where jax has no Pallas Triton the kept dz is an XLA fusion beside K (its second
    term at T != 1 too), and the plan counts that buffer: half the kept columns."""
    from logitless.jax.ops.common import mosaic_gpu as kind
    from logitless.jax.ops.linear_topk_kl import mosaic_gpu_backend as mb

    plan = lambda: mb.MosaicGpuBackend().plan_call((1024, 128), (4096, 128), jnp.dtype(jnp.bfloat16),
                                                   budget=22 << 20, weight_layout="vh").grad.keep
    assert plan() == 3072  # 6 MiB beside the forward's chunk: 3072 columns of 1024 bf16 rows
    monkeypatch.setattr(kind, "dz_in_place", lambda: False)
    monkeypatch.setattr(mb, "dz_in_place", lambda: False)
    assert plan() == 1536
    x, w, ids, lp, t = teacher(n=12, h=64, v=600, k=7, dtype="bfloat16")
    kw = dict(hard_label_weight=0.5, temperature=temperature, direction="reverse")
    check(x, w, ids, lp, t, "bfloat16", kw, budget=budget, implementation="mosaic_gpu")


@pytest.mark.parametrize("n,v,budget", [(24, 640, 1 << 22),
                                         (48, 600, 48 * 2 * ROW_BYTES_PER_ELEM * 600 + 300 * 48 * 2)],
                         ids=["keep_all", "keep_some_v_not_64"])
def test_mosaic_gpu_fused_forward_hv(n, v, budget, monkeypatch):
    """An (H, V) weight: the kernel reads it in place (padded to 64 columns where V is
    not a multiple: a second copy), z at the ids from its (V, H) copy, which fits the rows of
    the "xla" forward's chunk; hard labels at T = 2."""
    from logitless.jax.ops.linear_topk_kl import mosaic_gpu_backend as mb

    calls = []
    fused = mb.fused_forward
    monkeypatch.setattr(mb, "fused_forward", lambda *a, **k: calls.append(1) or fused(*a, **k))
    x, w, ids, lp, t = teacher(n=n, h=64, v=v, k=7, dtype="bfloat16")
    kw = dict(hard_label_weight=0.5, temperature=2.0, direction="reverse")
    check(x, w, ids, lp, t, "bfloat16", kw, budget=budget, layout="hv", implementation="mosaic_gpu")
    assert calls, "the fused forward did not run"


def test_mosaic_gpu_fused_forward_nearly_all_mass(monkeypatch):
    """The student's own top-5 at large logits (1 - Q ~ 1e-13): the kernel's tail
    log-sum-exp excludes the ids' columns, no subtraction."""
    x, w, _, lp, t = teacher(n=8, h=64, v=40, k=5, scale=25.0)
    z = np.asarray(x) @ np.asarray(w).T
    ids = jnp.asarray(np.argsort(-z, axis=1)[:, :5].astype(np.int32))
    check(x, w, ids, lp, t, "float32", dict(tail="bucket"), budget=10_000)  # the float64 reference
    check(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), ids, lp, t, "bfloat16", dict(tail="bucket"),
          implementation="mosaic_gpu")


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_mosaic_gpu_fused_forward_lowers_for_cuda(temperature, monkeypatch):
    """The fused forward and its backward lowered (not run) for CUDA: the kernel's layouts,
    TMA of the ids, shared memory (Mosaic GPU refused booleans of the row layout and a
    negated mask, which the interpreter runs); at T != 1 the second log-sum-exp."""
    from logitless.jax.ops.common import mosaic_gpu as kind

    monkeypatch.setattr(kind, "INTERPRET", False)
    n, h, v, k = 1000, 512, 4000, 20
    s = jax.ShapeDtypeStruct
    args = (s((n, h), jnp.bfloat16), s((v, h), jnp.bfloat16), s((n, k), jnp.int32), s((n, k), jnp.float32),
            s((n,), jnp.int32))
    f = lambda a, b, i, p, tt: linear_topk_kl(a, b, i, p, tt, hard_label_weight=0.5, temperature=temperature,
                                              implementation="mosaic_gpu")
    text = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") >= 1


def test_mosaic_gpu_fused_forward_cases():
    """Which calls the fused forward takes, whatever K: those whose bitmap of the ids
    (N V / 8 bytes) and, for an (H, V) weight, its copies fit the bytes of the "xla"
    forward's chunk (8 bytes per row and column)."""
    from logitless.jax.ops.linear_topk_kl import mosaic_gpu_backend as mb

    cfg = lambda layout, budget=1 << 24: mb.MosaicGpuBackend().plan_call(
        (64, 256), (1024, 256), jnp.dtype(jnp.bfloat16), budget=budget, weight_layout=layout)
    assert cfg("vh").grad.rows == 64 and cfg("hv").grad.rows == 64  # 512 bytes per column
    assert mb.fused(cfg("vh"), 64 * 64, (1024, 256), 2) and not mb.fused(cfg("vh"), 64 * 64 + 8, (1024, 256), 2)
    assert mb.fused(cfg("hv"), 64, (128, 1024), 2)  # 256 bytes per column of the copy, 8 of the bitmap
    assert not mb.fused(cfg("hv"), 64, (256, 1024), 2)  # 512 + 8
    small = cfg("hv", 300 * 1024)  # a chunk of 32 rows: 256 bytes per column
    assert small.grad.rows == 32 and not mb.fused(small, 64, (128, 1024), 2)
    # V = 1000: its (V, H) copy fits, with the bitmap, but its padded copy (1024 columns) does not
    assert (128 * 2 + 8) * 1000 <= 512 * 1000 and not mb.fused(cfg("hv"), 64, (128, 1000), 2)


@pytest.mark.parametrize("impl", ["triton", "mosaic_tpu"])
def test_kinds_without_a_kernel_refuse_with_a_reason(impl):
    x, w, ids, lp, t = teacher()
    with pytest.raises(ValueError, match="linear_topk_kl has no"):
        linear_topk_kl(x, w, ids, lp, t, implementation=impl)


def test_bad_input_names_the_argument():
    x, w, ids, lp, t = teacher()
    with pytest.raises(ValueError, match="one log-probability per id"):
        linear_topk_kl(x, w, ids, lp[:, :-1], t)
    with pytest.raises(ValueError, match=r"outside \[0, 37\)"):
        linear_topk_kl(x, w, ids.at[0, 0].set(37), lp, t)
    with pytest.raises(ValueError, match="repeats an id"):
        linear_topk_kl(x, w, ids.at[2, 1].set(ids[2, 0]), lp, t)
    with pytest.raises(ValueError, match="logits passed by mistake"):
        linear_topk_kl(x, w, ids, lp.at[1, 1].set(0.5), t)
    with pytest.raises(ValueError, match="direction must be one of"):
        linear_topk_kl(x, w, ids, lp, t, direction="sideways")
    with pytest.raises(ValueError, match="tail must be one of"):
        linear_topk_kl(x, w, ids, lp, t, tail="clamp")
    with pytest.raises(ValueError, match="needs target"):
        linear_topk_kl(x, w, ids, lp, hard_label_weight=0.1)
    with pytest.raises(ValueError, match="distinct"):
        linear_topk_kl(x, w, jnp.zeros((12, 40), jnp.int32), jnp.zeros((12, 40)), t)
    with pytest.raises(TypeError, match="teacher_ids must be an integer"):
        linear_topk_kl(x, w, lp, lp, t)


def test_a_bad_id_under_jit_is_nan_not_a_wrong_number():
    x, w, ids, lp, t = teacher()
    loss = jax.jit(lambda i: linear_topk_kl(x, w, i, lp, t, reduction="none"))(ids.at[4, 0].set(99))
    assert np.isnan(float(loss[4])) and np.isfinite(np.asarray(loss)[np.arange(12) != 4]).all()


# ------------------------------------------------------------------------------------
# several devices
# ------------------------------------------------------------------------------------

SHARDED_KW = dict(direction="reverse", tail="bucket", temperature=1.3, hard_label_weight=0.5)


@needs_devices
@pytest.mark.parametrize("layout,mesh_kind", [("data", "auto"), ("tensor", "auto"), ("2d", "auto"),
                                              ("2d", "explicit")])
def test_sharded_jit(layout, mesh_kind):
    specs = {"data": (P(DATA), P()), "tensor": (P(), P(MODEL)), "2d": (P(DATA), P(MODEL))}
    x, w, ids, lp, t = teacher(n=16, v=40, k=6, ignore=(3, 9))
    mesh = make_mesh(mesh_kind, layout)
    xspec, wspec = specs[layout]
    args = (put(mesh, x, *xspec), put(mesh, w, *wspec), put(mesh, ids, *xspec), put(mesh, lp, *xspec),
            put(mesh, t, *xspec))
    f = lambda a, b, i, p, tt: linear_topk_kl(a, b, i, p, tt, memory_budget=3_000, **SHARDED_KW)
    loss, (dx, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(*args)
    rloss, (rdx, rdw) = reference(x, w, ids, lp, t, SHARDED_KW)
    assert_close_to_ref("loss", loss, None, rloss, "float32")
    assert_close_to_ref("dx", dx, None, rdx, "float32")
    assert_close_to_ref("dw", dw, None, rdw, "float32")


@needs_devices
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_shard_map_vocabulary_and_token_axes(reduction):
    """Inside a user's shard_map: the weight split over "t" (the vocabulary; global ids),
    tokens over "d"; kept and recomputed columns both cross the vocabulary merge."""
    x, w, ids, lp, t = teacher(n=16, v=40, k=6, ignore=(3, 9))
    mesh = make_mesh("auto")
    kw = dict(SHARDED_KW, reduction=reduction)

    def local(a, b, i, p, tt):
        return linear_topk_kl(a, b, i, p, tt, vocab_axis_name=MODEL, token_axis_name=DATA, memory_budget=6_000,
                              **kw)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(DATA), P(MODEL), P(DATA), P(DATA), P(DATA)),
                       out_specs=P(DATA) if reduction == "none" else P())
    g_out = np.arange(1, 17) / 16.0
    proj = (lambda loss: jnp.sum(loss * g_out)) if reduction == "none" else (lambda loss: loss)
    loss, (dx, dw) = jax.jit(jax.value_and_grad(lambda a, b: proj(fn(a, b, ids, lp, t)), argnums=(0, 1)))(x, w)
    rloss, (rdx, rdw) = reference(x, w, ids, lp, t, kw, g_out=g_out if reduction == "none" else None)
    assert_close_to_ref("loss", loss, None, np.sum(rloss * g_out) if reduction == "none" else rloss, "float32")
    assert_close_to_ref("dx", dx, None, rdx, "float32")
    assert_close_to_ref("dw", dw, None, rdw, "float32")


@needs_sm90_gpus
@pytest.mark.parametrize("layout", ["data", "tensor"])
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
@pytest.mark.parametrize("budget", [None, 6 * 2**20], ids=["default", "part_kept"])
@pytest.mark.parametrize("temperature,k", [(1.3, 20), (1.0, 20), (2.0, 128)],
                         ids=["fused_t13", "fused_t1", "fused_t2_k128"])
def test_mosaic_gpu_sharded_on_gpus(layout, mesh_kind, budget, temperature, k):
    """The Mosaic GPU backend on 2 GPUs in bf16 against float64: sharded jit over an Auto
    mesh (custom_partitioning) and an Explicit one (shard_map), at the default budget
    (every column kept) and at 6 MiB (columns recomputed by the dz kernel); hard labels
    at T = 1.3, T = 1 and, with K = 128 ids, T = 2."""
    kw = dict(SHARDED_KW, temperature=temperature)
    x, w, ids, lp, t = teacher(n=2048, h=256, v=4608, k=k, dtype="bfloat16", ignore=(3, 9))
    mesh = make_mesh(mesh_kind, layout)
    xspec, wspec = LAYOUTS[layout]
    args = (put(mesh, x, *xspec), put(mesh, w, *wspec), put(mesh, ids, *xspec), put(mesh, lp, *xspec),
            put(mesh, t, *xspec))
    f = lambda a, b, i, p, tt: linear_topk_kl(a, b, i, p, tt, memory_budget=budget, implementation="mosaic_gpu",
                                              **kw)
    loss, (dx, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(*args)
    rloss, (rdx, rdw) = reference(x, w, ids, lp, t, kw)
    for name, ours, ref in (("loss", loss, rloss), ("dx", dx, rdx), ("dw", dw, rdw)):
        assert_close_to_ref(name, ours, None, ref, "bfloat16")


@needs_sm90_gpus
@pytest.mark.parametrize("layout", ["data", "tensor"])
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_mosaic_gpu_sharded_hv_on_gpus(layout, mesh_kind, monkeypatch):
    """A flax (H, V) weight on 2 GPUs (bf16 against float64): the fused forward's (V, H)
    copy of each device's columns, at the default budget; hard labels at T = 1.3."""
    from logitless.jax.ops.linear_topk_kl import mosaic_gpu_backend as mb

    calls = []
    fused = mb.fused_forward
    monkeypatch.setattr(mb, "fused_forward", lambda *a, **k: calls.append(1) or fused(*a, **k))
    x, w, ids, lp, t = teacher(n=2048, h=256, v=4608, k=20, dtype="bfloat16", ignore=(3, 9))
    mesh = make_mesh(mesh_kind, layout)
    xspec, wspec = LAYOUTS[layout]
    hv_spec = (None, *wspec) if len(wspec) else ()
    args = (put(mesh, x, *xspec), put(mesh, w.T, *hv_spec), put(mesh, ids, *xspec), put(mesh, lp, *xspec),
            put(mesh, t, *xspec))
    f = lambda a, b, i, p, tt: linear_topk_kl(a, b, i, p, tt, weight_layout="hv", implementation="mosaic_gpu",
                                              **SHARDED_KW)
    loss, (dx, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(*args)
    rloss, (rdx, rdw) = reference(x, w.T, ids, lp, t, SHARDED_KW, "hv")
    for name, ours, ref in (("loss", loss, rloss), ("dx", dx, rdx), ("dw", dw, rdw)):
        assert_close_to_ref(name, ours, None, ref, "bfloat16")
    assert calls, "the fused forward did not run"


def test_fp32_inputs_with_x64_on():
    """jax_enable_x64 on, fp32 inputs: the per-token terms run in float64, the rest as without."""
    with jax.enable_x64(True):
        check(*teacher(), "float32", dict(direction="reverse", tail="bucket", hard_label_weight=0.3,
                                          temperature=1.5), budget=10_000)
