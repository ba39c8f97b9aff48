"""Runtime shared by the JAX "triton" backends (``ops/<op>/triton_backend.py``): the Triton
kernels of ``logitless.triton_lib`` (the PyTorch ops' own) launched from JAX.

Route: on an NVIDIA GPU ``jax_triton.triton_call`` (the optional dependency
``jax-triton``) compiles a kernel into an XLA custom call; on a machine without a GPU
(where jax-triton does not import) the same kernel runs on Triton's interpreter through
``jax.pure_callback`` with numpy buffers (``logitless.triton_lib.interpret``): exact,
slow, tests at tiny shapes only. Kernel arguments: arrays first, then the outputs, then
every other argument by name (compile-time constants for jax-triton).

Also here, because every such backend needs them: the kind's base class (``TritonBase``:
the platform checks, ``can_partition``, the launch plan, ``TritonConfig``), the plan of a
module-level call (``plan``, ``planning.triton_plan``), the dot precision constant,
``sequential_under_vmap`` (neither triton_call nor the callback has a batching rule) and
the backward's chunked gradient GEMMs (``chunked_gradients``, XLA GEMMs on the dz chunks
a kernel writes).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import warnings
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from logitless.jax.ops.common.chunks import chunk_loop, uninitialised
from logitless.jax.ops.common.contract import BackendBase
from logitless.jax.planning import TritonPlan, triton_plan
from logitless.jax.sharding import to_varying, varying

F32 = jnp.float32

#: Appended to the api's error when an explicit implementation="triton" is refused.
UNSUPPORTED_HINT = ("the triton backend takes bf16/f16/f32 inputs, and needs the triton package (CPU: "
                    "Triton's interpreter) or, on an NVIDIA GPU, jax-triton: pip install 'logitless[jax-triton]'")
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def platform() -> str:
    return jax.default_backend()


def is_nvidia() -> bool:
    dev = jax.devices()[0]
    return "nvidia" in str(getattr(dev, "device_kind", "")).lower() or hasattr(dev, "compute_capability")


@functools.cache
def jax_triton():
    """jax_triton, or None: not installed; or installed but not importable with this jax,
    jaxlib and triton (a CPU-only jaxlib, or a release made for other versions: any
    exception); on a GPU the latter warns once (RuntimeWarning, with the cause) and the
    automatic choice goes on without "triton": an optional dependency never breaks a call."""
    if importlib.util.find_spec("jax_triton") is None:
        return None
    try:
        import jax_triton
    except Exception as exc:
        if platform() == "gpu":
            warnings.warn(f"logitless: jax-triton does not import here ({type(exc).__name__}: {exc}); the JAX "
                          "'triton' backend is off (pip install 'logitless[jax-triton]' installs a matching one)",
                          RuntimeWarning, stacklevel=2)
        return None
    return jax_triton


@functools.cache
def out_keyword(triton_call) -> str:
    """The keyword of triton_call's output shapes: ``out_shape`` up to jax-triton 0.3,
    ``out_type`` from 0.4 (where ``out_shape`` warns as deprecated)."""
    return "out_type" if "out_type" in inspect.signature(triton_call).parameters else "out_shape"


@functools.cache
def device_info():
    """(compute capability as major * 10 + minor, number of SMs) of the first GPU."""
    dev = jax.devices()[0]
    cc = str(getattr(dev, "compute_capability", "9.0"))
    major, _, minor = cc.partition(".")
    try:
        cc_int = int(major) * 10 + int(minor or 0)
    except ValueError:
        cc_int = 90
    return cc_int, int(getattr(dev, "core_count", 0) or 132)


def interpret() -> bool:
    """Whether kernels run on Triton's interpreter (no GPU)."""
    return platform() != "gpu"


def interpreter_usable() -> bool:
    """Whether this Triton's CPU interpreter is one ``logitless.triton_lib.interpret`` was
    checked against (``interpret.usable``: once per process, one warning when not)."""
    from logitless.triton_lib.interpret import usable

    return usable()


