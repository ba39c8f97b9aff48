"""logitless.jax under sharding: jit with NamedSharding inputs (Auto meshes through
custom_partitioning, Explicit meshes through shard_map), shard_map with
vocab_axis_name / token_axis_name (check_vma=True), against float64; compiled-HLO checks
(no all-gather of per-token arrays in data parallel, none of the weight in tensor
parallel, no tokens x vocab array); stats.lse differentiable.

Needs several devices: conftest.py gives the CPU 8 host devices
(``--xla_force_host_platform_device_count=8``); on a machine with fewer devices the
multi-device tests skip with that reason (on the 2-GPU machine they use a (1, 2) / (2, 1)
mesh where 8 devices are not there).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from logitless.jax import linear_cross_entropy
from logitless.jax.ops.linear_cross_entropy.reference import linear_cross_entropy_ref

from .helpers import (
    DATA,
    LAYOUTS,
    MODEL,
    NDEV,
    argmax_ref,
    assert_close_to_ref,
    hlo_array_shapes,
    hlo_collectives,
    inputs,
    make_mesh,
    needs_devices,
    needs_sm90_gpus,
    put,
    xla_materialised,
)

OPTIONS = {
    "plain": dict(),
    "all": dict(label_smoothing=0.1, z_loss=1e-3, softcap=4.0, bias=True),
}


def _sharded_inputs(mesh, layout, n, h, v, dtype, bias, seed=0):
    x, w, t, b = inputs(n, h, v, dtype, bias=bias, ignore=(1, 7), seed=seed)
    xs, ws = LAYOUTS[layout]
    tok = xs[0] if len(xs) else None
    voc = ws[0] if len(ws) else None
    args = (put(mesh, x, *xs), put(mesh, w, *ws), put(mesh, t, tok), put(mesh, b, voc))
    return (x, w, t, b), args


def _check(loss, grads, ref_args, kw, dtype, stats=None):
    x, w, t, b = ref_args
    red = kw.get("reduction", "mean")
    g_out = np.arange(1, t.size + 1) / t.size if red == "none" else None
    rloss, rlse, rgrads = linear_cross_entropy_ref(x, w, t, b, grad_out=g_out, **kw)
    nkw = {k: v for k, v in kw.items()}
    nloss = xla_materialised(x, w, t, b, **nkw)
    assert_close_to_ref("loss", loss, nloss, rloss, dtype)
    for name, g, rg, p in zip(("dx", "dw", "db"), grads, rgrads, (x, w, b)):
        if p is None:
            continue
        assert g.shape == p.shape and g.dtype == p.dtype, name
        assert_close_to_ref(name, g, None, rg, dtype)
    if stats is not None:
        assert_close_to_ref("lse", stats.lse, None, rlse, dtype)
        assert int(stats.num_tokens) == int(np.sum(np.asarray(t) != kw.get("ignore_index", -100)))
        if dtype == "float32":  # (16-bit near-ties may flip)
            assert np.array_equal(np.asarray(stats.argmax), argmax_ref(x, w, t, b, **kw))


def _loss_and_grads(args, kw):
    x, w, t, b = args
    red = kw.get("reduction", "mean")

    def f(x, w, b):
        loss = linear_cross_entropy(x, w, t, b, **kw)
        if red == "none":
            loss = jnp.sum(loss * jnp.arange(1, t.size + 1) / t.size)
        return loss

    argnums = (0, 1) if b is None else (0, 1, 2)
    fn = jax.jit(jax.value_and_grad(f, argnums=argnums))
    return fn, fn(x, w, b)


@needs_devices
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_jit_sharded_against_float64(mesh_kind, layout, option):
    mesh = make_mesh(mesh_kind, layout)
    kw = dict(OPTIONS[option])
    bias = kw.pop("bias", False)
    # Both sizes divide by every mesh axis; V odd per shard (268 / 4 = 67, 268 / 2 = 134).
    ref_args, args = _sharded_inputs(mesh, layout, 32, 24, 268, "float32", bias,
                                     seed=list(LAYOUTS).index(layout))
    for red in ("mean", "sum"):
        kw["reduction"] = red
        _, (loss, grads) = _loss_and_grads(args, kw)
        _check(loss, grads, ref_args, kw, "float32")
    x, w, t, b = args
    kw_none = dict(kw, reduction="none")
    loss, stats = jax.jit(lambda x, w, b: linear_cross_entropy(x, w, t, b, return_stats=True, **kw_none))(x, w, b)
    _check(jnp.asarray(loss), (), ref_args, dict(kw, reduction="none"), "float32", stats=stats)


@needs_devices
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_jit_sharded_bf16_and_3d(mesh_kind):
    """bf16, (B, S, H) inputs with the batch sharded, weight split over the vocabulary."""
    mesh = make_mesh(mesh_kind)
    x, w, t, _ = inputs(0, 40, 262, "bfloat16", lead=(8, 5), seed=3)
    xs = put(mesh, x, DATA)
    ts = put(mesh, t, DATA)
    ws = put(mesh, w, MODEL)
    f = lambda x, w: linear_cross_entropy(x, w, ts, label_smoothing=0.05)
    loss, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(xs, ws)
    rloss, _, rgrads = linear_cross_entropy_ref(x, w, t, label_smoothing=0.05)
    nloss = xla_materialised(x, w, t, label_smoothing=0.05)
    _, ngrads = jax.value_and_grad(lambda x, w: xla_materialised(x, w, t, label_smoothing=0.05), argnums=(0, 1))(x, w)
    assert_close_to_ref("loss", loss, nloss, rloss, "bfloat16")
    for name, g, ng, rg in zip(("dx", "dw"), grads, ngrads, rgrads):
        assert g.dtype == jnp.bfloat16
        assert_close_to_ref(name, g, ng, rg, "bfloat16")


# ------------------------------------------------------------------------------------
# Compiled HLO: which collectives, on what shapes
# ------------------------------------------------------------------------------------

@needs_devices
@pytest.mark.parametrize("layout", ["data", "tensor", "2d"])
def test_hlo_collectives(layout):
    mesh = make_mesh("auto", layout)
    n, h, v = 64, 32, 1024
    _, args = _sharded_inputs(mesh, layout, n, h, v, "float32", False)
    # The xla backend (the partitioning is the backends' common code): a GPU kernel
    # backend's chunk is at least one tile of columns, which a toy budget cannot shrink.
    fn, _ = _loss_and_grads(args, dict(reduction="mean", memory_budget=60_000, implementation="xla"))
    x, w, t, b = args
    text = fn.lower(x, w, b).compile().as_text()
    colls = hlo_collectives(text)
    ntok = mesh.shape[DATA] if layout != "tensor" else 1
    nvoc = mesh.shape[MODEL] if layout != "data" else 1
    for kind, shapes in colls:
        for s in shapes:
            # Nothing of the weight's size or larger but dW itself moves; no all-gather
            # of x, of per-token arrays or of the weight.
            assert kind != "all-gather", (kind, s, colls)
            # XLA's GPU all-reduce combiner packs dW with the bias/scalars (e.g. 1024 * 32 + 1):
            # allowed up to the local dW and db plus a few scalars.
            size = int(np.prod(s))
            assert (s in {(v // nvoc, h), (v, h)} or size <= (n // ntok) * h
                    or (kind == "all-reduce" and size <= (v // nvoc) * (h + 1) + 8)), (kind, s)
    if layout == "data":
        # Only O(1) values and dW are reduced: no per-token collective at all (XLA's GPU
        # all-reduce combiner packs dW with the loss scalar: v * h + 1 elements on 2 H200s).
        for kind, shapes in colls:
            for s in shapes:
                size = int(np.prod(s))
                assert size <= 2 or s in {(v, h)} or (kind == "all-reduce" and v * h <= size <= v * h + 8), (kind, s)
    # No tokens x vocab array anywhere (global or per device).
    for s in hlo_array_shapes(text):
        big = len(s) == 2 and s[0] >= n // ntok and s[1] >= v // nvoc
        assert not big, s
    assert any(kind == "all-reduce" for kind, _ in colls)


# ------------------------------------------------------------------------------------
# shard_map
# ------------------------------------------------------------------------------------


def _shard_map_loss(mesh, kw, token=True, vocab=True, check_vma=True):
    tok = DATA if token else None
    voc = MODEL if vocab else None

    def local(x, w, t, b):
        loss, stats = linear_cross_entropy(x, w, t, b, return_stats=True, token_axis_name=tok,
                                           vocab_axis_name=voc, **kw)
        return loss, stats.lse, stats.num_tokens, stats.argmax

    in_specs = (P(tok, None), P(voc, None), P(tok), P(voc))
    out_specs = (P(tok) if kw.get("reduction") == "none" else P(), P(tok), P(), P(tok))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)


@needs_devices
@pytest.mark.parametrize("axes", ["token", "vocab", "both"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_shard_map_global_values_and_grads(axes, reduction):
    mesh = make_mesh("explicit")
    token, vocab = axes in ("token", "both"), axes in ("vocab", "both")
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
    x, w, t, b = inputs(32, 24, 134, "float32", bias=True, ignore=(2, 9), seed=7)
    tok, voc = (DATA if token else None), (MODEL if vocab else None)
    xs, ws, ts, bs = put(mesh, x, tok, None), put(mesh, w, voc, None), put(mesh, t, tok), put(mesh, b, voc)
    sm = _shard_map_loss(mesh, kw, token, vocab)

    def f(x, w, b):
        loss, lse, cnt, am = sm(x, w, ts, b)
        return loss, (lse, cnt, am)

    (loss, (lse, cnt, am)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(xs, ws, bs)
    assert np.array_equal(np.asarray(am), argmax_ref(x, w, t, b, **kw))  # merged over the vocab shards
    if not token:
        # Without token_axis_name each member of the data axis would see its own tokens:
        # here the tokens are not split, so the values are global anyway.
        pass
    rloss, rlse, rgrads = linear_cross_entropy_ref(x, w, t, b, **kw)
    assert_close_to_ref("loss", loss, None, rloss, "float32")
    assert_close_to_ref("lse", lse, None, rlse, "float32")
    assert int(cnt) == 30
    for name, g, rg in zip(("dx", "dw", "db"), grads, rgrads):
        assert_close_to_ref(name, g, None, rg, "float32")


@needs_devices
def test_shard_map_unbound_axis_names_raise():
    mesh = make_mesh("explicit")
    x, w, t, _ = inputs(8, 16, 64, seed=1)
    for arg in ("vocab_axis_name", "token_axis_name"):
        f = jax.shard_map(lambda x, w, t, arg=arg: linear_cross_entropy(x, w, t, **{arg: "nope"}), mesh=mesh,
                          in_specs=(P(), P(), P()), out_specs=P())
        with pytest.raises(ValueError, match=f"{arg}='nope'"):
            jax.jit(f)(x, w, t)
    with pytest.raises(ValueError, match="vocab_axis_name='t'"):
        linear_cross_entropy(x, w, t, vocab_axis_name=MODEL)  # not inside shard_map


def test_lse_is_differentiable_against_float64():
    """d/d(x, w, b) of sum(r * stats.lse) + loss: d lse / d z_c = p_c (finite in fp64)."""
    x, w, t, b = inputs(13, 20, 97, "float32", bias=True, ignore=(4,), seed=11)
    r = jnp.asarray(np.random.default_rng(5).standard_normal(13), jnp.float32)
    kw = dict(label_smoothing=0.1, softcap=6.0)

    def ours(x, w, b):
        loss, stats = linear_cross_entropy(x, w, t, b, return_stats=True, **kw)
        return loss + jnp.sum(r * stats.lse)

    def ref(x, w, b):
        z = x @ w.T + b
        z = 6.0 * jnp.tanh(z / 6.0)
        return xla_materialised(x, w, t, b, **kw) + jnp.sum(r * jax.nn.logsumexp(z, axis=-1))

    grads = jax.grad(ours, argnums=(0, 1, 2))(x, w, b)
    with jax.enable_x64(True):
        to64 = lambda a: jnp.asarray(np.asarray(a), jnp.float64)
        r64 = to64(r)
        t64 = jnp.asarray(np.asarray(t))

        def ref64(x, w, b):
            z = 6.0 * jnp.tanh((x @ w.T + b) / 6.0)
            lse = jax.nn.logsumexp(z, axis=-1)
            valid = t64 != -100
            zt = jnp.take_along_axis(z, jnp.where(valid, t64, 0)[:, None], axis=-1)[:, 0]
            loss = 0.9 * (lse - zt) + 0.1 / 97 * (97 * lse - z.sum(-1))
            return jnp.sum(jnp.where(valid, loss, 0.0)) / valid.sum() + jnp.sum(r64 * lse)

        rgrads = [np.asarray(g) for g in jax.grad(ref64, argnums=(0, 1, 2))(to64(x), to64(w), to64(b))]
    ngrads = jax.grad(ref, argnums=(0, 1, 2))(x, w, b)
    for name, g, ng, rg in zip(("dx", "dw", "db"), grads, ngrads, rgrads):
        assert float(np.abs(rg).max()) > 0
        assert_close_to_ref(name, g, ng, rg, "float32")


@needs_devices
def test_vmap_and_replicated_jit_still_work():
    """One device's semantics on a multi-device machine: replicated jit and vmap (the
    partitioned functions have a vmap rule)."""
    x, w, t, _ = inputs(0, 16, 67, lead=(3, 5), seed=2)
    f = jax.jit(jax.vmap(lambda x, t: linear_cross_entropy(x, w, t)))
    got = f(x, t)
    want = jax.vmap(lambda x, t: xla_materialised(x, w, t))(x, t)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    g = jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(lambda x, t: linear_cross_entropy(x, w, t))(x, t))))(x)
    gw = jax.grad(lambda x: jnp.sum(jax.vmap(lambda x, t: xla_materialised(x, w, t))(x, t)))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(gw), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------
# The Mosaic GPU kernels, per shard
# ------------------------------------------------------------------------------------


@needs_devices
def test_mosaic_lowers_per_shard_for_cuda(monkeypatch):
    """Explicit mesh (tokens over "d", vocabulary over "t"): the fwd+bwd lowered for CUDA
    on any machine calls the Mosaic kernels on each device's shard (local shapes)."""
    kind = pytest.importorskip("logitless.jax.ops.common.mosaic_gpu", reason="this jax has no Pallas Mosaic GPU")
    monkeypatch.setattr(kind, "INTERPRET", False)
    mesh = make_mesh("explicit")
    nd, nt = mesh.shape[DATA], mesh.shape[MODEL]
    n, h, v = 16 * nd, 128, 256 * nt
    x = jax.ShapeDtypeStruct((n, h), jnp.bfloat16, sharding=NamedSharding(mesh, P(DATA)))
    w = jax.ShapeDtypeStruct((v, h), jnp.bfloat16, sharding=NamedSharding(mesh, P(MODEL)))
    t = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=NamedSharding(mesh, P(DATA)))
    for budget, kernels in ((None, 1), (1, 2)):  # exp(z - m) kept: no dz kernel; none kept: recomputed
        f = lambda x, w, t: linear_cross_entropy(x, w, t, implementation="mosaic_gpu", memory_budget=budget)
        text = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).trace(x, w, t).lower(
            lowering_platforms=("cuda",)).as_text()
        calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
        assert len(calls) == kernels, calls  # the forward kernel (and the dz kernel)
        for line in calls:
            assert f"tensor<16x{h}xbf16>" in line and f"tensor<256x{h}xbf16>" in line, line[-300:]
            assert nd == 1 or f"tensor<{n}x{h}xbf16>" not in line
            assert f"tensor<{v}x{h}xbf16>" not in line


