"""The "triton" backend of linear_log_probs: the PyTorch op's Triton kernels, called
from JAX (SM80+ NVIDIA GPUs through jax-triton; Triton's CPU interpreter elsewhere).

Route (shared with linear_cross_entropy's backend: ``logitless/jax/ops/common/triton.py``):
``jax_triton.triton_call`` launches the kernels of ``logitless.triton_lib.log_probs_kernels``
(the same source as ``logitless.linear_log_probs``, so the math is written once) as XLA
custom calls inside the api's ``jax.custom_vjp``; without a GPU the same kernels run on
Triton's interpreter through ``jax.pure_callback`` (exact, slow: tests at tiny shapes).

Math (``logitless/jax/formulas/log_probs.py``), a = softcap(x @ w.T + b) / T:

    forward   (1 GEMM) ``logp_forward_kernel`` over (row blocks x vocabulary splits)
              writes per split and token the running max m, s = sum exp(a - m),
              u = sum exp(a - m)(a - m) (entropy only) and a_t (fp32); merged here
              (``formulas.log_probs.merge_splits``) with O(tokens x splits) jnp ops.
    backward  (3 GEMMs) per chunk of c columns (a ``lax.fori_loop``; the last, shorter
              chunk is a separate static step): ``logp_dlogits_chunk_kernel``
              recomputes the chunk's a (GEMM 1) and writes dz = p (A + C log p) - B [c == t]
              (x cap') in the input dtype; XLA then runs dx += dz @ w_chunk (GEMM 2, fp32
              accumulator), dw_chunk = dz^T @ x (GEMM 3, fp32, cast once), db_chunk =
              column sums of dz.

Memory: O(tokens x splits) fp32 partials in the forward; in the backward one dz chunk
(tokens x c x itemsize), its fp32 dW chunk and the fp32 dx accumulator (tokens x H x 4):
``planning.triton_plan`` sizes c from the budget. Never tokens x V. No atomics: bitwise
repeatable. fp32 inputs: TF32 with rounded operands at JAX's default matmul precision,
3xTF32 at "highest".

Limits: 16-bit and fp32 inputs (not fp64: ``TritonBase.why_not`` says no); no TMA and no kept
exp(a - m) columns (as linear_cross_entropy's JAX triton backend: see
docs/design.md, "JAX backends"), so the backward always recomputes the
logits: 4 GEMMs per step in all. Under ``jax.vmap`` the kernels run once per batch
element (``sequential_vmap``).
Weight layouts: (V, H), or (H, V) with ``weight_layout="hv"`` (``native_hv``): the
kernels read the weight through its strides (a transposed load, no copy) and the
gradient GEMMs contract the other dimension; dW comes back in w's layout.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from logitless.jax.formulas import log_probs as lpf
from logitless.jax.ops.common import triton as rt
from logitless.jax.ops.common.triton import TritonBase, TritonConfig
from logitless.jax.ops.common.triton import device_info as _device_info
from logitless.jax.ops.common.triton import interpret as _interpret
from logitless.jax.ops.linear_log_probs.contract import LlpGrads, LlpResiduals, LlpStats
from logitless.jax.planning import TritonPlan
from logitless.options import LogProbOptions

_F32 = jnp.float32

#: Modules of the kernels, in import order (each imports the earlier ones).
_KERNEL_MODULES = (
    "logitless.triton_lib.ce_math",
    "logitless.triton_lib.gemm",
    "logitless.triton_lib.log_probs_math",
    "logitless.triton_lib.log_probs_kernels",
    "logitless.jax.ops.linear_log_probs.triton_kernels",
)


def _plan(x2d, vocab, budget) -> TritonPlan:
    return rt.plan(x2d, vocab, budget, _interpret(), _device_info)


def _launch(kernel_name, grid, plan: TritonPlan, out_specs, arrays, consts):
    """Launch ``kernel_name`` (``rt.launch``) over ``grid``: arrays, outputs, consts."""
    return rt.launch(_KERNEL_MODULES, kernel_name, grid, plan, out_specs, arrays, consts,
                     interpreted=_interpret())


def _vocab(w, weight_layout):
    return w.shape[0 if weight_layout == "vh" else 1]


def _common_consts(x2d, w, bias, opts: LogProbOptions, plan: TritonPlan, weight_layout="vh"):
    n, h = x2d.shape
    stride_wv, stride_wh = rt.weight_strides(w, weight_layout)
    row_blocks = -(-n // plan.block_n)
    return dict(
        N=n, V=_vocab(w, weight_layout), H=h, stride_xn=h, stride_xh=1, stride_wv=stride_wv, stride_wh=stride_wh,
        softcap=float(opts.softcap or 1.0), inv_temp=1.0 / opts.temperature,
        group_n=min(plan.group_n, row_blocks),
        HAS_BIAS=bias is not None, HAS_SOFTCAP=opts.softcap is not None, ENTROPY=opts.entropy,
        DOT_PRECISION=rt.dot_precision(x2d.dtype, _interpret()),
        BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, BLOCK_H=plan.block_h, FLATTEN=plan.flatten,
    )


def forward(x2d, w, bias, tokens, *, opts: LogProbOptions, budget: Optional[int] = None, weight_layout: str = "vh",
            plan: Optional[TritonPlan] = None):
    """The interface's forward: (lse, a_t, H or None), fp32 per token (w (H, V) with
    ``weight_layout="hv"``). ``plan``: the launch plan (``TritonBackend.plan``'s); None:
    planned here from ``budget``."""
    run = functools.partial(_forward, opts=opts, budget=budget, weight_layout=weight_layout, plan=plan)
    return rt.sequential_under_vmap(run)(x2d, w, bias, tokens)


def _forward(x2d, w, bias, tokens, *, opts, budget, weight_layout, plan=None):
    n = x2d.shape[0]
    vocab = _vocab(w, weight_layout)
    plan = _plan(x2d, vocab, budget) if plan is None else plan
    splits = plan.vocab_splits
    vocab_blocks = -(-vocab // plan.block_v)
    blocks_per_split = -(-vocab_blocks // splits)
    row_blocks = -(-n // plan.block_n)
    b = bias if bias is not None else x2d  # never read without a bias
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=_F32)
    dummy = f32((1,))
    part = f32((splits, n))
    outs = (part, part, part if opts.entropy else dummy, part, dummy, dummy)  # max, sum, u, a_t, keep, keep_max
    consts = _common_consts(x2d, w, bias, opts, plan, weight_layout)
    consts.update(stride_keep=0, blocks_per_split=blocks_per_split, keep_blocks=0, splits=splits,
                  KEEP=False, USE_TMA=False, split0=0, W_CHUNK=False)
    part_max, part_sum, part_u, part_tgt, *_ = _launch(
        "logp_forward_kernel", (row_blocks * splits,), plan, outs,
        (x2d, w, b, tokens.astype(jnp.int32)), consts)
    lse, ent = lpf.merge_splits(part_max, part_sum, part_u if opts.entropy else None)
    return lse, part_tgt.sum(axis=0), ent


def backward(x2d, w, bias, tokens, lse, coef, *, opts: LogProbOptions, budget: Optional[int] = None,
             weight_layout: str = "vh", plan: Optional[TritonPlan] = None):
    """The interface's backward: (dx, dw, db) in the inputs' dtypes, dw in w's layout;
    ``plan`` as for ``forward``."""
    run = functools.partial(_backward, opts=opts, budget=budget, weight_layout=weight_layout, plan=plan)
    return rt.sequential_under_vmap(run)(x2d, w, bias, tokens, lse, coef)


def _backward(x2d, w, bias, tokens, lse, coef, *, opts, budget, weight_layout, plan=None):
    n = x2d.shape[0]
    vocab = _vocab(w, weight_layout)
    plan = _plan(x2d, vocab, budget) if plan is None else plan
    tokens = tokens.astype(jnp.int32)
    lse = lse.astype(_F32)
    coef = coef.astype(_F32)
    b = bias if bias is not None else x2d
    consts = _common_consts(x2d, w, bias, opts, plan, weight_layout)
    row_blocks = -(-n // plan.block_n)

    def dz_of(v0, width):
        tiles = row_blocks * -(-width // plan.block_v)
        if plan.dlogits_programs:  # persistent: that many programs per SM, each looping over tiles
            tiles = min(tiles, plan.dlogits_programs * _device_info()[1])
        out = (jax.ShapeDtypeStruct((n, width), x2d.dtype),)
        (dz,) = _launch("logp_dlogits_chunk_kernel", (tiles,), plan, out,
                        (x2d, w, b, tokens, lse, coef, jnp.reshape(v0, (1,)).astype(jnp.int32)),
                        dict(consts, width=width))
        return dz

    return rt.chunked_gradients(x2d, w, bias, min(plan.vocab_chunk, vocab), dz_of, weight_layout=weight_layout)


class TritonBackend(TritonBase):
    """The "triton" backend (``contract.LlpBackend``; ``TritonBase``: the platform checks
    and the launch plan)."""

    def forward(self, x2d, w, bias, tokens, config: TritonConfig, *, opts: LogProbOptions) -> LlpStats:
        return LlpStats(*forward(x2d, w, bias, tokens, opts=opts, weight_layout=config.weight_layout,
                                 plan=config.plan))

    def backward(self, res: LlpResiduals, coef, config: TritonConfig, *, opts: LogProbOptions) -> LlpGrads:
        return LlpGrads(*backward(res.x2d, res.w, res.bias, res.tokens, res.lse, coef, opts=opts,
                                  weight_layout=config.weight_layout, plan=config.plan))
