"""Public API of linear_jsd for JAX: distillation between a student and a teacher LM head
from their hidden states and weights, without their logits (the twin of
``logitless.linear_jsd``; math in ``logitless/jax/formulas/jsd.py``).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax import sharding as shd
from logitless.jax.budget import resolve_memory_budget
from logitless.jax.formulas import jsd as jf
from logitless.jax.ops.common import reduction as red
from logitless.jax.ops.common.contract import w_axis
from logitless.jax.ops.common.validate import check_distill_target, check_head
from logitless.jax.ops.linear_jsd import sharded
from logitless.jax.ops.linear_jsd.backends import BACKENDS, choose_backend  # noqa: F401 (re-exported)
from logitless.jax.ops.linear_jsd.contract import JsdResiduals
from logitless.options import JSDOptions


class _Config(NamedTuple):
    """Static (hashable) arguments of the custom_vjp."""

    opts: JSDOptions
    reduction: str
    backend: str  # its name in BACKENDS
    budget: int
    num_classes: int  # global V
    weight_layout: str = "vh"
    token_axes: tuple = ()  # shard_map: mesh axes splitting the tokens
    vocab_axes: tuple = ()  # shard_map: mesh axes splitting the vocabulary
    partition: bool = False  # jit on several devices: custom_partitioning per device
    plan: Any = None  # the backend's RowsConfig (None when partitioned: made per device)

    def static(self) -> sharded.Static:
        return sharded.Static(self.backend, self.opts, self.budget, self.weight_layout)


def _forward(xs, ws, xt, wt, target, cfg: _Config, grad: bool):
    """(loss, stats, kept dz | None, count)."""
    opts = cfg.opts
    count = red.count(target, opts.ignore_index, cfg.token_axes)
    kept = None
    if cfg.partition:
        out = sharded.forward_fn(cfg.static())(xs, ws, xt, wt, target)
        stats = jf.JsdStats(*out, *([None] * (6 - len(out))))
    else:
        keep = grad and cfg.reduction != "none" and cfg.plan.grad.keep > 0
        g_unit = red.unit_gradient(target, opts.ignore_index, cfg.reduction, count) if keep else None
        if cfg.token_axes:
            xs, xt, target = (shd.to_varying(a, cfg.token_axes) for a in (xs, xt, target))
        out = sharded.local_forward(BACKENDS[cfg.backend], xs, ws, xt, wt, target, cfg.plan, opts=opts,
                                    vocab_axes=cfg.vocab_axes, g_unit=g_unit)
        stats, kept = out.stats, out.kept
    loss_tok = jf.token_loss(stats, target, cfg.num_classes, opts).astype(jnp.float32)
    return red.reduce(loss_tok, cfg.reduction, count, cfg.token_axes), stats, kept, count


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ljsd(xs, ws, xt, wt, target, cfg: _Config):
    return _forward(xs, ws, xt, wt, target, cfg, grad=False)[0]


def _ljsd_fwd(xs, ws, xt, wt, target, cfg):
    loss, stats, kept, count = _forward(xs, ws, xt, wt, target, cfg, grad=True)
    return loss, (JsdResiduals(xs, ws, xt, wt, target, stats, kept), count)


def _ljsd_bwd(cfg, saved, g_loss):
    res, count = saved
    g = red.upstream(g_loss, res.target, cfg.opts.ignore_index, cfg.reduction, count)
    if cfg.partition:
        k = 6 if cfg.opts.needs_lse1 else 4
        dx, dw = sharded.backward_fn(cfg.static())(res.xs, res.ws, res.xt, res.wt, res.target, g, *res.stats[:k])
    else:
        if cfg.token_axes:
            res = res._replace(xs=shd.to_varying(res.xs, cfg.token_axes))
        g_kept = jnp.asarray(g_loss, jnp.float32) if res.kept is not None else None
        dx, dw = sharded.local_backward(BACKENDS[cfg.backend], res, g, g_kept, cfg.plan, opts=cfg.opts,
                                        vocab_axes=cfg.vocab_axes)
    # The teacher is a constant: no cotangent (zeros where one is asked for).
    return shd.fit_cotangent(dx, res.xs), shd.fit_cotangent(dw, res.ws), None, None, None


_ljsd.defvjp(_ljsd_fwd, _ljsd_bwd)


def linear_jsd(
    student_x,
    student_weight,
    teacher_x,
    teacher_weight,
    target=None,
    *,
    beta: float = 0.5,
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
    """Distillation loss of a student and a teacher LM head, without their logits.

    The generalized Jensen-Shannon divergence of ``logitless.linear_jsd`` (PyTorch), on
    zs = student_x @ student_weight.T and zt = teacher_x @ teacher_weight.T: with p =
    softmax(zs / T) (student), q = softmax(zt / T) (teacher), m = beta q + (1 - beta) p,
    the per-token loss is beta KL(q || m) + (1 - beta) KL(p || m); beta = 0 is exactly
    the forward KL(q || p) and beta = 1 the reverse KL(p || q) (not limits of the
    mixture form); no T**2 factor; plus ``hard_label_weight`` times the student's
    cross-entropy at temperature 1 on ``target``. Logits and statistics are fp32 (fp64
    for fp64 inputs), gradients accumulate in fp32 and are cast once. Works under
    ``jax.jit`` (every keyword is static), ``jax.grad`` / ``value_and_grad`` (a
    ``jax.custom_vjp``) and ``jax.vmap``.

    The teacher is a constant: teacher_x and teacher_weight get no gradient (as under
    ``jax.lax.stop_gradient``; asked for, their gradient is zero), whether they come
    from a frozen teacher or not.

    Cost: the forward takes chunks of tokens with both heads' full rows (two GEMMs per
    chunk; the mixture's sums need both log-sum-exps first). When differentiated
    ("mean" or "sum"), it also computes the student's d(logits) of the leading columns
    that ``memory_budget`` holds (in x's dtype), so that the backward is two GEMMs on
    them (four GEMMs in all: the floor) and recomputes both heads' logits only for the
    other columns. Never a (tokens x vocab) array beyond the budget.

    Args:
        student_x: (..., H_s) hidden states, bfloat16/float16/float32 (float64 with x64).
        student_weight: (V, H_s) with ``weight_layout="vh"`` (torch ``nn.Linear``), or
            (H_s, V) with "hv" (a flax ``Dense`` kernel, read in place; its gradient
            comes back (H_s, V)); same dtype as student_x.
        teacher_x: (..., H_t), the same leading shape; teacher_weight: (V, H_t) or (H_t,
            V), the same layout; the same dtype as the student's. H_t may differ from H_s;
            the vocabularies must match.
        target: optional (...) integer labels: tokens equal to ``ignore_index`` count for
            nothing; the hard-label term uses them. None: every token counts
            (hard_label_weight must then be 0).
        beta: in [0, 1]. temperature: > 0, divides both heads' logits.
        ignore_index: the target value of tokens that count for nothing.
        reduction: "mean" (over counted tokens; NaN when none), "sum", or "none" (per
            token in target's shape, 0 at ignored tokens).
        hard_label_weight: >= 0, the weight of the student's cross-entropy on target.
        weight_layout: "vh" or "hv" (both heads).
        memory_budget: bytes of temporaries per device (None: 3% of a GPU's memory, at
            least 256 MiB; 256 MiB on a CPU or TPU; ``logitless.jax.default_memory_budget``).
            It holds a forward chunk's fp32 logits of both heads and, when differentiated,
            the kept d(logits) columns (``logitless.jax.planning.rows_plan``).
        implementation: None (automatic: "triton" on an NVIDIA GPU with jax-triton, else
            "xla"), "xla" (any platform) or "triton" (the PyTorch op's fused two-head
            kernel for the recomputed columns; Triton's interpreter on a CPU: tests).
            "mosaic_gpu" and "mosaic_tpu" raise ValueError: they have no kernel for it.
        vocab_axis_name: inside ``jax.shard_map``: the mesh axis (or axes) over which both
            weights are split along the vocabulary, in order (the same rows of both);
            the loss is the full vocabulary's, student_x gets its full gradient on every
            member, student_weight its own rows' (O(tokens) collectives per chunk).
        token_axis_name: inside ``jax.shard_map``: the axes over which the tokens are
            split; "mean" and "sum" then reduce over every device's tokens.
            Outside shard_map leave both None: under ``jax.jit`` with sharded inputs the
            op partitions itself per device (tokens, vocabulary or both).

    Returns:
        The fp32 loss (fp64 for fp64 inputs): a scalar, or per token for "none".

    Errors: wrong ranks, shapes or dtypes, mismatched vocabularies or leading shapes,
    options out of range, hard labels without a target, and a mosaic implementation raise
    ``ValueError``/``TypeError`` at trace time. With hard labels, a target outside [0, V)
    that is not ignore_index raises when the target is concrete on the CPU; traced (under
    jit) or on a GPU it is not checked (no host sync) and makes that token's loss NaN.
    Empty inputs: "mean" NaN with zero gradients, "sum" 0, "none" empty.
    """
    opts = JSDOptions.checked(beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction,
                              hard_label_weight=hard_label_weight)
    vocab_axes, token_axes = shd.manual_axes(vocab_axis_name, token_axis_name)
    budget = resolve_memory_budget(memory_budget)
    if implementation is not None:
        BACKENDS[implementation]  # an unknown name: ValueError naming the choices
    v_local, h_s = check_head("student_x", "student_weight", student_x, student_weight, weight_layout)
    v_teacher, _ = check_head("teacher_x", "teacher_weight", teacher_x, teacher_weight, weight_layout)
    if v_teacher != v_local:
        raise ValueError(f"vocabularies differ: student_weight has {v_local} classes, teacher_weight {v_teacher}; "
                         "distillation needs one vocabulary")
    if tuple(teacher_x.shape[:-1]) != tuple(student_x.shape[:-1]):
        raise ValueError(f"teacher_x has leading shape {tuple(teacher_x.shape[:-1])} but student_x has "
                         f"{tuple(student_x.shape[:-1])}; tokens must match")
    dtypes = {jnp.dtype(a.dtype).name for a in (student_x, student_weight, teacher_x, teacher_weight)}
    if len(dtypes) > 1:
        raise TypeError(f"student and teacher arrays must share one dtype, got {sorted(dtypes)}")
    if v_local == 0:
        raise ValueError("student_weight has no classes: the vocabulary is empty")
    num_classes = v_local * shd.axis_size(vocab_axes)
    lead = tuple(student_x.shape[:-1])
    if target is None:
        if opts.hard_label_weight != 0.0:
            raise ValueError("hard_label_weight > 0 needs a target (the hard labels)")
        target = jnp.zeros(lead, jnp.int32)
        opts = dataclasses.replace(opts, ignore_index=-1)  # no label: every token counts
    else:
        check_distill_target(target, lead, "student_x", hard=opts.hard_label_weight != 0.0, num_classes=num_classes,
                             ignore_index=opts.ignore_index)

    xs = jnp.reshape(student_x, (-1, h_s))
    xt = jnp.reshape(teacher_x, (-1, teacher_x.shape[-1]))
    flat = jnp.reshape(target, (-1,)).astype(jnp.int32)
    ws, wt = student_weight, lax.stop_gradient(teacher_weight)
    xt = lax.stop_gradient(xt)
    n = xs.shape[0]
    vaxis = w_axis(weight_layout)
    manual = bool(token_axes or vocab_axes)
    explicit = None if (manual or n == 0) else shd.explicit_axes(xs, ws, vaxis)
    if explicit is not None:
        kw = dict(beta=beta, temperature=temperature, ignore_index=opts.ignore_index, reduction=reduction,
                  hard_label_weight=hard_label_weight, weight_layout=weight_layout, memory_budget=budget,
                  implementation=implementation)
        loss = _explicit_call(*explicit, xs, ws, xt, wt, flat, vaxis=vaxis, none=reduction == "none", **kw)
    elif n == 0:
        loss = red.reduce(jnp.zeros((0,), jnp.float32), reduction, red.count(flat, opts.ignore_index, token_axes),
                          token_axes)
    else:
        name = choose_backend(implementation, xs.shape, (v_local, h_s), xs.dtype, None, False)
        impl = BACKENDS[name]
        partition = not manual and shd.use_partitioning() and impl.can_partition()
        plan = None if partition else impl.plan_call(tuple(xs.shape), (v_local, h_s), jnp.dtype(xs.dtype),
                                                      budget=budget, weight_layout=weight_layout)
        cfg = _Config(opts, reduction, name, budget, num_classes, weight_layout, token_axes, vocab_axes, partition,
                      plan)
        loss = _ljsd(xs, ws, xt, wt, flat, cfg)
    if reduction == "none":
        loss = jnp.reshape(loss, lead)
    return loss


def _explicit_call(mesh, axes: shd.Axes, xs, ws, xt, wt, target, *, vaxis: int, none: bool, **kw):
    """The op under ``jax.shard_map`` over an Explicit mesh (sharding in types): inputs
    resharded to (tokens, vocabulary) splits, the per-device call with the axis names."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tok = shd.spec_entry(axes.token)
    wspec = P(*shd.w_entries(axes, vaxis))
    specs = (P(tok, None), wspec, P(tok, None), wspec, P(tok))
    args = [jax.sharding.reshard(a, NamedSharding(mesh, s)) for a, s in zip((xs, ws, xt, wt, target), specs)]

    def local(xs, ws, xt, wt, target):
        return linear_jsd(xs, ws, xt, wt, target, token_axis_name=axes.token or None,
                          vocab_axis_name=axes.vocab or None, **kw)

    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(tok) if none else P())(*args)