@needs_devices
def test_mosaic_kept_dz_kernel_types_its_output_inside_shard_map(monkeypatch):
    """Explicit mesh, every column kept, whole row blocks per device: the backward writes dz
    over K with a pallas_call (``common.mosaic_gpu.dz_over_kept``), whose output must be typed as varying
    like K inside jax.shard_map (check_vma; untyped, jax refused the trace: the kernels ran
    only on an Auto mesh). Traced on any machine; run on 2 GPUs by
    ``test_mosaic_sharded_on_gpus[default-explicit-*]``."""
    kind = pytest.importorskip("logitless.jax.ops.common.mosaic_gpu", reason="this jax has no Pallas Mosaic GPU")
    monkeypatch.setattr(kind, "INTERPRET", False)
    mesh = make_mesh("explicit")
    nd, nt = mesh.shape[DATA], mesh.shape[MODEL]
    n, h, v = 256 * nd, 128, 256 * nt  # 256 rows: one whole row block per device
    x = jax.ShapeDtypeStruct((n, h), jnp.bfloat16, sharding=NamedSharding(mesh, P(DATA)))
    w = jax.ShapeDtypeStruct((v, h), jnp.bfloat16, sharding=NamedSharding(mesh, P(MODEL)))
    t = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=NamedSharding(mesh, P(DATA)))
    f = lambda x, w, t: linear_cross_entropy(x, w, t, implementation="mosaic_gpu")
    jaxpr = str(jax.jit(jax.value_and_grad(f, argnums=(0, 1))).trace(x, w, t).jaxpr)
    assert "shard_map" in jaxpr and "input_output_aliases=((0, 0),)" in jaxpr


