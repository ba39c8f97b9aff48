"""Sharded execution of the fused linear cross-entropy: every backend, per device.

Two entry points, one local computation:

* ``jax.jit`` with ``NamedSharding`` inputs (no user code change): the forward
  statistics and the backward are ``custom_partitioning`` functions. At SPMD
  partitioning time they see the operands' shardings and run the backend on each
  device's shard:
    - the mesh axes that split x's tokens (dim 0 of x2d, and of the target) are the
      *token axes*: every device computes its own tokens, per-token outputs stay
      sharded, nothing per-token is gathered;
    - the mesh axes that split the weight's vocabulary (and the bias) are the *vocab
      axes*: each device reduces its columns to partial statistics, merged with
      O(tokens) collectives (pmax + psum of exp for lse, psum for the target logit
      and the smoothing sum); in the backward dx is psummed over the vocab axes
      (O(tokens x H)), dW keeps its local rows;
    - dW and db are psummed over the token axes (the data-parallel gradient
      all-reduce, which a replicated weight needs anyway); where the weight itself is
      split along token axes (FSDP), dW is reduce-scattered back to that split;
    - the hidden dimension is never split: an H-sharded operand is resharded by XLA
      (requested as replicated along H); an axis on both x's tokens and W's
      vocabulary (FSDP-style) is kept on the tokens and W is gathered along it; a
      dimension that does not divide by its axes' sizes is requested replicated.
  Outside a multi-device jit (one device, ``vmap``) the same functions run as plain
  JAX (a ``custom_vmap`` rule maps the unpartitioned computation).
* inside ``jax.shard_map`` (the caller names the axes): ``vocab_axis_name`` /
  ``token_axis_name`` of the api call the same local computation directly.

Local computation (per device, shapes are per device; the backend plans its chunks
from them, so the memory budget is per device): with V_l local columns starting at
``off = V_l * index along the vocab axes``, the backend sees ``target - off`` (a
target outside [0, V_l) matches no local column; its local target logit is masked to
0), then
    lse = M + log psum_vocab exp(lse_l - M),  M = pmax_vocab lse_l
    z_t = psum_vocab z_t,l;   S = psum_vocab S_l
    dx  = psum_vocab dx_l;    dW_l, db_l = psum_token (local), in the weight's dtype.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax.ops.linear_cross_entropy import backends


class Axes(NamedTuple):
    """Mesh axis names (tuples of str) of the tokens and of the vocabulary."""

    token: tuple = ()
    vocab: tuple = ()


def as_axes(name) -> tuple:
    """None -> (); "a" -> ("a",); ("a", "b") -> ("a", "b")."""
    if name is None:
        return ()
    if isinstance(name, str):
        return (name,)
    if isinstance(name, (tuple, list)) and all(isinstance(a, str) for a in name):
        return tuple(name)
    raise TypeError(f"an axis name must be None, a str or a tuple of str, got {name!r}")


def check_bound(argname: str, axes: tuple) -> None:
    """ValueError naming the axis when it is not bound (not inside a shard_map over it)."""
    for a in axes:
        try:
            lax.axis_size(a)
        except NameError:
            raise ValueError(
                f"{argname}={a!r}: no mesh axis of that name is bound here; call the op inside "
                f"jax.shard_map over a mesh with an axis {a!r} (or leave {argname}=None)") from None


def varying(a) -> frozenset:
    """The manual mesh axes over which ``a`` varies (shard_map's check_vma types)."""
    aval = jax.typeof(a)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def to_varying(a, axes):
    """``a`` marked as varying over ``axes`` (no-op outside shard_map or if it already is)."""
    if a is None:
        return None
    missing = tuple(x for x in axes if x not in varying(a))
    return lax.pcast(a, missing, to="varying") if missing else a


def reduce_to(ct, primal_axes: frozenset):
    """Psum a cotangent over the axes along which it varies but its primal does not (the
    transpose of the implicit broadcast of an invariant input, as shard_map's autodiff
    does it)."""
    if ct is None:
        return None
    extra = tuple(sorted(varying(ct) - primal_axes))
    return lax.psum(ct, extra) if extra else ct


def axis_size(axes: tuple) -> int:
    return math.prod(lax.axis_size(a) for a in axes) if axes else 1


def _vocab_offset(axes: tuple, local_v: int):
    if not axes:
        return 0
    return lax.axis_index(axes) * local_v


def local_forward(module, x2d, w, bias, target, *, softcap, need_smooth, budget, layout_kw, vocab_axes):
    """Global statistics (lse, z_t, S|None) of this device's tokens; the local columns are
    reduced by ``module.forward`` and merged over ``vocab_axes`` (O(tokens) collectives)."""
    vaxis = 1 if dict(layout_kw).get("weight_layout") == "hv" else 0
    local_v = w.shape[vaxis]
    t = target
    if vocab_axes:
        t = target - _vocab_offset(vocab_axes, local_v).astype(target.dtype)
    lse, zt, ss = module.forward(x2d, w, bias, t, softcap=softcap, need_smooth=need_smooth, budget=budget,
                                 **dict(layout_kw))
    if not vocab_axes:
        return lse, zt, ss
    zt = jnp.where((t >= 0) & (t < local_v), zt, 0.0)
    m = lax.pmax(lse, vocab_axes)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = m + jnp.log(lax.psum(jnp.exp(lse - m), vocab_axes))
    zt = lax.psum(zt, vocab_axes)
    if ss is not None:
        ss = lax.psum(ss, vocab_axes)
    return lse, zt, ss


def local_backward(module, x2d, w, bias, target, lse, coef, *, softcap, budget, layout_kw, vocab_axes,
                   token_axes):
    """(dx, dW_l, db_l): dx summed over ``vocab_axes``, dW and db over ``token_axes``."""
    vaxis = 1 if dict(layout_kw).get("weight_layout") == "hv" else 0
    local_v = w.shape[vaxis]
    t = target
    if vocab_axes:
        t = target - _vocab_offset(vocab_axes, local_v).astype(target.dtype)
    dx, dw, db = module.backward(x2d, w, bias, t, lse, coef, softcap=softcap, budget=budget, **dict(layout_kw))
    if vocab_axes:
        dx = lax.psum(dx, vocab_axes)
    if token_axes:
        dw = lax.psum(dw, token_axes)
        if db is not None:
            db = lax.psum(db, token_axes)
    return dx, dw, db


# ------------------------------------------------------------------------------------
# jax.jit with sharded inputs: custom_partitioning
# ------------------------------------------------------------------------------------


def _spec_axes(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec_entry(axes: tuple):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _dim_axes(sharding, ndim: int, dim: int) -> tuple:
    spec = getattr(sharding, "spec", None)
    if spec is None or dim >= len(spec):
        return ()
    return _spec_axes(spec[dim])


def _mesh_size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes) if axes else 1


def _plan_axes(mesh, x_info, w_info, vaxis) -> Axes:
    """Token and vocab axes from the operands' shardings (see the module docstring)."""
    n = x_info.shape[0]
    v = w_info.shape[vaxis]
    tok = _dim_axes(x_info.sharding, 2, 0)
    voc = tuple(a for a in _dim_axes(w_info.sharding, 2, vaxis) if a not in tok)
    if n % _mesh_size(mesh, tok):
        tok = ()
    if v % _mesh_size(mesh, voc):
        voc = ()
    return Axes(tok, voc)


class _Static(NamedTuple):
    backend: str
    softcap: object
    need_smooth: bool
    budget: int
    layout_kw: tuple
    has_bias: bool


def _local_module(static: _Static, x_shape, w_shape, dtype):
    """The backend for these per-device shapes: the chosen one if it supports them, else xla."""
    module = backends.backend_module(static.backend)
    vh = w_shape if dict(static.layout_kw).get("weight_layout") != "hv" else w_shape[::-1]
    if backends._supported(module, tuple(x_shape), tuple(vh), dtype, static.softcap, static.has_bias):
        return module
    return backends.backend_module("xla")


def _named(mesh, *entries):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(*entries))


