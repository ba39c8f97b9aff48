"""The "triton" backend of logitless.jax.linear_cross_entropy against the float64 reference.

On a machine without GPU the kernels run on Triton's CPU interpreter (through
``jax.pure_callback``): shapes stay tiny. On an NVIDIA GPU they run through jax-triton.
Needs the triton package (skipped, with the reason, without it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .helpers import (
    LCE_OPTIONS,
    MAX_SHARED,
    assert_jit_matches_eager_and_repeats,
    assert_unsupported_without_jax_triton_on_a_gpu,
    check_linear_cross_entropy,
    compile_launches_through_jax_triton,
    inputs,
    needs_triton,
    run_without_torch,
)

pytestmark = needs_triton

from logitless.jax import linear_cross_entropy  # noqa: E402
from logitless.jax.ops.common import choice  # noqa: E402
from logitless.jax.ops.common import triton as rt  # noqa: E402
from logitless.jax.ops.linear_cross_entropy import api  # noqa: E402
from logitless.jax.ops.linear_cross_entropy.reference import linear_cross_entropy_ref  # noqa: E402
from logitless.jax.planning import triton_plan  # noqa: E402

ON_GPU = jax.devices()[0].platform == "gpu"
OPTIONS = LCE_OPTIONS
#: Forces several backward column chunks (a fori_loop) and a ragged tail at the test
#: shapes on the interpreter's tiles (block_v = 32: chunks of 64 columns).
SMALL_BUDGET = 20_000


def _check(x, w, t, b, dtype, kw, budget=None, layout="vh"):
    return check_linear_cross_entropy(x, w, t, b, dtype, kw, budget, layout, implementation="triton")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_against_float64(dtype, option):
    # V prime, H not a multiple of 16, ignored tokens, bias with "all", several chunks.
    x, w, t, b = inputs(21, 20, 151, dtype, bias=option == "all", ignore=(3, 17), seed=len(option))
    _check(x, w, t, b, dtype, dict(OPTIONS[option], reduction="mean"), budget=SMALL_BUDGET)


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_reductions_and_layouts(reduction, layout):
    x, w, t, b = inputs(13, 24, 97, bias=True, ignore=(0,))
    _check(x, w, t, b, "float32", dict(label_smoothing=0.1, softcap=5.0, reduction=reduction),
           budget=SMALL_BUDGET, layout=layout)


@pytest.mark.parametrize("budget", [None, 1])
def test_budgets(budget):
    # None: one chunk covers V (dx = dz @ w); 1: the smallest chunks.
    x, w, t, _ = inputs(11, 16, 131, "bfloat16", ignore=(5,))
    _check(x, w, t, None, "bfloat16", dict(z_loss=1e-3), budget=budget)


def test_float16():
    x, w, t, b = inputs(9, 16, 67, "float16", bias=True)
    _check(x, w, t, b, "float16", dict(label_smoothing=0.1), budget=SMALL_BUDGET)


@pytest.mark.parametrize("shape", [(1, 16, 7), (3, 7, 1), (2, 8, 40)])
def test_odd_shapes(shape):
    n, h, v = shape
    x, w, t, b = inputs(n, h, v, bias=True)
    _check(x, w, t, b, "float32", dict(reduction="sum"), budget=SMALL_BUDGET)


def test_three_dimensional_stats():
    x, w, t, _ = inputs(0, 12, 61, lead=(2, 5))
    loss, stats = linear_cross_entropy(x, w, t, reduction="none", return_stats=True, implementation="triton")
    assert loss.shape == (2, 5) and stats.lse.shape == (2, 5)
    rl, rlse, _ = linear_cross_entropy_ref(x, w, t, reduction="none")
    np.testing.assert_allclose(np.asarray(loss), rl, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(stats.lse), rlse, rtol=1e-5, atol=1e-6)


def test_special_values():
    x, w, t, _ = inputs(6, 8, 31, ignore=range(6))
    f = lambda x, t, **kw: linear_cross_entropy(x, w, t, implementation="triton", **kw)
    loss, dx = jax.value_and_grad(lambda x: f(x, t))(x)
    assert np.isnan(float(loss)) and np.all(np.asarray(dx) == 0)  # mean over no token, as torch
    assert float(f(x, t, reduction="sum")) == 0.0
    x, w, t, _ = inputs(4, 8, 31)
    bad = t.at[2].set(31)  # traced (a jit argument): concrete CPU targets would raise ValueError
    per_tok = np.asarray(jax.jit(lambda x, t: f(x, t, reduction="none"))(x, bad))
    assert np.isnan(per_tok[2]) and np.isfinite(per_tok[[0, 1, 3]]).all()
    dx = np.asarray(jax.jit(jax.grad(lambda x, t: f(x, t, reduction="sum")))(x, bad))
    assert np.isnan(dx[2]).all() and np.isfinite(dx[[0, 1, 3]]).all()
    assert np.isnan(float(f(x.at[1, 0].set(jnp.inf), t)))
    assert np.isnan(float(f(x.at[1, 0].set(jnp.nan), t)))
    xe, te = jnp.zeros((0, 8)), jnp.zeros((0,), jnp.int32)
    assert float(f(xe, te, reduction="sum")) == 0.0


def test_jit_and_bitwise_repeatable():
    x, w, t, b = inputs(10, 16, 83, "bfloat16", bias=True, ignore=(1,))
    f = lambda x, w, b: linear_cross_entropy(x, w, t, b, label_smoothing=0.1, implementation="triton",
                                             memory_budget=SMALL_BUDGET)
    assert_jit_matches_eager_and_repeats(jax.value_and_grad(f, argnums=(0, 1, 2)), x, w, b)


def test_tokamax_drop_in():
    x, w, t, _ = inputs(7, 16, 29)
    ours = api.linear_softmax_cross_entropy_loss(x, t, w.T, implementation="triton")
    rl, _, _ = linear_cross_entropy_ref(x, w, t, reduction="sum")
    np.testing.assert_allclose(float(ours), rl, rtol=1e-5)


def test_float64_is_refused():
    assert api.BACKENDS["triton"].unsupported((4, 8), (31, 8), jnp.float64, softcap=None, has_bias=False)
    with pytest.raises(ValueError, match="triton"):
        api.choose_backend("triton", (4, 8), (31, 8), jnp.float64, None, False)


def test_automatic_choice(monkeypatch):
    args = ((4, 8), (31, 8), jnp.bfloat16, None, False)
    if not ON_GPU:
        assert api.choose_backend(None, *args) == "xla"  # the interpreter is never automatic
    monkeypatch.setattr(choice, "is_nvidia_gpu", lambda: True)
    monkeypatch.setattr(choice, "is_sm90", lambda: False)
    monkeypatch.setattr(rt, "is_supported", lambda *a, **k: True)
    assert api.choose_backend(None, *args) == "triton"  # A100, L4, RTX: Triton
    assert api.choose_backend(None, *args, True) == "triton"  # also with class weights
    monkeypatch.setattr(rt, "is_supported", lambda *a, **k: False)  # e.g. no jax-triton
    assert api.choose_backend(None, *args) == "xla"


def test_without_jax_triton_on_a_gpu_it_is_unsupported(monkeypatch):
    assert_unsupported_without_jax_triton_on_a_gpu(monkeypatch, api.BACKENDS)


def test_plan_memory_at_the_tokamax_shapes():
    from logitless_bench.shapes import JAX_SHAPES as SHAPES

    budget = 256 * 2**20
    for s in SHAPES:
        p = triton_plan(s.tokens, s.vocab, s.hidden, 2, budget, interpret=False, compute_capability=80,
                        num_sms=108)
        assert p.vocab_chunk % p.block_v == 0 and p.vocab_chunk >= 4096
        temp = 4 * s.tokens * s.hidden + p.vocab_chunk * (2 * s.tokens + 4 * s.hidden)
        assert temp <= 512 * 2**20, (s, p, temp)
        assert p.vocab_splits * -(-s.tokens // p.block_n) >= 108  # fills the GPU
    small = triton_plan(4096, 128256, 4096, 2, budget, interpret=False, compute_capability=89, num_sms=128)
    assert (small.block_n, small.block_v) == (128, 128)  # ~100 KiB of shared memory
    whole = triton_plan(64, 1000, 32, 4, 2**30, interpret=True)
    assert whole.vocab_chunk >= 1000  # one chunk when the budget holds it


def test_plan_takes_the_shared_tiles():
    # The JAX plan is the torch side's TritonPlan, from its tables (logitless.planning.tiles).
    from logitless.planning import tiles

    p = triton_plan(4096, 128256, 4096, 2, 256 * 2**20, interpret=False, compute_capability=90, num_sms=132)
    assert type(p) is tiles.TritonPlan
    assert (p.block_n, p.block_v, p.block_h, p.num_warps, p.num_stages) == tiles.CUDA_TILES[2]
    assert p.group_n == tiles.group_rows_for(132, p.block_n, p.block_v) and p.dlogits_programs == 1
    assert (p.keep_cols, p.dz_tma, p.w_chunk) == (0, False, 0)  # torch-only fields stay at their defaults
    small = triton_plan(64, 1000, 32, 4, 2**30, interpret=False, compute_capability=89, num_sms=58)
    assert (small.block_n, small.block_v) == tiles.CUDA_TILES_SMALL_SMEM[4][:2] and small.dlogits_programs == 0
    interp = triton_plan(64, 1000, 32, 4, 2**30, interpret=True)
    assert (interp.block_n, interp.block_v, interp.block_h) == tiles.INTERPRETER_TILES[:3] and interp.group_n == 1


def test_kernels_import_without_torch():
    # The shared kernels and the interpreter helpers are framework-free.
    out = run_without_torch(
        "import logitless.triton_lib.lce_kernels, logitless.triton_lib.interpret\n"
        "import jax.numpy as jnp\n"
        "from logitless.jax import linear_cross_entropy\n"
        "x = jnp.ones((2, 4)); w = jnp.ones((5, 4)); t = jnp.array([1, 2])\n"
        "print(float(linear_cross_entropy(x, w, t, implementation='triton')))\n"
        "assert 'torch' not in sys.modules\n"
    )
    assert abs(float(out.strip()) - np.log(5)) < 1e-6


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (compiled kernels through jax-triton)")
@pytest.mark.parametrize("layout", ["vh", "hv"])
def test_gpu_matches_xla_at_a_medium_shape(layout):
    x, w, t, b = inputs(1000, 256, 32003, "bfloat16", bias=True, ignore=(7,))
    _check(x, w, t, b, "bfloat16", dict(label_smoothing=0.1, softcap=30.0), budget=8 * 2**20, layout=layout)


def test_vmap_runs_per_element():
    # Neither triton_call nor the interpreter's callback batches: the backend loops.
    x, w, t, b = inputs(0, 8, 37, lead=(3, 4), bias=True, ignore=(2,))
    f = lambda x, t: linear_cross_entropy(x, w, t, b, label_smoothing=0.1, implementation="triton")
    per_seq = jax.jit(jax.vmap(f))(x, t)
    gx = jax.grad(lambda x: jax.vmap(f)(x, t).sum())(x)
    for i in range(3):
        rl, _, (rdx, _, _) = linear_cross_entropy_ref(x[i], w, t[i], b, label_smoothing=0.1)
        np.testing.assert_allclose(float(per_seq[i]), rl, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(gx[i]), rdx, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cc", sorted(MAX_SHARED))
def test_kernels_compile_through_jax_triton_and_fit_shared_memory(cc, monkeypatch):
    # jax-triton's own compile path (kernel arguments, constexprs, Triton -> PTX) on the
    # launches the backend makes at a tokamax shape, for A100, RTX 30/40 and H100 targets.
    from logitless.jax.ops.linear_cross_entropy import triton_backend as backend
    from logitless.jax.ops.linear_cross_entropy import triton_kernels
    from logitless.triton_lib import lce_kernels

    shared, _ = compile_launches_through_jax_triton(monkeypatch, backend, (lce_kernels, triton_kernels), cc)
    n, h, v = 4096, 4096, 128256
    bf = jnp.bfloat16
    x, w = jax.ShapeDtypeStruct((n, h), bf), jax.ShapeDtypeStruct((h, v), bf)  # flax's (H, V)
    b, t = jax.ShapeDtypeStruct((v,), bf), jax.ShapeDtypeStruct((n,), jnp.int32)
    cw, lse = jax.ShapeDtypeStruct((v,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32)
    coef = jax.ShapeDtypeStruct((3, n), jnp.float32)
    kw = dict(softcap=30.0, budget=256 * 2**20, weight_layout="hv")
    jax.eval_shape(lambda *a: backend.forward(*a[:4], need_smooth=True, class_weight=a[4], **kw), x, w, b, t, cw)
    jax.eval_shape(lambda *a: backend.backward(*a[:6], class_weight=a[6], **kw), x, w, b, t, lse, coef, cw)
    assert len(shared) >= 2 and max(shared) <= MAX_SHARED[cc], shared


def test_the_interpreter_leaves_triton_language_as_it_was():
    # An interpreted launch (CPU path) patches triton.language while it runs; afterwards
    # kernels compiled in the same process must see the real module (see the test above,
    # which compiles after the interpreter ran in this process).
    import triton.language as tl

    before = {k: v for k, v in vars(tl).items() if not k.startswith("__")}
    before_tensor = dict(vars(tl.tensor))
    x, w, t, _ = inputs(5, 8, 37)
    float(linear_cross_entropy(x, w, t, implementation="triton"))
    after = {k: v for k, v in vars(tl).items() if not k.startswith("__")}
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert dict(vars(tl.tensor)) == before_tensor


def test_the_cpu_interpreter_route_only_on_the_triton_releases_it_was_checked_against(monkeypatch):
    # logitless.triton_lib.interpret rests on the interpreter's internals: outside its
    # SUPPORTED releases the backend is not offered on the CPU (one warning), "xla" runs.
    import warnings

    from logitless.jax.ops.common import triton as rt
    from logitless.triton_lib import interpret

    lo, hi = interpret.SUPPORTED
    assert interpret.supported(f"{lo[0]}.{lo[1]}.0") and interpret.supported(f"{hi[0]}.{hi[1]}.1+git")
    assert not interpret.supported(f"{hi[0]}.{hi[1] + 1}.0") and not interpret.supported("3.5.1")
    assert not interpret.supported("nightly")
    assert rt.is_supported(jnp.bfloat16, "cpu", triton_installed=lambda: True) == interpret.usable()
    monkeypatch.setattr(interpret.triton, "__version__", f"{hi[0]}.{hi[1] + 1}.0")
    interpret.usable.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert not rt.is_supported(jnp.bfloat16, "cpu", triton_installed=lambda: True)
            assert not rt.is_supported(jnp.float32, "cpu", triton_installed=lambda: True)
        assert [issubclass(w.category, interpret.InterpreterWarning) for w in seen] == [True]
        if not ON_GPU:
            args = ((4, 8), (31, 8), jnp.bfloat16, None, False)
            assert api.choose_backend(None, *args) == "xla"
            with pytest.raises(ValueError, match="triton"):
                api.choose_backend("triton", *args)
    finally:
        monkeypatch.undo()
        interpret.usable.cache_clear()


# ------------------------------------------- jax-triton releases for other jax/triton versions


def test_a_jax_triton_that_fails_to_import_warns_once_and_the_choice_goes_on(monkeypatch, tmp_path):
    # e.g. a jax-triton made for another jax: its import raises something else than ImportError
    import sys
    import warnings


    (tmp_path / "jax_triton").mkdir()
    (tmp_path / "jax_triton" / "__init__.py").write_text("raise AttributeError('no get_compute_capability')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "jax_triton", raising=False)
    monkeypatch.setattr(rt, "platform", lambda: "gpu")
    monkeypatch.setattr(choice, "is_nvidia_gpu", lambda: True)
    monkeypatch.setattr(choice, "is_sm90", lambda: False)
    rt.jax_triton.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="jax-triton does not import here .AttributeError: no get_comp"):
            assert api.choose_backend(None, (4, 8), (31, 8), jnp.bfloat16, None, False) == "xla"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: the second call is quiet
            assert rt.jax_triton() is None
            assert api.BACKENDS["triton"].unsupported((4, 8), (31, 8), jnp.bfloat16, softcap=None, has_bias=False)
    finally:
        rt.jax_triton.cache_clear()


@pytest.mark.parametrize("release", ["0.3", "0.4"])
def test_launch_names_the_outputs_as_the_installed_jax_triton_does(monkeypatch, release):
    # jax-triton 0.4 renamed triton_call's out_shape= to out_type= (out_shape= warns there)
    import types


    calls = []

    def call_03(*args, kernel, out_shape, grid, name="", num_warps=None, num_stages=None, **kwargs):
        calls.append(dict(out=out_shape, kernel=kernel, **kwargs))
        return out_shape

    def call_04(*args, kernel, out_type=None, grid, name="", num_warps=None, num_stages=None, **kwargs):
        calls.append(dict(out=out_type, kernel=kernel, **kwargs))
        return out_type

    fake = types.SimpleNamespace(triton_call=call_03 if release == "0.3" else call_04)
    monkeypatch.setattr(rt, "jax_triton", lambda: fake)
    plan = types.SimpleNamespace(num_warps=4, num_stages=2)
    spec = jax.ShapeDtypeStruct((3,), jnp.float32)
    rt.launch(("math",), "sqrt", (1,), plan, (spec,), (jnp.ones(3),), {"BLOCK": 8}, interpreted=False)
    (got,) = calls
    assert got["out"] == (spec,) and got["kernel"] is __import__("math").sqrt
    assert set(got) == {"out", "kernel", "BLOCK"}  # no out_shape= left over as a kernel argument
