"""Every backend of every JAX op is its kind's base class plus the op's own forward and
backward (``logitless/jax/ops/common/contract.py``): the checks, ``can_partition`` and the
plan are the kind's, written once, so two ops' backends of one kind plan the same Config
for the same call. Ops are found by their ``backends`` module (a new op joins by itself)."""

from __future__ import annotations

import importlib
import pkgutil

import jax.numpy as jnp
import pytest

import logitless.jax.ops as jax_ops
from logitless.jax.ops.common import contract

#: backend name -> (module of its kind, base class name)
KINDS = {"xla": ("xla", "XlaBase"), "triton": ("triton", "TritonBase"),
         "mosaic_gpu": ("mosaic_gpu", "MosaicGpuBase"), "mosaic_tpu": ("mosaic_tpu", "MosaicTpuBase")}
#: What the kind answers: an op's class never redefines these (``why_not`` it may narrow,
#: and ``plan`` an op whose call is not one (x, W) pair may wrap: the kind still plans).
KIND_METHODS = ("unsupported", "can_partition")


def _tables():
    out = {}
    for info in pkgutil.iter_modules(jax_ops.__path__):
        if info.ispkg and info.name != "common":
            try:
                out[info.name] = importlib.import_module(f"{jax_ops.__name__}.{info.name}.backends").BACKENDS
            except ModuleNotFoundError:
                continue
    return out


TABLES = _tables()


def _backend(table, name):
    try:
        return table[name]
    except ImportError as exc:  # a jax without Pallas Mosaic GPU / TPU
        pytest.skip(f"{name} does not import here: {exc}")


def _base(name):
    module, cls = KINDS[name]
    try:
        return getattr(importlib.import_module(f"logitless.jax.ops.common.{module}"), cls)
    except ImportError as exc:
        pytest.skip(f"the {name} kind does not import here: {exc}")


def test_the_ops_are_found():
    assert {"linear_cross_entropy", "linear_log_probs"} <= set(TABLES)


@pytest.mark.parametrize("name", sorted(KINDS))
@pytest.mark.parametrize("op", sorted(TABLES))
def test_each_backend_is_its_kind_plus_the_ops_forward_and_backward(op, name):
    table = TABLES[op]
    if name not in table:
        pytest.skip(f"{op} has no {name} backend")
    backend = _backend(table, name)
    base = _base(name)
    assert isinstance(backend, base) and isinstance(backend, contract.BackendBase)
    assert backend.name == name
    cls = type(backend)
    assert not set(KIND_METHODS) & set(vars(cls)), f"{cls.__qualname__} redefines its kind's {KIND_METHODS}"
    own = set(vars(cls)) | (set(vars(contract.Refused)) if issubclass(cls, contract.Refused) else set())
    assert {"forward", "backward"} <= own  # (a backend that refuses every case raises in both)


#: (x2d shape, (V, H), dtype, budget, layout, bias)
CASES = [((7, 64), (96, 64), jnp.bfloat16, 20_000, "vh", False),
         ((300, 128), (1000, 128), jnp.float16, 2**28, "hv", False),
         ((33, 48), (201, 48), jnp.float32, 10**6, "vh", True),
         ((4096, 4096), (128256, 4096), jnp.bfloat16, 1800 * 2**20, "hv", False)]


@pytest.mark.parametrize("name", sorted(KINDS))
def test_the_kind_plans_not_the_op(name):
    """The same call gets the same Config from every op's backend of a kind that plans
    with the kind's ``plan`` (the only place where heuristics decide), and the same
    answer from ``unsupported`` (where ``why_not`` is the kind's too) and ``can_partition``."""
    base = _base(name)
    backends = [b for b in (_backend(t, name) for t in TABLES.values() if name in t) if type(b).plan is base.plan]
    if len(backends) < 2:
        pytest.skip(f"fewer than two ops have a {name} backend")
    first, *others = backends
    for x, w, dtype, budget, layout, bias in CASES:
        want = first.plan(x, w, jnp.dtype(dtype), budget=budget, weight_layout=layout, has_bias=bias)
        why = first.unsupported(x, w, dtype, softcap=None, has_bias=bias) is None
        for other in others:
            assert other.plan(x, w, jnp.dtype(dtype), budget=budget, weight_layout=layout, has_bias=bias) == want
            if first.why_not.__func__ is other.why_not.__func__:
                assert (other.unsupported(x, w, dtype, softcap=None, has_bias=bias) is None) == why
            assert other.can_partition() == first.can_partition()


def test_capabilities_refuse_with_a_reason():
    """A backend without an op's capability says so (the automatic choice skips it, an
    explicit choice raises with the reason)."""
    lce = TABLES["linear_cross_entropy"]
    tpu = _backend(lce, "mosaic_tpu")
    assert tpu.class_weights and not tpu.argmax
    assert tpu.unsupported((8, 16), (32, 16), jnp.float32, softcap=None, has_bias=False, has_class_weight=True) is None
    assert "argmax" in tpu.unsupported((8, 16), (32, 16), jnp.float32, softcap=None, has_bias=False, need_argmax=True)
    assert "bf16/f32" in tpu.unsupported((8, 16), (32, 16), jnp.float16, softcap=None, has_bias=False, need_argmax=True)
    xla = lce["xla"]
    assert xla.unsupported((8, 16), (32, 16), jnp.float64, softcap=None, has_bias=True, has_class_weight=True,
                           need_argmax=True) is None