def _w_entries(axes: Axes, vaxis: int):
    e = [None, None]
    e[vaxis] = _spec_entry(axes.vocab)
    return e


@functools.cache
def forward_fn(static: _Static):
    """fn(x2d, w, [bias,] target) -> (lse, z_t[, S]) partitioned per device."""
    from jax.experimental.custom_partitioning import custom_partitioning

    vaxis = 1 if dict(static.layout_kw).get("weight_layout") == "hv" else 0
    w_rule = "g v" if vaxis else "v g"  # g: H of the weight, a factor of its own (never split)
    nout = 3 if static.need_smooth else 2

    def run(args, vocab_axes):
        if static.has_bias:
            x2d, w, bias, target = args
        else:
            (x2d, w, target), bias = args, None
        module = _local_module(static, x2d.shape, w.shape, x2d.dtype)
        out = local_forward(module, x2d, w, bias, target, softcap=static.softcap, need_smooth=static.need_smooth,
                            budget=static.budget, layout_kw=static.layout_kw, vocab_axes=vocab_axes)
        return tuple(out[:nout])

    def plain(*args):
        return run(args, ())

    fn = custom_partitioning(plain)

    def shardings(mesh, arg_infos):
        axes = _plan_axes(mesh, arg_infos[0], arg_infos[1], vaxis)
        tok = _spec_entry(axes.token)
        args = [_named(mesh, tok, None), _named(mesh, *_w_entries(axes, vaxis))]
        if static.has_bias:
            args.append(_named(mesh, _spec_entry(axes.vocab)))
        args.append(_named(mesh, tok))
        outs = tuple(_named(mesh, tok) for _ in range(nout))
        return axes, tuple(args), outs

    def partition(mesh, arg_infos, result_infos):
        axes, args, outs = shardings(mesh, arg_infos)
        return mesh, lambda *a: run(a, axes.vocab), outs, args

    def infer(mesh, arg_infos, result_infos):
        return shardings(mesh, arg_infos)[2]

    rule = ", ".join(["n h", w_rule] + (["v"] if static.has_bias else []) + ["n"]) + " -> " + ", ".join(["n"] * nout)
    fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return _with_vmap(fn, plain)


