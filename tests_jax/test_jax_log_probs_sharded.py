"""logitless.jax.linear_log_probs under sharding: jit with NamedSharding inputs (Auto
meshes through custom_partitioning, Explicit meshes through shard_map), data parallel,
tensor parallel over the vocabulary, both, FSDP-like; outputs and gradients (random
upstream gradients on both outputs) against the unsharded op and float64; compiled-HLO
checks at a memory budget that forces chunking (no all-gather of x / tokens in data
parallel, none of the weight in tensor parallel, the merge is one MAX + one SUM).

Needs several devices: conftest.py gives the CPU 8 host devices; with fewer the tests
skip with that reason (on 2 GPUs the meshes are (2, 1) / (1, 2)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from logitless.jax import linear_log_probs
from logitless.jax.ops.linear_log_probs.reference import linear_log_probs_reference

from .helpers import (
    DATA,
    LAYOUTS,
    MODEL,
    NDEV,
    assert_close_to_ref,
    hlo_array_shapes,
    hlo_collectives,
    inputs,
    log_probs_reference64,
    make_mesh,
    needs_devices,
    put,
    upstream,
)

#: Forces several column and row chunks per device at the test shapes.
SMALL_BUDGET = 40_000


OPTIONS = {
    "plain": dict(),
    "temperature": dict(temperature=0.7),
    "entropy": dict(entropy=True),
    "softcap": dict(softcap=3.0),
    "bias": dict(bias=True),
    "ignore_index": dict(ignore_index=5),
    "all": dict(temperature=1.3, entropy=True, softcap=4.0, bias=True, ignore_index=5),
}


def _inputs(n, h, v, dtype, bias, seed, lead=None, ignore_index=-100):
    """Random inputs; tokens include ignore_index (twice), 5 and the classes 5 + k v / 2,
    5 + k v / 4 (the same local column on other vocabulary shards: an in-range
    ignore_index=5 must only ignore global class 5)."""
    x, w, t, b = inputs(n, h, v, dtype, bias=bias, seed=seed, lead=lead)
    flat = np.array(t).reshape(-1)
    flat[[1, 7]] = ignore_index
    for i, c in zip((2, 3, 4, 5), (5, 5 + v // 2, 5 + v // 4, 5 + 3 * (v // 4))):
        if c < v:
            flat[i] = c
    return x, w, jnp.asarray(flat.reshape(np.shape(t))), b


def _sharded(mesh, layout, arrays):
    x, w, t, b = arrays
    xs, ws = LAYOUTS[layout]
    tok = xs[0] if len(xs) else None
    voc = ws[0] if len(ws) else None
    hid = xs[1] if len(xs) > 1 else None
    lead = (tok,) + (None,) * (t.ndim - 1)
    xspec = (tok,) + (None,) * (x.ndim - 2) + (hid,)
    return put(mesh, x, *xspec), put(mesh, w, *ws), put(mesh, t, *lead), put(mesh, b, voc)


def _value_and_grad(kw, t, has_bias, budget=None):
    """jit(value_and_grad) of sum(g1 logp) + sum(g2 H) and the outputs, as a function of
    (x, w, b, t)."""
    ent = kw.get("entropy", False)
    g1, g2 = (jnp.asarray(g) for g in upstream(t.shape))

    def f(x, w, b, t):
        out = linear_log_probs(x, w, t, b, memory_budget=budget, **kw)
        out = out if ent else (out,)
        total = jnp.sum(out[0] * g1) + (jnp.sum(out[1] * g2) if ent else 0.0)
        return total, out

    argnums = (0, 1, 2) if has_bias else (0, 1)
    return jax.jit(jax.value_and_grad(f, argnums=argnums, has_aux=True)), (g1, g2)


def _check(arrays, sharded_args, kw, dtype, budget=SMALL_BUDGET, exact_sharding=True):
    """Sharded == unsharded (same dtype; tight) and both close to float64; gradients keep
    their primal's shape and dtype."""
    x, w, t, b = arrays
    fn, (g1, g2) = _value_and_grad(kw, t, b is not None, budget)
    xs, ws, ts, bs = sharded_args
    (_, outs), grads = fn(xs, ws, bs, ts)
    (_, uouts), ugrads = jax.jit(jax.value_and_grad(
        lambda x, w, b: _single(x, w, b, t, kw, budget, g1, g2), argnums=(0, 1, 2) if b is not None else (0, 1),
        has_aux=True))(x, w, b)
    routs, rgrads = log_probs_reference64(*arrays, kw, g1, g2)
    rtol = 1e-5 if dtype == "float32" else 2e-2
    for name, o, u, r in zip(("logp", "entropy"), outs, uouts, routs):
        assert o.shape == t.shape, name
        np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(u, np.float32), rtol=rtol, atol=rtol,
                                   err_msg=name)
        assert_close_to_ref(name, o, None, r, dtype)
    for name, g, u, r, p in zip(("dx", "dw", "db"), grads, ugrads, rgrads, (x, w, b)):
        assert g.shape == p.shape and g.dtype == p.dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(u, np.float32), rtol=rtol,
                                   atol=rtol * max(1.0, float(np.abs(np.asarray(u, np.float32)).max())), err_msg=name)
        assert_close_to_ref(name, g, None, r, dtype)
    return fn


