"""The "triton" backend: the PyTorch op's Triton kernels, called from JAX (SM80+ GPUs;
Triton's CPU interpreter elsewhere).

Route: ``jax_triton.triton_call`` (the optional dependency ``jax-triton``) launches the
kernels of ``logitless.triton_lib.lce_kernels`` (the same source as the PyTorch op, so
the math is written once) as XLA custom calls inside the api's ``jax.custom_vjp``. On a
machine without a GPU (where jax-triton does not import) the same kernels run on
Triton's interpreter through ``jax.pure_callback`` with numpy buffers
(``logitless.triton_lib.interpret``): exact, and slow (tests at tiny shapes only).
docs/PERFORMANCE.md (section "JAX on every NVIDIA GPU") says why not Pallas Triton.

Math (``logitless/jax/formulas.py``), z = cap(x @ w.T + b), p_c = exp(z_c - lse):

    forward   (1 GEMM) ``forward_stats_kernel`` over (row blocks x vocabulary splits)
              writes per split and token the running max, sum of exp, z_t and
              sum_c w_c z_c (fp32); merged here with O(tokens x splits) jnp ops.
    backward  (3 GEMMs) per chunk of c columns (a ``lax.fori_loop``; the last, shorter
              chunk is a separate static step): ``dlogits_chunk_kernel`` recomputes the
              chunk's z (GEMM 1) and writes dz = p A - B [c == t] - C w_c (x cap') in
              the input dtype; XLA then runs dx += dz @ w_chunk (GEMM 2, fp32
              accumulator), dw_chunk = dz^T @ x (GEMM 3, fp32, cast once), db_chunk =
              column sums of dz.

Memory: O(tokens x splits) fp32 partials in the forward; in the backward one dz chunk
(tokens x c x itemsize), its fp32 dW chunk and the fp32 dx accumulator (tokens x H x
4): ``planning.triton_plan`` sizes c from the budget. Never tokens x V. No atomics:
bitwise repeatable. fp32 inputs: TF32 with rounded operands ("tf32-round") at JAX's
default matmul precision, 3xTF32 (about fp32) at "highest"/"float32".

Limits: 16-bit and fp32 inputs (not fp64: ``is_supported`` says no); no TMA (tensor
descriptors need host-made descriptors or a device allocator that jax-triton does not
provide), so on SM90 the kernels load tiles with pointers (the default there is the
mosaic_gpu backend); the forward does not keep exp(z) for the backward (the PyTorch
op's "keep" strategy writes into an input buffer in place, which triton_call cannot
express), so the backward always recomputes the logits: 4 GEMMs per step in all.
Under ``jax.vmap`` the kernels run once per batch element (``sequential_vmap``: no
batching rule exists for triton_call or the callback).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from logitless.jax.ops.linear_cross_entropy.sharded import to_varying, varying
from logitless.jax.planning import TritonPlan, triton_plan

_F32 = jnp.float32
#: The api passes (H, V) weights as they are (the kernels take any strides).
NATIVE_HV = True
#: forward and backward accept ``class_weight=`` (a (V,) array, w_c in the formulas).
CLASS_WEIGHTS = True

#: Modules of the kernels, in import order (each imports the earlier ones).
_KERNEL_MODULES = (
    "logitless.triton_lib.ce_math",
    "logitless.triton_lib.gemm",
    "logitless.triton_lib.lce_kernels",
    "logitless.jax.ops.linear_cross_entropy.triton_kernels",
)


#: Appended to the api's error when an explicit implementation="triton" is refused.
UNSUPPORTED_HINT = ("the triton backend takes bf16/f16/f32 inputs, and needs the triton package (CPU: "
                    "Triton's interpreter) or, on an NVIDIA GPU, jax-triton: pip install 'logitless[jax-triton]'")


def is_supported(x2d_shape, w_shape, dtype, *, softcap, has_bias) -> bool:
    """16-bit and fp32 inputs, on an NVIDIA GPU with jax-triton, or on the CPU
    (Triton's interpreter) with triton installed."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        return False
    platform = _platform()
    if platform == "gpu":
        return _jax_triton() is not None and _is_nvidia()
    return platform == "cpu" and _has_triton()


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _platform() -> str:
    return jax.default_backend()


def _is_nvidia() -> bool:
    dev = jax.devices()[0]
    return "nvidia" in str(getattr(dev, "device_kind", "")).lower() or hasattr(dev, "compute_capability")


@functools.cache
def _jax_triton():
    """jax_triton, or None where it does not import (not installed, or a CPU-only jax)."""
    try:
        import jax_triton
    except ImportError:
        return None
    return jax_triton


@functools.cache
def _device_info():
    """(compute capability as major * 10 + minor, number of SMs) of the first GPU."""
    dev = jax.devices()[0]
    cc = str(getattr(dev, "compute_capability", "9.0"))
    major, _, minor = cc.partition(".")
    try:
        cc_int = int(major) * 10 + int(minor or 0)
    except ValueError:
        cc_int = 90
    return cc_int, int(getattr(dev, "core_count", 0) or 132)


def _interpret() -> bool:
    return _platform() != "gpu"


def can_partition() -> bool:
    """Whether the sharded jit path (``custom_partitioning``) may call these kernels: not
    through the interpreter's host callback (the api then runs the unpartitioned program)."""
    return not _interpret()


def _plan(x2d, vocab, budget) -> TritonPlan:
    n, h = x2d.shape
    interpret = _interpret()
    cc, sms = (90, 132) if interpret else _device_info()
    return triton_plan(n, vocab, h, jnp.dtype(x2d.dtype).itemsize, budget, interpret=interpret,
                       compute_capability=cc, num_sms=sms)


def _dot_precision(dtype) -> str:
    """``gemm.dot``'s DOT_PRECISION: 16-bit inputs on the interpreter are widened (its
    bf16 products are wrong otherwise); fp32 follows ``jax_default_matmul_precision``."""
    if jnp.dtype(dtype).itemsize == 2:
        return "interpreter-bf16" if _interpret() else "tf32"
    if _interpret():
        return "ieee"
    prec = str(jax.config.jax_default_matmul_precision or "default").lower()
    return "tf32x3" if prec in ("highest", "float32", "f32_f32_f32", "precision.highest") else "tf32-round"


def _host_launch(kernel_name, grid, num_warps, num_stages, consts, out_specs, *arrays):
    """Run one kernel on Triton's interpreter over numpy buffers (pure_callback body)."""
    from logitless.triton_lib.interpret import HostArray, interpreted_language, interpreted_modules

    mods = interpreted_modules(_KERNEL_MODULES)
    kernel = None
    for mod in mods.values():
        kernel = getattr(mod, kernel_name, kernel)
    ins = [HostArray(np.ascontiguousarray(a)) for a in arrays]
    outs = [np.zeros(s.shape, s.dtype) for s in out_specs]
    with interpreted_language():
        kernel[grid](*ins, *[HostArray(o) for o in outs], **consts)
    return tuple(outs)


def _launch(kernel_name, grid, plan: TritonPlan, out_specs, arrays, consts):
    """Launch ``kernel_name`` over ``grid``: arrays first, then outputs (``out_specs``),
    then ``consts`` (every other argument, by name; compile-time constants)."""
    out_specs = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_specs)
    if _interpret():
        fn = functools.partial(_host_launch, kernel_name, grid, plan.num_warps, plan.num_stages,
                               consts, out_specs)
        return jax.pure_callback(fn, out_specs, *arrays)
    jt = _jax_triton()
    if jt is None:
        raise ImportError('implementation="triton" on a GPU needs the jax-triton package '
                          "(pip install 'logitless[jax-triton]')")
    from logitless.jax.ops.linear_cross_entropy import triton_kernels
    from logitless.triton_lib import lce_kernels

    kernel = getattr(lce_kernels, kernel_name, None) or getattr(triton_kernels, kernel_name)
    return jt.triton_call(*arrays, kernel=kernel, out_shape=out_specs, grid=grid,
                          num_warps=plan.num_warps, num_stages=plan.num_stages,
                          name=f"logitless_{kernel_name}", **consts)


