"""Public API of linear_topk_kl for JAX: KL divergence between a teacher's top-k
log-probabilities and the student's distribution, from the student's hidden states and
LM-head weight, without its logits (the twin of ``logitless.linear_topk_kl``; math in
``logitless/jax/formulas/topk_kl.py``).
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax import sharding as shd
from logitless.jax.budget import resolve_memory_budget
from logitless.jax.ops.common import reduction as red
from logitless.jax.ops.common.contract import w_axis
from logitless.jax.ops.common.validate import check_distill_target, check_head, check_teacher_top_k
from logitless.jax.ops.linear_topk_kl import sharded
from logitless.jax.ops.linear_topk_kl.backends import BACKENDS, choose_backend  # noqa: F401 (re-exported)
from logitless.jax.ops.linear_topk_kl.contract import TopKResiduals
from logitless.options import TopKKLOptions


class _Config(NamedTuple):
    """Static (hashable) arguments of the custom_vjp."""

    opts: TopKKLOptions
    backend: str  # its name in BACKENDS
    budget: int
    num_classes: int  # global V
    weight_layout: str = "vh"
    token_axes: tuple = ()  # shard_map: mesh axes splitting the tokens
    vocab_axes: tuple = ()  # shard_map: mesh axes splitting the vocabulary
    partition: bool = False  # jit on several devices: custom_partitioning per device
    plan: Any = None  # the backend's RowsConfig (None when partitioned: made per device)

    def static(self) -> sharded.Static:
        return sharded.Static(self.backend, self.opts, self.budget, self.weight_layout, self.num_classes)


def _forward(x2d, w, ids, lp, target, cfg: _Config, grad: bool):
    """(loss, TopKResiduals fields, count)."""
    opts = cfg.opts
    count = red.count(target, opts.ignore_index, cfg.token_axes)
    if cfg.partition:
        out = list(sharded.forward_fn(cfg.static(), grad)(x2d, w, ids, lp, target))
        loss_tok, lse_tail = out[:2]
        lse1 = out[2] if opts.hard_at_other_temperature else None
        coef, sparse = (out[-2], out[-1]) if grad else (None, None)
        kept = None
    else:
        keep = grad and opts.reduction != "none" and cfg.plan.grad.keep > 0
        g_unit = red.unit_gradient(target, opts.ignore_index, opts.reduction, count) if keep else None
        if cfg.token_axes:
            x2d, ids, lp, target = (shd.to_varying(a, cfg.token_axes) for a in (x2d, ids, lp, target))
        out = sharded.local_forward(BACKENDS[cfg.backend], x2d, w, ids, lp, target, cfg.plan, opts=opts,
                                    vocab_axes=cfg.vocab_axes, num_classes=cfg.num_classes, grad=grad,
                                    g_unit=g_unit)
        loss_tok, lse_tail, lse1, coef, sparse, kept = out
    loss = red.reduce(loss_tok, opts.reduction, count, cfg.token_axes)
    return loss, (lse_tail, lse1, coef, sparse, kept), count


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ltk(x2d, w, ids, lp, target, cfg: _Config):
    return _forward(x2d, w, ids, lp, target, cfg, grad=False)[0]


def _ltk_fwd(x2d, w, ids, lp, target, cfg):
    loss, saved, count = _forward(x2d, w, ids, lp, target, cfg, grad=True)
    return loss, (TopKResiduals(x2d, w, ids, target, *saved), count)


def _ltk_bwd(cfg, saved, g_loss):
    res, count = saved
    opts = cfg.opts
    g = red.upstream(g_loss, res.target, opts.ignore_index, opts.reduction, count)
    if cfg.partition:
        args = (res.x2d, res.w, res.ids, res.target, res.lse_tail, *([res.lse1] if res.lse1 is not None else []),
                res.coef, res.sparse, g)
        dx, dw = sharded.backward_fn(cfg.static())(*args)
    else:
        if cfg.token_axes:
            res = res._replace(x2d=shd.to_varying(res.x2d, cfg.token_axes))
        g_kept = jnp.asarray(g_loss, jnp.float32) if res.kept is not None else None
        dx, dw = sharded.local_backward(BACKENDS[cfg.backend], res, g, g_kept, cfg.plan, opts=opts,
                                        vocab_axes=cfg.vocab_axes)
    # The teacher's arrays are constants: no cotangent.
    return shd.fit_cotangent(dx, res.x2d), shd.fit_cotangent(dw, res.w), None, None, None


_ltk.defvjp(_ltk_fwd, _ltk_bwd)


def linear_topk_kl(
    hidden,
    weight,
    teacher_ids,
    teacher_log_probs,
    target=None,
    *,
    direction: str = "forward",
    tail: str = "bucket",
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    hard_label_weight: float = 0.0,
    weight_layout: str = "vh",
    memory_budget: Optional[int] = None,
    implementation: Optional[str] = None,
    vocab_axis_name=None,
    token_axis_name=None,
):
    """KL divergence between a teacher's top-k log-probabilities and the student's
    distribution, from the student's hidden states and LM-head weight, without its logits.

    The JAX twin of ``logitless.linear_topk_kl``. The student: log q =
    log_softmax(hidden @ weight.T / temperature) over the full vocabulary (fp32, never
    materialised). The teacher: per token K distinct ids and their log-probabilities lp
    under its full distribution (vLLM's ``prompt_logprobs=k``, an offline pass's saved
    top-k). With p_i = exp(lp_i), q_i the student's probability of id i, P = sum p_i,
    Q = sum q_i, the per-token loss is

        tail="none"         forward  sum p_i (lp_i - log q_i)     (verl's truncated form)
                            reverse  sum q_i (log q_i - lp_i)
        tail="renormalize"  the same over p_i / P and q_i / Q
        tail="bucket"       the same over K + 1 bins, the last one (1 - P, 1 - Q)

    (0 log 0 = 0), plus ``hard_label_weight`` times the student's cross-entropy at
    temperature 1 on ``target``. log(1 - Q) comes from the log-sum-exp of the student's
    logits outside the ids, computed in the same pass (the ids masked), never from 1 - Q:
    a top-k that holds nearly all of the student's mass stays exact. The per-token terms
    (O(tokens x K)) are computed in float64 when jax_enable_x64 is on, else in float32.
    Works under ``jax.jit`` (every keyword is static), ``jax.grad`` (a
    ``jax.custom_vjp``: gradients to hidden and weight; the teacher's arrays are
    constants) and ``jax.vmap``.

    Cost: the forward takes chunks of tokens with their full rows (one GEMM per chunk);
    when differentiated ("mean" or "sum") it also computes d(logits) of the leading
    columns that ``memory_budget`` holds (in x's dtype), so that the backward is two GEMMs
    on them (three GEMMs in all, the cross-entropy's floor) and recomputes the logits only
    for the other columns. Never a (tokens x vocab) array beyond the budget.

    Args:
        hidden: (..., H) the student's last hidden states, bfloat16/float16/float32
            (float64 with x64).
        weight: (V, H) with ``weight_layout="vh"``, or (H, V) with "hv" (a flax
            ``Dense`` kernel, read in place; its gradient comes back (H, V)); same dtype.
        teacher_ids: (..., K) integers, the teacher's top-k ids of each position,
            distinct per token, in [0, V); positions as ``hidden``'s. Any order.
        teacher_log_probs: (..., K) float, the teacher's log-probabilities of those ids
            (<= 0), same shape as teacher_ids.
        target: optional (...) integer ids: tokens whose target is ``ignore_index``
            count for nothing; with ``hard_label_weight`` the hard labels (then required).
        direction: "forward" (KL(teacher || student)) or "reverse" (KL(student || teacher)).
        tail: "bucket", "renormalize" or "none" (above).
        temperature: > 0: the student's logits are divided by it (the teacher's
            log-probs are taken as given).
        ignore_index: the target value of tokens that count for nothing.
        reduction: "mean" (over counted tokens; all without ``target``; NaN when none),
            "sum" or "none" (per token, target's shape, 0 at ignored tokens).
        hard_label_weight: >= 0, the weight of the cross-entropy (temperature 1) on target.
        weight_layout: "vh" or "hv" (see weight).
        memory_budget: bytes of temporaries per device (None: 3% of a GPU's memory, at
            least 256 MiB; 256 MiB on a CPU or TPU): a forward chunk's fp32 logits and,
            when differentiated, the kept d(logits) columns.
        implementation: None (automatic: "mosaic_gpu" on an SM90 GPU where it takes the
            case, else "xla"), "xla" (any platform) or "mosaic_gpu" (SM90, bf16/f16,
            H % 64 == 0, V % 8 == 0: its kernel recomputes the columns not kept; Mosaic
            GPU's interpret mode without a GPU: tests). "triton" and "mosaic_tpu" raise
            ValueError (no kernel for it).
        vocab_axis_name: inside ``jax.shard_map``: the mesh axis (or axes) over which
            ``weight`` is split along the vocabulary, in order (the teacher's ids and
            the target stay global); the loss is the full vocabulary's, hidden gets its
            full gradient on every member, weight its own rows'.
        token_axis_name: inside ``jax.shard_map``: the axes over which the tokens are
            split; "mean" and "sum" then reduce over every device's tokens. Outside
            shard_map leave both None: under ``jax.jit`` with sharded inputs the op
            partitions itself per device (tokens, vocabulary or both).

    Returns:
        The loss (fp32): a scalar, or per token for "none".

    Errors and special values: bad shapes, dtypes or options raise ``ValueError`` /
    ``TypeError`` naming the argument (an unknown direction or tail names the choices;
    ids and log-probs of different shapes; K > V). When the teacher's arrays are concrete
    CPU values (eager calls on a CPU, numpy arrays), an id outside [0, V) or repeated
    within a token and a log-probability > 0 (logits passed by mistake?) raise
    ``ValueError``, and so does, with hard labels, a target outside [0, V). Under
    ``jax.jit`` or on a GPU nothing is read (a host sync): an id outside [0, V) makes
    that token's loss and gradient NaN, a repeated id counts twice, P > 1 (rounding)
    counts as an empty tail bin. Empty inputs: "mean" NaN, "sum" 0, "none" empty.
    """
    opts = TopKKLOptions.checked(direction=direction, tail=tail, temperature=temperature, ignore_index=ignore_index,
                                 reduction=reduction, hard_label_weight=hard_label_weight)
    vocab_axes, token_axes = shd.manual_axes(vocab_axis_name, token_axis_name)
    budget = resolve_memory_budget(memory_budget)
    if implementation is not None:
        BACKENDS[implementation]  # an unknown name: ValueError naming the choices
    v_local, h = check_head("hidden", "weight", hidden, weight, weight_layout)
    if v_local == 0:
        raise ValueError("weight has no classes: the vocabulary is empty")
    num_classes = v_local * shd.axis_size(vocab_axes)
    lead = tuple(hidden.shape[:-1])
    k = _check_teacher(teacher_ids, teacher_log_probs, lead, num_classes)
    check_teacher_top_k(teacher_ids, teacher_log_probs, num_classes)
    if target is None:
        if opts.hard:
            raise ValueError("hard_label_weight > 0 needs target (the hard labels)")
        # every token counts (a class other than ignore_index; read only as a mask)
        target = jnp.full(lead, 1 if ignore_index == 0 else 0, jnp.int32)
    else:
        check_distill_target(target, lead, "hidden", hard=opts.hard, num_classes=num_classes,
                             ignore_index=opts.ignore_index)

    x2d = jnp.reshape(hidden, (-1, h))
    ids = lax.stop_gradient(jnp.reshape(teacher_ids, (-1, k)).astype(jnp.int32))
    lp = lax.stop_gradient(jnp.reshape(teacher_log_probs, (-1, k)))
    flat = jnp.reshape(target, (-1,)).astype(jnp.int32)
    n = x2d.shape[0]
    vaxis = w_axis(weight_layout)
    manual = bool(token_axes or vocab_axes)
    explicit = None if (manual or n == 0) else shd.explicit_axes(x2d, weight, vaxis)
    if explicit is not None:
        kw = dict(direction=direction, tail=tail, temperature=temperature, ignore_index=ignore_index,
                  reduction=reduction, hard_label_weight=hard_label_weight, weight_layout=weight_layout,
                  memory_budget=budget, implementation=implementation)
        loss = _explicit_call(*explicit, x2d, weight, ids, lp, flat, vaxis=vaxis, none=reduction == "none", **kw)
    elif n == 0:
        loss = red.reduce(jnp.zeros((0,), jnp.float32), reduction, red.count(flat, opts.ignore_index, token_axes),
                          token_axes)
    else:
        name = choose_backend(implementation, x2d.shape, (v_local, h), x2d.dtype, None, False)
        impl = BACKENDS[name]
        partition = not manual and shd.use_partitioning() and impl.can_partition()
        plan = None if partition else impl.plan_call(tuple(x2d.shape), (v_local, h), jnp.dtype(x2d.dtype),
                                                      budget=budget, weight_layout=weight_layout)
        cfg = _Config(opts, name, budget, num_classes, weight_layout, token_axes, vocab_axes, partition, plan)
        loss = _ltk(x2d, weight, ids, lp, flat, cfg)
    if reduction == "none":
        loss = jnp.reshape(loss, lead)
    return loss


def _check_teacher(ids, lp, lead: tuple, num_classes: int) -> int:
    """K, or a clear error for the teacher's arrays (shapes and dtypes)."""
    if not hasattr(ids, "dtype") or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"teacher_ids must be an integer array, got {getattr(ids, 'dtype', type(ids).__name__)}")
    if not hasattr(lp, "dtype") or not jnp.issubdtype(lp.dtype, jnp.floating):
        raise TypeError(f"teacher_log_probs must be a float array, got {getattr(lp, 'dtype', type(lp).__name__)}")
    if len(ids.shape) != len(lead) + 1 or tuple(ids.shape[:-1]) != lead:
        raise ValueError(f"teacher_ids has shape {tuple(ids.shape)}, expected {(*lead, 'K')} (the leading "
                         "dimensions of hidden, then the teacher's K ids)")
    if tuple(lp.shape) != tuple(ids.shape):
        raise ValueError(f"teacher_log_probs has shape {tuple(lp.shape)} but teacher_ids has {tuple(ids.shape)}: "
                         "one log-probability per id")
    k = ids.shape[-1]
    if k == 0:
        raise ValueError("teacher_ids has no ids (K = 0): pass the teacher's top-k, K >= 1")
    if k > num_classes:
        raise ValueError(f"teacher_ids has {k} ids per token but the vocabulary has {num_classes} classes: the ids "
                         "of a token must be distinct")
    return k


def _explicit_call(mesh, axes: shd.Axes, x2d, w, ids, lp, target, *, vaxis: int, none: bool, **kw):
    """The op under ``jax.shard_map`` over an Explicit mesh (sharding in types): inputs
    resharded to (tokens, vocabulary) splits, the per-device call with the axis names."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tok = shd.spec_entry(axes.token)
    specs = (P(tok, None), P(*shd.w_entries(axes, vaxis)), P(tok, None), P(tok, None), P(tok))
    args = [jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip((x2d, w, ids, lp, target), specs)]

    def local(x2d, w, ids, lp, target):
        return linear_topk_kl(x2d, w, ids, lp, target, token_axis_name=axes.token or None,
                              vocab_axis_name=axes.vocab or None, **kw)

    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(tok) if none else P())(*args)