def _single(x, w, b, t, kw, budget, g1, g2):
    """The op on unsharded inputs (nothing split: the single-device computation)."""
    ent = kw.get("entropy", False)
    out = linear_log_probs(x, w, t, b, memory_budget=budget, **kw)
    out = out if ent else (out,)
    return jnp.sum(out[0] * g1) + (jnp.sum(out[1] * g2) if ent else 0.0), out


def _kw(option):
    kw = dict(OPTIONS[option])
    return kw, kw.pop("bias", False)


@needs_devices
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("option", ["plain", "all"])
def test_jit_sharded_against_unsharded_and_float64(mesh_kind, layout, option):
    mesh = make_mesh(mesh_kind, layout)
    kw, bias = _kw(option)
    # N and V divide by every mesh axis; V odd per shard (268 / 4 = 67).
    arrays = _inputs(32, 24, 268, "float32", bias, seed=3, ignore_index=kw.get("ignore_index", -100))
    _check(arrays, _sharded(mesh, layout, arrays), kw, "float32")


@needs_devices
@pytest.mark.parametrize("layout", ["data", "tensor", "2d"])
@pytest.mark.parametrize("option", [o for o in OPTIONS if o not in ("plain", "all")])
def test_each_option_alone_sharded(layout, option):
    mesh = make_mesh("auto", layout)
    kw, bias = _kw(option)
    arrays = _inputs(16, 20, 132, "float32", bias, seed=11, ignore_index=kw.get("ignore_index", -100))
    _check(arrays, _sharded(mesh, layout, arrays), kw, "float32")


