"""The threshold pass's logits on the Triton backend (truncated sampling,
``ops/linear_log_probs/truncation.py``): a = softcap(x W^T + b) / T for a chunk of
vocabulary columns into an fp32 buffer, from the same tile code as
``log_probs_kernels.logp_forward_kernel`` (``tile_io.block_tile``, the forward plan's
block sizes and dot precision), so the candidates come from the GEMM the forward runs
(16-bit operands on the tensor cores, fp32 accumulation). Memory traffic: the GEMM's
reads plus one fp32 write of the chunk (rows x chunk columns, within the budget).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from logitless.triton_lib import launch
from logitless.triton_lib.tile_io import block_tile


@triton.jit
def scaled_logits_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, stride_out,
    first_block, softcap, inv_temp,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Program (i, j): rows [i BLOCK_N, ...) x vocabulary block first_block + j, written
    at columns from first_block * BLOCK_V on (out: rows x chunk, fp32)."""
    pid_n = tl.program_id(0)
    block = first_block + tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v, col_ok, z = block_tile(
        x_ptr, w_ptr, b_ptr, pid_n, block, N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, softcap,
        HAS_BIAS, HAS_SOFTCAP, DOT_PRECISION, False, BLOCK_N, BLOCK_V, BLOCK_H,
    )
    a = z * inv_temp
    local = offs_v - first_block * BLOCK_V
    mask = (offs_n < N)[:, None] & col_ok[None, :]
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * stride_out + local[None, :], a, mask=mask)


def scaled_logits(x: Tensor, weight: Tensor, bias, softcap, temperature: float, v0: int, v1: int, plan,
                  out: Tensor = None) -> Tensor:
    """(rows, v1 - v0) fp32 a of x's rows and columns [v0, v1) (v0 a multiple of
    plan.block_v)."""
    n, h = x.shape
    v = weight.shape[0]
    assert v0 % plan.block_v == 0
    if out is None or out.shape != (n, v1 - v0):
        out = torch.empty(n, v1 - v0, dtype=torch.float32, device=x.device)
    grid = (launch.cdiv(n, plan.block_n), launch.cdiv(v1 - v0, plan.block_v))
    launch.run_kernel(
        scaled_logits_kernel, grid,
        x, weight, bias if bias is not None else x, out, n, min(v, v1), h, x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1), out.stride(0), v0 // plan.block_v, float(softcap or 1.0),
        1.0 / temperature,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None, DOT_PRECISION=launch.dot_precision(x.dtype),
        BLOCK_N=plan.block_n, BLOCK_V=plan.block_v, BLOCK_H=plan.block_h, num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    return out
