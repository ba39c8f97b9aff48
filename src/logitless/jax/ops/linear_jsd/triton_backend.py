"""The "triton" backend of linear_jsd: the "xla" backend's forward (XLA's GEMMs of both
heads' full rows per chunk, the kept dz) and a backward whose recomputed columns come
from the PyTorch op's fused two-head kernel (``triton_lib.linear_jsd_kernels``, launched
by jax-triton on an NVIDIA GPU, on Triton's interpreter on a CPU: ``common/triton.py``):

    per chunk of ``vocab_chunk`` columns past the kept ones (a fori_loop; the last,
    shorter chunk its own static step): ``jsd_dlogits_chunk_kernel`` recomputes both
    heads' tiles in registers and writes dz in the input dtype (one write per chunk),
    then XLA's GEMMs take dx += dz @ W_s[chunk], dW_s[chunk] = dz^T x_s
    (``rows.chunk_gradients``)

Tiles: ``planning.tiles.JSD_CUDA_TILES`` (two fp32 accumulators), the interpreter's on a
CPU; the chunk from the budget the kept dz leaves (``planning.triton_plan``). No TMA
(jax-triton has no device descriptors), no atomics. fp64 is refused (``TritonBase``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from logitless.jax.ops.common import triton as rt
from logitless.jax.ops.common.rows import W_AXIS, RowsConfig, chunk_gradients, kept_gradients, plan_rows
from logitless.jax.ops.common.triton import TritonBase, TritonConfig
from logitless.jax.ops.linear_jsd import xla_backend
from logitless.jax.ops.linear_jsd.contract import JsdForward, JsdResiduals
from logitless.planning.tiles import INTERPRETER_TILES, JSD_CUDA_TILES

#: Modules of the kernel, in import order (each imports the earlier ones).
_KERNEL_MODULES = (
    "logitless.triton_lib.ce_math",
    "logitless.triton_lib.jsd_math",
    "logitless.triton_lib.gemm",
    "logitless.triton_lib.linear_jsd_kernels",
    "logitless.jax.ops.linear_jsd.triton_kernels",
)


def _jsd_tiles(config: TritonConfig, itemsize: int) -> TritonConfig:
    """The kind's Config with linear_jsd's two-head tiles (its chunk a multiple of them)."""
    plan = config.plan
    block_n, block_v, block_h, warps, stages = INTERPRETER_TILES if rt.interpret() else JSD_CUDA_TILES[itemsize]
    chunk = max(block_v, plan.vocab_chunk // block_v * block_v)
    return TritonConfig(dataclasses.replace(plan, block_n=block_n, block_v=block_v, block_h=block_h, num_warps=warps,
                                      num_stages=stages, vocab_chunk=chunk), config.weight_layout)


def backward(res: JsdResiduals, g, g_kept, config: RowsConfig, *, opts):
    """The contract's backward: the kept columns' GEMMs, then the Triton dz chunks'."""
    xs, ws, xt, wt, target, stats, kept = res
    layout = config.weight_layout
    vaxis = W_AXIS[layout]
    n, hs = xs.shape
    v = ws.shape[vaxis]
    plan = config.recompute.plan
    start, dx, dw = kept_gradients(kept, xs, ws, g_kept, layout=layout)
    if start >= v:
        return dx.astype(xs.dtype), dw
    zero = jnp.zeros_like(stats.lse_s)
    rows = jnp.stack([stats.lse_s, stats.lse_t, stats.s, stats.k, zero if stats.lse1 is None else stats.lse1,
                      zero]).astype(jnp.float32)
    gf = g.astype(jnp.float32)
    t32 = target.astype(jnp.int32)
    beta = opts.beta
    mode = 1 if beta == 0.0 else 2 if beta == 1.0 else 0
    sws, swh = rt.weight_strides(ws, layout)
    swt, swth = rt.weight_strides(wt, layout)
    row_blocks = -(-n // plan.block_n)
    consts = dict(N=n, V=v, HS=hs, HT=xt.shape[1], stride_wsv=sws, stride_wsh=swh, stride_wtv=swt, stride_wth=swth,
                  inv_t=1.0 / opts.temperature, wp=opts.weights[1], hlw=float(opts.hard_label_weight),
                  log_beta=math.log(beta) if mode == 0 else 0.0, log_1mbeta=math.log1p(-beta) if mode == 0 else 0.0,
                  group_n=min(plan.group_n, row_blocks), MODE=mode, HAS_HARD=opts.needs_lse1,
                  DOT_PRECISION=rt.dot_precision(xs.dtype, rt.interpret()),
                  BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, BLOCK_H=plan.block_h)

    def chunks(xs, ws, xt, wt, t32, rows, gf, dx, dw):
        def dz_of(c0, width):
            grid = (row_blocks * -(-width // plan.block_v),)
            out = (jax.ShapeDtypeStruct((n, width), xs.dtype),)
            (dz,) = rt.launch(_KERNEL_MODULES, "jsd_dlogits_chunk_kernel", grid, plan, out,
                              (xs, ws, xt, wt, t32, rows, gf, jnp.reshape(c0, (1,)).astype(jnp.int32)),
                              dict(consts, width=width), interpreted=rt.interpret())
            return dz

        return chunk_gradients(xs, ws, start, plan.vocab_chunk, dz_of, layout=layout, dx=dx, dw=dw,
                               refs=(xt, wt, rows, gf, t32))

    # (under jax.vmap: once per batch element; the launches have no batching rule)
    dx, dw = rt.sequential_under_vmap(chunks)(xs, ws, xt, wt, t32, rows, gf, dx, dw)
    return dx.astype(xs.dtype), dw


class TritonBackend(TritonBase):
    """The "triton" backend (``contract.JsdBackend``; ``TritonBase``: the platform checks
    and the launch plan, here with linear_jsd's tiles)."""

    def plan_call(self, x2d_shape, w_shape, dtype, *, budget: int, weight_layout: str = "vh") -> RowsConfig:
        config = plan_rows(self, x2d_shape, w_shape, dtype, budget=budget, weight_layout=weight_layout, arrays=2,
                         heads=2)
        return RowsConfig(config.plain, config.grad, _jsd_tiles(config.recompute, jnp.dtype(dtype).itemsize))

    def forward(self, xs, ws, xt, wt, target, config: RowsConfig, *, opts, merge, g_unit=None) -> JsdForward:
        return xla_backend.forward(xs, ws, xt, wt, target, config, opts=opts, merge=merge, g_unit=g_unit)

    def backward(self, res: JsdResiduals, g, g_kept, config: RowsConfig, *, opts):
        return backward(res, g, g_kept, config, opts=opts)
