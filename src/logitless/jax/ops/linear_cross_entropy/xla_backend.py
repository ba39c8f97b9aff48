"""The "xla" backend: chunked linear cross-entropy in plain JAX (CPU, GPU, TPU).

Math (see ``logitless/jax/formulas/cross_entropy.py``): per token, lse, z_t and (label smoothing)
sum_c z_c of the soft-capped logits z = cap(x @ w.T + b), computed tile by tile:

    forward   for each column chunk j (fori_loop), for each row chunk i:
                  z = cap(x_i @ w_j.T + b_j)                fp32 (one GEMM)
                  lse_i = logaddexp(lse_i, logsumexp(z))    online log-sum-exp
                  z_t  += z[c == t];  S_i += sum_c z
    backward  for each column chunk j, for each row chunk i:
                  z recomputed (GEMM 1), dz = p * A - B [c == t] - C (x cap')
                  dx_i += dz @ w_j  (GEMM 2),  dw_j += dz.T @ x_i  (GEMM 3),  db_j += sum dz
              dw_j and db_j are written once per column chunk (fp32 accumulation, one cast).

The last column (and row) chunk may be shorter: it is a separate, statically shaped
step after the loop, so padded columns never exist and never enter the log-sum-exp.
Memory: one tile of logits and its temporaries (``planning.xla_plan`` sizes it from the
budget), the fp32 dx accumulator (N x H) and one fp32 dW chunk; never N x V.
Dots accumulate in fp32 (``preferred_element_type``); dz is cast to the input dtype
before the gradient GEMMs (as the PyTorch side), so bf16 inputs run bf16 GEMMs.
fp32 inputs follow JAX's default matmul precision (``jax_default_matmul_precision``).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from jax import lax

from logitless.jax.formulas.cross_entropy import dlogits, softcap_logits
from logitless.jax.ops.common.chunks import chunk_loop, put, take, uninitialised
from logitless.jax.ops.common.xla import XlaBase, XlaConfig
from logitless.jax.ops.linear_cross_entropy.contract import LceGrads, LceResiduals, LceStats
from logitless.jax.planning import XlaPlan, xla_plan
from logitless.jax.sharding import to_varying, varying

_F32 = jnp.float32


#: Contracting dimensions of the three GEMMs by weight layout (a w tile is (v, H) for
#: "vh", (H, v) for "hv"): z = x @ w^T, dx = dz @ w, dw = dz^T @ x (or x^T @ dz for "hv").
_W_AXIS = {"vh": 0, "hv": 1}  # the vocabulary axis of w
_Z_DIMS = {"vh": (((1,), (1,)), ((), ())), "hv": (((1,), (0,)), ((), ()))}
_DX_DIMS = {"vh": (((1,), (0,)), ((), ())), "hv": (((1,), (1,)), ((), ()))}


def _logits(x, w, b, softcap, layout="vh"):
    """cap(x @ w.T + b) in fp32 for a tile: x (n, H), w (v, H) ("vh") or (H, v) ("hv"),
    b (v,) or None."""
    z = lax.dot_general(x, w, _Z_DIMS[layout], preferred_element_type=_F32)
    if b is not None:
        z = z + b.astype(_F32)[None, :]
    return softcap_logits(z, softcap)


def _varying_like(carry, *refs):
    """Loop carries typed as varying over the manual axes of the inputs (inside
    ``jax.shard_map`` with ``check_vma=True`` a carry's type must not change in the loop)."""
    axes = tuple(sorted(frozenset().union(*(varying(r) for r in refs if r is not None))))
    return tuple(to_varying(c, axes) for c in carry) if axes else carry


def _plan(x2d, vocab, budget):
    n, h = x2d.shape
    return xla_plan(n, vocab, h, jnp.dtype(x2d.dtype).itemsize, budget)


def forward(x2d, w, bias, target, *, softcap: Optional[float], need_smooth: bool, budget: Optional[int] = None,
            weight_layout: str = "vh", class_weight=None, need_argmax: bool = False, plan: Optional[XlaPlan] = None):
    """The interface's forward; ``weight_layout="hv"`` (an extension of this backend)
    takes w as (H, V) without a transposed copy; ``class_weight`` (V,): smooth_sum is
    sum_c w_c z_c; ``need_argmax``: also the row maximum and its first index (a strict
    ``>`` across column chunks keeps the earliest of equal maxima). ``plan``: the tiles
    (``XlaBackend.plan``'s); None: planned here from ``budget``."""
    n = x2d.shape[0]
    vaxis = _W_AXIS[weight_layout]
    vocab = w.shape[vaxis]
    plan = _plan(x2d, vocab, budget) if plan is None else plan
    target = target.astype(jnp.int32)

    def col_step(c0, vc, carry):
        wj = take(w, c0, vc, vaxis)
        bj = None if bias is None else take(bias, c0, vc)
        cwj = None if class_weight is None else take(class_weight, c0, vc).astype(_F32)
        cols = c0 + jnp.arange(vc, dtype=jnp.int32)

        def row_step(r0, nr, carry):
            lse, zt, ss, best, arg = carry
            z = _logits(take(x2d, r0, nr), wj, bj, softcap, weight_layout)
            m = jnp.max(z, axis=1)
            if best is not None:
                better = m > take(best, r0, nr)  # strict: an earlier chunk keeps a tie
                best = put(best, jnp.where(better, m, take(best, r0, nr)), r0)
                first = jnp.argmax(z, axis=1).astype(jnp.int32) + c0
                arg = put(arg, jnp.where(better, first, take(arg, r0, nr)), r0)
            m = jnp.where(m == -jnp.inf, 0.0, m)  # all -inf: lse -inf; +inf: NaN
            chunk_lse = m + jnp.log(jnp.sum(jnp.exp(z - m[:, None]), axis=1))
            hit = cols[None, :] == take(target, r0, nr)[:, None]
            lse = put(lse, jnp.logaddexp(take(lse, r0, nr), chunk_lse), r0)
            zt = put(zt, take(zt, r0, nr) + jnp.sum(jnp.where(hit, z, 0.0), axis=1), r0)
            if ss is not None:
                zw = z if cwj is None else z * cwj[None, :]
                ss = put(ss, take(ss, r0, nr) + jnp.sum(zw, axis=1), r0)
            return lse, zt, ss, best, arg

        return chunk_loop(n, plan.token_chunk, row_step, carry)

    init = (
        jnp.full((n,), -jnp.inf, _F32),
        jnp.zeros((n,), _F32),
        jnp.zeros((n,), _F32) if need_smooth else None,
        jnp.full((n,), -jnp.inf, _F32) if need_argmax else None,
        jnp.zeros((n,), jnp.int32) if need_argmax else None,
    )
    init = _varying_like(init, x2d, w, bias, target)
    out = chunk_loop(vocab, plan.vocab_chunk, col_step, init)
    return out if need_argmax else out[:3]


def backward(x2d, w, bias, target, lse, coef, *, softcap: Optional[float], budget: Optional[int] = None,
             weight_layout: str = "vh", class_weight=None, plan: Optional[XlaPlan] = None):
    """The interface's backward; dw has the layout of w; ``plan`` as for ``forward``."""
    n, h = x2d.shape
    vaxis = _W_AXIS[weight_layout]
    vocab = w.shape[vaxis]
    plan = _plan(x2d, vocab, budget) if plan is None else plan
    target = target.astype(jnp.int32)

    def col_step(c0, vc, carry):
        dx, dw, db = carry
        wj = take(w, c0, vc, vaxis)
        bj = None if bias is None else take(bias, c0, vc)
        cwj = None if class_weight is None else take(class_weight, c0, vc)

        def row_step(r0, nr, carry):
            dx, dwj, dbj = carry
            xr = take(x2d, r0, nr)
            z = _logits(xr, wj, bj, softcap, weight_layout)
            dz = dlogits(z, take(lse, r0, nr), take(coef, r0, nr, axis=1),
                         take(target, r0, nr), c0, softcap, cwj)
            dzl = dz.astype(x2d.dtype)
            dxr = lax.dot_general(dzl, wj, _DX_DIMS[weight_layout], preferred_element_type=_F32)
            dx = put(dx, take(dx, r0, nr) + dxr, r0)
            if weight_layout == "vh":
                dwj = dwj + lax.dot_general(dzl, xr, (((0,), (0,)), ((), ())), preferred_element_type=_F32)
            else:
                dwj = dwj + lax.dot_general(xr, dzl, (((0,), (0,)), ((), ())), preferred_element_type=_F32)
            if dbj is not None:
                dbj = dbj + jnp.sum(dz, axis=0)
            return dx, dwj, dbj

        dwj = jnp.zeros((vc, h) if weight_layout == "vh" else (h, vc), _F32)
        dbj = None if db is None else jnp.zeros((vc,), _F32)
        dwj, dbj = _varying_like((dwj, dbj), x2d, w, bias, target, lse, coef)
        dx, dwj, dbj = chunk_loop(n, plan.token_chunk, row_step, (dx, dwj, dbj))
        dw = put(dw, dwj.astype(w.dtype), c0, vaxis)
        if db is not None:
            db = put(db, dbj.astype(db.dtype), c0)
        return dx, dw, db

    init = (
        jnp.zeros((n, h), _F32),
        uninitialised(w.shape, w.dtype),  # every column chunk writes its part
        None if bias is None else jnp.zeros(bias.shape, bias.dtype),
    )
    init = _varying_like(init, x2d, w, bias, target, lse, coef)
    dx, dw, db = chunk_loop(vocab, plan.vocab_chunk, col_step, init)
    return dx.astype(x2d.dtype), dw, db


class XlaBackend(XlaBase):
    """The "xla" backend (``contract.LceBackend``; ``XlaBase``: every case, every platform;
    (H, V) weights in place, class weights and the argmax)."""

    class_weights = True
    argmax = True
    keeps = False

    def forward(self, x2d, w, bias, target, config: XlaConfig, *, softcap, need_smooth, class_weight=None,
                need_argmax=False) -> LceStats:
        return LceStats(*forward(x2d, w, bias, target, softcap=softcap, need_smooth=need_smooth,
                                 weight_layout=config.weight_layout, class_weight=class_weight,
                                 need_argmax=need_argmax, plan=config.plan))

    def backward(self, res: LceResiduals, coef, config: XlaConfig, *, softcap) -> LceGrads:
        return LceGrads(*backward(res.x2d, res.w, res.bias, res.target, res.lse, coef, softcap=softcap,
                                  weight_layout=config.weight_layout, class_weight=res.class_weight,
                                  plan=config.plan))
