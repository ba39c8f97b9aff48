"""Public API of the fused linear cross-entropy for JAX: the function, the tokamax
drop-in, the backend registry and the automatic choice.

The loss equals ``optax.softmax_cross_entropy_with_integer_labels(softcap(x @ w.T + b),
target)`` (with ignore_index, label smoothing and z-loss as the PyTorch op) without the
(tokens x vocab) logits ever being stored. The backend interface is described in
``logitless/jax/linear_cross_entropy/__init__.py``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax.budget import resolve_memory_budget
from logitless.jax.formulas import cross_entropy as lm
from logitless.jax.ops.common.contract import backend_weight
from logitless.jax.ops.common.validate import check_float, check_labels_in_range, check_linear_inputs
from logitless.jax.ops.linear_cross_entropy import sharded
from logitless.jax.ops.linear_cross_entropy.backends import BACKENDS, choose_backend  # noqa: F401 (re-exported)
from logitless.jax.ops.linear_cross_entropy.contract import LceResiduals
from logitless.jax.sharding import fit_cotangent
from logitless.options import CrossEntropyOptions


class _Config(NamedTuple):
    """Static (hashable) arguments of the custom_vjp."""

    opts: CrossEntropyOptions
    backend: str  # its name in BACKENDS
    budget: int
    num_classes: int  # global V (the local V times the vocab axes' size inside shard_map)
    weight_layout: str = "vh"  # the weight's layout as the backend gets it ("hv": (H, V) natively)
    token_axes: tuple = ()  # shard_map: mesh axes splitting the tokens (token_axis_name)
    vocab_axes: tuple = ()  # shard_map: mesh axes splitting the vocabulary (vocab_axis_name)
    partition: bool = False  # jit on several devices: custom_partitioning per device
    argmax: bool = False  # return_stats: the statistics also give each token's argmax
    plan: Any = None  # the backend's Config for this call (None when partitioned: made per device)
    slots: tuple = ()  # partitioned: the per-device residual slots (``sharded.kept_slots``)

    @property
    def manual(self) -> bool:
        return bool(self.token_axes or self.vocab_axes)

    def static(self, has_bias: bool, keep: bool = False) -> sharded._Static:
        """The partitioned path's static arguments; ``keep``: with the residual slots."""
        return sharded._Static(self.backend, self.opts.softcap, self.opts.needs_smooth_sum, self.budget,
                               self.weight_layout, has_bias, self.argmax, self.slots if keep else ())


def _total(a, cfg: _Config):
    """sum(a) over this call's tokens: all devices' along the token axes (shard_map)."""
    s = jnp.sum(a)
    return lax.psum(s, cfg.token_axes) if cfg.token_axes else s


def _denominator(target, class_weight, cfg: _Config):
    """"mean"'s divisor over all devices' tokens (the weighted count with class weights)."""
    valid = target != cfg.opts.ignore_index
    return _total(lm.target_weight(target, class_weight, valid), cfg)


def _stats(x2d, w, bias, target, class_weight, cfg: _Config, keep: bool = False):
    """(lse, z_t, S|None, argmax|None, kept|None) per token, on whichever path the config
    names (the argmax with ``cfg.argmax``: the first index of each row's maximum; kept:
    with ``keep``, what a backend with ``keeps`` kept for its backward)."""
    opts = cfg.opts
    backend = BACKENDS[cfg.backend]
    keep = keep and backend.keeps
    kept = None
    if cfg.manual:
        xv, tv = (sharded.to_varying(a, cfg.token_axes) for a in (x2d, target))
        out, kept = sharded.local_forward(backend, xv, w, bias, tv, cfg.plan, softcap=opts.softcap,
                                          need_smooth=opts.needs_smooth_sum, vocab_axes=cfg.vocab_axes,
                                          class_weight=class_weight, need_argmax=cfg.argmax, keep=keep)
    elif cfg.partition:
        static = cfg.static(bias is not None, keep)
        out = sharded.forward_fn(static)(*[a for a in (x2d, w, bias, target) if a is not None])
        if static.slots:
            out, kept = out[:-len(static.slots)], tuple(out[-len(static.slots):])
        if not opts.needs_smooth_sum:
            out = (out[0], out[1], None, *out[2:])
    else:
        st = backend.forward(x2d, w, bias, target, cfg.plan, softcap=opts.softcap, need_smooth=opts.needs_smooth_sum,
                             class_weight=class_weight, need_argmax=cfg.argmax, **({"keep": True} if keep else {}))
        out, kept = tuple(st[:5]), st.kept
    lse, zt, ss = out[:3]
    return lse, zt, ss, (out[4] if cfg.argmax else None), kept


