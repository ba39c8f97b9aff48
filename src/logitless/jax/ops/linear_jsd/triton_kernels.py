"""Launch wrapper of the shared linear_jsd backward kernel for the JAX "triton" backend.

The kernel is ``logitless.triton_lib.linear_jsd_kernels.jsd_dlogits_kernel`` (the PyTorch
op's, not a copy): both heads' logits tiles recomputed in registers and the divergence's
dz written in the input dtype. jax-triton passes a kernel's arrays first, then its
outputs, then every other argument as a ``tl.constexpr``: this wrapper reads the chunk's
first column from a one-element array (so that one compiled kernel serves every step
of the loop over column chunks; chunks start at multiples of BLOCK_V, which it tells the
compiler) and passes no biases or soft-caps (the JAX op has none).
"""

import triton
import triton.language as tl

from logitless.triton_lib.linear_jsd_kernels import jsd_dlogits_kernel


@triton.jit
def jsd_dlogits_chunk_kernel(
    xs_ptr, ws_ptr, xt_ptr, wt_ptr, target_ptr, stats_ptr, g_ptr, v0_ptr, dz_ptr,
    N, V, HS, HT, stride_wsv, stride_wsh, stride_wtv, stride_wth, width,
    inv_t, wp, hlw, log_beta, log_1mbeta, group_n,
    MODE: tl.constexpr, HAS_HARD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """dz of columns [v0, min(v0 + width, V)) into the (N, width) buffer dz_ptr, with
    v0 = v0_ptr[0] (a multiple of BLOCK_V): ``jsd_dlogits_kernel`` without TMA."""
    v_start = tl.multiple_of(tl.load(v0_ptr), BLOCK_V)
    v_end = tl.minimum(v_start + width, V)
    jsd_dlogits_kernel(
        xs_ptr, ws_ptr, xs_ptr, xt_ptr, wt_ptr, xt_ptr, target_ptr, stats_ptr, g_ptr, dz_ptr,
        N, V, HS, HT, HS, 1, stride_wsv, stride_wsh, HT, 1, stride_wtv, stride_wth, width,
        v_start, v_end, inv_t, wp, hlw, log_beta, log_1mbeta, 1.0, 1.0, group_n,
        MODE=MODE, HAS_HARD=HAS_HARD, HAS_CAP_S=False, HAS_CAP_T=False, HAS_BIAS_S=False, HAS_BIAS_T=False,
        DOT_PRECISION=DOT_PRECISION, USE_TMA=False, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H,
    )