@needs_sm90_gpus
@pytest.mark.parametrize("layout", ["data", "tensor", "fsdp"])
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
@pytest.mark.parametrize("part", [False, True], ids=["default", "part_kept"])
def test_mosaic_sharded_on_gpus(layout, mesh_kind, part):
    """The Mosaic kernels sharded; ``part``: a budget that holds part of the columns (the
    slots of ``test_mosaic_partial_keep_slots``: both splits keep, one refitted)."""
    mesh = make_mesh(mesh_kind, layout)
    n, h, v = (4096, 256, 33024) if part else (1024, 256, 4096 + 512)
    ref_args, args = _sharded_inputs(mesh, layout, n, h, v, "bfloat16", False, seed=5)
    x, w, t, _ = ref_args
    kw = dict(reduction="mean", implementation="mosaic_gpu", label_smoothing=0.1,
              **({"memory_budget": 100 * 2**20} if part else {}))
    _, (loss, grads) = _loss_and_grads(args, kw)
    ref_kw = dict(reduction="mean", label_smoothing=0.1)
    rloss, _, rgrads = linear_cross_entropy_ref(x, w, t, **ref_kw)
    nloss, ngrads = jax.value_and_grad(lambda x, w: xla_materialised(x, w, t, **ref_kw), argnums=(0, 1))(x, w)
    assert_close_to_ref("loss", loss, nloss, rloss, "bfloat16")
    for name, g, ng, rg in zip(("dx", "dw"), grads, ngrads, rgrads):
        assert_close_to_ref(name, g, ng, rg, "bfloat16")


