"""Sharding machinery shared by the JAX ops (linear_cross_entropy, linear_log_probs):
how an op that reduces a (tokens x vocab) logits matrix runs per device.

Every op has one *local computation* per device on 2-D operands, built from its backend:

* ``x`` (N_l, H) hidden states, ``w`` (V_l, H) (or (H, V_l)) weight rows, ``b`` (V_l,)
  bias, ``n`` (N_l,) per-token arrays (targets, statistics), ``kn`` (k, N_l) per-token
  coefficient rows;
* the mesh axes that split the tokens (dim 0 of x) are the *token axes*: per-token work
  stays local, nothing per-token is gathered; the weight gradient is summed over them
  (the data-parallel all-reduce), or reduce-scattered back where the weight itself is
  split along a token axis (FSDP);
* the mesh axes that split the weight's vocabulary are the *vocab axes*: each device
  reduces its V_l columns (global classes ``[off, off + V_l)``, ``off = V_l * index``)
  to partial per-token statistics that are merged with O(tokens) collectives, one MAX
  and one packed SUM (:func:`vocab_merge`), and dx is summed over them (O(tokens x H));
* H is never split (an H-sharded operand is resharded by XLA); an axis on both the
  tokens and the vocabulary (FSDP) splits the vocabulary, x gathered along it, where x is
  the smaller to move (:func:`split_shared`: 3 N < 2 V), else stays on the tokens (W
  gathered along it, dW reduce-scattered back); a dimension that does not divide by its
  axes' sizes is computed replicated along them.

Two ways to get there without user code change, both built here:

* :func:`partitioned`: a ``custom_partitioning`` function for ``jax.jit`` with
  ``NamedSharding`` inputs on an Auto mesh (the shardings are known at SPMD partitioning
  time); :func:`use_partitioning` says when to take it;
* :func:`mapped`: the same local computation under ``jax.shard_map`` over an Explicit
  mesh (sharding in types, known at trace time; :func:`explicit_axes`).

Plus the helpers of the ops' own ``shard_map`` entry points (``vocab_axis_name``,
``token_axis_name``): :func:`manual_axes` (:func:`as_axes`, :func:`check_bound`), :func:`varying`,
:func:`to_varying`, :func:`reduce_to`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax


class Axes(NamedTuple):
    """Mesh axis names (tuples of str) of the tokens and of the vocabulary, and the
    mesh's number of devices (each holds 1/devices of a "slot" operand)."""

    token: tuple = ()
    vocab: tuple = ()
    devices: int = 1


# ------------------------------------------------------------------------------------
# axis names inside shard_map
# ------------------------------------------------------------------------------------


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


def manual_axes(vocab_axis_name, token_axis_name) -> tuple[tuple, tuple]:
    """(vocab axes, token axes) of an op's ``vocab_axis_name`` and ``token_axis_name``
    (``as_axes``), each bound (``check_bound``), sharing no axis (else ValueError)."""
    vocab_axes = as_axes(vocab_axis_name)
    token_axes = as_axes(token_axis_name)
    check_bound("vocab_axis_name", vocab_axes)
    check_bound("token_axis_name", token_axes)
    if set(vocab_axes) & set(token_axes):
        raise ValueError(f"vocab_axis_name {vocab_axis_name!r} and token_axis_name {token_axis_name!r} "
                         "must not share an axis")
    return vocab_axes, token_axes


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


def typed_like(*arrays):
    """(arrays, struct): the inputs (None passes) marked as varying over the union of
    their manual mesh axes (inside ``jax.shard_map`` with check_vma), and
    ``struct(shape, dtype)`` making output ShapeDtypeStructs typed the same: a
    ``pallas_call``'s outputs there must say over which axes they vary."""
    axes = tuple(sorted(frozenset().union(*(varying(a) for a in arrays if a is not None))))
    arrays = [to_varying(a, axes) if a is not None else None for a in arrays]
    mat = getattr(jax.typeof(arrays[0]), "manual_axis_type", None)

    def struct(shape, dtype):
        if mat is None:
            return jax.ShapeDtypeStruct(shape, dtype)
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)

    return arrays, struct


def reduce_to(ct, primal_axes: frozenset):
    """Psum a cotangent over the axes along which it varies but its primal does not (the
    transpose of the implicit broadcast of an invariant input, as shard_map's autodiff
    does it)."""
    if ct is None:
        return None
    extra = tuple(sorted(varying(ct) - primal_axes))
    return lax.psum(ct, extra) if extra else ct