@needs_devices
@pytest.mark.parametrize("layout", ["tensor", "2d"])
def test_vocab_not_divisible_by_the_mesh(layout):
    """V prime (269): JAX cannot place such a weight split over the model axis
    (device_put / Explicit types refuse it), but inside jit a sharding constraint may ask
    for it (XLA pads). The op then computes the vocabulary replicated along that axis
    (as linear_cross_entropy): the same values and gradients as unsharded."""
    mesh = make_mesh("auto", layout)
    kw, bias = _kw("all")
    x, w, t, b = _inputs(16, 24, 269, "float32", bias, seed=5, ignore_index=kw["ignore_index"])
    xs_spec, ws_spec = LAYOUTS[layout]
    xs, ts = put(mesh, x, *xs_spec), put(mesh, t, xs_spec[0] if len(xs_spec) else None)
    g1, g2 = (jnp.asarray(g) for g in upstream(t.shape))

    def f(x, w, b, t, constrain):
        if constrain:
            w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, ws_spec))
            b = jax.lax.with_sharding_constraint(b, NamedSharding(mesh, P(ws_spec[0])))
        lp, h = linear_log_probs(x, w, t, b, memory_budget=SMALL_BUDGET, **kw)
        return jnp.sum(lp * g1) + jnp.sum(h * g2)

    vg = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)), static_argnums=4)
    val, grads = vg(xs, w, b, ts, True)
    rval, rgrads = vg(x, w, b, t, False)
    np.testing.assert_allclose(float(val), float(rval), rtol=1e-5)
    for g, r in zip(grads, rgrads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    _, r64 = log_probs_reference64(x, w, t, b, kw, g1, g2)
    for name, g, r in zip(("dx", "dw", "db"), grads, r64):
        assert_close_to_ref(name, g, None, r, "float32")


@needs_devices
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_bf16_3d_sharded(mesh_kind):
    mesh = make_mesh(mesh_kind, "2d")
    kw = dict(temperature=0.8, entropy=True, softcap=5.0)
    arrays = _inputs(0, 24, 268, "bfloat16", False, seed=9, lead=(8, 4))
    _check(arrays, _sharded(mesh, "2d", arrays), kw, "bfloat16")


# ------------------------------------------------------------------------------------
# Compiled HLO
# ------------------------------------------------------------------------------------

def _compiled(layout, entropy=True, bias=False, budget=60_000):
    mesh = make_mesh("auto", layout)
    # n_local != h: a flat buffer of XLA's GPU all-reduce combiner holding dW (V_l * H,
    # + scalars) must not look like a tokens x vocab array (N_l * V_l).
    n, h, v = 96, 32, 1024
    arrays = _inputs(n, h, v, "float32", bias, seed=1)
    xs, ws, ts, bs = _sharded(mesh, layout, arrays)
    # The xla backend (the partitioning is the backends' common code): a GPU kernel
    # backend's chunk is at least one tile of columns, which a toy budget cannot shrink.
    fn, _ = _value_and_grad(dict(temperature=0.7, entropy=entropy, implementation="xla"), arrays[2], bias, budget)
    text = fn.lower(xs, ws, bs, ts).compile().as_text()
    return mesh, (n, h, v), text


@needs_devices
@pytest.mark.parametrize("layout", ["data", "tensor", "2d"])
def test_hlo_no_all_gather_and_small_collectives(layout):
    """At a budget that forces chunking (the backend loops over column chunks): no
    all-gather at all (neither x / tokens nor the weight), no tokens x vocab array, and
    nothing of the weight's size moves but dW's data-parallel all-reduce (XLA's GPU
    combiner may pack collectives into one flat array: bounds allow for it)."""
    mesh, (n, h, v), text = _compiled(layout)
    colls = hlo_collectives(text)
    assert colls, "expected the merge / gradient collectives"
    nvoc = mesh.shape[MODEL] if layout != "data" else 1
    ntok = mesh.shape[DATA] if layout != "tensor" else 1
    for kind, shapes in colls:
        assert kind != "all-gather", (kind, shapes, colls)
        for s in shapes:
            size = int(np.prod(s))
            if kind == "all-reduce" and size >= (v // nvoc) * h:
                assert ntok > 1 and size <= (v // nvoc) * h + 8, (kind, s)  # dW over the token axis
            else:
                # per-token (the merge's (N_l,) and (3, N_l)) or dx (N_l x H), possibly combined
                assert size <= (n // ntok) * (h + 4) + 8, (kind, s)
    shapes = hlo_array_shapes(text)
    # (weight-shaped chunks such as (V_chunk, H) are fine: only arrays without an H dim count)
    big = [s for s in shapes if np.prod(s) >= (n // ntok) * (v // nvoc) and h not in s]
    assert not big, f"a tokens x vocab array was materialised: {big}"


@needs_devices
def test_hlo_tensor_parallel_merge_is_one_max_and_one_sum():
    """TP forward+backward: the statistics merge is one MAX of (N,) and one packed SUM of
    (3, N) [e^d, a_t, e^d (d - H)] (the torch TP merge's shape), plus dx's SUM (N x H):
    all-reduced elements <= 4 N + N H (+ 8 for scalars), dW never reduced. On the CPU,
    where XLA does not flatten-combine all-reduces, the (3, N) SUM is there as such."""
    mesh, (n, h, v), text = _compiled("tensor")
    reduces = [s for kind, shapes in hlo_collectives(text) if kind == "all-reduce" for s in shapes]
    total = sum(int(np.prod(s)) for s in reduces)
    assert 4 * n + n * h <= total <= 4 * n + n * h + 8, (total, reduces)
    if jax.devices()[0].platform == "cpu":
        assert (3, n) in reduces and (n, h) in reduces, reduces
        assert sum(1 for s in reduces if s == (n,)) == 1, reduces  # the MAX; no separate sums


@needs_devices
def test_hlo_fsdp_reduce_scatters_dw():
    mesh = make_mesh("auto", "fsdp")
    # 3 N >= 2 V: W gathered (a smaller x splits the vocabulary instead: ``sharding.split_shared``,
    # linear_cross_entropy's FSDP HLO test).
    arrays = _inputs(64, 32, 96, "float32", False, seed=2)
    args = _sharded(mesh, "fsdp", arrays)
    # The xla backend on every platform (as linear_cross_entropy's FSDP HLO test; the GPU
    # kernel backends partition alike: jax-fsdp-hlo-2xH100-2026-11-25.json, in git history).
    fn = _check(arrays, args, dict(entropy=True, implementation="xla"), "float32", budget=None)
    xs, ws, ts, bs = args
    (_, _), grads = fn(xs, ws, bs, ts)
    assert grads[1].sharding.spec[0] == DATA  # dW keeps the weight's split
    colls = hlo_collectives(fn.lower(xs, ws, bs, ts).compile().as_text())
    assert any(kind == "reduce-scatter" for kind, _ in colls), colls


@needs_devices
def test_vmap_and_replicated_jit_still_work():
    """Unsharded inputs on several devices (the partitioned path with nothing split) and
    vmap (mapped plain computation) give the single-device values."""
    kw = dict(temperature=0.9, entropy=True)
    x, w, t, _ = _inputs(12, 16, 50, "float32", False, seed=4)
    lp, h = jax.jit(lambda x, w, t: linear_log_probs(x, w, t, **kw))(x, w, t)
    rlp, rh = linear_log_probs_reference(x, w, t, temperature=0.9)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(rlp), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(h), np.asarray(rh), rtol=1e-5, atol=1e-5)
    xb, tb = jnp.stack([x, x * 0.5]), jnp.stack([t, t[::-1]])
    vlp, vh = jax.vmap(lambda x, t: linear_log_probs(x, w, t, **kw))(xb, tb)
    for i in range(2):
        rlp, rh = linear_log_probs_reference(xb[i], w, tb[i], temperature=0.9)
        np.testing.assert_allclose(np.asarray(vlp[i]), np.asarray(rlp), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(vh[i]), np.asarray(rh), rtol=1e-5, atol=1e-5)


@needs_devices
@pytest.mark.parametrize("layout", ["data", "tensor"])
def test_gradient_from_one_output_only(layout):
    """entropy=True but only log p feeds the loss (and the other way round)."""
    mesh = make_mesh("auto", layout)
    x, w, t, _ = _inputs(16, 24, 268, "float32", False, seed=6)
    xs, ws, ts, _ = _sharded(mesh, layout, (x, w, t, None))
    for pick in (0, 1):
        f = lambda x, w, t: jnp.sum(linear_log_probs(x, w, t, entropy=True, memory_budget=SMALL_BUDGET)[pick])
        g = jax.jit(jax.grad(f, argnums=(0, 1)))(xs, ws, ts)
        rg = jax.grad(lambda x, w: jnp.sum(linear_log_probs_reference(x, w, t)[pick]), argnums=(0, 1))(x, w)
        for a, r in zip(g, rg):
            np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_bench_log_prob_rows_smoke(tmp_path):
    """The jax-sharded suite's log-prob rows (bash benchmarks/gpu/suite.sh jax-sharded) on the
    CPU's host devices: the one-device row, data and tensor parallel, equal to XLA with
    the logits, no all-gather in the compiled HLO."""
    import json

    from logitless_bench import jax_sharded

    rc = jax_sharded.main(["--suite", "jax-sharded", "--cpu", "--tokens", "64", "--hidden", "32", "--vocab", "512",
                           "--dtype", "float32", "--warmup", "0", "--reps", "1", "--out", str(tmp_path),
                           "--modes", "data,tensor", "--methods", "logp-xla-logits,logp,logp-xla",
                           "--name", "jax-sharded-logp"])
    assert rc == 0
    (latest,) = tmp_path.glob("latest-jax-sharded-logp-*.json")
    data = json.loads(latest.read_text())
    assert data["complete"]
    rows = {(r["mode"], r["method"]): r for r in data["rows"]}
    assert set(rows) == {("1 device", "logp"), ("1 device", "logp-xla")} | {
        (mode, m) for mode in ("data", "tensor") for m in ("logp-xla-logits", "logp", "logp-xla")}
    for key, r in rows.items():
        assert "note" not in r, r
        assert r["fwd+bwd ms"] > 0 and r["temp MiB/dev"] >= 0 and r["vs 1-dev op"] > 0
        if key[0] != "1 device" and key[1] != "logp-xla-logits":
            assert r["|loss-xla|"] < 1e-5
            if NDEV > 1:
                assert "all-gather" not in r["collectives_detail"], r["collectives"]


@needs_devices
def test_inside_a_users_shard_map_runs_locally():
    """Inside a shard_map whose axes are all manual the op is the single-device op on the
    local block (no partitioning of its own)."""
    mesh = make_mesh("auto", "data")
    x, w, t, _ = _inputs(32, 16, 60, "float32", False, seed=8)
    f = jax.shard_map(lambda x, w, t: linear_log_probs(x, w, t, temperature=0.9, entropy=True),
                      mesh=mesh, in_specs=(P(DATA), P(), P(DATA)), out_specs=(P(DATA), P(DATA)), check_vma=False)
    lp, h = jax.jit(f)(x, w, t)
    rlp, rh = linear_log_probs_reference(x, w, t, temperature=0.9)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(rlp), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(h), np.asarray(rh), rtol=1e-5, atol=1e-5)


def _gpu_backends():
    from logitless.jax.ops.linear_log_probs import backends

    return [name for name in backends.BACKENDS if name != "xla"]


@needs_devices
@pytest.mark.parametrize("backend", _gpu_backends())
@pytest.mark.parametrize("layout", ["data", "tensor", "fsdp"])
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_gpu_backend_per_shard(backend, layout, mesh_kind):
    """A GPU backend per device (its kernels inside custom_partitioning), against the
    same backend unsharded and float64, bf16. Skips where the backend cannot be
    partitioned here (CPU: its interpreter's host callbacks)."""
    from logitless.jax.ops.linear_log_probs import backends

    impl = backends.BACKENDS[backend]
    if not impl.can_partition():
        pytest.skip(f"{backend} cannot run partitioned here (needs its accelerator, not the interpreter)")
    if impl.unsupported((64, 128), (1024, 128), jnp.bfloat16, softcap=None, has_bias=False) is not None:
        pytest.skip(f"{backend} is not available here (the triton backend needs jax-triton on a GPU)")
    mesh = make_mesh(mesh_kind, layout)
    kw = dict(temperature=0.7, entropy=True, implementation=backend)
    arrays = _inputs(64, 128, 1024, "bfloat16", False, seed=12)
    _check(arrays, _sharded(mesh, layout, arrays), kw, "bfloat16", budget=None)


@needs_devices
def test_mosaic_lowers_per_shard_for_cuda(monkeypatch):
    """Explicit mesh (tokens over "d", vocabulary over "t"): the fwd+bwd lowered for CUDA
    on any machine calls the Mosaic GPU kernels on each device's shard (local shapes),
    never on the global x or W (the backend partitions; it once ran unsharded)."""
    kind = pytest.importorskip("logitless.jax.ops.common.mosaic_gpu", reason="this jax has no Pallas Mosaic GPU")
    monkeypatch.setattr(kind, "INTERPRET", False)
    mesh = make_mesh("explicit")
    nd, nt = mesh.shape[DATA], mesh.shape[MODEL]
    n, h, v = 64 * nd, 128, 384 * nt  # (no global size equals a local one)
    x = jax.ShapeDtypeStruct((n, h), jnp.bfloat16, sharding=NamedSharding(mesh, P(DATA)))
    w = jax.ShapeDtypeStruct((v, h), jnp.bfloat16, sharding=NamedSharding(mesh, P(MODEL)))
    t = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=NamedSharding(mesh, P(DATA)))

    def f(x, w, t):
        lp, ent = linear_log_probs(x, w, t, temperature=0.7, entropy=True, implementation="mosaic_gpu")
        return jnp.sum(lp) + jnp.sum(ent)

    text = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).trace(x, w, t).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) >= 2, calls  # forward and backward kernels
    for line in calls:
        assert f"tensor<64x{h}xbf16>" in line and f"tensor<384x{h}xbf16>" in line, line[-300:]
        assert nd == 1 or f"tensor<{n}x{h}xbf16>" not in line, line[-300:]  # (one data device: local = global)
        assert f"tensor<{v}x{h}xbf16>" not in line, line[-300:]


@needs_devices
@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_shard_map_token_split_replicated_weight(implementation):
    """Inside jax.shard_map (check_vma) with the tokens split and the weight and bias
    replicated: dW and db come back summed over the devices' tokens, typed like their
    primals (the backward once returned them per device: a custom_vjp type error)."""
    from logitless.jax.ops.linear_log_probs import backends

    if backends.BACKENDS[implementation].unsupported((8, 24), (268, 24), jnp.float32, softcap=None,
                                                      has_bias=True) is not None:
        pytest.skip(f"{implementation} is not available here")
    mesh = jax.make_mesh((NDEV,), (DATA,), axis_types=(jax.sharding.AxisType.Auto,))
    x, w, t, b = inputs(4 * NDEV, 24, 268, "float32", bias=True, ignore=(1,), seed=5)
    kw = dict(temperature=0.7, entropy=True)

    g1, g2 = (jnp.asarray(g) for g in upstream(t.shape))

    def local(x, w, t, b, g1, g2):
        lp, h = linear_log_probs(x, w, t, b, implementation=implementation, **kw)
        return jax.lax.psum(jnp.sum(lp * g1) + jnp.sum(h * g2), DATA)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(DATA), P(), P(DATA), P(), P(DATA), P(DATA)), out_specs=P())
    grads = jax.jit(jax.grad(lambda x, w, b: f(x, w, t, b, g1, g2), argnums=(0, 1, 2)))(x, w, b)
    _, rgrads = log_probs_reference64(x, w, t, b, kw, g1, g2)
    for name, g, rg in zip(("dx", "dw", "db"), grads, rgrads):
        assert_close_to_ref(name, g, None, rg, "float32")
