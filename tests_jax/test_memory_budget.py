"""``memory_budget=None`` of the JAX ops: the PyTorch ops' rule (``logitless.jax.budget``).

3% of a GPU's total memory (``memory_stats()["bytes_limit"]``, read once per device;
whole MiB, at least DEFAULT_MEMORY_BUDGET), DEFAULT_MEMORY_BUDGET on a CPU, on a TPU and on
a GPU that reports no limit; resolved once per call (at trace time under jit), and the
call then plans exactly as with the resolved value given explicitly (bitwise the same
results). A GPU is faked here: a device object with ``platform`` and ``memory_stats``.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import logitless.jax
from logitless.jax import budget, linear_cross_entropy, linear_log_probs
from logitless.jax.ops.common import contract
from logitless.jax.ops.linear_cross_entropy import backends as lce_backends
from logitless.jax.ops.linear_log_probs import backends as llp_backends
from logitless.jax.planning import xla_plan
from logitless.options import DEFAULT_MEMORY_BUDGET, GPU_BUDGET_SHARE

from .helpers import DATA, MODEL, inputs, make_mesh, needs_devices

MiB = 2**20


def fake_gpu(bytes_limit, *, platform="gpu", id=0, asked=None):
    """A device reporting ``bytes_limit`` (None: no stats; an exception: raised); its
    ``memory_stats`` calls are appended to ``asked``."""

    def memory_stats():
        if asked is not None:
            asked.append(id)
        if isinstance(bytes_limit, Exception):
            raise bytes_limit
        return None if bytes_limit is None else {"bytes_limit": bytes_limit, "bytes_in_use": 12345}

    return SimpleNamespace(platform=platform, id=id, memory_stats=memory_stats)


@pytest.fixture
def fresh(monkeypatch):
    """No total memory remembered from an earlier test."""
    monkeypatch.setattr(budget, "_TOTAL_MEMORY", {})


@pytest.fixture
def on_gpu(monkeypatch, fresh):
    """``on_gpu(bytes_limit)``: the ops' default device is a fake GPU from then on (for the
    budget only: the backend choice still sees the CPU); its stats reads in ``.asked``."""
    asked = []

    def install(bytes_limit):
        dev = fake_gpu(bytes_limit, id=7, asked=asked)
        monkeypatch.setattr(budget, "_default_device", lambda: dev)
        return dev

    install.asked = asked
    return install


@pytest.fixture
def plans(monkeypatch):
    """The ``budget=`` of every backend ``plan`` call (forward and backward share one),
    per (op, backend); per-device plans uncached."""
    seen = []
    contract.local_plan.cache_clear()
    for op, table in (("lce", lce_backends.BACKENDS), ("llp", llp_backends.BACKENDS)):
        cls = type(table["xla"])
        orig = cls.plan

        def recording(self, x2d_shape, w_shape, *a, _orig=orig, _op=op, **k):
            seen.append((_op, k["budget"]))
            return _orig(self, x2d_shape, w_shape, *a, **k)

        monkeypatch.setattr(cls, "plan", recording)
    yield seen
    contract.local_plan.cache_clear()


def test_cpu_default_is_the_constant(fresh):
    assert jax.devices()[0].platform == "cpu"
    assert budget.default_memory_budget() == DEFAULT_MEMORY_BUDGET == 256 * MiB
    assert budget.default_memory_budget(jax.devices()[0]) == DEFAULT_MEMORY_BUDGET
    assert logitless.jax.default_memory_budget() == DEFAULT_MEMORY_BUDGET
    assert budget.resolve_memory_budget(None) == DEFAULT_MEMORY_BUDGET
    assert budget.resolve_memory_budget(12345) == 12345
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="memory_budget"):
            budget.resolve_memory_budget(bad)


@pytest.mark.parametrize("total, expected", [
    (81559 * MiB, 2446 * MiB),          # 3%, whole MiB: the PyTorch side's H100 figure
    (61169 * MiB, 1835 * MiB),          # an H100's bytes_limit at JAX's default fraction (75%)
    (143771 * MiB, 4313 * MiB),         # an H200
    (4 * 2**30, DEFAULT_MEMORY_BUDGET),  # a small GPU: the floor
])
def test_gpu_default_is_three_percent_of_total_memory(fresh, total, expected):
    assert GPU_BUDGET_SHARE == 0.03
    asked = []
    dev = fake_gpu(total, id=3, asked=asked)
    assert budget.default_memory_budget(dev) == expected
    assert budget.default_memory_budget(dev) == expected
    assert budget.total_memory(dev) == total
    assert asked == [3]  # a device property, read once per device
    other = fake_gpu(total, id=4, asked=asked)
    assert budget.default_memory_budget(other) == expected
    assert asked == [3, 4]


@pytest.mark.parametrize("stats", [None, RuntimeError("no allocator stats"), 0])
def test_gpu_without_a_limit_gets_the_constant(fresh, stats):
    """The platform allocator reports no stats: DEFAULT_MEMORY_BUDGET, still read once."""
    asked = []
    dev = fake_gpu(stats, id=5, asked=asked)
    assert budget.default_memory_budget(dev) == DEFAULT_MEMORY_BUDGET
    assert budget.default_memory_budget(dev) == DEFAULT_MEMORY_BUDGET
    assert asked == [5]


@pytest.mark.parametrize("platform", ["tpu", "cpu"])
def test_tpu_and_cpu_keep_the_constant(fresh, platform):
    """Off GPUs the device is not even asked (a TPU's "mosaic_tpu" tiles take
    min(budget, 48 MiB) anyway)."""
    asked = []
    dev = fake_gpu(95 * 2**30, platform=platform, asked=asked)
    assert budget.default_memory_budget(dev) == DEFAULT_MEMORY_BUDGET
    assert asked == []


def _grad(fn, x, w, jit):
    g = jax.value_and_grad(lambda x, w: sum(jnp.sum(o) for o in jax.tree.leaves(fn(x, w))), argnums=(0, 1))
    return jax.block_until_ready((jax.jit(g) if jit else g)(x, w))


def _ops(t):
    return {
        "lce": lambda x, w, **kw: linear_cross_entropy(x, w, t, label_smoothing=0.1, **kw),
        "llp": lambda x, w, **kw: linear_log_probs(x, w, t, entropy=True, **kw),
    }


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("op", ["lce", "llp"])
def test_none_plans_as_the_resolved_budget(on_gpu, plans, op, jit):
    """On a (faked) GPU, None plans with 3% of its memory: the same plan, and bitwise the
    same loss and gradients, as that budget given explicitly; a plan that 256 MiB would
    not give (the logits, 128 MiB in fp32, take one tile of columns instead of three)."""
    on_gpu(40 * 2**30)
    resolved = budget.default_memory_budget()
    assert resolved == 1228 * MiB
    n = 4088 if jit else 4096  # shapes of its own: no program traced by another case is reused
    x, w, t, _ = inputs(n, 8, 8192, "float32", seed=11)
    fn = _ops(t)[op]
    got = _grad(fn, x, w, jit)
    assert {b for _, b in plans} == {resolved}
    plans.clear()
    contract.local_plan.cache_clear()
    want = _grad(lambda x, w: fn(x, w, memory_budget=resolved), x, w, jit)
    # (no plan at all where jax reuses the program traced for None: the same static config)
    assert {b for _, b in plans} <= {resolved}
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert on_gpu.asked == [7]  # the device's memory, read once over all these calls
    plans.clear()
    contract.local_plan.cache_clear()
    _grad(lambda x, w: fn(x, w, memory_budget=DEFAULT_MEMORY_BUDGET), x, w, jit)
    assert {b for _, b in plans} == {DEFAULT_MEMORY_BUDGET}
    assert xla_plan(n, 8192, 8, 4, resolved) != xla_plan(n, 8192, 8, 4, DEFAULT_MEMORY_BUDGET)


@pytest.mark.parametrize("op", ["lce", "llp"])
def test_explicit_budget_is_used_as_given(on_gpu, plans, op):
    """An explicit budget is the plan's, below the floor too; the device is not asked."""
    on_gpu(40 * 2**30)
    x, w, t, _ = inputs(64, 8, 300, "float32", seed=12)
    _grad(lambda x, w: _ops(t)[op](x, w, memory_budget=40_000), x, w, jit=False)
    assert plans and {b for _, b in plans} == {40_000}
    assert on_gpu.asked == []