def fit_cotangent(ct, primal):
    """A custom_vjp cotangent with its primal's varying-axes type (shard_map, check_vma):
    summed over the axes along which it varies but the primal does not, marked varying
    where the primal does."""
    if ct is None:
        return None
    ct = reduce_to(ct, varying(primal))
    return to_varying(ct, tuple(varying(primal)))


def axis_size(axes: tuple) -> int:
    return math.prod(lax.axis_size(a) for a in axes) if axes else 1


# ------------------------------------------------------------------------------------
# the local computation's collectives
# ------------------------------------------------------------------------------------


def vocab_offset(axes: tuple, local_v: int):
    """First global class of this device's columns (0 without vocab axes)."""
    if not axes:
        return 0
    return lax.axis_index(axes) * local_v


def local_targets(target, axes: tuple, local_v: int):
    """(target - off, in_range): global class ids as this device's column ids, and
    whether the class is one of its V_l columns."""
    if not axes:
        return target, None
    t = target - vocab_offset(axes, local_v).astype(target.dtype)
    return t, (t >= 0) & (t < local_v)


def sum_over(a, axes: tuple, ordered: bool = False):
    """``a`` summed over the mesh ``axes``: one ``psum``, or with ``ordered`` an all-gather
    and additions in device order (((a_0 + a_1) + a_2) + ...), so that each element's bits
    depend on the devices' values only, not on the message size or the collective's
    algorithm (batch invariance; the torch twin: ``distributed.merge.sum_in_rank_order``).
    Exact dtypes (integers) need no order: always one psum."""
    if not axes:
        return a
    if not ordered or not jnp.issubdtype(a.dtype, jnp.inexact):
        return lax.psum(a, axes)
    parts = lax.all_gather(a, axes)
    out = parts[0]
    for i in range(1, parts.shape[0]):
        out = out + parts[i]
    return out


def vocab_merge(lse_l, axes: tuple, parts: Callable[[jnp.ndarray], Sequence[jnp.ndarray]], ordered: bool = False):
    """Merge per-device log-sum-exps over the vocab axes with one MAX and one SUM.

    ``M = pmax(lse_l)`` (0 where it is not finite), ``d = lse_l - M``; ``parts(d)`` gives
    the per-token terms to sum over the axes (the first usually ``exp(d)``, so that the
    global lse is ``M + log(sum_0)``); they are stacked and summed by one ``psum`` of
    (k, N_l) (``ordered``: :func:`sum_over`'s fixed order). Returns (M, sums (k, N_l)).
    """
    m = lax.pmax(lse_l, axes)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return m, sum_over(jnp.stack(list(parts(lse_l - m))), axes, ordered)


def reduce_weight_grads(dw, db, token_axes: tuple, scatter=None):
    """dW and db summed over the token axes; ``scatter = (dim, axes)`` (FSDP: the weight
    is split along those token axes) reduce-scatters dW along ``dim`` over them instead."""
    if not token_axes:
        return dw, db
    dim, sc = scatter or (0, ())
    rest = tuple(a for a in token_axes if a not in sc)
    if rest:
        dw = lax.psum(dw, rest)
    if sc:  # FSDP: each device keeps its slice of dW (a reduce-scatter, not an all-reduce)
        dw = lax.psum_scatter(dw, sc, scatter_dimension=dim, tiled=True)
    if db is not None:
        db = lax.psum(db, token_axes)
    return dw, db


# ------------------------------------------------------------------------------------
# shardings of the operands
# ------------------------------------------------------------------------------------


def spec_axes(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: tuple):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def dim_axes(sharding, dim: int) -> tuple:
    spec = getattr(sharding, "spec", None)
    if spec is None or dim >= len(spec):
        return ()
    return spec_axes(spec[dim])


def mesh_size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes) if axes else 1


def split_shared(tok: tuple, voc: tuple, n: int, v: int) -> tuple[tuple, tuple]:
    """(token axes, vocab axes) of x's token axes ``tok`` and W's vocabulary axes ``voc``
    (FSDP: an axis on both): a shared axis splits the vocabulary, x gathered along it,
    where that moves less than gathering W, 3 N < 2 V (x's all-gather and dx's all-reduce,
    3 N H, against W's all-gather and dW's reduce-scatter, 2 V H; the device's memory: x
    and dx instead of all of W and dW); else it stays on the tokens (W gathered)."""
    shared = tuple(a for a in voc if a in tok)
    if shared and 3 * n < 2 * v:
        return tuple(a for a in tok if a not in shared), voc
    return tok, tuple(a for a in voc if a not in tok)


