"""Shared JAX test tools: random inputs, the accuracy criterion against float64, the
op checks the backends' test files share (linear_cross_entropy, linear_log_probs), the
torch-free subprocess check, the sharding meshes and HLO parsing, and jax-triton's
compile path without a GPU."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

#: Extra allowance over XLA's own (materialised, same dtype) error, relative to the
#: largest reference value.
TOL = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}


def inputs(n, h, v, dtype="float32", *, seed=0, bias=False, ignore=(), scale=1.0, lead=None):
    """x (n, h) or (*lead, h), weight (v, h), target, bias: random, in ``dtype``."""
    rng = np.random.default_rng(seed)
    shape = (n,) if lead is None else tuple(lead)
    x = (rng.standard_normal(shape + (h,)) * scale).astype(np.float32)
    w = (rng.standard_normal((v, h)) / np.sqrt(h) * 2.0).astype(np.float32)
    t = rng.integers(0, v, size=shape).astype(np.int32)
    flat = t.reshape(-1)
    for i in ignore:
        flat[i] = -100
    b = (rng.standard_normal(v) * 0.5).astype(np.float32) if bias else None
    cast = lambda a: None if a is None else jnp.asarray(a, dtype)
    return cast(x), cast(w), jnp.asarray(t), cast(b)


def max_err(a, ref) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max()) if ref.size else 0.0


def assert_close_to_ref(name, ours, xla_same_dtype, ref, dtype):
    """|ours - ref| <= |XLA in the same dtype - ref| + tol * max(max|ref|, 0.01); NaN never passes."""
    ours = np.asarray(jnp.asarray(ours, jnp.float32))
    ref = np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{name}: shape {ours.shape} != {ref.shape}"
    if ref.size == 0:
        return
    assert not np.isnan(ours).any(), f"{name}: NaN"
    e_ours = max_err(ours, ref)
    e_xla = max_err(xla_same_dtype, ref) if xla_same_dtype is not None else 0.0
    if e_xla != e_xla:
        e_xla = 0.0
    scale = float(np.abs(ref).max())
    bound = e_xla + TOL[str(dtype)] * max(scale, 1e-2)
    assert e_ours <= bound, f"{name}: error {e_ours:.3g} > bound {bound:.3g} (xla {e_xla:.3g})"


def xla_materialised(x, w, t, b=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                     softcap=None, z_loss=0.0):
    """The plain-JAX loss with the logits materialised in the input dtype (what a user
    would write); the baseline error of the criterion."""
    logits = jnp.einsum("...h,vh->...v", x, w)
    if b is not None:
        logits = logits + b
    z = logits.astype(jnp.float32)
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    lse = jax.nn.logsumexp(z, axis=-1)
    valid = t != ignore_index
    zt = jnp.take_along_axis(z, jnp.where(valid, t, 0)[..., None], axis=-1)[..., 0]
    v = w.shape[0]
    eps = label_smoothing
    loss = (1 - eps) * (lse - zt) + eps / v * (v * lse - z.sum(-1)) + z_loss * lse ** 2
    loss = jnp.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()


def captured_constants(lower, threshold=4096):
    """Messages of jax's "large amount of constants were captured" warnings while
    ``lower()`` runs, with the threshold lowered to ``threshold`` bytes. A jitted
    function that closes over an array (or builds shape-sized host data) embeds it in
    the program: gigabytes at real shapes, and minutes of compile time."""
    import warnings

    old = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", threshold)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lower()
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", old)
    return [str(w.message)[:300] for w in caught if "constants were captured" in str(w.message)]


def assert_matches_finite_differences(loss, arrays, grads, *, rtol, atol=1e-8, eps=1e-6):
    """Central differences of the float64 scalar ``loss()`` in every element of the
    numpy ``arrays`` (perturbed in place, then restored) against ``grads``."""
    for arr, g in zip(arrays, grads):
        num = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            old = arr[i]
            arr[i] = old + eps
            up = loss()
            arr[i] = old - eps
            down = loss()
            arr[i] = old
            num[i] = (up - down) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=rtol, atol=atol)


def assert_jit_matches_eager_and_repeats(step, *args):
    """``jit(step)`` twice: bitwise equal to each other, and close to the eager call."""
    eager = step(*args)
    jitted = jax.jit(step)(*args)
    again = jax.jit(step)(*args)
    for a, c, d in zip(jax.tree_util.tree_leaves(eager), jax.tree_util.tree_leaves(jitted),
                       jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(np.asarray(c, np.float32), np.asarray(d, np.float32))
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32), rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------------------------
# linear_cross_entropy: loss and gradients vs float64, plain JAX as the yardstick
# ------------------------------------------------------------------------------------

#: The option cases of the linear_cross_entropy backends' tests.
LCE_OPTIONS = {
    "plain": {},
    "smooth": dict(label_smoothing=0.1),
    "zloss": dict(z_loss=1e-3),
    "softcap": dict(softcap=3.0),
    "all": dict(label_smoothing=0.2, z_loss=1e-2, softcap=4.0),
}


def check_linear_cross_entropy(x, w, t, b, dtype, kw, budget=None, layout="vh", implementation=None):
    """Loss and gradients of ``linear_cross_entropy`` (``w`` given as (V, H); ``layout``
    "hv" passes its transpose) vs the float64 reference, with ``xla_materialised`` in
    the same dtype as the yardstick; reduction "none" gets the upstream 1..n / n."""
    from logitless.jax import linear_cross_entropy
    from logitless.jax.ops.linear_cross_entropy.reference import linear_cross_entropy_ref

    wl = w if layout == "vh" else w.T
    argnums = (0, 1) if b is None else (0, 1, 2)
    f = lambda x, w, b: linear_cross_entropy(x, w, t, b, memory_budget=budget, weight_layout=layout,
                                             implementation=implementation, **kw)
    red = kw.get("reduction", "mean")
    g_out = np.arange(1, t.size + 1).reshape(t.shape) / t.size if red == "none" else None
    proj = (lambda loss: jnp.sum(loss * jnp.asarray(g_out, jnp.float32))) if red == "none" else (lambda loss: loss)
    loss = f(x, wl, b)
    grads = jax.grad(lambda *a: proj(f(*a)), argnums=argnums)(x, wl, b)
    naive = lambda x, w, b: xla_materialised(x, w if layout == "vh" else w.T, t, b, **kw)
    nloss = naive(x, wl, b)
    ngrads = jax.grad(lambda *a: proj(naive(*a)), argnums=argnums)(x, wl, b)
    rloss, _, rgrads = linear_cross_entropy_ref(x, wl, t, b, weight_layout=layout, grad_out=g_out, **kw)
    assert loss.dtype == jnp.float32
    assert_close_to_ref("loss", loss, nloss, rloss, dtype)
    for name, g, ng, rg, p in zip(("dx", "dw", "db"), grads, ngrads, rgrads, (x, wl, b)):
        assert g.dtype == p.dtype and g.shape == p.shape, name
        assert_close_to_ref(name, g, ng, rg, dtype)
    return loss, grads


# ------------------------------------------------------------------------------------
# linear_log_probs: both outputs and the gradients vs float64
# ------------------------------------------------------------------------------------

#: The option cases of the log-prob backends' tests.
LOG_PROB_OPTIONS = {
    "plain": {},
    "temperature": dict(temperature=0.7),
    "entropy": dict(entropy=True),
    "softcap": dict(softcap=3.0),
    "ignore_index": dict(ignore_index=5),
    "all": dict(temperature=1.3, entropy=True, softcap=4.0),
}


def log_prob_reference_kw(kw):
    """The options of ``kw`` the log-prob reference takes."""
    return {k: v for k, v in kw.items() if k in ("temperature", "softcap", "ignore_index")}


def upstream(shape, seed=7):
    """Random upstream gradients (g1 on logp, g2 on the entropy), float32 numpy."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def project(outs, g1, g2):
    """Scalar sum(g1 * logp) + sum(g2 * H): random upstream gradients on both outputs."""
    total = jnp.sum(outs[0].astype(jnp.float32) * g1)
    if len(outs) > 1:
        total = total + jnp.sum(outs[1].astype(jnp.float32) * g2)
    return total


