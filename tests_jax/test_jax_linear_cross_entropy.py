"""logitless.jax.ops.linear_cross_entropy (xla backend) against the float64 NumPy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logitless.jax import LossStats, linear_cross_entropy, linear_softmax_cross_entropy_loss
from logitless.jax.ops.linear_cross_entropy import api
from logitless.jax.ops.linear_cross_entropy.reference import linear_cross_entropy_ref
from logitless.jax.planning import xla_plan

from .helpers import (
    LCE_OPTIONS,
    assert_close_to_ref,
    assert_matches_finite_differences,
    check_linear_cross_entropy,
    inputs,
    run_without_torch,
    xla_materialised,
)

OPTIONS = LCE_OPTIONS
#: A budget that forces several column *and* row chunks (with ragged tails) at the
#: small test shapes, and the default (one chunk at these shapes).
SMALL_BUDGET = 40_000


def _check(x, w, t, b, dtype, kw, budget=None, layout="vh"):
    return check_linear_cross_entropy(x, w, t, b, dtype, kw, budget, layout)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_options_against_float64(dtype, option, reduction):
    # V prime, H not a multiple of 16, ignored tokens, bias, chunks in both dimensions.
    x, w, t, b = inputs(45, 40, 1031, dtype, bias=option == "all", ignore=(3, 17), seed=list(OPTIONS).index(option))
    kw = dict(OPTIONS[option], reduction=reduction)
    _check(x, w, t, b, dtype, kw, budget=SMALL_BUDGET)


@pytest.mark.parametrize("budget", [None, SMALL_BUDGET, 1])
@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_budgets_and_layouts(budget, layout):
    x, w, t, b = inputs(33, 24, 509, bias=True, ignore=(0,))
    _check(x, w, t, b, "float32", dict(label_smoothing=0.1, softcap=5.0), budget=budget, layout=layout)


def test_plans_chunk_both_dimensions():
    assert xla_plan(45, 1031, 40, 4, SMALL_BUDGET) != (45, 1031)
    p = xla_plan(45, 1031, 40, 4, SMALL_BUDGET)
    assert p.token_chunk < 45 and 45 % p.token_chunk and 1031 % p.vocab_chunk  # ragged tails
    assert xla_plan(4096, 128256, 4096, 2, 256 * 2**20).token_chunk == 4096


@pytest.mark.parametrize("shape", [(1, 16, 7), (3, 7, 1), (5, 17, 2), (2, 8, 300)])
def test_odd_shapes(shape):
    n, h, v = shape
    x, w, t, b = inputs(n, h, v, bias=True)
    _check(x, w, t, b, "float32", dict(reduction="sum"), budget=SMALL_BUDGET)


def test_three_dimensional_and_none_shape():
    x, w, t, _ = inputs(0, 12, 101, lead=(2, 5))
    loss = linear_cross_entropy(x, w, t, reduction="none")
    assert loss.shape == (2, 5)
    _check(x, w, t, None, "float32", dict(reduction="none"), budget=SMALL_BUDGET)
    loss, stats = linear_cross_entropy(x, w, t, return_stats=True)
    assert isinstance(stats, LossStats) and stats.lse.shape == (2, 5) and int(stats.num_tokens) == 10
    _, rlse, _ = linear_cross_entropy_ref(x, w, t)
    np.testing.assert_allclose(np.asarray(stats.lse), rlse, rtol=1e-5, atol=1e-5)


def test_ignored_tokens_have_zero_gradient_and_loss():
    x, w, t, b = inputs(20, 16, 257, bias=True, ignore=(1, 2, 19))
    per_tok = linear_cross_entropy(x, w, t, b, reduction="none", memory_budget=SMALL_BUDGET)
    assert np.all(np.asarray(per_tok)[[1, 2, 19]] == 0.0)
    dx = jax.grad(lambda x: linear_cross_entropy(x, w, t, b, z_loss=1e-2, label_smoothing=0.1,
                                                 memory_budget=SMALL_BUDGET))(x)
    assert np.all(np.asarray(dx)[[1, 2, 19]] == 0.0)
    assert np.all(np.abs(np.asarray(dx)[0]) > 0)
    _, stats = linear_cross_entropy(x, w, t, return_stats=True)
    assert int(stats.num_tokens) == 17


def test_all_ignored_and_empty():
    x, w, t, b = inputs(6, 8, 31, ignore=range(6))
    loss, dx = jax.value_and_grad(lambda x: linear_cross_entropy(x, w, t))(x)
    assert np.isnan(float(loss)) and np.all(np.asarray(dx) == 0)  # mean over no token: 0/0, as torch
    assert float(linear_cross_entropy(x, w, t, reduction="sum")) == 0.0
    xe, te = jnp.zeros((0, 8)), jnp.zeros((0,), jnp.int32)
    assert np.isnan(float(linear_cross_entropy(xe, w, te)))
    assert float(linear_cross_entropy(xe, w, te, reduction="sum")) == 0.0
    assert linear_cross_entropy(xe, w, te, reduction="none").shape == (0,)
    dx, dw = jax.grad(lambda x, w: linear_cross_entropy(x, w, te, reduction="sum"), argnums=(0, 1))(xe, w)
    assert dx.shape == (0, 8) and np.all(np.asarray(dw) == 0)


def test_out_of_range_target_is_nan_when_traced():
    x, w, t, _ = inputs(4, 8, 31)
    t = t.at[2].set(31)
    if jax.devices()[0].platform == "cpu":  # concrete CPU targets are checked (tests_jax/test_user_hints.py)
        with pytest.raises(ValueError, match="target contains 31"):
            linear_cross_entropy(x, w, t)
    # traced targets (a jit argument): never read on the host, NaN for that token
    per_tok = np.asarray(jax.jit(lambda x, t: linear_cross_entropy(x, w, t, reduction="none"))(x, t))
    assert np.isnan(per_tok[2]) and np.isfinite(per_tok[[0, 1, 3]]).all()
    assert np.isnan(float(jax.jit(lambda x, t: linear_cross_entropy(x, w, t))(x, t)))
    dx = np.asarray(jax.jit(jax.grad(lambda x, t: linear_cross_entropy(x, w, t, reduction="sum")))(x, t))
    assert np.isnan(dx[2]).all()


def test_nonfinite_input_gives_nan():
    x, w, t, _ = inputs(4, 8, 31)
    assert np.isnan(float(linear_cross_entropy(x.at[1, 0].set(jnp.inf), w, t)))
    assert np.isnan(float(linear_cross_entropy(x.at[1, 0].set(jnp.nan), w, t)))


def test_jit_grad_vmap():
    x, w, t, b = inputs(0, 16, 211, lead=(3, 9), bias=True, ignore=(4,))
    kw = dict(label_smoothing=0.1, z_loss=1e-3)
    f = lambda x, w, b, t: linear_cross_entropy(x, w, t, b, memory_budget=SMALL_BUDGET, **kw)
    eager = f(x, w, b, t)
    jitted = jax.jit(f)(x, w, b, t)
    np.testing.assert_allclose(float(eager), float(jitted), rtol=1e-6)
    g_eager = jax.grad(f, argnums=(0, 1, 2))(x, w, b, t)
    g_jit = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, w, b, t)
    for a, c in zip(g_eager, g_jit):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-7)
    # vmap over the batch axis: one loss per sequence, each its own mean.
    per_seq = jax.jit(jax.vmap(f, in_axes=(0, None, None, 0)))(x, w, b, t)
    for i in range(3):
        rl, _, _ = linear_cross_entropy_ref(x[i], w, t[i], b, **kw)
        np.testing.assert_allclose(float(per_seq[i]), rl, rtol=1e-5)
    gx = jax.grad(lambda x: jax.vmap(f, in_axes=(0, None, None, 0))(x, w, b, t).sum())(x)
    for i in range(3):
        _, _, (rdx, _, _) = linear_cross_entropy_ref(x[i], w, t[i], b, **kw)
        np.testing.assert_allclose(np.asarray(gx[i]), rdx, rtol=1e-4, atol=1e-6)


def test_static_options_under_jit():
    x, w, t, _ = inputs(8, 8, 53)
    f = jax.jit(linear_cross_entropy, static_argnames=("reduction", "label_smoothing", "softcap"))
    a = f(x, w, t, reduction="sum", label_smoothing=0.1, softcap=2.0)
    rl, _, _ = linear_cross_entropy_ref(x, w, t, reduction="sum", label_smoothing=0.1, softcap=2.0)
    np.testing.assert_allclose(float(a), rl, rtol=1e-5)


def test_bf16_loss_is_exact():
    # fp32 statistics: the bf16 loss is as exact as the fp32 one on the same bf16 values.
    x, w, t, _ = inputs(64, 64, 2003, "bfloat16", scale=3.0)
    loss = float(linear_cross_entropy(x, w, t, memory_budget=SMALL_BUDGET))
    rl, _, _ = linear_cross_entropy_ref(np.asarray(x, np.float32), np.asarray(w, np.float32), t)
    assert abs(loss - rl) <= 2e-6 * max(1.0, abs(rl))
    naive = float(xla_materialised(x, w, t))
    assert abs(naive - rl) > abs(loss - rl)  # bf16 logits lose precision; we do not


def test_finite_differences_of_the_reference():
    # The reference's analytic gradients (which the op is tested against) match central
    # differences of its loss, for every option at once.
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 6))
    w = rng.standard_normal((13, 6))
    b = rng.standard_normal(13)
    t = np.array([0, 12, -100, 5, 7])
    kw = dict(label_smoothing=0.2, z_loss=0.05, softcap=2.5, reduction="mean")
    _, _, (dx, dw, db) = linear_cross_entropy_ref(x, w, t, b, **kw)
    assert_matches_finite_differences(lambda: linear_cross_entropy_ref(x, w, t, b, **kw)[0], (x, w, b),
                                      (dx, dw, db), rtol=1e-5)


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tokamax_drop_in(reduction, dtype):
    x, w, t, _ = inputs(24, 32, 301, dtype)  # V=301 is not a multiple of any block size
    w_hv = w.T
    f = lambda x, w: linear_softmax_cross_entropy_loss(x, t, w, reduction=reduction)
    proj = (lambda a: jnp.sum(a * 0.5)) if reduction == "none" else (lambda a: a)
    loss = f(x, w_hv)
    _, grads = jax.value_and_grad(lambda *a: proj(f(*a)), argnums=(0, 1))(x, w_hv)
    red = "sum" if reduction == "mean" else reduction
    scale = 1.0 / 24 if reduction == "mean" else 1.0
    g_out = np.full(24, 0.5) if reduction == "none" else scale
    rl, _, (rdx, rdw, _) = linear_cross_entropy_ref(x, w_hv, t, reduction=red, weight_layout="hv", grad_out=g_out)
    rl = rl * scale
    naive = xla_materialised(x, w, t, reduction=red) * scale
    assert_close_to_ref("loss", loss, naive, rl, dtype)
    assert grads[1].shape == (32, 301)
    assert_close_to_ref("dx", grads[0], None, rdx, dtype)
    assert_close_to_ref("dw", grads[1], None, rdw, dtype)


def test_tokamax_drop_in_padding_label():
    # -100 (and any label outside [0, V)): zero loss and zero gradient.
    x, w, t, _ = inputs(6, 8, 40)
    t = t.at[1].set(-100).at[4].set(40)
    per_tok = linear_softmax_cross_entropy_loss(x, t, w.T, reduction="none")
    assert float(per_tok[1]) == 0.0 and float(per_tok[4]) == 0.0
    dx = jax.grad(lambda x: linear_softmax_cross_entropy_loss(x, t, w.T))(x)
    assert np.all(np.asarray(dx)[[1, 4]] == 0.0)
    mean = linear_softmax_cross_entropy_loss(x, t, w.T, reduction="mean")
    np.testing.assert_allclose(float(mean), float(per_tok.sum()) / 6, rtol=1e-6)  # jnp.mean, as tokamax
    with pytest.raises(NotImplementedError):
        linear_softmax_cross_entropy_loss(x, t, w.T, precision="highest")


def _tokamax():
    try:
        import tokamax  # noqa: F401
        from tokamax._src.ops.linear_softmax_cross_entropy_loss import api as tk
    except Exception as exc:  # not installed, or its optional imports missing
        pytest.skip(f"tokamax not importable: {exc!r}")
    return tk


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_matches_tokamax_xla_where_it_is_right(reduction):
    tk = _tokamax()
    x, w, t, _ = inputs(64, 32, 300)  # all labels valid, fp32
    ours = lambda x, w: linear_softmax_cross_entropy_loss(x, t, w, reduction=reduction)
    theirs = lambda x, w: tk.linear_softmax_cross_entropy_loss(x, t, w, reduction=reduction, implementation="xla")
    proj = (lambda a: jnp.sum(a * 0.5)) if reduction == "none" else (lambda a: a)
    a, ga = jax.value_and_grad(lambda *p: proj(ours(*p)), argnums=(0, 1))(x, w.T)
    b, gb = jax.value_and_grad(lambda *p: proj(theirs(*p)), argnums=(0, 1))(x, w.T)
    np.testing.assert_allclose(float(a), float(b), rtol=2e-5)
    for u, v in zip(ga, gb):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-4, atol=2e-6)


def test_bad_inputs_raise_clear_errors():
    x, w, t, b = inputs(4, 8, 31, bias=True)
    cases = [
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(z_loss=-1.0), ValueError, "z_loss"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
        (dict(weight_layout="hw"), ValueError, "weight_layout"),
        (dict(memory_budget=0), ValueError, "memory_budget"),
        (dict(implementation="pallas_triton"), ValueError, "implementation"),
    ]
    for kw, exc, word in cases:
        with pytest.raises(exc, match=word):
            linear_cross_entropy(x, w, t, **kw)
    with pytest.raises(ValueError, match="hidden size"):
        linear_cross_entropy(x, w[:, :7], t)
    with pytest.raises(ValueError, match="hidden size"):
        linear_cross_entropy(x, w, t, weight_layout="hv")  # (V, H) passed as (H, V)
    with pytest.raises(TypeError, match="must match"):
        linear_cross_entropy(x, w.astype(jnp.bfloat16), t)
    with pytest.raises(TypeError, match="integer"):
        linear_cross_entropy(x, w, t.astype(jnp.float32))
    with pytest.raises(TypeError, match="float"):
        linear_cross_entropy(x.astype(jnp.int32), w, t)
    with pytest.raises(ValueError, match="target has shape"):
        linear_cross_entropy(x, w, t[:3])
    with pytest.raises(ValueError, match="bias"):
        linear_cross_entropy(x, w, t, b[:5])
    with pytest.raises(TypeError, match="bias"):
        linear_cross_entropy(x, w, t, b.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        linear_cross_entropy(x, w[None], t)
    with pytest.raises(ValueError, match="empty"):
        linear_cross_entropy(x, w[:0], t)


def test_automatic_backend_choice():
    name = api.choose_backend(None, (4, 8), (31, 8), jnp.float32, None, False)
    if jax.devices()[0].platform == "cpu":
        assert name == "xla"
    assert set(api.BACKENDS) >= {"xla", "mosaic_gpu"}


@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_memory_stays_within_the_budget(layout):
    # Compiled only (abstract shapes, nothing runs): fp32 logits would take 1 GiB.
    n, h, v = 4096, 512, 65536
    budget = 64 * 2**20
    x = jax.ShapeDtypeStruct((n, h), jnp.float32)
    w = jax.ShapeDtypeStruct((v, h) if layout == "vh" else (h, v), jnp.float32)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)
    loss = lambda x, w, t: linear_cross_entropy(x, w, t, memory_budget=budget, weight_layout=layout)
    step = jax.value_and_grad(loss, argnums=(0, 1))
    # XLA's small buffers (per-token vectors, loop state); on GPUs also the GEMM workspace.
    slack = 2 * 2**20 if jax.devices()[0].platform == "cpu" else 96 * 2**20
    for fn in (loss, step):
        mem = jax.jit(fn).lower(x, w, t).compile().memory_analysis()
        if mem is None:
            pytest.skip("this backend gives no memory analysis")
        assert mem.temp_size_in_bytes <= budget + slack, (fn, mem.temp_size_in_bytes)
        assert mem.temp_size_in_bytes < n * v * 4 / 4, (fn, mem.temp_size_in_bytes)


def test_importing_logitless_jax_never_needs_torch():
    # Works in a process where `import torch` fails (torch may be installed here).
    out = run_without_torch(
        "import jax.numpy as jnp\n"
        "import logitless.jax as lj\n"
        "import logitless\n"
        "assert 'torch' not in sys.modules and logitless.__all__ == []\n"
        "x = jnp.ones((2, 4)); w = jnp.ones((5, 4)); t = jnp.array([1, 2])\n"
        "print(float(lj.linear_cross_entropy(x, w, t)))\n"
    )
    assert abs(float(out.strip()) - np.log(5)) < 1e-6


def test_float16_inputs():
    x, w, t, b = inputs(29, 24, 307, "float16", bias=True, ignore=(5,))
    _check(x, w, t, b, "float16", dict(z_loss=1e-3, softcap=6.0), budget=SMALL_BUDGET)


@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_no_large_constants_captured(layout):
    """fwd and fwd+bwd of the public op embed no array constants (closures over arrays,
    host data of the size of the inputs): checked at lowering, with real arrays."""
    from .helpers import captured_constants

    x, w, t, b = inputs(300, 64, 1031, "float32", bias=True, ignore=(3,))
    wl = w if layout == "vh" else w.T
    kw = dict(label_smoothing=0.1, z_loss=1e-3, softcap=5.0, weight_layout=layout, implementation="xla")
    for red in ("mean", "none"):
        f = lambda x, w, b: jnp.sum(linear_cross_entropy(x, w, t, b, reduction=red, memory_budget=SMALL_BUDGET, **kw))
        for fn in (f, jax.value_and_grad(f, argnums=(0, 1, 2))):
            assert captured_constants(lambda: jax.jit(fn).lower(x, wl, b)) == []
    # The tokamax drop-in as well (it remaps labels).
    g = lambda x, w: linear_softmax_cross_entropy_loss(x, t, w, implementation="xla")
    assert captured_constants(lambda: jax.jit(jax.value_and_grad(g, argnums=(0, 1))).lower(x, w.T)) == []


@pytest.mark.parametrize("op", ["lce", "log_probs"])
@pytest.mark.parametrize("implementation", ["xla", "mosaic_gpu"])
def test_backward_leaves_dw_uninitialised_on_gpu(op, implementation, monkeypatch):
    """Lowered for CUDA (on any machine): dW starts as an uninitialised buffer
    (``lax.empty``: XLA's AllocateBuffer), not as zeros, which the column chunks
    overwrite entirely; on the H100 the zeros were a 0.6-1.2 ms memset per fwd+bwd
    (docs/design.md). Several chunks (a small budget)."""
    from logitless.jax import linear_log_probs

    if implementation == "mosaic_gpu":
        kind = pytest.importorskip("logitless.jax.ops.common.mosaic_gpu", reason="this jax has no Pallas Mosaic GPU")
        monkeypatch.setattr(kind, "INTERPRET", False)
    n, h, v = 64, 128, 1024
    x = jax.ShapeDtypeStruct((n, h), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((v, h), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)
    budget = 4 * n * h + 2 * 256 * (n + 2 * h)  # 256-column chunks

    def f(x, w, t):
        if op == "lce":
            return linear_cross_entropy(x, w, t, implementation=implementation, memory_budget=budget)
        return jnp.sum(linear_log_probs(x, w, t, implementation=implementation, memory_budget=budget))

    text = jax.jit(jax.grad(f, argnums=1)).trace(x, w, t).lower(lowering_platforms=("cuda",)).as_text()
    dw_type = f"tensor<{v}x{h}xbf16>"
    allocs = [ln for ln in text.splitlines() if "@AllocateBuffer" in ln]
    assert any(dw_type in ln for ln in allocs), allocs
    zeros = [ln for ln in text.splitlines() if "broadcast_in_dim" in ln and f"-> {dw_type}" in ln]
    assert not zeros, zeros