def plan_axes(mesh, x_info, w_info, vaxis: int) -> Axes:
    """Token and vocab axes from the operands' shardings (see the module docstring)."""
    n = x_info.shape[0]
    v = w_info.shape[vaxis]
    tok, voc = split_shared(dim_axes(x_info.sharding, 0), dim_axes(w_info.sharding, vaxis), n, v)
    if n % mesh_size(mesh, tok):
        tok = ()
    if v % mesh_size(mesh, voc):
        voc = ()
    return Axes(tok, voc, mesh_size(mesh, tuple(mesh.axis_names)))


def fsdp_scatter(mesh, w_info, axes: Axes, vaxis: int):
    """(dim, axes) when dW should keep the weight's own split along token axes (FSDP: W is
    gathered for the computation, its gradient reduce-scattered back): a dimension whose
    axes are all token axes (the vocabulary only when no vocab axis splits it); else None."""
    for dim in (vaxis, 1 - vaxis):
        orig = dim_axes(w_info.sharding, dim)
        if orig and all(a in axes.token for a in orig) and (dim != vaxis or not axes.vocab) \
                and w_info.shape[dim] % mesh_size(mesh, orig) == 0:
            return dim, orig
    return None


def named(mesh, *entries):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(*entries))


def w_entries(axes: Axes, vaxis: int):
    e = [None, None]
    e[vaxis] = spec_entry(axes.vocab)
    return e


#: Operand kinds of a local computation (module docstring) -> sharding_rule factors. A
#: kind "slot<i>" is an opaque per-device array (a backend's residual): its rows split
#: over every mesh axis, one block per device, whatever the tokens' and the vocabulary's
#: axes (factors of its own).
_RULE = {"x": "n h", "b": "v", "n": "n", "kn": "k n"}
#: A second head's hidden states and weight (linear_jsd's teacher: a hidden size of its
#: own, placed as "x" and "w"; "w2hv" an (H, V) one) and (tokens, K) per-token rows "nk".
_RULE.update({"x2": "n h2", "w2vh": "v g2", "w2hv": "g2 v", "nk": "n k2"})


def _rule_of(kind: str, vaxis: int) -> str:
    if kind == "w":
        return "g v" if vaxis else "v g"  # g: H of the weight, a factor of its own (never split)
    if kind.startswith("slot"):
        return f"{kind}r {kind}c"
    return _RULE[kind]


def _entries(kind: str, axes: Axes, vaxis: int, dw_entries=None, mesh_axes: tuple = ()) -> tuple:
    tok, voc = spec_entry(axes.token), spec_entry(axes.vocab)
    if kind.startswith("slot"):
        return (spec_entry(mesh_axes), None)
    if kind == "x":
        return (tok, None)
    if kind == "w":
        return tuple(dw_entries if dw_entries is not None else w_entries(axes, vaxis))
    if kind == "b":
        return (voc,)
    if kind == "n":
        return (tok,)
    if kind == "kn":
        return (None, tok)
    if kind in ("x2", "nk"):
        return (tok, None)
    if kind in ("w2vh", "w2hv"):
        return tuple(w_entries(axes, vaxis))
    raise ValueError(f"unknown operand kind {kind!r}")


def _dw_entries(axes: Axes, vaxis: int, scatter):
    e = w_entries(axes, vaxis)
    if scatter is not None:
        e[scatter[0]] = spec_entry(scatter[1])
    return e


# ------------------------------------------------------------------------------------
# jax.jit on an Auto mesh: custom_partitioning
# ------------------------------------------------------------------------------------