def log_probs_reference64(x, w, t, b, kw, g1, g2):
    """(outputs, grads) in float64 numpy: the reference, differentiated by jax.grad;
    outputs (logp,) or (logp, H) as ``kw["entropy"]``, grads of ``project``."""
    from logitless.jax.ops.linear_log_probs.reference import linear_log_probs_reference

    ent = kw.get("entropy", False)
    with jax.enable_x64(True):
        as64 = lambda a: None if a is None else jnp.asarray(np.asarray(jnp.asarray(a, jnp.float32), np.float64))
        x64, w64, b64 = as64(x), as64(w), as64(b)
        t64 = jnp.asarray(np.asarray(t))

        def f(x, w, b):
            lp, h = linear_log_probs_reference(x, w, t64, b, **log_prob_reference_kw(kw))
            return (lp, h) if ent else (lp,)

        outs = f(x64, w64, b64)
        argnums = (0, 1) if b is None else (0, 1, 2)
        grads = jax.grad(lambda *a: project(f(*a), as64(g1), as64(g2)), argnums=argnums)(x64, w64, b64)
        return [np.asarray(o) for o in outs], [np.asarray(g) for g in grads]


def check_log_probs(x, w, t, b, dtype, kw, budget=None, implementation=None, jit=False):
    """Outputs and gradients (both outputs, random upstream) of ``linear_log_probs`` vs
    float64, with plain JAX in the same dtype (logits materialised) as the yardstick;
    ``jit``: the op's forward and gradient run under jax.jit."""
    from logitless.jax import linear_log_probs
    from logitless.jax.ops.linear_log_probs.reference import linear_log_probs_reference

    ent = kw.get("entropy", False)
    g1, g2 = upstream(t.shape)
    argnums = (0, 1) if b is None else (0, 1, 2)
    wrap = jax.jit if jit else (lambda fn: fn)

    def ours(x, w, b):
        out = linear_log_probs(x, w, t, b, memory_budget=budget, implementation=implementation, **kw)
        return out if ent else (out,)

    def plain(x, w, b):
        lp, h = linear_log_probs_reference(x, w, t, b, dtype=x.dtype, **log_prob_reference_kw(kw))
        return (lp, h) if ent else (lp,)

    outs = wrap(ours)(x, w, b)
    grads = wrap(jax.grad(lambda *a: project(ours(*a), g1, g2), argnums=argnums))(x, w, b)
    pouts = plain(x, w, b)
    pgrads = jax.grad(lambda *a: project(plain(*a), g1, g2), argnums=argnums)(x, w, b)
    routs, rgrads = log_probs_reference64(x, w, t, b, kw, g1, g2)
    assert len(outs) == (2 if ent else 1)
    for name, o, p, r in zip(("logp", "entropy"), outs, pouts, routs):
        assert o.dtype == jnp.float32 and o.shape == t.shape, name
        assert_close_to_ref(name, o, p, r, dtype)
    for name, g, p, r, a in zip(("dx", "dw", "db"), grads, pgrads, rgrads, (x, w, b)):
        assert g.dtype == a.dtype and g.shape == a.shape, name
        assert_close_to_ref(name, g, p, r, dtype)
    return outs, grads