@needs_devices
def test_tokamax_dropin_inside_shard_map_check_vma():
    """The drop-in (no axis names) inside shard_map with the default check_vma=True,
    tokens split: each device's own sum; the weight's gradient is summed over the
    devices (shard_map's typing), as a replicated parameter's must be."""
    from logitless.jax import linear_softmax_cross_entropy_loss

    mesh = make_mesh("explicit")
    x, w, t, _ = inputs(32, 24, 300, seed=9)
    kernel = w.T  # (H, V)
    xs, ts = put(mesh, x, DATA), put(mesh, t, DATA)
    ks = put(mesh, kernel)

    def local(x, k, t):
        return jax.lax.psum(linear_softmax_cross_entropy_loss(x, t, k), DATA)

    sm = jax.shard_map(local, mesh=mesh, in_specs=(P(DATA), P(), P(DATA)), out_specs=P())
    loss, (gx, gk) = jax.jit(jax.value_and_grad(lambda x, k: sm(x, k, ts), argnums=(0, 1)))(xs, ks)
    rloss, _, (rgx, rgw, _) = linear_cross_entropy_ref(x, w, t, reduction="sum")
    assert_close_to_ref("loss", loss, None, rloss, "float32")
    assert_close_to_ref("dx", gx, None, rgx, "float32")
    assert_close_to_ref("dkernel", gk, None, np.asarray(rgw).T, "float32")