def is_supported(dtype, on_platform: str, jax_triton_module=jax_triton, triton_installed=has_triton) -> bool:
    """16-bit and fp32 inputs, on an NVIDIA GPU with jax-triton (``jax_triton_module()``
    not None), or on the CPU (Triton's interpreter) with triton installed
    (``triton_installed()``) at a release the interpreter route was checked against
    (``interpreter_usable``); the callables are the backend's (tests replace them)."""
    if jnp.dtype(dtype) not in _DTYPES:
        return False
    if on_platform == "gpu":
        return jax_triton_module() is not None and is_nvidia()
    return on_platform == "cpu" and triton_installed() and interpreter_usable()


def plan(x2d, vocab: int, budget: int, interpreted: bool, gpu_info) -> TritonPlan:
    """``planning.triton_plan`` for (N, H) x2d; ``gpu_info()`` -> (cc, SMs) on GPUs."""
    return plan_for(x2d.shape, x2d.dtype, vocab, budget, interpreted, gpu_info)


def plan_for(x2d_shape, dtype, vocab: int, budget: int, interpreted: bool, gpu_info) -> TritonPlan:
    """``plan`` from x2d's shape (N, H) and dtype."""
    n, h = x2d_shape
    cc, sms = (90, 132) if interpreted else gpu_info()
    return triton_plan(n, vocab, h, jnp.dtype(dtype).itemsize, budget, interpret=interpreted,
                       compute_capability=cc, num_sms=sms)


def dot_precision(dtype, interpreted: bool) -> str:
    """``gemm.dot``'s DOT_PRECISION: 16-bit inputs on the interpreter are widened (its
    bf16 products are wrong otherwise); fp32 follows ``jax_default_matmul_precision``."""
    if jnp.dtype(dtype).itemsize == 2:
        return "interpreter-bf16" if interpreted else "tf32"
    if interpreted:
        return "ieee"
    prec = str(jax.config.jax_default_matmul_precision or "default").lower()
    return "tf32x3" if prec in ("highest", "float32", "f32_f32_f32", "precision.highest") else "tf32-round"


def _host_launch(modules, kernel_name, grid, consts, out_specs, *arrays):
    """Run one kernel on Triton's interpreter over numpy buffers (pure_callback body)."""
    from logitless.triton_lib.interpret import HostArray, interpreted_language, interpreted_modules

    mods = interpreted_modules(modules)
    kernel = None
    for mod in mods.values():
        kernel = getattr(mod, kernel_name, kernel)
    ins = [HostArray(np.ascontiguousarray(a)) for a in arrays]
    outs = [np.zeros(s.shape, s.dtype) for s in out_specs]
    with interpreted_language():
        kernel[grid](*ins, *[HostArray(o) for o in outs], **consts)
    return tuple(outs)


def launch(modules, kernel_name, grid, plan_: TritonPlan, out_specs, arrays, consts, *, interpreted: bool):
    """Launch ``kernel_name`` (found in the last of ``modules`` that defines it; the
    modules in import order, each importing the earlier ones) over ``grid``: arrays
    first, then outputs (``out_specs``), then ``consts`` (every other argument, by
    name; compile-time constants)."""
    out_specs = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_specs)
    # Inside jax.shard_map (check_vma) triton_call and pure_callback type their outputs as
    # invariant; a kernel's outputs vary wherever its inputs do. Without this, autodiff
    # skipped the psum of db over a token split (db summed this device's tokens only).
    axes = tuple(sorted(frozenset().union(*(varying(a) for a in arrays))))
    return tuple(to_varying(o, axes) for o in _launch(modules, kernel_name, grid, plan_, out_specs, arrays, consts,
                                                      interpreted))


def _launch(modules, kernel_name, grid, plan_: TritonPlan, out_specs, arrays, consts, interpreted: bool):
    if interpreted:
        fn = functools.partial(_host_launch, tuple(modules), kernel_name, grid, consts, out_specs)
        return jax.pure_callback(fn, out_specs, *arrays)
    jt = jax_triton()
    if jt is None:
        raise ImportError('implementation="triton" on a GPU needs the jax-triton package '
                          "(pip install 'logitless[jax-triton]')")
    kernel = None
    for name in modules:
        kernel = getattr(importlib.import_module(name), kernel_name, kernel)
    out = {out_keyword(jt.triton_call): out_specs}
    return jt.triton_call(*arrays, kernel=kernel, grid=grid, num_warps=plan_.num_warps, num_stages=plan_.num_stages,
                          name=f"logitless_{kernel_name}", **out, **consts)