# ------------------------------------------------------------------------------------
# Without torch: a fresh process in which `import torch` fails
# ------------------------------------------------------------------------------------

_BLOCK_TORCH = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch' or name.startswith('torch.'):\n"
    "            raise ImportError(\"No module named 'torch'\", name='torch')\n"
    "sys.meta_path.insert(0, Block())\n"
)


def run_without_torch(code: str, timeout: float = 300) -> str:
    """stdout of ``python -c code`` in a process where any torch import fails (torch may
    be installed here), with this process's sys.path; on the CPU unless a GPU is the
    default device. Fails the test with the stderr tail if the process fails."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if jax.devices()[0].platform != "gpu":
        env.setdefault("JAX_PLATFORMS", "cpu")
    r = subprocess.run([sys.executable, "-c", _BLOCK_TORCH + code], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


# ------------------------------------------------------------------------------------
# Sharding: meshes and layouts of the sharded tests, collectives in compiled HLO
# ------------------------------------------------------------------------------------

NDEV = len(jax.devices())
needs_devices = pytest.mark.skipif(NDEV < 2, reason="needs >= 2 devices (CPU: conftest sets 8 host devices)")
DATA, MODEL = ("d", "t")
#: (x spec, weight spec): data parallel, tensor parallel, both, tokens over both axes,
#: FSDP-like (the same axis on tokens and vocabulary), H sharded (resharded by XLA).
LAYOUTS = {
    "data": (P(DATA), P()),
    "tensor": (P(), P(MODEL)),
    "2d": (P(DATA), P(MODEL)),
    "tokens_2axes": (P((DATA, MODEL)), P()),
    "fsdp": (P(DATA), P(DATA)),
    "hidden": (P(None, MODEL), P(None, MODEL)),
}


def make_mesh(kind: str, layout: str = "2d"):
    """A (data, model) mesh of ``kind`` "auto" or "explicit" axes: 4 x 2 with 8 devices,
    (n/2) x 2 with 4+; with 2 devices, both on the axis the layout splits (2 x 1 for
    token layouts, 1 x 2 else)."""
    types = (AxisType.Auto if kind == "auto" else AxisType.Explicit,) * 2
    if NDEV >= 8:
        shape = (4, 2)
    elif NDEV >= 4:
        shape = (NDEV // 2, 2)
    elif layout in ("data", "tokens_2axes", "fsdp"):
        shape = (NDEV, 1)
    else:
        shape = (1, NDEV)
    return jax.make_mesh(shape, (DATA, MODEL), axis_types=types, devices=jax.devices()[:shape[0] * shape[1]])


def put(mesh, a, *spec):
    """``a`` placed on ``mesh`` with PartitionSpec(*spec); None stays None."""
    return None if a is None else jax.device_put(a, NamedSharding(mesh, P(*spec)))


def hlo_collectives(text):
    """[(kind, [shape, ...])] of the collectives in compiled HLO text (the benchmark's
    parser, ``logitless_bench.jax_sharded.hlo_collectives``, without the dtypes)."""
    from logitless_bench.jax_sharded import hlo_collectives as parse

    return [(kind, [shape for _, shape in shapes]) for kind, shapes in parse(text)]


_TYPED_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def hlo_array_shapes(text):
    """The set of array shapes named in HLO text, but byte arrays (s8/u8: the cuBLAS
    custom calls' 32 MiB workspace on GPUs, not data)."""
    return {tuple(int(d) for d in s.split(",") if d) for dt, s in _TYPED_SHAPE.findall(text) if dt not in ("s8", "u8")}


# ------------------------------------------------------------------------------------
# Pallas Mosaic GPU and Triton backends: where the kernels run
# ------------------------------------------------------------------------------------

def mosaic_platform():
    """"sm90" (Mosaic GPU kernels compiled), "interpret" (no GPU: the CPU interpreter) or
    "other-gpu" (a GPU Mosaic GPU does not support)."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return "interpret"
    cc = str(getattr(dev, "compute_capability", ""))
    return "sm90" if cc.startswith("9") else "other-gpu"


#: The sharded GPU tests: the Mosaic GPU kernels compiled, on at least 2 devices.
needs_sm90_gpus = pytest.mark.skipif(not (mosaic_platform() == "sm90" and NDEV >= 2),
                                     reason="needs >= 2 SM90 GPUs (the kernels for real)")


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="the triton backend needs the triton package (pip install triton)")

#: Shared memory a block may use, by compute capability (CUDA's opt-in maximum).
MAX_SHARED = {80: 166912, 86: 101376, 90: 232448}


def jax_triton_lib():
    """jax_triton.triton_lib, loaded from its file where the package refuses to import
    (a CPU-only jaxlib): its compile path (Triton -> PTX) needs no GPU. Skips the test
    without jax-triton."""
    spec = importlib.util.find_spec("jax_triton")
    if spec is None:
        pytest.skip("jax-triton is not installed (pip install jax-triton==0.3.1)")
    try:
        from jax_triton import triton_lib
        return triton_lib
    except ImportError:
        pass
    name = "_jax_triton_lib_for_tests"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(spec.submodule_search_locations[0], "triton_lib.py")
    lib_spec = importlib.util.spec_from_file_location(name, path)
    lib = importlib.util.module_from_spec(lib_spec)
    sys.modules[name] = lib
    lib_spec.loader.exec_module(lib)
    return lib


def compile_launches_through_jax_triton(monkeypatch, backend, kernel_modules, cc):
    """Makes ``backend`` (a JAX triton backend module) compile each launch through
    jax-triton's own path (kernel arguments, constexprs, Triton -> PTX) for compute
    capability ``cc`` instead of running it: no GPU needed. Returns the lists
    (shared memory bytes per compiled kernel, launched kernel names) that fill as the
    backend is traced (jax.eval_shape)."""
    jt = jax_triton_lib()
    shared, names = [], []
    compile_ptx = jt.compile_ttir_to_ptx_inplace

    def spy(ttir, be, options, cc_, platform):
        res = compile_ptx(ttir, be, options, cc_)
        shared.append(res.shared_mem_bytes)
        return res

    def fake_launch(kernel_name, grid, plan, out_specs, arrays, consts):
        kernel = next(getattr(m, kernel_name) for m in kernel_modules if hasattr(m, kernel_name))
        names.append(kernel_name)
        types = [jt.get_triton_type(jax.core.ShapedArray(a.shape, a.dtype)) for a in (*arrays, *out_specs)]
        try:
            jt.get_or_create_triton_kernel(
                jt.get_cuda_backend, "cuda", kernel, types, (), num_warps=plan.num_warps,
                num_stages=plan.num_stages, num_ctas=1, compute_capability=cc, enable_fp_fusion=True,
                metaparams=dict(consts), dump=False)
        except AttributeError as exc:  # jaxlib's TritonKernel: GPU builds only, after the PTX
            assert "TritonKernel" in str(exc), exc
        return tuple(jnp.zeros(s.shape, s.dtype) for s in out_specs)

    monkeypatch.setattr(jt, "compile_ttir_inplace", spy)
    monkeypatch.setattr(backend, "_interpret", lambda: False)
    monkeypatch.setattr(backend, "_device_info", lambda: (cc, 108))
    monkeypatch.setattr(backend, "_launch", fake_launch)
    return shared, names


def backend_module(op_module, name: str):
    """The module of backend ``name`` of the op whose ``api`` or ``backends`` module is
    ``op_module`` (``<op>/<name>_backend.py``: its kernel functions); the op's ``BACKENDS``
    holds its class."""
    return importlib.import_module(f"{op_module.__name__.rsplit('.', 1)[0]}.{name}_backend")


def assert_unsupported_without_jax_triton_on_a_gpu(monkeypatch, table):
    """On a GPU without jax-triton the triton backend of the op whose ``BACKENDS`` is
    ``table`` says it is unsupported (the kind's checks: ``common.triton``)."""
    from logitless.jax.ops.common import triton as rt

    monkeypatch.setattr(rt, "platform", lambda: "gpu")
    monkeypatch.setattr(rt, "jax_triton", lambda: None)
    assert table["triton"].unsupported((4, 8), (31, 8), jnp.bfloat16, softcap=None, has_bias=False)


def argmax_ref(x, w, t, b=None, *, softcap=None, ignore_index=-100, **_):
    """LossStats.argmax in float64 numpy: the first index of each token's largest
    (soft-capped) logit, -1 at ignored tokens; x (..., H), w (V, H)."""
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    if b is not None:
        z = z + np.asarray(b, np.float64)
    if softcap is not None:
        z = softcap * np.tanh(z / softcap)
    t = np.asarray(t)
    return np.where(t != ignore_index, z.argmax(-1), -1)