@needs_devices
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_maxtext_style_kernel_hv(mesh_kind):
    """MaxText's layout: activations (batch, seq, embed) with the batch over "d", the
    LM-head kernel (embed, vocab) with embed over "d" (FSDP) and vocab over "t"."""
    mesh = make_mesh(mesh_kind)
    x, w, t, _ = inputs(0, 32, 268, "float32", lead=(8, 3), ignore=(5,), seed=12)
    kernel = w.T
    xs, ts = put(mesh, x, DATA), put(mesh, t, DATA)
    ks = put(mesh, kernel, DATA, MODEL)
    f = lambda x, k: linear_cross_entropy(x, k, ts, weight_layout="hv", z_loss=1e-4)
    loss, (gx, gk) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(xs, ks)
    assert gk.shape == kernel.shape and gx.shape == x.shape
    rloss, _, (rgx, rgk, _) = linear_cross_entropy_ref(x, kernel, t, weight_layout="hv", z_loss=1e-4)
    assert_close_to_ref("loss", loss, None, rloss, "float32")
    assert_close_to_ref("dx", gx, None, rgx, "float32")
    assert_close_to_ref("dkernel", gk, None, rgk, "float32")


def test_mosaic_backward_chunk_counts_its_temporaries():
    """The Mosaic backward's chunk: the dz chunk, the W slice and the dW chunk fit in the
    budget left after the fp32 dx accumulator (when that leaves at least a tile)."""
    mg = pytest.importorskip("logitless.jax.ops.linear_cross_entropy.mosaic_gpu_backend",
                             reason="this jax has no Pallas Mosaic GPU")
    budget = 256 * 2**20
    for n, h, v in [(4096, 4096, 128256), (8192, 7168, 128256), (4096, 2560, 262144), (8192, 4096, 64128)]:
        c = mg._chunk_columns(n, v, h, 2, budget, 128)
        assert c % 128 == 0 and 128 <= c <= v + 127
        fixed = 4 * n * h
        chunk_bytes = 2 * c * (n + 2 * h)
        assert chunk_bytes <= max(budget - fixed, budget // 4), (n, h, v, c)
        assert fixed + chunk_bytes <= 2 * budget
    assert mg._chunk_columns(64, 256, 64, 2, 1, 128) == 128  # at least one tile


@needs_devices
@pytest.mark.parametrize("v", [1024, 96])
def test_hlo_fsdp_reduce_scatters_dw(v):
    """FSDP (tokens and the weight's vocabulary over the same axis): where x is the smaller
    to move (3 N < 2 V, ``sharding.split_shared``) the axis splits the vocabulary: x
    gathered, dW computed in the weight's split (no reduce-scatter, no all-gather or
    all-reduce of W's size); else W is gathered for the computation and dW
    reduce-scattered back to the weight's split (never all-reduced)."""
    mesh = make_mesh("auto", "fsdp")
    n, h = 64, 32
    ref_args, args = _sharded_inputs(mesh, "fsdp", n, h, v, "float32", False)
    # The xla backend on every platform (fp32 at a toy shape; Mosaic partitions alike: its
    # async reduce-scatter on 2 H100s, jax-fsdp-hlo-2xH100-2026-11-25.json in git history).
    kw = dict(reduction="mean", implementation="xla")
    fn, (loss, grads) = _loss_and_grads(args, kw)
    _check(loss, grads, ref_args, dict(reduction="mean"), "float32")
    assert grads[1].sharding.spec[0] == DATA  # dW keeps the weight's split
    x, w, _, b = args
    colls = hlo_collectives(fn.lower(x, w, b).compile().as_text())
    vocab_split = 3 * n < 2 * v
    assert any(kind == "reduce-scatter" for kind, _ in colls) != vocab_split, colls
    for kind, shapes in colls:
        if kind == "all-reduce" or vocab_split:
            assert all(int(np.prod(s)) < v * h for s in shapes), (kind, shapes)


@needs_devices
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
@pytest.mark.parametrize("layout", ["data", "tensor"])
def test_class_weight_and_shift_under_sharded_jit(mesh_kind, layout):
    """class_weight (no vocabulary split: the op then runs unsplit along the vocabulary)
    and shift=True, sharded inputs, against the single-device result."""
    mesh = make_mesh(mesh_kind, layout)
    x, w, t, _ = inputs(0, 24, 268, "float32", lead=(8, 4), ignore=(3,), seed=21)
    cw = jnp.asarray(np.random.default_rng(2).uniform(0.5, 2.0, 268), jnp.float32)
    xs_spec, ws_spec = LAYOUTS[layout]
    xs, ws = put(mesh, x, *xs_spec), put(mesh, w, *ws_spec)
    ts = put(mesh, t, xs_spec[0] if len(xs_spec) else None)
    kw = dict(class_weight=cw, shift=True, label_smoothing=0.1)
    f = lambda x, w, t: linear_cross_entropy(x, w, t, **kw)
    loss, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(xs, ws, ts)
    rloss, rgrads = jax.value_and_grad(f, argnums=(0, 1))(x, w, t)  # unsharded
    np.testing.assert_allclose(float(loss), float(rloss), rtol=1e-6)
    for g, rg in zip(grads, rgrads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(rg), rtol=1e-5, atol=1e-6)


@needs_devices
@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_shard_map_token_split_replicated_bias(implementation):
    """Inside jax.shard_map (check_vma) with the tokens split and the weight and bias
    replicated: dW and db are summed over every device's tokens. The Triton kernels'
    outputs were typed invariant there, so db held this device's tokens only."""
    from logitless.jax.ops.linear_cross_entropy import backends

    if backends.BACKENDS[implementation].unsupported((8, 24), (268, 24), jnp.float32, softcap=None,
                                                      has_bias=True) is not None:
        pytest.skip(f"{implementation} is not available here")
    mesh = jax.make_mesh((NDEV,), (DATA,), axis_types=(jax.sharding.AxisType.Auto,))
    x, w, t, b = inputs(4 * NDEV, 24, 268, "float32", bias=True, ignore=(1,), seed=4)
    kw = dict(label_smoothing=0.1, z_loss=1e-3)

    def local(x, w, t, b):
        return linear_cross_entropy(x, w, t, b, implementation=implementation, token_axis_name=DATA, **kw)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(DATA), P(), P(DATA), P()), out_specs=P())
    loss, grads = jax.jit(jax.value_and_grad(lambda x, w, b: f(x, w, t, b), argnums=(0, 1, 2)))(x, w, b)
    rloss, _, rgrads = linear_cross_entropy_ref(x, w, t, b, **kw)
    assert_close_to_ref("loss", loss, None, rloss, "float32")
    for name, g, rg in zip(("dx", "dw", "db"), grads, rgrads):
        assert_close_to_ref(name, g, None, rg, "float32")


