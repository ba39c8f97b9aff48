"""Launch wrapper of the shared log-prob kernels for the JAX "triton" backend.

The kernels themselves are ``logitless.triton_lib.log_probs_kernels`` (the PyTorch
op's, not a copy). jax-triton passes a kernel's arrays first, then its outputs, then
every other argument as a ``tl.constexpr``; ``logp_forward_kernel`` already has that
order. The backward's ``logp_dlogits_kernel`` takes the chunk's first column as a
scalar; this wrapper reads it from a one-element array instead, so that one compiled
kernel serves every step of the ``lax.fori_loop`` over column chunks (chunks start at
multiples of BLOCK_V, which the wrapper tells the compiler).
"""

import triton
import triton.language as tl

from logitless.triton_lib.log_probs_kernels import logp_dlogits_kernel


@triton.jit
def logp_dlogits_chunk_kernel(
    x_ptr, w_ptr, b_ptr, token_ptr, lse_ptr, coef_ptr, v0_ptr, dz_ptr,
    N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, width, softcap, inv_temp, group_n,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr, FLATTEN: tl.constexpr,
):
    """dz of columns [v0, min(v0 + width, V)) into the (N, width) buffer dz_ptr, with
    v0 = v0_ptr[0] (a multiple of BLOCK_V): ``logp_dlogits_kernel`` with TMA off."""
    v_start = tl.multiple_of(tl.load(v0_ptr), BLOCK_V)
    v_end = tl.minimum(v_start + width, V)
    logp_dlogits_kernel(
        x_ptr, w_ptr, b_ptr, token_ptr, lse_ptr, coef_ptr, dz_ptr,
        N, V, H, stride_xn, stride_xh, stride_wv, stride_wh, width,
        v_start, v_end, softcap, inv_temp, group_n,
        HAS_BIAS=HAS_BIAS, HAS_SOFTCAP=HAS_SOFTCAP, ENTROPY=ENTROPY,
        DOT_PRECISION=DOT_PRECISION, USE_TMA=False,
        BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H, DZ_TMA=False, FLATTEN=FLATTEN,
    )