def _weight_strides(w, weight_layout):
    """(stride_wv, stride_wh) of a contiguous w: (V, H) for "vh", (H, V) for "hv"."""
    if weight_layout == "vh":
        return w.shape[1], 1
    return 1, w.shape[1]


def _common_consts(x2d, w, vocab, softcap, has_bias, has_cw, weight_layout, plan):
    n, h = x2d.shape
    stride_wv, stride_wh = _weight_strides(w, weight_layout)
    return dict(
        N=n, V=vocab, H=h, stride_xn=h, stride_xh=1, stride_wv=stride_wv, stride_wh=stride_wh,
        softcap=float(softcap or 1.0), group_n=plan.group_n,
        HAS_BIAS=has_bias, HAS_SOFTCAP=softcap is not None, HAS_CW=has_cw,
        DOT_PRECISION=_dot_precision(x2d.dtype),
        BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, BLOCK_H=plan.block_h, FLATTEN=plan.flatten,
    )


def _operands(x2d, w, bias, class_weight):
    """The kernels' pointer arguments; absent ones point at x (never read)."""
    b = bias if bias is not None else x2d
    cw = class_weight.astype(_F32) if class_weight is not None else x2d
    return b, cw


def _sequential_under_vmap(fn):
    """fn(*arrays) that, under ``jax.vmap``, runs once per batch element (a loop):
    neither triton_call nor the interpreter's callback has a batching rule."""
    return jax.custom_batching.sequential_vmap(fn)