class _KeepingXla:
    """A test backend that keeps something for its backward: the "xla" backend whose
    forward (keep=True) keeps the local fp32 logits z, and whose backward takes dz from
    exactly that array (so a device given another device's block, or none, fails)."""

    name = "keeping"
    keeps = True
    seen: list = []  # per traced backward: (x rows, W rows, whether it found what its forward kept)

    def __init__(self):
        from logitless.jax.ops.linear_cross_entropy.backends import BACKENDS

        self.xla = BACKENDS["xla"]
        self.native_hv, self.class_weights, self.argmax = False, False, False

    def unsupported(self, *a, **k):
        return self.xla.unsupported(*a, **k)

    def can_partition(self):
        return True

    def plan(self, *a, **k):
        return self.xla.plan(*a, **k)

    def refit_kept(self, config, x2d_shape, w_shape, dtype, *, budget, sizes):
        return None  # (it keeps every column: both splits' arrays have the same sizes)

    def forward(self, x2d, w, bias, target, config, *, softcap, need_smooth, class_weight=None, need_argmax=False,
                keep=False):
        st = self.xla.forward(x2d, w, bias, target, config, softcap=softcap, need_smooth=need_smooth)
        return st._replace(kept=(jnp.dot(x2d, w.T, preferred_element_type=jnp.float32),)) if keep else st

    def backward(self, res, coef, config, *, softcap):
        from logitless.jax.formulas.cross_entropy import dlogits
        from logitless.jax.ops.linear_cross_entropy.contract import LceGrads

        _KeepingXla.seen.append((res.x2d.shape[0], res.w.shape[0], res.kept is not None))
        if res.kept is None:
            return self.xla.backward(res, coef, config, softcap=softcap)
        dz = dlogits(res.kept[0], res.lse, coef, res.target, 0, None)
        return LceGrads((dz @ res.w).astype(res.x2d.dtype), (dz.T @ res.x2d).astype(res.w.dtype), None)


