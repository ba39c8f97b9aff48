"""The Triton form of ``_loss_math``'s per-element formulas, shared by every op's kernels."""

import triton
import triton.language as tl


@triton.jit
def softcap_tile(z, softcap):
    """s * tanh(z / s), with tanh(y) = 1 - 2 / (exp(2y) + 1): exact limits at +-inf."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0))


@triton.jit
def dz_tile(p, z, offs_v, target, a, b, c, cw_ptr, V, softcap,
            HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr, BLOCK_V: tl.constexpr):
    """dz_c = p_c * A - B * [c == t] - C * w_c, times 1 - (z_c/s)^2 with a soft-cap
    (``_loss_math``'s one gradient line). p, z: (BLOCK_N, BLOCK_V) fp32, z the capped
    logits (only read with HAS_SOFTCAP); a, b, c, target per row; w_c = 1 without
    class weights."""
    if HAS_CW:
        cw = tl.load(cw_ptr + offs_v, mask=offs_v < V, other=0.0).to(tl.float32)
    else:
        cw = tl.full((BLOCK_V,), 1.0, tl.float32)
    dz = p * a[:, None] - tl.where(offs_v[None, :] == target[:, None], b[:, None], 0.0)
    dz -= c[:, None] * cw[None, :]
    if HAS_SOFTCAP:
        capped = z / softcap
        dz *= 1.0 - capped * capped
    return dz
