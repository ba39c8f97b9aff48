"""Public API of linear_log_probs for JAX: per-token log-probabilities (and entropy) at a
temperature from the hidden states and the LM-head weight, without the logits. The
twin of ``logitless.linear_log_probs`` (PyTorch); math in
``logitless/jax/formulas/log_probs.py``, backend interface in this package's __init__.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from logitless.jax.budget import resolve_memory_budget
from logitless.jax.formulas import log_probs as lpf
from logitless.jax.formulas import truncation as _truncation
from logitless.jax.ops.common.contract import backend_weight, vh_shape
from logitless.jax.ops.common.validate import check_labels_in_range, check_linear_inputs
from logitless.jax.ops.linear_log_probs import sharded
from logitless.jax.ops.linear_log_probs.backends import BACKENDS, choose_backend  # noqa: F401 (re-exported)
from logitless.jax.ops.linear_log_probs.contract import LlpResiduals
from logitless.jax.sharding import fit_cotangent
from logitless.options import LogProbOptions


class _Config(NamedTuple):
    """Static (hashable) arguments of the custom_vjp."""

    opts: LogProbOptions
    backend: str  # its name in BACKENDS
    budget: int
    num_classes: int
    weight_layout: str = "vh"  # the weight's layout as the backend gets it ("hv": (H, V) natively)
    plan: Any = None  # the backend's Config for this call (None on the sharded paths: made per device)


def _outputs(x2d, w, bias, tokens, cfg: _Config):
    lse, at, ent = BACKENDS[cfg.backend].forward(x2d, w, bias, tokens, cfg.plan, opts=cfg.opts)
    logp, h = lpf.token_outputs(lse, at, ent, tokens, cfg.num_classes, cfg.opts)
    return (logp, h) if cfg.opts.entropy else (logp,), lse, h


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _llp(x2d, w, bias, tokens, cfg: _Config):
    return _outputs(x2d, w, bias, tokens, cfg)[0]


def _llp_fwd(x2d, w, bias, tokens, cfg):
    out, lse, h = _outputs(x2d, w, bias, tokens, cfg)
    return out, (LlpResiduals(x2d, w, bias, tokens, lse), h)


def _llp_bwd(cfg, saved, cotangents):
    res, h = saved
    x2d, w, bias, tokens, lse = res
    g_lp = cotangents[0]
    g_h = cotangents[1] if cfg.opts.entropy else None
    coef = lpf.grad_coefficients(h, tokens, g_lp, g_h, cfg.num_classes, cfg.opts, dtype=lse.dtype)
    dx, dw, db = BACKENDS[cfg.backend].backward(res, coef, cfg.plan, opts=cfg.opts)
    # (inside shard_map: dW and db of a weight invariant over the token axes are summed)
    return fit_cotangent(dx, x2d), fit_cotangent(dw, w), fit_cotangent(db, bias), None


_llp.defvjp(_llp_fwd, _llp_bwd)


def linear_log_probs(
    x,
    weight,
    tokens,
    bias=None,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    softcap: Optional[float] = None,
    ignore_index: int = -100,
    weight_layout: str = "vh",
    memory_budget: Optional[int] = None,
    implementation: Optional[str] = None,
    top_k=None,
    top_p=1.0,
    min_p=0.0,
    batch_invariant: bool = False,
):
    """log softmax(a)[token] per token, a = softcap(x @ weight.T + bias) / temperature,
    without the (tokens x vocab) logits; with ``entropy=True`` also the entropy of
    softmax(a). The JAX twin of ``logitless.linear_log_probs``.

    Equals ``jax.nn.log_softmax(z / T)[..., token]`` and ``-(p * log p).sum(-1)`` with z
    the fp32 logits (soft-capped first when ``softcap`` is set); the division by T is
    done on the fp32 logits, x / T is never rounded to x's dtype. Statistics are fp32
    (fp64 for fp64 inputs); gradients accumulate in the same and are cast once to the
    inputs' dtypes. Works under ``jax.jit`` (every keyword is static), ``jax.grad`` (a
    ``jax.custom_vjp``: gradients from both outputs, any upstream gradient, to x,
    weight and bias) and ``jax.vmap``.

    Memory traffic: the forward is one GEMM pass over the vocabulary that writes
    O(tokens) statistics ("triton": O(tokens x splits) fp32 partials, merged); the
    backward recomputes the logits chunk by chunk (3 GEMMs in all). Temporaries: one
    logits tile ("xla") or one dz chunk ("triton") sized from ``memory_budget``, plus
    an fp32 dx accumulator (tokens x H) and one fp32 dW chunk; never tokens x V.

    Args:
        x: (..., H) hidden states, bfloat16/float16/float32 (float64 with x64 enabled).
        weight: (V, H) LM-head weight (torch ``nn.Linear`` layout) with
            ``weight_layout="vh"``, or (H, V) with "hv" (a flax ``Dense`` kernel, read
            in place: no transposed copy; its gradient is (H, V)); same dtype as x.
        tokens: (...) integer token ids, the leading shape of x.
        bias: optional (V,), same dtype as weight.
        temperature: finite float > 0 (else ValueError).
        entropy: also return the entropy of softmax(a) per token.
        softcap: optional s > 0: logits become s * tanh(z / s) before the temperature.
        ignore_index: tokens equal to it give 0 for both outputs and no gradient.
        weight_layout: "vh" or "hv" (see weight).
        memory_budget: bytes of temporaries per device, as for ``linear_cross_entropy``
            (None: 3% of a GPU's total memory, at least 256 MiB; 256 MiB on a CPU or TPU).
        implementation: None (automatic, the policy of ``linear_cross_entropy``:
            "triton" on an NVIDIA GPU when the optional jax-triton package is
            installed, "mosaic_tpu" on a TPU, else "xla"), "xla" (plain JAX, any
            platform), "mosaic_tpu" (Pallas TPU kernels, bf16/f32; TPU interpret
            mode off a TPU, slow: tests only) or "triton" (the
            PyTorch op's Triton kernels through jax-triton, SM80+ GPUs, bf16/f16/f32;
            on a machine without GPU Triton's CPU interpreter, very slow: tests only;
            fp64 raises ValueError) or "mosaic_gpu" (Pallas Mosaic GPU kernels, SM90,
            by name only; bf16/f16 inputs only, else ValueError; bias, H % 64 != 0 or
            V % 8 != 0 (V % 64 != 0 for an (H, V) weight) cost a padded copy of the
            weight per call).
        top_k, top_p, min_p: the distribution vLLM samples from (min-p, then top-k,
            then top-p, renormalised; ``logitless.formulas.truncation``): Python numbers
            or per-token arrays (tokens' shape or (N,)); ``top_k`` 0/None, ``top_p`` 1,
            ``min_p`` 0 are off; out of range: ValueError (arrays: when concrete).
            log p is -inf outside the kept set (no gradient there); ``entropy`` is the
            truncated distribution's. "xla" backend only (another ``implementation``
            named: ValueError; automatic: "xla"). Under sharded jit per device as
            the plain op (tokens and/or vocabulary split; the vocabulary devices
            exchange (tokens x C) candidates and O(tokens) statistics, never the
            weight or x). Cost and method: ``jax/ops/linear_log_probs/truncation.py``.
        batch_invariant: per-token outputs bitwise the same whatever the batch (the
            forward's rows in fixed blocks of 1024, 64 on a CPU, the last padded; "xla"
            only; gradients deterministic, not invariant). Sharded: on a given mesh
            (vocabulary merges summed in device order); with only the tokens split,
            bitwise the unsharded call's.

    Returns:
        logp (fp32, tokens' shape), or ``(logp, entropy)`` with ``entropy=True``.

    Errors and special values: bad ranks, shapes, dtypes or options raise
    ``ValueError``/``TypeError`` naming the argument, at trace time. A token outside
    [0, V) that is not ``ignore_index`` raises ``ValueError`` when the tokens are
    concrete on the CPU (not a tracer: an eager call on a CPU, a numpy array, a
    constant closed over by a jitted function); traced tokens (an argument of
    ``jax.jit``) or tokens on a GPU (no host sync) are not checked: that token's
    outputs (and gradients) are NaN. Empty inputs give empty outputs.
    """
    opts = LogProbOptions.checked(temperature=temperature, entropy=entropy, softcap=softcap,
                                  ignore_index=ignore_index)
    budget = resolve_memory_budget(memory_budget)  # once per call (None: the device's default)
    if implementation is not None:
        BACKENDS[implementation]  # an unknown name: ValueError naming the choices
    _, num_classes, hidden = check_linear_inputs(x, weight, tokens, bias, labels_name="tokens",
                                                 weight_layout=weight_layout)
    check_labels_in_range(tokens, num_classes, opts.ignore_index, "tokens")

    out_shape = tuple(tokens.shape)
    trunc = _truncation.check(top_k, top_p, min_p, out_shape)
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    x2d = jnp.reshape(x, (-1, hidden))
    flat = jnp.reshape(tokens, (-1,)).astype(jnp.int32)
    if x2d.shape[0] == 0:
        empty = jnp.zeros(out_shape, lpf.compute_dtype(x.dtype))
        return (empty, empty) if opts.entropy else empty
    if trunc is not None or batch_invariant:
        if implementation not in (None, "xla"):
            raise ValueError(f"top_k/top_p/min_p and batch_invariant=True run on implementation='xla' only, got "
                             f"{implementation!r}: pass implementation='xla' (or None)")
        from logitless.jax.ops.linear_log_probs import truncation as _trunc_op

        cfg = _trunc_op.Config(opts, budget, num_classes, trunc[1] if trunc is not None else 0,
                               weight_layout=weight_layout)
        logp, ent = _trunc_op.linear_log_probs_truncated(x2d, weight, bias, flat,
                                                         trunc[0] if trunc is not None else None, cfg,
                                                         batch_invariant)
        logp, ent = jnp.reshape(logp, out_shape), jnp.reshape(ent, out_shape)
        return (logp, ent) if opts.entropy else logp
    vh = vh_shape(weight.shape, weight_layout)
    backend = choose_backend(implementation, x2d.shape, vh, x2d.dtype, opts.softcap, bias is not None)
    impl = BACKENDS[backend]
    weight, layout = backend_weight(impl, weight, weight_layout)
    cfg = _Config(opts, backend, budget, num_classes, layout)
    # Several devices (sharded jit, Explicit mesh): per device, see sharded.py.
    run = sharded.runner(x2d, weight, cfg)
    if run is None:  # one device: the call's one plan (the backward takes it too)
        run = _llp
        cfg = cfg._replace(plan=impl.plan(tuple(x2d.shape), vh, jnp.dtype(x2d.dtype), budget=budget,
                                          weight_layout=layout, has_bias=bias is not None))
    out = run(x2d, weight, bias, flat, cfg)
    out = tuple(jnp.reshape(o, out_shape) for o in out)
    return out if opts.entropy else out[0]