def forward(x2d, w, bias, target, *, softcap: Optional[float], need_smooth: bool, budget: int,
            weight_layout: str = "vh", class_weight=None):
    """The interface's forward (``weight_layout="hv"``: w is (H, V), no copy;
    ``class_weight``: (V,) weights, smooth_sum = sum_c w_c z_c)."""
    run = functools.partial(_forward, softcap=softcap, need_smooth=need_smooth, budget=budget,
                            weight_layout=weight_layout)
    return _sequential_under_vmap(run)(x2d, w, bias, target, class_weight)


def _forward(x2d, w, bias, target, class_weight, *, softcap, need_smooth, budget, weight_layout):
    n = x2d.shape[0]
    vocab = w.shape[0] if weight_layout == "vh" else w.shape[1]
    plan = _plan(x2d, vocab, budget)
    splits = plan.vocab_splits
    vocab_blocks = -(-vocab // plan.block_v)
    blocks_per_split = -(-vocab_blocks // splits)
    row_blocks = -(-n // plan.block_n)
    b, cw = _operands(x2d, w, bias, class_weight)
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=_F32)
    dummy = f32((1,))
    outs = (f32((splits, n)), f32((splits, n)), f32((splits, n)),
            f32((splits, n)) if need_smooth else dummy,
            dummy, jax.ShapeDtypeStruct((1,), jnp.int32), dummy, dummy)  # best, arg, keep, keep_max
    consts = _common_consts(x2d, w, vocab, softcap, bias is not None, class_weight is not None,
                            weight_layout, plan)
    consts.update(stride_keep=0, blocks_per_split=blocks_per_split, keep_blocks=0, splits=splits,
                  group_n=min(plan.group_n, row_blocks), NEED_SMOOTH=need_smooth,
                  NEED_ARGMAX=False, KEEP=False, USE_TMA=False)
    part_max, part_sum, part_tgt, part_smooth, *_ = _launch(
        "forward_stats_kernel", (row_blocks * splits,), plan, outs,
        (x2d, w, b, cw, target.astype(jnp.int32)), consts)
    # Merge the splits as the PyTorch op: lse = M + log sum_j s_j exp(m_j - M), M = 0
    # where every split is -inf; max() propagates NaN.
    big_m = part_max.max(axis=0)
    m_safe = jnp.where(big_m == -jnp.inf, 0.0, big_m)
    lse = m_safe + jnp.log(jnp.sum(part_sum * jnp.exp(part_max - m_safe), axis=0))
    smooth = part_smooth.sum(axis=0) if need_smooth else None
    return lse, part_tgt.sum(axis=0), smooth


def backward(x2d, w, bias, target, lse, coef, *, softcap: Optional[float], budget: int,
             weight_layout: str = "vh", class_weight=None):
    """The interface's backward; dw has the layout of w."""
    run = functools.partial(_backward, softcap=softcap, budget=budget, weight_layout=weight_layout)
    return _sequential_under_vmap(run)(x2d, w, bias, target, lse, coef, class_weight)


def _backward(x2d, w, bias, target, lse, coef, class_weight, *, softcap, budget, weight_layout):
    n, h = x2d.shape
    vaxis = 0 if weight_layout == "vh" else 1
    vocab = w.shape[vaxis]
    plan = _plan(x2d, vocab, budget)
    target = target.astype(jnp.int32)
    coef = coef.astype(_F32)
    b, cw = _operands(x2d, w, bias, class_weight)
    consts = _common_consts(x2d, w, vocab, softcap, bias is not None, class_weight is not None,
                            weight_layout, plan)
    row_blocks = -(-n // plan.block_n)
    consts["group_n"] = min(plan.group_n, row_blocks)
    chunk = min(plan.vocab_chunk, vocab)
    n_full, tail = divmod(vocab, chunk)
    one_chunk = n_full == 1 and tail == 0

    def dz_of(v0, width):
        tiles = row_blocks * -(-width // plan.block_v)
        if plan.persistent:
            tiles = min(tiles, _device_info()[1])
        out = (jax.ShapeDtypeStruct((n, width), x2d.dtype),)
        (dz,) = _launch("dlogits_chunk_kernel", (tiles,), plan, out,
                        (x2d, w, b, cw, target, lse, coef, jnp.reshape(v0, (1,)).astype(jnp.int32)),
                        dict(consts, width=width))
        return dz

    def step(v0, width, carry):
        dx, dw, db = carry
        dz = dz_of(v0, width)
        wj = lax.dynamic_slice_in_dim(w, v0, width, vaxis)
        if weight_layout == "vh":
            dxj = lax.dot_general(dz, wj, (((1,), (0,)), ((), ())), preferred_element_type=_F32)
            dwj = lax.dot_general(dz, x2d, (((0,), (0,)), ((), ())), preferred_element_type=_F32)
        else:
            dxj = lax.dot_general(dz, wj, (((1,), (1,)), ((), ())), preferred_element_type=_F32)
            dwj = lax.dot_general(x2d, dz, (((0,), (0,)), ((), ())), preferred_element_type=_F32)
        dx = dxj if dx is None else dx + dxj
        dw = lax.dynamic_update_slice_in_dim(dw, dwj.astype(w.dtype), v0, vaxis)
        if db is not None:
            dbj = jnp.sum(dz.astype(_F32), axis=0)
            db = lax.dynamic_update_slice_in_dim(db, dbj.astype(db.dtype), v0, 0)
        return dx, dw, db

    dw0 = jnp.zeros(w.shape, w.dtype)
    db0 = None if bias is None else jnp.zeros(bias.shape, bias.dtype)
    if one_chunk:
        dx, dw, db = step(0, vocab, (None, dw0, db0))
        return dx.astype(x2d.dtype), dw, db
    carry = (jnp.zeros((n, h), _F32), dw0, db0)
    # Inside shard_map (check_vma): the loop's carries vary over the inputs' axes.
    axes = tuple(sorted(frozenset().union(*(varying(a) for a in (x2d, w, target, lse, coef)))))
    carry = tuple(to_varying(c, axes) for c in carry)
    if n_full == 1:
        carry = step(0, chunk, carry)
    elif n_full > 1:
        carry = lax.fori_loop(0, n_full, lambda i, c: step(i * chunk, chunk, c), carry)
    if tail:
        carry = step(n_full * chunk, tail, carry)
    dx, dw, db = carry
    return dx.astype(x2d.dtype), dw, db