@needs_devices
@pytest.mark.parametrize("layout", ["data", "tensor", "2d", "tokens_2axes", "fsdp"])
def test_partitioned_backward_gets_what_its_forward_kept(layout, monkeypatch):
    """Auto mesh (custom_partitioning): a backend's kept arrays travel from each device's
    forward to its backward as that device's block of the residual slots (tokens and
    vocabulary split over every device: kept; a split over fewer devices: unused slots,
    the backward recomputes); gradients exact either way."""
    from logitless.jax.ops.linear_cross_entropy import backends

    monkeypatch.setitem(backends.BACKENDS.classes, "keeping", "_KeepingXla")  # (the instance below serves)
    monkeypatch.setitem(backends.BACKENDS, "keeping", _KeepingXla())
    _KeepingXla.seen.clear()
    mesh = make_mesh("auto", layout)
    ref_args, args = _sharded_inputs(mesh, layout, 64, 24, 512, "float32", False, seed=3)
    kw = dict(reduction="mean", label_smoothing=0.1, z_loss=1e-3)
    axes = lambda spec: () if not len(spec) or spec[0] is None else (
        (spec[0],) if isinstance(spec[0], str) else tuple(spec[0]))
    tok = axes(LAYOUTS[layout][0])
    voc = tuple(a for a in axes(LAYOUTS[layout][1]) if a not in tok)
    every = int(np.prod([mesh.shape[a] for a in tok + voc])) == mesh.size
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, (loss, grads) = _loss_and_grads(args, dict(kw, implementation="keeping"))
    _check(loss, grads, ref_args, kw, "float32")
    # Slots that a split over fewer devices leaves unused are said (memory beside the budget).
    assert any("go unused" in str(w.message) for w in caught) == (not every)
    # The per-device traces (the global-shape one is jax's abstract evaluation).
    per_device = [kept for n, v, kept in _KeepingXla.seen if (n, v) != (64, 512)]
    assert per_device and all(k == every for k in per_device), (_KeepingXla.seen, mesh.shape)