def test_cpu_none_is_bitwise_the_explicit_constant(fresh, plans):
    """On this CPU, None is DEFAULT_MEMORY_BUDGET: its plan and bitwise its results."""
    x, w, t, _ = inputs(96, 16, 517, "float32", seed=13)
    for op, fn in _ops(t).items():
        plans.clear()
        contract.local_plan.cache_clear()
        a = _grad(fn, x, w, jit=True)
        assert {b for _, b in plans} == {DEFAULT_MEMORY_BUDGET}, op
        b = _grad(lambda x, w: fn(x, w, memory_budget=DEFAULT_MEMORY_BUDGET), x, w, jit=True)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@needs_devices
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_sharded_budget_is_per_device(on_gpu, plans, mesh_kind):
    """Sharded jit (tokens over DATA, vocabulary over MODEL): None resolves once for the
    call, and every device's plan of its shard takes that budget (not a share of it)."""
    on_gpu(40 * 2**30)
    mesh = make_mesh(mesh_kind)
    nd, nm = mesh.shape[DATA], mesh.shape[MODEL]
    x, w, t, _ = inputs(5 * nd, 16, 24 * nm + (8 * nm if mesh_kind == "explicit" else 0), "float32",
                        seed=14 if mesh_kind == "auto" else 15)
    xs = jax.device_put(x, NamedSharding(mesh, P(DATA, None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(MODEL, None)))
    ts = jax.device_put(t, NamedSharding(mesh, P(DATA)))
    for op, fn in _ops(ts).items():
        _grad(fn, xs, ws, jit=True)
        assert {b for o, b in plans if o == op} == {1228 * MiB}, op
    assert on_gpu.asked == [7]


@needs_devices
def test_shard_map_budget_is_per_device(on_gpu, plans):
    """Inside jax.shard_map (axes named): the local call resolves None, per device."""
    on_gpu(40 * 2**30)
    mesh = make_mesh("auto")
    nd, nm = mesh.shape[DATA], mesh.shape[MODEL]
    x, w, t, _ = inputs(3 * nd, 16, 2 * 17 * nm, "float32", seed=16)

    def local(x, w, t):
        return linear_cross_entropy(x, w, t, vocab_axis_name=MODEL, token_axis_name=DATA)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(DATA, None), P(MODEL, None), P(DATA)), out_specs=P())
    _grad(lambda x, w: f(x, w, t), x, w, jit=True)
    assert plans == [("lce", 1228 * MiB)]