def _stats_and_loss(x2d, w, bias, target, class_weight, cfg: _Config, keep: bool = False):
    """((loss, lse) and, with ``cfg.argmax``, the argmax (-1 at ignored tokens); what the
    backend kept for the backward, with ``keep``, else None)."""
    opts = cfg.opts
    lse, zt, ss, arg, kept = _stats(x2d, w, bias, target, class_weight, cfg, keep)
    loss_tok = lm.token_loss(lse, zt, ss, target, cfg.num_classes, opts, class_weight)
    extra = () if arg is None else (jnp.where(target != opts.ignore_index, arg.astype(jnp.int32), -1),)
    if not cfg.token_axes or opts.reduction == "none":
        return (lm.reduce_loss(loss_tok, target, opts, class_weight), lse, *extra), kept
    loss = _total(loss_tok, cfg)
    return ((loss / _denominator(target, class_weight, cfg) if opts.reduction == "mean" else loss), lse, *extra), kept


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _lce(x2d, w, bias, target, class_weight, cfg: _Config):
    # Without gradients: the statistics only (nothing kept).
    return _stats_and_loss(x2d, w, bias, target, class_weight, cfg)[0]


def _lce_fwd(x2d, w, bias, target, class_weight, cfg):
    # The backend may keep what its backward needs (e.g. exp(z - m) where the budget holds it).
    out, kept = _stats_and_loss(x2d, w, bias, target, class_weight, cfg, keep=True)
    return out, LceResiduals(x2d, w, bias, target, class_weight, out[1], kept)


def _lce_bwd(cfg, res: LceResiduals, cotangents):
    x2d, w, bias, target, class_weight, lse = res[:6]
    g_loss, g_lse = cotangents[:2]  # (the argmax, an integer output, has no cotangent to use)
    opts = cfg.opts
    if opts.reduction == "mean" and cfg.token_axes:
        g = jnp.broadcast_to(jnp.asarray(g_loss, jnp.float32) / _denominator(target, class_weight, cfg),
                             target.shape)
    else:
        g = lm.upstream_per_token(g_loss, target, opts, class_weight)
    coef = lm.grad_coefficients(lse, target, g, cfg.num_classes, opts, class_weight)
    if g_lse is not None and not isinstance(g_lse, jax.custom_derivatives.SymbolicZero):
        # stats.lse is differentiable: d lse / d z_c = p_c, the A term, at every token.
        coef = coef.at[0].add(jnp.asarray(g_lse, jnp.float32))
    backend = BACKENDS[cfg.backend]
    if cfg.manual:
        dx, dw, db = sharded.local_backward(
            backend, res._replace(x2d=sharded.to_varying(x2d, cfg.token_axes)), coef, cfg.plan,
            softcap=opts.softcap, vocab_axes=cfg.vocab_axes, token_axes=())
    elif cfg.partition:
        fn = sharded.backward_fn(cfg.static(bias is not None, keep=res.kept is not None))
        out = fn(*[a for a in (x2d, w, bias, target, lse, coef) if a is not None], *(res.kept or ()))
        dx, dw, db = out if len(out) == 3 else (*out, None)
    else:
        dx, dw, db = backend.backward(res, coef, cfg.plan, softcap=opts.softcap)
    # Inside shard_map (also without axis names): each cotangent typed as its primal.
    # class_weight receives no gradient (as torch's weight=).
    return (fit_cotangent(dx, x2d), fit_cotangent(dw, w), fit_cotangent(db, bias), None,
            None if class_weight is None else jnp.zeros_like(class_weight))