class _PartKeeping(_KeepingXla):
    """A keeping backend whose budget holds part of the columns, as mosaic_gpu's: its plan
    keeps the fp32 logits of the first C columns, C = (budget - 4 N H) / (4 N) rounded
    down to 8 (the N x H accumulator makes a vocabulary split keep fewer elements than a
    token split), and ``refit_kept`` keeps any other count that the budget holds. The
    backward takes those columns' dz from what it kept, recomputes the others."""

    from typing import NamedTuple as _NT

    class Config(_NT):
        xla: object
        keep: int
        weight_layout: str = "vh"

    def plan(self, x2d_shape, w_shape, dtype, *, budget, weight_layout="vh", has_bias=False):
        (n, h), v = x2d_shape, w_shape[0]
        base = self.xla.plan(x2d_shape, w_shape, dtype, budget=budget, weight_layout=weight_layout,
                             has_bias=has_bias)
        return self.Config(base, min(v, max(0, budget - 4 * n * h) // (4 * n) // 8 * 8))

    def refit_kept(self, config, x2d_shape, w_shape, dtype, *, budget, sizes):
        (n, h), v = x2d_shape, w_shape[0]
        c = sizes[0] // n
        fits = len(sizes) == 1 and c * n == sizes[0] and 0 < c <= v and 4 * n * (c + h) <= budget
        return config._replace(keep=c) if fits else None

    def forward(self, x2d, w, bias, target, config, *, softcap, need_smooth, class_weight=None, need_argmax=False,
                keep=False):
        st = self.xla.forward(x2d, w, bias, target, config.xla, softcap=softcap, need_smooth=need_smooth)
        if not keep or not config.keep:
            return st
        return st._replace(kept=(jnp.dot(x2d, w[:config.keep].T, preferred_element_type=jnp.float32),))

    def backward(self, res, coef, config, *, softcap):
        from logitless.jax.formulas.cross_entropy import dlogits
        from logitless.jax.ops.linear_cross_entropy.contract import LceGrads

        _KeepingXla.seen.append((res.x2d.shape[0], res.w.shape[0], None if res.kept is None else config.keep))
        z = jnp.dot(res.x2d, res.w.T, preferred_element_type=jnp.float32)
        if res.kept is not None:  # the kept columns from the forward (another block would fail)
            z = jnp.concatenate([res.kept[0], z[:, config.keep:]], axis=1)
        dz = dlogits(z, res.lse, coef, res.target, 0, None)
        return LceGrads((dz @ res.w).astype(res.x2d.dtype), (dz.T @ res.x2d).astype(res.w.dtype), None)


@needs_devices
def test_partial_keeps_fill_slots_in_both_splits(monkeypatch):
    """A budget that holds part of the columns: a token split and a vocabulary split over
    every device plan different kept arrays of their own (the slots then fitted neither
    and nothing was kept: the backward recomputed the whole GEMM), so the slots take the
    smaller and the other split's plan is refitted to it: both keep (no warning), and the
    loss and gradients equal the float64 reference in both splits."""
    from logitless.jax.ops.linear_cross_entropy import backends, sharded

    monkeypatch.setitem(backends.BACKENDS.classes, "partkeeping", "_PartKeeping")
    monkeypatch.setitem(backends.BACKENDS, "partkeeping", _PartKeeping())
    n, h, v = 8 * NDEV, 24, 64 * NDEV
    budget = 4 * n * h + n * (v // NDEV)  # a vocabulary split keeps a quarter of its columns
    static = sharded._Static("partkeeping", None, True, budget, "vh", False)
    tok_plan = _PartKeeping().plan((n // NDEV, h), (v, h), jnp.float32, budget=budget)
    voc_plan = _PartKeeping().plan((n, h), (v // NDEV, h), jnp.float32, budget=budget)
    # The case: each split keeps part of its columns, a different number of elements.
    assert 0 < voc_plan.keep < v // NDEV and 0 < tok_plan.keep < v
    assert n * voc_plan.keep != n // NDEV * tok_plan.keep
    slots = sharded.kept_slots(static, (n, h), (v, h), jnp.float32, NDEV)
    assert slots == (((NDEV * n, voc_plan.keep), "float32"),)
    mesh = jax.make_mesh((NDEV,), (DATA,), axis_types=(jax.sharding.AxisType.Auto,))
    x, w, t, _ = inputs(n, h, v, "float32", ignore=(1,), seed=5)
    kw = dict(reduction="mean", label_smoothing=0.1, z_loss=1e-3, memory_budget=budget)
    ref_kw = {k: a for k, a in kw.items() if k != "memory_budget"}
    for split, (xs, ws) in {"tokens": (P(DATA), P()), "vocabulary": (P(), P(DATA))}.items():
        _KeepingXla.seen.clear()
        args = (put(mesh, x, *xs), put(mesh, w, *ws), put(mesh, t, *xs[:1]), None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _, (loss, grads) = _loss_and_grads(args, dict(kw, implementation="partkeeping"))
        _check(loss, grads, (x, w, t, None), ref_kw, "float32")
        per_device = [(rows, cols, keep) for rows, cols, keep in _KeepingXla.seen if (rows, cols) != (n, v)]
        # Each device kept the slots' elements: the token split refitted to the vocabulary split's.
        assert per_device and all(keep is not None and rows * keep == n * voc_plan.keep
                                  for rows, cols, keep in per_device), (split, _KeepingXla.seen)


def test_mosaic_partial_keep_slots():
    """mosaic_gpu where the budget holds part of the columns (2 devices): the token split
    and the vocabulary split plan different kept columns of their own; the slots take the
    vocabulary split's (the smaller) and the token split keeps into them, refitted (the
    kernels on 2 H100s: ``test_mosaic_sharded_on_gpus[part_kept]``; llama3.1-8b's head at
    16384 tokens and 1840 MiB in ``test_keep_plan_of_given_columns``)."""
    from logitless.jax.ops.linear_cross_entropy import sharded

    n, h, v, budget = 4096, 256, 33024, 100 * 2**20
    static = sharded._Static("mosaic_gpu", None, True, budget, "vh", False)
    tok = sharded._local_backend(static, (n // 2, h), (v, h), jnp.bfloat16)[1]
    voc = sharded._local_backend(static, (n, h), (v // 2, h), jnp.bfloat16)[1]
    assert 0 < n * voc.keep < n // 2 * tok.keep < n // 2 * v  # each keeps part, other elements
    slots = sharded.kept_slots(static, (n, h), (v, h), jnp.bfloat16, 2)
    assert slots == (((2 * n, voc.keep), "bfloat16"), ((2 * voc.keep // 128, n), "float32"))
    static = static._replace(slots=slots)
    axes = sharded.Axes(("d",), (), 2)
    for x_shape, w_shape, keep in (((n // 2, h), (v, h), 2 * voc.keep), ((n, h), (v // 2, h), voc.keep)):
        _, config, shapes, kept = sharded._local_kept(static, x_shape, w_shape, jnp.bfloat16, axes)
        assert kept is not None and config.keep == keep, (x_shape, config)