@functools.cache
def backward_fn(static: _Static):
    """fn(x2d, w, [bias,] target, lse, coef) -> (dx, dw[, db]) partitioned per device."""
    from jax.experimental.custom_partitioning import custom_partitioning

    vaxis = 1 if dict(static.layout_kw).get("weight_layout") == "hv" else 0
    w_rule = "g v" if vaxis else "v g"  # g: H of the weight, a factor of its own (never split)

    def run(args, axes: Axes, scatter=None):
        if static.has_bias:
            x2d, w, bias, target, lse, coef = args
        else:
            (x2d, w, target, lse, coef), bias = args, None
        module = _local_module(static, x2d.shape, w.shape, x2d.dtype)
        dx, dw, db = local_backward(module, x2d, w, bias, target, lse, coef, softcap=static.softcap,
                                    budget=static.budget, layout_kw=static.layout_kw, vocab_axes=axes.vocab,
                                    token_axes=())
        if axes.token:
            dim, sc = scatter or (0, ())
            rest = tuple(a for a in axes.token if a not in sc)
            if rest:
                dw = lax.psum(dw, rest)
            if sc:  # FSDP: each device keeps its slice of dW (a reduce-scatter, not an all-reduce)
                dw = lax.psum_scatter(dw, sc, scatter_dimension=dim, tiled=True)
            if db is not None:
                db = lax.psum(db, axes.token)
        return (dx, dw, db) if static.has_bias else (dx, dw)

    def plain(*args):
        return run(args, Axes())

    fn = custom_partitioning(plain)

    def shardings(mesh, arg_infos):
        axes = _plan_axes(mesh, arg_infos[0], arg_infos[1], vaxis)
        tok, voc = _spec_entry(axes.token), _spec_entry(axes.vocab)
        wsh = _named(mesh, *_w_entries(axes, vaxis))
        # dW keeps the weight's own split along token axes (FSDP: W is gathered for the
        # computation, its gradient reduce-scattered back): a dimension whose axes are
        # all token axes (the vocabulary only when no vocab axis splits it).
        scatter = None
        for dim in (vaxis, 1 - vaxis):
            orig = _dim_axes(arg_infos[1].sharding, 2, dim)
            if orig and all(a in axes.token for a in orig) and (dim != vaxis or not axes.vocab) \
                    and arg_infos[1].shape[dim] % _mesh_size(mesh, orig) == 0:
                scatter = (dim, orig)
                break
        dw_entries = _w_entries(axes, vaxis)
        if scatter is not None:
            dw_entries[scatter[0]] = _spec_entry(scatter[1])
        args = [_named(mesh, tok, None), wsh]
        outs = [_named(mesh, tok, None), _named(mesh, *dw_entries)]
        if static.has_bias:
            args.append(_named(mesh, voc))
            outs.append(_named(mesh, voc))
        args += [_named(mesh, tok), _named(mesh, tok), _named(mesh, None, tok)]
        return (axes, scatter), tuple(args), tuple(outs)

    def partition(mesh, arg_infos, result_infos):
        (axes, scatter), args, outs = shardings(mesh, arg_infos)
        return mesh, lambda *a: run(a, axes, scatter), outs, args

    def infer(mesh, arg_infos, result_infos):
        return shardings(mesh, arg_infos)[2]

    b = ["v"] if static.has_bias else []
    rule = ", ".join(["n h", w_rule] + b + ["n", "n", "k n"]) + " -> " + ", ".join(["n h", w_rule] + b)
    fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return _with_vmap(fn, plain)