def weight_strides(w, weight_layout):
    """(stride_wv, stride_wh) of a contiguous w: (V, H) for "vh", (H, V) for "hv"."""
    if weight_layout == "vh":
        return w.shape[1], 1
    return 1, w.shape[1]


def sequential_under_vmap(fn):
    """fn(*arrays) that, under ``jax.vmap``, runs once per batch element (a loop):
    neither triton_call nor the interpreter's callback has a batching rule."""
    return jax.custom_batching.sequential_vmap(fn)


def chunked_gradients(x2d, w, bias, chunk: int, dz_of, *, weight_layout: str = "vh", carry_type=None):
    """(dx, dw, db) from dz chunks: for each chunk of ``chunk`` columns (a
    ``lax.fori_loop``; the last, shorter chunk is a separate static step),
    ``dz_of(v0, width)`` -> (N, width) dz in x's dtype, then dx += dz @ w_chunk (fp32
    accumulator; no accumulator when one chunk covers V), dw_chunk = dz^T @ x (fp32,
    cast once to w's dtype), db_chunk = column sums of dz (fp32). dw has w's layout.
    ``carry_type(carry)``: retypes the loop's initial carry (shard_map's varying axes)."""
    n, h = x2d.shape
    vaxis = 0 if weight_layout == "vh" else 1
    vocab = w.shape[vaxis]
    one_chunk = vocab == chunk

    def step(v0, width, carry):
        dx, dw, db = carry
        dz = dz_of(v0, width)
        wj = lax.dynamic_slice_in_dim(w, v0, width, vaxis)
        if weight_layout == "vh":
            dxj = lax.dot_general(dz, wj, (((1,), (0,)), ((), ())), preferred_element_type=F32)
            dwj = lax.dot_general(dz, x2d, (((0,), (0,)), ((), ())), preferred_element_type=F32)
        else:
            dxj = lax.dot_general(dz, wj, (((1,), (1,)), ((), ())), preferred_element_type=F32)
            dwj = lax.dot_general(x2d, dz, (((0,), (0,)), ((), ())), preferred_element_type=F32)
        dx = dxj if dx is None else dx + dxj
        dw = lax.dynamic_update_slice_in_dim(dw, dwj.astype(w.dtype), v0, vaxis)
        if db is not None:
            dbj = jnp.sum(dz.astype(F32), axis=0)
            db = lax.dynamic_update_slice_in_dim(db, dbj.astype(db.dtype), v0, 0)
        return dx, dw, db

    dw0 = uninitialised(w.shape, w.dtype)  # every chunk writes its columns
    db0 = None if bias is None else jnp.zeros(bias.shape, bias.dtype)
    if one_chunk:
        dx, dw, db = step(0, vocab, (None, dw0, db0))
        return dx.astype(x2d.dtype), dw, db
    carry = (jnp.zeros((n, h), F32), dw0, db0)
    if carry_type is not None:
        carry = carry_type(carry)
    dx, dw, db = chunk_loop(vocab, chunk, step, carry)
    return dx.astype(x2d.dtype), dw, db


@dataclass(frozen=True)
class TritonConfig:
    """The "triton" backends' Config: the launch plan (``planning.triton_plan``: tiles,
    splits, the backward's chunk) and the weight's layout."""

    plan: TritonPlan
    weight_layout: str = "vh"


class TritonBase(BackendBase):
    """The "triton" kind (the base of every op's ``TritonBackend``): 16-bit and fp32
    inputs on an NVIDIA GPU with jax-triton, or on the CPU with triton (its interpreter,
    never partitioned); plans the launch from the budget and the GPU (this module's
    ``platform``, ``jax_triton``, ``has_triton``, ``interpret``, ``device_info``, looked
    up per call)."""

    name = "triton"

    def why_not(self, x2d_shape, w_shape, dtype, *, softcap, has_bias) -> Optional[str]:
        return None if is_supported(dtype, platform(), jax_triton, has_triton) else UNSUPPORTED_HINT

    def can_partition(self) -> bool:
        return not interpret()

    def plan(self, x2d_shape, w_shape, dtype, *, budget: int, weight_layout: str = "vh",
             has_bias: bool = False) -> TritonConfig:
        return TritonConfig(plan_for(x2d_shape, dtype, w_shape[0], budget, interpret(), device_info), weight_layout)
