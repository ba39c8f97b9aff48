"""The "triton" backend: the PyTorch op's Triton kernels, called from JAX (SM80+ GPUs;
Triton's CPU interpreter elsewhere).

Route: ``jax_triton.triton_call`` (the optional dependency ``jax-triton``) launches the
kernels of ``logitless.triton_lib.lce_kernels`` (the same source as the PyTorch op, so
the math is written once) as XLA custom calls inside the api's ``jax.custom_vjp``. On a
machine without a GPU (where jax-triton does not import) the same kernels run on
Triton's interpreter through ``jax.pure_callback`` with numpy buffers
(``logitless.triton_lib.interpret``): exact, and slow (tests at tiny shapes only).
docs/design.md ("JAX backends") says why not Pallas Triton.

Math (``logitless/jax/formulas/cross_entropy.py``), z = cap(x @ w.T + b), p_c = exp(z_c - lse):

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

Limits: 16-bit and fp32 inputs (not fp64: ``TritonBase.why_not`` says no); no TMA (tensor
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
from typing import Optional

import jax
import jax.numpy as jnp

from logitless.jax.formulas.cross_entropy import merge_argmax
from logitless.jax.ops.common import triton as rt
from logitless.jax.ops.common.triton import TritonBase, TritonConfig
from logitless.jax.ops.common.triton import device_info as _device_info
from logitless.jax.ops.common.triton import interpret as _interpret
from logitless.jax.ops.linear_cross_entropy.contract import LceGrads, LceResiduals, LceStats
from logitless.jax.planning import TritonPlan
from logitless.jax.sharding import to_varying, varying

_F32 = jnp.float32

#: Modules of the kernels, in import order (each imports the earlier ones).
_KERNEL_MODULES = (
    "logitless.triton_lib.ce_math",
    "logitless.triton_lib.gemm",
    "logitless.triton_lib.lce_kernels",
    "logitless.jax.ops.linear_cross_entropy.triton_kernels",
)


def _plan(x2d, vocab, budget) -> TritonPlan:
    return rt.plan(x2d, vocab, budget, _interpret(), _device_info)


def _dot_precision(dtype) -> str:
    return rt.dot_precision(dtype, _interpret())


def _launch(kernel_name, grid, plan: TritonPlan, out_specs, arrays, consts):
    """Launch ``kernel_name`` (``rt.launch``) over ``grid``: arrays, outputs, consts."""
    return rt.launch(_KERNEL_MODULES, kernel_name, grid, plan, out_specs, arrays, consts,
                     interpreted=_interpret())


_weight_strides = rt.weight_strides


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


_sequential_under_vmap = rt.sequential_under_vmap


def forward(x2d, w, bias, target, *, softcap: Optional[float], need_smooth: bool, budget: Optional[int] = None,
            weight_layout: str = "vh", class_weight=None, need_argmax: bool = False,
            plan: Optional[TritonPlan] = None):
    """The interface's forward (``weight_layout="hv"``: w is (H, V), no copy;
    ``class_weight``: (V,) weights, smooth_sum = sum_c w_c z_c; ``need_argmax``: also
    the row maximum and its first index, merged over the splits as the PyTorch op).
    ``plan``: the launch plan (``TritonBackend.plan``'s); None: planned here from ``budget``."""
    run = functools.partial(_forward, softcap=softcap, need_smooth=need_smooth, budget=budget,
                            weight_layout=weight_layout, need_argmax=need_argmax, plan=plan)
    return _sequential_under_vmap(run)(x2d, w, bias, target, class_weight)


def _forward(x2d, w, bias, target, class_weight, *, softcap, need_smooth, budget, weight_layout,
             need_argmax=False, plan=None):
    n = x2d.shape[0]
    vocab = w.shape[0] if weight_layout == "vh" else w.shape[1]
    plan = _plan(x2d, vocab, budget) if plan is None else plan
    splits = plan.vocab_splits
    vocab_blocks = -(-vocab // plan.block_v)
    blocks_per_split = -(-vocab_blocks // splits)
    row_blocks = -(-n // plan.block_n)
    b, cw = _operands(x2d, w, bias, class_weight)
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=_F32)
    dummy = f32((1,))
    outs = (f32((splits, n)), f32((splits, n)), f32((splits, n)),
            f32((splits, n)) if need_smooth else dummy,
            f32((splits, n)) if need_argmax else dummy,  # best: each split's row maximum
            jax.ShapeDtypeStruct((splits, n) if need_argmax else (1,), jnp.int32),  # arg: its first index
            dummy, dummy)  # keep, keep_max
    consts = _common_consts(x2d, w, vocab, softcap, bias is not None, class_weight is not None,
                            weight_layout, plan)
    consts.update(stride_keep=0, blocks_per_split=blocks_per_split, keep_blocks=0, splits=splits,
                  group_n=min(plan.group_n, row_blocks), NEED_SMOOTH=need_smooth,
                  NEED_ARGMAX=need_argmax, KEEP=False, USE_TMA=False, split0=0, W_CHUNK=False)
    part_max, part_sum, part_tgt, part_smooth, part_best, part_arg, *_ = _launch(
        "forward_stats_kernel", (row_blocks * splits,), plan, outs,
        (x2d, w, b, cw, target.astype(jnp.int32)), consts)
    # Merge the splits as the PyTorch op: lse = M + log sum_j s_j exp(m_j - M), M = 0
    # where every split is -inf; max() propagates NaN.
    big_m = part_max.max(axis=0)
    m_safe = jnp.where(big_m == -jnp.inf, 0.0, big_m)
    lse = m_safe + jnp.log(jnp.sum(part_sum * jnp.exp(part_max - m_safe), axis=0))
    smooth = part_smooth.sum(axis=0) if need_smooth else None
    if need_argmax:
        return lse, part_tgt.sum(axis=0), smooth, part_best.max(axis=0), merge_argmax(part_best, part_arg)
    return lse, part_tgt.sum(axis=0), smooth


def backward(x2d, w, bias, target, lse, coef, *, softcap: Optional[float], budget: Optional[int] = None,
             weight_layout: str = "vh", class_weight=None, plan: Optional[TritonPlan] = None):
    """The interface's backward; dw has the layout of w; ``plan`` as for ``forward``."""
    run = functools.partial(_backward, softcap=softcap, budget=budget, weight_layout=weight_layout, plan=plan)
    return _sequential_under_vmap(run)(x2d, w, bias, target, lse, coef, class_weight)


def _backward(x2d, w, bias, target, lse, coef, class_weight, *, softcap, budget, weight_layout, plan=None):
    n = x2d.shape[0]
    vaxis = 0 if weight_layout == "vh" else 1
    vocab = w.shape[vaxis]
    plan = _plan(x2d, vocab, budget) if plan is None else plan
    target = target.astype(jnp.int32)
    coef = coef.astype(_F32)
    b, cw = _operands(x2d, w, bias, class_weight)
    consts = _common_consts(x2d, w, vocab, softcap, bias is not None, class_weight is not None,
                            weight_layout, plan)
    row_blocks = -(-n // plan.block_n)
    consts["group_n"] = min(plan.group_n, row_blocks)

    def dz_of(v0, width):
        tiles = row_blocks * -(-width // plan.block_v)
        if plan.dlogits_programs:  # persistent: that many programs per SM, each looping over tiles
            tiles = min(tiles, plan.dlogits_programs * _device_info()[1])
        out = (jax.ShapeDtypeStruct((n, width), x2d.dtype),)
        (dz,) = _launch("dlogits_chunk_kernel", (tiles,), plan, out,
                        (x2d, w, b, cw, target, lse, coef, jnp.reshape(v0, (1,)).astype(jnp.int32)),
                        dict(consts, width=width))
        return dz

    def carry_type(carry):
        # Inside shard_map (check_vma): the loop's carries vary over the inputs' axes.
        axes = tuple(sorted(frozenset().union(*(varying(a) for a in (x2d, w, target, lse, coef)))))
        return tuple(to_varying(c, axes) for c in carry)

    return rt.chunked_gradients(x2d, w, bias, min(plan.vocab_chunk, vocab), dz_of,
                                weight_layout=weight_layout, carry_type=carry_type)


class TritonBackend(TritonBase):
    """The "triton" backend (``contract.LceBackend``; ``TritonBase``: the platform checks
    and the launch plan); class weights and the argmax (the kernel's per-split maximum and
    first index)."""

    class_weights = True
    argmax = True
    keeps = False

    def forward(self, x2d, w, bias, target, config: TritonConfig, *, softcap, need_smooth, class_weight=None,
                need_argmax=False) -> LceStats:
        return LceStats(*forward(x2d, w, bias, target, softcap=softcap, need_smooth=need_smooth,
                                 weight_layout=config.weight_layout, class_weight=class_weight,
                                 need_argmax=need_argmax, plan=config.plan))

    def backward(self, res: LceResiduals, coef, config: TritonConfig, *, softcap) -> LceGrads:
        return LceGrads(*backward(res.x2d, res.w, res.bias, res.target, res.lse, coef, softcap=softcap,
                                  weight_layout=config.weight_layout, class_weight=res.class_weight,
                                  plan=config.plan))