def _with_vmap(fn, plain):
    """custom_partitioning has no batching rule: under vmap, map the plain computation."""
    from jax.custom_batching import custom_vmap

    @custom_vmap
    def wrapped(*args):
        return fn(*args)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        axes = tuple(0 if b else None for b in in_batched)
        out = jax.vmap(plain, in_axes=axes)(*args)
        return out, tuple(True for _ in out)

    return wrapped


def explicit_axes(x2d, w, vaxis: int):
    """(mesh, Axes) when x2d or w carries an explicit sharding type (a mesh with
    ``AxisType.Explicit`` axes) that splits the tokens or the vocabulary; else None."""
    sx, sw = jax.typeof(x2d).sharding, jax.typeof(w).sharding
    mesh = getattr(sx, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or not getattr(mesh, "explicit_axes", ()):
        return None
    tok = _spec_axes(sx.spec[0]) if len(sx.spec) > 0 else ()
    wspec = sw.spec if getattr(sw, "mesh", None) is not None else ()
    voc = tuple(a for a in (_spec_axes(wspec[vaxis]) if len(wspec) > vaxis else ()) if a not in tok)
    explicit = set(mesh.explicit_axes)
    tok = tuple(a for a in tok if a in explicit)
    voc = tuple(a for a in voc if a in explicit)
    if x2d.shape[0] % _mesh_size(mesh, tok):
        tok = ()
    if w.shape[vaxis] % _mesh_size(mesh, voc):
        voc = ()
    if not tok and not voc:
        hidden_split = any(e is not None for e in tuple(sx.spec) + tuple(wspec))
        return (mesh, Axes()) if hidden_split else None
    return mesh, Axes(tok, voc)


def explicit_call(op, mesh, axes: Axes, x2d, w, target, bias, *, vaxis: int, none: bool, **kw):
    """``op`` (the public function) under ``jax.shard_map`` over ``mesh``: inputs resharded
    to (tokens, vocab) splits (H never split), per-device call with the axis names."""
    from jax.sharding import PartitionSpec as P

    tok, voc = _spec_entry(axes.token), _spec_entry(axes.vocab)
    wspec = P(*_w_entries(axes, vaxis))
    specs = [P(tok, None), wspec, P(tok)] + ([] if bias is None else [P(voc)])
    args = [x2d, w, target] + ([] if bias is None else [bias])
    args = [jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, s)) for a, s in zip(args, specs)]

    def local(x2d, w, target, *b):
        loss, stats = op(x2d, w, target, b[0] if b else None, return_stats=True,
                         token_axis_name=axes.token or None, vocab_axis_name=axes.vocab or None, **kw)
        return loss, stats

    from logitless.jax.formulas import LossStats

    out_specs = (P(tok) if none else P(), LossStats(lse=P(tok), num_tokens=P()))
    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs)(*args)


def use_partitioning() -> bool:
    """Whether the jit path should go through custom_partitioning: several devices and
    not inside a shard_map whose axes are all manual (there the caller names the axes)."""
    if jax.device_count() <= 1:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    manual = getattr(mesh, "manual_axes", ())
    return not (manual and not mesh.empty and set(manual) == set(mesh.axis_names))