_lce.defvjp(_lce_fwd, _lce_bwd)


def linear_cross_entropy(
    x,
    weight,
    target,
    bias=None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight=None,
    softcap: Optional[float] = None,
    z_loss: float = 0.0,
    shift: bool = False,
    return_stats: bool = False,
    weight_layout: str = "vh",
    memory_budget: Optional[int] = None,
    implementation: Optional[str] = None,
    vocab_axis_name=None,
    token_axis_name=None,
):
    """Cross-entropy of ``x @ weight.T + bias`` against ``target``, without the logits.

    Equals ``optax.softmax_cross_entropy_with_integer_labels(logits, target)`` (and
    ``torch.nn.functional.cross_entropy`` with the same options, ``class_weight`` as
    its ``weight=``) with ``logits =
    softcap * tanh((x @ weight.T + bias) / softcap)`` when ``softcap`` is set, plus
    ``z_loss * lse**2`` per non-ignored token, reduced like the loss. Logits,
    log-sum-exp and softmax are fp32; gradients are accumulated in fp32 and cast once
    to the dtype of x, weight and bias. Works under ``jax.jit`` (every keyword is
    static), ``jax.grad``/``value_and_grad`` (gradients for x, weight, bias; a
    ``jax.custom_vjp``) and ``jax.vmap``.

    Args:
        x: (..., H) hidden states, bfloat16/float16/float32 (float64 with x64 enabled).
        weight: (V, H) with ``weight_layout="vh"`` (as a torch ``nn.Linear``), or (H, V)
            with "hv" (as a flax ``Dense`` kernel); same dtype as x.
        target: (...) integer class indices, the leading shape of x.
        bias: optional (V,), same dtype as weight.
        ignore_index: targets equal to it contribute no loss and no gradient.
        reduction: "mean" (over non-ignored tokens, weighted by class_weight as torch),
            "sum" or "none" (per-token loss in the shape of target, 0 at ignored tokens).
        label_smoothing: in [0, 1], as in ``torch.nn.functional.cross_entropy``.
        class_weight: optional (V,) float per-class weights w_c, as ``weight=`` of
            ``torch.nn.functional.cross_entropy``: a token's cross-entropy is scaled by
            w_t, label smoothing's term is (eps / V) sum_c w_c (lse - z_c), and "mean"
            divides by the sum of w_t over non-ignored tokens (the z-loss term, not
            weighted, by the same). Receives no gradient (a zero cotangent). Backends
            without class weights (mosaic_gpu) are skipped by the automatic choice
            (then "triton" where available, else "xla"); naming one explicitly raises.
        softcap: optional s > 0: logits become s * tanh(z / s) (Gemma 2).
        z_loss: coefficient of the z-loss term lse**2 (0 disables it).
        shift: causal-LM shift: position t of x (..., T, H) predicts target[..., t + 1];
            the last position predicts nothing (its target is replaced by
            ignore_index; x is not copied, only the small target). "none" and the
            stats then have T - 1 positions (none for T <= 1; "mean" is then NaN and
            "sum" 0, as torch).
        return_stats: also return ``LossStats(lse, num_tokens, argmax)``: the
            per-token log-sum-exp (fp32, shape of target; differentiable: d lse / d
            z_c = p_c), the number of non-ignored tokens and the per-token argmax of
            the logits (int32, first maximum on ties, -1 at ignored tokens), all from
            the one pass over the vocabulary. The backends that compute the argmax are
            "xla" and "triton": with return_stats the automatic choice skips
            "mosaic_gpu" and "mosaic_tpu"; named explicitly, they run and the argmax
            is None (their kernels keep no running argmax).
        weight_layout: "vh" or "hv" (see weight).
        memory_budget: bytes of temporary memory the op may use, per device. None (the
            default): 3% of a GPU's total memory (``memory_stats()["bytes_limit"]``, the
            memory JAX may use there; whole MiB, at least 256 MiB), 256 MiB on a CPU or
            TPU (``logitless.jax.budget``): resolved once per call, never from free
            memory. It sizes the chunks of the "xla" backend: one tile of logits of at
            most about budget / 16 elements, plus an fp32 dx accumulator (4 x tokens x H
            bytes) and one fp32 dW chunk; when even the smallest tile does not fit, the
            smallest is used. "mosaic_gpu" under ``jax.grad`` keeps exp(z - m) of as many
            columns as it holds (all: a 16-bit tokens x vocab array, when it fits; the
            backward is then two GEMMs), recomputing the rest.
        implementation: None (automatic: "mosaic_gpu" on an SM90 GPU when available
            and the case is supported; else "triton" on any NVIDIA GPU when the
            optional jax-triton package is installed; "mosaic_tpu" on a TPU; else
            "xla"), "xla", "mosaic_gpu", "triton" (Triton kernels, SM80+ GPUs; on a
            machine without GPU it runs on Triton's CPU interpreter, which is very
            slow: tests only) or "mosaic_tpu" (Pallas TPU kernels; TPU interpret mode
            off a TPU, slow: tests only).
        vocab_axis_name: inside ``jax.shard_map`` only: the mesh axis name (or tuple of
            names) over which ``weight`` (and ``bias``) is split along the vocabulary,
            in order (member i holds classes [i V_l, (i + 1) V_l)). The local call then
            computes the global loss and stats (O(tokens) collectives: pmax/psum of the
            per-token statistics) and the gradients: the full dx on every member of the
            axis (a psum of O(tokens x H)) and the local rows of dW. ``target`` holds
            global class indices. Not with ``class_weight`` (ValueError).
        token_axis_name: inside ``jax.shard_map`` only: the mesh axis name(s) over which
            the tokens are split. "sum" and "mean" then reduce over all devices' tokens
            (a psum of two scalars; "mean" divides by the global count) and
            ``stats.num_tokens`` is global. Gradients of operands that are replicated
            along an axis are summed along it (shard_map's ``check_vma`` typing).
            Outside shard_map leave both None: under ``jax.jit`` with sharded inputs
            (``NamedSharding``) the op partitions itself per device (tokens, vocabulary
            or both; see ``logitless/jax/ops/linear_cross_entropy/sharded.py``). An axis
            name that is not bound raises ``ValueError``.

    Returns:
        The fp32 loss (a scalar, or per-token for "none"), or ``(loss, stats)``.

    Errors and special values:
        Wrong ranks, shapes or dtypes, unknown options and options out of range raise
        ``ValueError``/``TypeError`` at trace time; a weight whose shape fits the other
        ``weight_layout`` (e.g. a flax (H, V) kernel passed as "vh") says so. A target
        outside [0, V) that is not ``ignore_index`` raises ``ValueError`` when the
        target is concrete on the CPU (not a tracer: an eager call on a CPU, a numpy
        array, a constant closed over by a jitted function); a traced target (an
        argument of ``jax.jit``, inside ``shard_map``) or one on a GPU (no host sync)
        is not checked: that token's loss (and gradients) is NaN, so the reduced loss
        is NaN. NaN or inf inputs
        give a NaN loss. Empty inputs and all-ignored batches behave as torch: "mean"
        is NaN with zero gradients, "sum" is 0.
    """
    opts = CrossEntropyOptions.checked(ignore_index=ignore_index, reduction=reduction,
                                       label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss)
    vocab_axes = sharded.as_axes(vocab_axis_name)
    token_axes = sharded.as_axes(token_axis_name)
    sharded.check_bound("vocab_axis_name", vocab_axes)
    sharded.check_bound("token_axis_name", token_axes)
    if set(vocab_axes) & set(token_axes):
        raise ValueError(f"vocab_axis_name {vocab_axis_name!r} and token_axis_name {token_axis_name!r} "
                         "must not share an axis")
    if vocab_axes and class_weight is not None:
        raise ValueError("class_weight is not supported with vocab_axis_name (a vocabulary split inside "
                         "shard_map); pass the whole weight or no class weights")
    budget = resolve_memory_budget(memory_budget)  # once per call (None: the device's default)
    local_classes, num_classes, hidden = check_linear_inputs(
        x, weight, target, bias, labels_name="target", weight_layout=weight_layout,
        vocab_shards=sharded.axis_size(vocab_axes))
    check_labels_in_range(target, num_classes, opts.ignore_index, "target")
    if class_weight is not None:
        check_float("class_weight", class_weight)
        if tuple(class_weight.shape) != (num_classes,):
            raise ValueError(f"class_weight must have shape ({num_classes},), got {tuple(class_weight.shape)}")
        class_weight = jax.lax.stop_gradient(jnp.asarray(class_weight, jnp.float32))
    if not isinstance(shift, bool):
        raise TypeError(f"shift must be a bool, got {type(shift).__name__}")
    if shift and x.ndim < 2:
        raise ValueError("shift=True needs x of shape (..., T, H) with a sequence dimension")

    out_shape = tuple(target.shape)
    if shift and target.shape[-1] > 0:
        # Target of position t is target[t + 1]; the last position is ignored. Only the
        # (small) target is copied, never x.
        pad = jnp.full(target.shape[:-1] + (1,), ignore_index, target.dtype)
        target = jnp.concatenate([target[..., 1:], pad], axis=-1)
    x2d = jnp.reshape(x, (-1, hidden))
    flat_target = jnp.reshape(target, (-1,)).astype(jnp.int32)
    n = x2d.shape[0]
    vaxis = 1 if weight_layout == "hv" else 0
    explicit = None if (token_axes or vocab_axes or n == 0) else sharded.explicit_axes(x2d, weight, vaxis)
    if explicit is not None and class_weight is not None:  # class weights: no vocabulary split
        explicit = (explicit[0], explicit[1]._replace(vocab=()))
    num_tokens = None
    if explicit is not None:
        # Explicit sharding types (jax.make_mesh's default): the same local call under
        # shard_map over the arrays' own mesh, axes named from their shardings.
        mesh, axes = explicit
        kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                  class_weight=class_weight, softcap=softcap, z_loss=z_loss, weight_layout=weight_layout,
                  memory_budget=budget, implementation=implementation)
        loss, stats = sharded.explicit_call(linear_cross_entropy, mesh, axes, x2d, weight, flat_target, bias,
                                            vaxis=vaxis, none=opts.reduction == "none", stats=return_stats, **kw)
        if stats is not None:
            lse, num_tokens, argmax = stats.lse, stats.num_tokens, stats.argmax
    elif n == 0:
        loss = jnp.zeros((0,), jnp.float32)
        lse = loss
        argmax = jnp.zeros((0,), jnp.int32)
        if token_axes and opts.reduction != "none":  # other devices may have tokens
            lss = lax.psum(jnp.sum(loss), token_axes)
            cnt = lax.psum(jnp.sum(flat_target != opts.ignore_index).astype(jnp.float32), token_axes)
            loss = lss / cnt if opts.reduction == "mean" else lss
        else:
            loss = lm.reduce_loss(loss, flat_target, opts)
    else:
        backend = choose_backend(implementation, x2d.shape, (local_classes, hidden), x2d.dtype,
                                 opts.softcap, bias is not None, class_weight is not None,
                                 need_argmax=return_stats and implementation is None)
        impl = BACKENDS[backend]
        w, layout = backend_weight(impl, weight, weight_layout)
        manual = bool(token_axes or vocab_axes)
        partition = (not manual and class_weight is None and sharded.use_partitioning() and impl.can_partition())
        # The call's one plan (the backward takes it too); per device when partitioned.
        plan = None if partition else impl.plan(tuple(x2d.shape), (local_classes, hidden), jnp.dtype(x2d.dtype),
                                                budget=budget, weight_layout=layout, has_bias=bias is not None)
        cfg = _Config(opts, backend, budget, num_classes, layout, token_axes, vocab_axes, partition=partition,
                      argmax=bool(return_stats) and impl.argmax, plan=plan)
        if partition and impl.keeps:  # what each device's forward may keep for its backward
            cfg = cfg._replace(slots=sharded.kept_slots(cfg.static(bias is not None), tuple(x2d.shape),
                                                        tuple(w.shape), jnp.dtype(x2d.dtype),
                                                        sharded.mesh_devices()))
        loss, lse, *argmax = _lce(x2d, w, bias, flat_target, class_weight, cfg)
        argmax = argmax[0] if argmax else None

    def per_token(t):
        if t is None:
            return None
        t = jnp.reshape(t, out_shape)
        return t[..., :-1] if shift else t

    if opts.reduction == "none":
        loss = per_token(loss)
    if not return_stats:
        return loss
    if num_tokens is None:
        num_tokens = jnp.sum(flat_target != opts.ignore_index).astype(jnp.int32)
        if token_axes:
            num_tokens = lax.psum(num_tokens, token_axes)
    # lse is differentiable (d lse / d z_c = p_c; the custom_vjp adds it to the A term).
    return loss, lm.LossStats(lse=per_token(lse), num_tokens=num_tokens, argmax=per_token(argmax))


