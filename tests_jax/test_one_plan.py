"""One plan per call: a forward and its backward (``jax.grad`` of the loss) call the
backend's ``plan`` exactly once, on one device and on every sharded path that runs on
the CPU (the conftest's 8 host devices): the multi-device jit with unsharded inputs, an
Explicit mesh and ``jax.shard_map`` with the axes named (the api plans inside the
per-device call). On an Auto mesh with sharded inputs (custom_partitioning) there are
two programs, each planned once for its forward and backward together: the per-device
one (the partitions' shapes) and the unpartitioned fallback that custom_partitioning
traces at the global shapes.

Each case uses shapes of its own (jit and compilation caches would otherwise skip the
tracing of a program seen before) and starts with ``contract.local_plan`` cleared (it
keeps the per-device plans of every call, by shapes).
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from logitless.jax import linear_cross_entropy, linear_log_probs
from logitless.jax.ops.common import contract
from logitless.jax.ops.linear_cross_entropy import backends as lce_backends
from logitless.jax.ops.linear_log_probs import backends as llp_backends

from .helpers import DATA, MODEL, NDEV, inputs, make_mesh, needs_devices

HAS_TRITON = importlib.util.find_spec("triton") is not None
SMALL_BUDGET = 40_000  # several chunks at these shapes


class _Counts(dict):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def clear(self):
        """Forget the counts and the plans made (a later call of the same shapes plans again)."""
        super().clear()
        self.shapes.clear()
        contract.local_plan.cache_clear()


@pytest.fixture
def plans(monkeypatch):
    """Counts of ``plan`` calls per (op, backend name), from the calls made after it; the
    shapes of each call in ``counts.shapes``."""
    counts = _Counts()
    contract.local_plan.cache_clear()
    for op, table in (("lce", lce_backends.BACKENDS), ("llp", llp_backends.BACKENDS)):
        for name in ("xla", "mosaic_tpu") + (("triton",) if HAS_TRITON else ()):
            cls = type(table[name])
            orig = cls.plan

            def counted(self, x2d_shape, w_shape, *a, _orig=orig, _key=(op, name), **k):
                counts[_key] = counts.get(_key, 0) + 1
                counts.shapes.append((tuple(x2d_shape), tuple(w_shape)))
                return _orig(self, x2d_shape, w_shape, *a, **k)

            monkeypatch.setattr(cls, "plan", counted)
    yield counts
    contract.local_plan.cache_clear()


def _grad(loss, *args, jit=False):
    """Forward and backward, once: ``jax.grad`` of the summed outputs, eager or jitted."""

    def f(*a):
        return sum(jnp.sum(jnp.asarray(o, jnp.float32)) for o in jax.tree.leaves(loss(*a))
                   if jnp.issubdtype(jnp.asarray(o).dtype, jnp.floating))

    grad = jax.grad(f, argnums=(0, 1))
    return jax.block_until_ready((jax.jit(grad) if jit else grad)(*args))


def _backends():
    out = ["xla", "mosaic_tpu"]
    if HAS_TRITON:
        out.append("triton")
    return out


@pytest.mark.parametrize("backend", _backends())
def test_lce_one_plan(backend, plans):
    """Unsharded inputs: with class weights (the api's one-device path, for every
    backend) and without (several devices: the partitioned path, where the backend can)."""
    x, w, t, b = inputs(11, 16, 37, "float32", bias=True, seed=1)
    cw = jnp.linspace(0.5, 1.5, 37)
    kw = dict(label_smoothing=0.1, memory_budget=SMALL_BUDGET, implementation=backend)
    _grad(lambda x, w: linear_cross_entropy(x, w, t, b, class_weight=cw, **kw), x, w)
    assert plans == {("lce", backend): 1}
    plans.clear()
    x, w, t, b = inputs(13, 16, 41, "float32", bias=True, seed=2)
    _grad(lambda x, w: linear_cross_entropy(x, w, t, b, return_stats=True, **kw), x, w)
    assert plans == {("lce", backend): 1}
    plans.clear()
    x, w, t, _ = inputs(9, 16, 43, "float32", seed=3)
    _grad(lambda x, w: linear_cross_entropy(x, w, t, weight_layout="hv", **kw), x, w.T)
    assert plans == {("lce", backend): 1}


@pytest.mark.parametrize("backend", _backends())
def test_llp_one_plan(backend, plans):
    x, w, t, b = inputs(11, 16, 37, "float32", bias=True, seed=4)
    t = jnp.abs(t)
    kw = dict(temperature=0.7, entropy=True, memory_budget=SMALL_BUDGET, implementation=backend)
    _grad(lambda x, w: linear_log_probs(x, w, t, b, **kw), x, w)
    assert plans == {("llp", backend): 1}
    plans.clear()
    x, w, t, _ = inputs(9, 16, 43, "float32", seed=5)
    _grad(lambda x, w: linear_log_probs(x, w, jnp.abs(t), weight_layout="hv", **kw), x, w.T)
    assert plans == {("llp", backend): 1}


def test_llp_truncated_one_plan(plans):
    """top-k/top-p ("xla" only): the threshold pass, the forward and the backward share
    the plan of their (per-device) shapes."""
    x, w, t, _ = inputs(15, 16, 47, "float32", seed=6)
    _grad(lambda x, w: linear_log_probs(x, w, jnp.abs(t), top_k=5, top_p=0.9, entropy=True,
                                        memory_budget=SMALL_BUDGET), x, w)
    assert plans == {("llp", "xla"): 1}


@needs_devices
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_sharded_jit_one_plan(mesh_kind, plans):
    """NamedSharding inputs (tokens over DATA, vocabulary over MODEL), forward and backward
    in one jax.jit."""
    mesh = make_mesh(mesh_kind)
    nd, nm = mesh.shape[DATA], mesh.shape[MODEL]
    seed = 7 if mesh_kind == "auto" else 8
    n, v = 3 * nd + (0 if mesh_kind == "auto" else nd), 24 * nm + (0 if mesh_kind == "auto" else 8 * nm)
    x, w, t, _ = inputs(n, 16, v, "float32", seed=seed)
    xs = jax.device_put(x, NamedSharding(mesh, P(DATA, None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(MODEL, None)))
    ts = jax.device_put(t, NamedSharding(mesh, P(DATA)))
    kw = dict(memory_budget=SMALL_BUDGET)

    local = ((n // nd, 16), (v // nm, 16))
    # Auto: the per-device program's plan and the unpartitioned fallback's (global shapes)
    expected = [local] if mesh_kind == "explicit" else [((n, 16), (v, 16)), local]

    loss = lambda x, w: linear_cross_entropy(x, w, ts, label_smoothing=0.1, **kw)
    _grad(loss, xs, ws, jit=True)
    assert plans == {("lce", "xla"): len(expected)} and sorted(plans.shapes) == sorted(expected)
    plans.clear()
    logp = lambda x, w: linear_log_probs(x, w, jnp.abs(ts), entropy=True, **kw)
    _grad(logp, xs, ws, jit=True)
    assert plans == {("llp", "xla"): len(expected)} and sorted(plans.shapes) == sorted(expected)
    plans.clear()
    trunc = lambda x, w: linear_log_probs(x, w, jnp.abs(ts), top_k=3, **kw)
    _grad(trunc, xs, ws, jit=True)
    assert plans == {("llp", "xla"): len(expected)} and sorted(plans.shapes) == sorted(expected)


@needs_devices
def test_shard_map_one_plan(plans):
    """Inside jax.shard_map with the axes named: the api plans once, for the local shapes."""
    mesh = jax.make_mesh((NDEV // 2, 2), (DATA, MODEL), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    nd = NDEV // 2
    x, w, t, _ = inputs(5 * nd, 16, 2 * 29, "float32", seed=9)

    def lce_local(x, w, t):
        return linear_cross_entropy(x, w, t, label_smoothing=0.1, memory_budget=SMALL_BUDGET,
                                    vocab_axis_name=MODEL, token_axis_name=DATA)

    f = jax.shard_map(lce_local, mesh=mesh, in_specs=(P(DATA, None), P(MODEL, None), P(DATA)), out_specs=P())
    _grad(lambda x, w: f(x, w, t), x, w)
    assert plans == {("lce", "xla"): 1}
    plans.clear()

    def llp_local(x, w, t):  # tokens split, all the vocabulary on every device
        return linear_log_probs(x, w, t, entropy=True, memory_budget=SMALL_BUDGET)

    g = jax.shard_map(llp_local, mesh=mesh, in_specs=(P((DATA, MODEL), None), P(), P((DATA, MODEL))),
                      out_specs=(P((DATA, MODEL)), P((DATA, MODEL))))
    x, w, t, _ = inputs(3 * NDEV, 16, 31, "float32", seed=10)
    _grad(lambda x, w: g(x, w, jnp.abs(t)), x, w)
    assert plans == {("llp", "xla"): 1}