def partitioned(local: Callable, *, in_kinds: Sequence[str], out_kinds: Sequence[str], vaxis: int = 0):
    """``fn(*operands) -> tuple`` partitioned per device by ``custom_partitioning``.

    ``local(args, axes, scatter) -> tuple`` is the per-device computation on the
    operands (of ``in_kinds``, which name one "x" and one "w"), with ``axes`` the token
    and vocab axes and ``scatter`` the FSDP split of dW (:func:`fsdp_scatter`; only
    when ``out_kinds`` has a "w"); outside a multi-device jit it runs with ``Axes()``
    and ``None``. Operands and outputs are placed by kind (module docstring). Under
    ``vmap`` the plain computation is mapped.
    """
    from jax.experimental.custom_partitioning import custom_partitioning

    in_kinds, out_kinds = tuple(in_kinds), tuple(out_kinds)
    ix, iw = in_kinds.index("x"), in_kinds.index("w")

    def plain(*args):
        return tuple(local(args, Axes(), None))

    fn = custom_partitioning(plain)

    def shardings(mesh, arg_infos):
        axes = plan_axes(mesh, arg_infos[ix], arg_infos[iw], vaxis)
        scatter = fsdp_scatter(mesh, arg_infos[iw], axes, vaxis) if "w" in out_kinds else None
        every = tuple(mesh.axis_names)
        args = tuple(named(mesh, *_entries(k, axes, vaxis, mesh_axes=every)) for k in in_kinds)
        dwe = _dw_entries(axes, vaxis, scatter)
        outs = tuple(named(mesh, *_entries(k, axes, vaxis, dwe, mesh_axes=every)) for k in out_kinds)
        return (axes, scatter), args, outs

    def partition(mesh, arg_infos, result_infos):
        (axes, scatter), args, outs = shardings(mesh, arg_infos)
        return mesh, lambda *a: tuple(local(a, axes, scatter)), outs, args

    def infer(mesh, arg_infos, result_infos):
        return shardings(mesh, arg_infos)[2]

    rule = (", ".join(_rule_of(k, vaxis) for k in in_kinds) + " -> "
            + ", ".join(_rule_of(k, vaxis) for k in out_kinds))
    fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return with_vmap(fn, plain)


def with_vmap(fn, plain):
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


def use_partitioning() -> bool:
    """Whether the jit path should go through custom_partitioning: several devices and
    not inside a shard_map whose axes are all manual (there the caller names the axes)."""
    if jax.device_count() <= 1:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    manual = getattr(mesh, "manual_axes", ())
    return not (manual and not mesh.empty and set(manual) == set(mesh.axis_names))


# ------------------------------------------------------------------------------------
# Explicit meshes (sharding in types): shard_map
# ------------------------------------------------------------------------------------


def explicit_axes(x2d, w, vaxis: int):
    """(mesh, Axes) when x2d or w carries an explicit sharding type (a mesh with
    ``AxisType.Explicit`` axes) that splits the tokens or the vocabulary; else None
    ((mesh, Axes()) when only H is split: the op then runs replicated under shard_map)."""
    sx, sw = jax.typeof(x2d).sharding, jax.typeof(w).sharding
    mesh = getattr(sx, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or not getattr(mesh, "explicit_axes", ()):
        return None
    tok = spec_axes(sx.spec[0]) if len(sx.spec) > 0 else ()
    wspec = sw.spec if getattr(sw, "mesh", None) is not None else ()
    tok, voc = split_shared(tok, spec_axes(wspec[vaxis]) if len(wspec) > vaxis else (), x2d.shape[0],
                            w.shape[vaxis])
    explicit = set(mesh.explicit_axes)
    tok = tuple(a for a in tok if a in explicit)
    voc = tuple(a for a in voc if a in explicit)
    if x2d.shape[0] % mesh_size(mesh, tok):
        tok = ()
    if w.shape[vaxis] % mesh_size(mesh, voc):
        voc = ()
    if not tok and not voc:
        hidden_split = any(e is not None for e in tuple(sx.spec) + tuple(wspec))
        return (mesh, Axes()) if hidden_split else None
    return mesh, Axes(tok, voc)


def mapped(local: Callable, mesh, axes: Axes, *, in_kinds: Sequence[str], out_kinds: Sequence[str],
           vaxis: int = 0, scatter: Optional[tuple] = None):
    """``fn(*operands) -> tuple``: ``local(args, axes, scatter)`` under ``jax.shard_map``
    over ``mesh`` (``check_vma=False``: the local computation does its collectives
    itself); the operands are resharded to their kinds' splits first (H never split)."""
    from jax.sharding import PartitionSpec as P

    in_specs = tuple(P(*_entries(k, axes, vaxis)) for k in in_kinds)
    dwe = _dw_entries(axes, vaxis, scatter)
    out_specs = tuple(P(*_entries(k, axes, vaxis, dwe)) for k in out_kinds)

    def fn(*args):
        args = [jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
        body = lambda *a: tuple(local(a, axes, scatter))
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

    return fn