def linear_softmax_cross_entropy_loss(
    x,
    labels,
    weights,
    *,
    reduction: str = "sum",
    precision=None,
    implementation: Optional[str] = None,
):
    """Drop-in for ``tokamax.linear_softmax_cross_entropy_loss``: x (B, H), labels
    (B,), weights (H, V); ``reduction`` "sum" (default), "mean" or "none".

    Same results as tokamax's "xla" implementation for labels in [0, V), but exact
    (fp32 logits and statistics also for bf16 inputs) and without the logits. Where
    tokamax is wrong we differ: a label outside [0, V) (e.g. -100 for padding) has
    zero loss *and* zero gradient (tokamax: zero loss, softmax gradient); "mean"
    divides by B, all tokens, as tokamax's ``jnp.mean``. ``precision`` must be None,
    as in tokamax 0.0.17 (NotImplementedError otherwise); fp32 inputs follow
    ``jax_default_matmul_precision``. ``implementation``: as in
    :func:`linear_cross_entropy` (tokamax's names "xla"/"chunked_xla" both mean our
    "xla" backend; "mosaic_tpu" is our Pallas TPU backend, TPU interpret mode off a
    TPU; tokamax's Triton backend is our "triton").
    """
    if precision is not None:
        raise NotImplementedError("Customization of precision is currently not supported (as in tokamax).")
    if implementation == "chunked_xla":
        implementation = "xla"
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"Unsupported reduction method: {reduction!r}")
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"x must be (B, H), got shape {getattr(x, 'shape', None)}")
    if getattr(labels, "ndim", None) != 1:
        raise ValueError(f"labels must be (B,), got shape {getattr(labels, 'shape', None)}")
    v = weights.shape[-1] if getattr(weights, "ndim", 0) == 2 else 0
    labels = jnp.asarray(labels)
    # Every label outside [0, V) is "ignored": map it to one ignore value that no
    # valid label can take.
    ignore = -1
    labels = jnp.where((labels >= 0) & (labels < v), labels, ignore)
    loss = linear_cross_entropy(
        x, weights, labels, ignore_index=ignore, reduction="sum" if reduction == "mean" else reduction,
        weight_layout="hv", implementation=implementation)
    if reduction == "mean":
        loss = loss / x.shape[0]
    return loss
