"""Sharded execution of the fused linear cross-entropy: every backend, per device.

The machinery (axes from shardings, ``custom_partitioning`` / ``shard_map`` wrappers, the
one-MAX-one-SUM vocabulary merge, the dW reduction) is ``logitless/jax/sharding.py``,
shared with ``linear_log_probs``; this module is the cross-entropy's local computation.

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
      vocabulary (FSDP-style) splits the vocabulary, x gathered along it, where x is the
      smaller to move (``sharding.split_shared``), else the tokens, W gathered; a
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
    z_t = psum_vocab z_t,l;   S = psum_vocab S_l   (one packed psum of [e^(lse_l - M), z_t,l, S_l])
    dx  = psum_vocab dx_l;    dW_l, db_l = psum_token (local), in the weight's dtype.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax.ops.common.contract import local_backend, vh_shape, w_axis
from logitless.jax.ops.linear_cross_entropy import backends
from logitless.jax.ops.linear_cross_entropy.contract import LceResiduals
from logitless.jax.sharding import (  # noqa: F401 (re-exported: the backends and the api use them)
    Axes,
    as_axes,
    axis_size,
    check_bound,
    explicit_axes,
    local_targets,
    partitioned,
    reduce_to,
    reduce_weight_grads,
    spec_entry,
    to_varying,
    use_partitioning,
    varying,
    vocab_merge,
    vocab_offset,
    w_entries,
)


def local_forward(backend, x2d, w, bias, target, config, *, softcap, need_smooth, vocab_axes, class_weight=None,
                  need_argmax=False, keep=None):
    """Global statistics (lse, z_t, S|None) of this device's tokens, and with
    ``need_argmax`` (row maximum, first index of it) as well; the local columns are
    reduced by ``backend.forward`` under ``config`` (its Config for these shapes) and
    merged over ``vocab_axes`` (O(tokens) collectives; the argmax: one more MAX and a MIN
    over the devices holding the maximum). ``keep`` not None: returns (statistics, what
    the backend kept of its local columns for ``local_backward``, or None), ``keep=True``
    passed to backends with ``keeps``."""
    vaxis = w_axis(config.weight_layout)
    t, in_range = local_targets(target, vocab_axes, w.shape[vaxis])
    st = backend.forward(x2d, w, bias, t, config, softcap=softcap, need_smooth=need_smooth,
                         class_weight=class_weight, need_argmax=need_argmax,
                         **({"keep": True} if keep and backend.keeps else {}))
    out = _merged(st, in_range, vocab_axes, need_argmax, w.shape[vaxis])
    return out if keep is None else (out, st.kept)


def _merged(st, in_range, vocab_axes, need_argmax, local_v):
    """``local_forward``'s statistics of the backend's local ``st`` (merged over the vocab axes)."""
    lse, zt, ss = st.lse, st.target_logit, st.smooth_sum
    arg = (st.best, st.argmax) if need_argmax else ()
    if not vocab_axes:
        return (lse, zt, ss, *arg)
    zt = jnp.where(in_range, zt, 0.0)
    # one MAX and one packed SUM: [exp(lse_l - M), z_t,l (, S_l)]
    m, sums = vocab_merge(lse, vocab_axes, lambda d: [jnp.exp(d), zt] + ([] if ss is None else [ss]))
    out = (m + jnp.log(sums[0]), sums[1], (None if ss is None else sums[2]))
    if need_argmax:  # the first device (lowest column ids) holding the largest maximum
        best, idx = arg
        idx = idx + vocab_offset(vocab_axes, local_v).astype(idx.dtype)
        top = lax.pmax(best, vocab_axes)
        idx = lax.pmin(jnp.where(best == top, idx, jnp.iinfo(idx.dtype).max), vocab_axes)
        out = out + (top, idx)
    return out


def local_backward(backend, res: LceResiduals, coef, config, *, softcap, vocab_axes, token_axes):
    """(dx, dW_l, db_l) by ``backend.backward`` under the forward's ``config``: dx summed
    over ``vocab_axes``, dW and db over ``token_axes``; ``res.target`` holds global ids."""
    t, _ = local_targets(res.target, vocab_axes, res.w.shape[w_axis(config.weight_layout)])
    dx, dw, db = backend.backward(res._replace(target=t), coef, config, softcap=softcap)
    if vocab_axes:
        dx = lax.psum(dx, vocab_axes)
    dw, db = reduce_weight_grads(dw, db, token_axes)
    return dx, dw, db


# ------------------------------------------------------------------------------------
# jax.jit with sharded inputs: custom_partitioning
# ------------------------------------------------------------------------------------


class _Static(NamedTuple):
    backend: str
    softcap: object
    need_smooth: bool
    budget: int
    weight_layout: str
    has_bias: bool
    need_argmax: bool = False
    #: The per-device residual slots' global types, ((rows, columns), dtype name) each:
    #: what the backend's forward keeps for its backward, one block of rows per device
    #: (``kept_slots``); () keeps nothing.
    slots: tuple = ()


def _kept_types(static: _Static, backend, config, x_shape, w_shape, dtype):
    """The types of what ``backend.forward(keep=True)`` keeps at these per-device shapes
    (``jax.eval_shape``: nothing runs), or None (it keeps nothing there)."""
    if not backend.keeps or static.has_bias:
        return None
    sds = jax.ShapeDtypeStruct
    kept = jax.eval_shape(
        lambda x, w, t: backend.forward(x, w, None, t, config, softcap=static.softcap, need_smooth=static.need_smooth,
                                        keep=True).kept,
        sds(tuple(x_shape), dtype), sds(tuple(w_shape), dtype), sds((x_shape[0],), jnp.int32))
    return tuple(kept) if kept else None


def _sizes(kept) -> tuple:
    """((elements, dtype name), ...) of kept arrays or slot blocks (what must match)."""
    return tuple((math.prod(a.shape), jnp.dtype(a.dtype).name) for a in kept)


def _fitted(static: _Static, x_shape, w_shape, dtype, sizes: tuple):
    """(backend, Config, kept types or None) for these per-device shapes: the backend's own
    plan where what it keeps has ``sizes`` (``_sizes``), else its plan refitted to them
    (``refit_kept``: within the budget); kept None where neither keeps exactly that."""
    backend, config = _local_backend(static, x_shape, w_shape, dtype)
    kept = _kept_types(static, backend, config, x_shape, w_shape, dtype)
    if kept is not None and _sizes(kept) == sizes:
        return backend, config, kept
    if not backend.keeps or static.has_bias:
        return backend, config, None
    refit = backend.refit_kept(config, tuple(x_shape), vh_shape(w_shape, static.weight_layout), jnp.dtype(dtype),
                               budget=static.budget, sizes=tuple(e for e, _ in sizes))
    kept = None if refit is None else _kept_types(static, backend, refit, x_shape, w_shape, dtype)
    if kept is None or _sizes(kept) != sizes:
        return backend, config, None
    return backend, refit, kept


def kept_slots(static: _Static, x_shape, w_shape, dtype, devices: int) -> tuple:
    """``_Static.slots`` of a sharded jit over ``devices`` devices: what the backend keeps
    for an even share of the problem, each array as (devices x rows, columns), one block
    per device. The shares: N / devices tokens and the whole vocabulary (a token split),
    and N tokens and V / devices columns (a vocabulary split, where V divides); the same
    elements per device, but where the budget holds only part of them each plans its own
    part (mosaic_gpu: other columns, other chunks). The slots take the larger of the two
    that both can keep (``_fitted``: the other split's plan refitted to those sizes, within
    its budget), else the token split's (the common case: data parallel, FSDP; a
    vocabulary split then recomputes). () when the tokens do not divide or the token split
    keeps nothing. A device whose arrays do not fit the slots (a split over fewer devices,
    ragged tiles) keeps nothing (``_local_kept``): the slots are then unused, within the
    same memory."""
    n, h = x_shape
    if devices < 2 or n % devices:
        return ()
    shares = [((n // devices, h), tuple(w_shape))]
    vaxis = 1 if static.weight_layout == "hv" else 0
    if w_shape[vaxis] % devices == 0:
        shares.append(((n, h), tuple(d // devices if i == vaxis else d for i, d in enumerate(w_shape))))
    own = [_kept_types(static, *_local_backend(static, xs, ws, dtype), xs, ws, dtype) for xs, ws in shares]
    if own[0] is None:
        return ()
    bytes_of = lambda kept: sum(e * jnp.dtype(dt).itemsize for e, dt in _sizes(kept))
    common = [k for k in sorted((k for k in own if k is not None), key=bytes_of, reverse=True)
              if all(_fitted(static, xs, ws, dtype, _sizes(k))[2] is not None for xs, ws in shares)]
    kept = common[0] if common else own[0]
    return tuple(((devices * a.shape[0], math.prod(a.shape[1:])), jnp.dtype(a.dtype).name) for a in kept)


def _warn_unused_slots(static: _Static, axes: Axes) -> None:
    import warnings

    per_device = sum(r * c * jnp.dtype(dt).itemsize for (r, c), dt in static.slots) // axes.devices
    warnings.warn(
        f"logitless.jax.linear_cross_entropy: the tokens and the vocabulary are split over fewer than the mesh's "
        f"{axes.devices} devices (token axes {axes.token}, vocabulary axes {axes.vocab}): what the forward keeps "
        f"for the backward does not fit its per-device slots, so the backward recomputes it and the slots "
        f"({per_device / 2**20:.0f} MiB per device) go unused, beside the memory budget. Split the tokens (or "
        f"the weight's vocabulary) over every mesh axis, or call it inside jax.shard_map with token_axis_name / "
        f"vocab_axis_name.", RuntimeWarning, stacklevel=2)


def mesh_devices() -> int:
    """The devices a sharded jit spreads over, as far as tracing knows: the context mesh's
    (``jax.set_mesh``, ``with mesh``), else all of them."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.size if not getattr(mesh, "empty", True) else jax.device_count()


def _local_kept(static: _Static, x_shape, w_shape, dtype, axes: Axes):
    """(backend, Config, the slots' per-device shapes, what this device's forward keeps into
    them or None): ``_fitted`` to the slots' per-device sizes."""
    shapes = tuple((rows // axes.devices, cols) for (rows, cols), _ in static.slots)
    sizes = tuple((r * c, dt) for (r, c), (_, dt) in zip(shapes, static.slots))
    if not shapes:
        return (*_local_backend(static, x_shape, w_shape, dtype), shapes, None)
    backend, config, kept = _fitted(static, x_shape, w_shape, dtype, sizes)
    return backend, config, shapes, kept


def _local_backend(static: _Static, x_shape, w_shape, dtype):
    """(backend, Config) for these per-device shapes (``contract.local_backend``: the chosen
    backend if it supports them, else xla; one Config per shapes)."""
    return local_backend(backends.BACKENDS, static.backend, x_shape, w_shape, dtype, softcap=static.softcap,
                         has_bias=static.has_bias, budget=static.budget, weight_layout=static.weight_layout,
                         need_argmax=static.need_argmax)


@functools.cache
def forward_fn(static: _Static):
    """fn(x2d, w, [bias,] target) -> (lse, z_t[, S][, best, argmax]) partitioned per device."""
    nout = 3 if static.need_smooth else 2

    def local(args, axes, scatter):
        if static.has_bias:
            x2d, w, bias, target = args
        else:
            (x2d, w, target), bias = args, None
        backend, config, shapes, kept_types = _local_kept(static, x2d.shape, w.shape, x2d.dtype, axes)
        if shapes and kept_types is None and axis_size(axes.token + axes.vocab) < axes.devices:
            _warn_unused_slots(static, axes)
        out, kept = local_forward(backend, x2d, w, bias, target, config, softcap=static.softcap,
                                  need_smooth=static.need_smooth, vocab_axes=axes.vocab,
                                  need_argmax=static.need_argmax, keep=kept_types is not None)
        # The kept arrays as this device's block of each slot (a reshape, no copy), else unused blocks.
        slots = tuple(k.reshape(shape) if kept_types is not None else lax.empty(shape, jnp.dtype(dt))
                      for k, shape, (_, dt) in zip(kept or (None,) * len(shapes), shapes, static.slots))
        return tuple(out[:nout]) + tuple(out[3:]) + slots

    kinds = ("x", "w") + (("b",) if static.has_bias else ()) + ("n",)
    slot_kinds = tuple(f"slot{i}" for i in range(len(static.slots)))
    return partitioned(local, in_kinds=kinds, out_kinds=("n",) * (nout + 2 * static.need_argmax) + slot_kinds,
                       vaxis=w_axis(static.weight_layout))


@functools.cache
def backward_fn(static: _Static):
    """fn(x2d, w, [bias,] target, lse, coef[, *slots]) -> (dx, dw[, db]) partitioned per device."""
    nslots = len(static.slots)

    def local(args, axes, scatter):
        args, slots = (args[:-nslots], args[-nslots:]) if nslots else (args, ())
        if static.has_bias:
            x2d, w, bias, target, lse, coef = args
        else:
            (x2d, w, target, lse, coef), bias = args, None
        backend, config, _, kept_types = _local_kept(static, x2d.shape, w.shape, x2d.dtype, axes)
        kept = None if kept_types is None else tuple(a.reshape(k.shape) for a, k in zip(slots, kept_types))
        dx, dw, db = local_backward(backend, LceResiduals(x2d, w, bias, target, None, lse, kept), coef, config,
                                    softcap=static.softcap, vocab_axes=axes.vocab, token_axes=())
        dw, db = reduce_weight_grads(dw, db, axes.token, scatter)
        return (dx, dw, db) if static.has_bias else (dx, dw)

    b = ("b",) if static.has_bias else ()
    slot_kinds = tuple(f"slot{i}" for i in range(nslots))
    return partitioned(local, in_kinds=("x", "w") + b + ("n", "n", "kn") + slot_kinds, out_kinds=("x", "w") + b,
                       vaxis=w_axis(static.weight_layout))


def explicit_call(op, mesh, axes: Axes, x2d, w, target, bias, *, vaxis: int, none: bool, stats: bool = True,
                  **kw):
    """``op`` (the public function) under ``jax.shard_map`` over ``mesh``: inputs resharded
    to (tokens, vocab) splits (H never split), per-device call with the axis names.
    Returns (loss, LossStats), or (loss, None) with ``stats=False``."""
    from jax.sharding import PartitionSpec as P

    tok, voc = spec_entry(axes.token), spec_entry(axes.vocab)
    wspec = P(*w_entries(axes, vaxis))
    specs = [P(tok, None), wspec, P(tok)] + ([] if bias is None else [P(voc)])
    args = [x2d, w, target] + ([] if bias is None else [bias])
    args = [jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, s)) for a, s in zip(args, specs)]

    def local(x2d, w, target, *b):
        return op(x2d, w, target, b[0] if b else None, return_stats=stats,
                  token_axis_name=axes.token or None, vocab_axis_name=axes.vocab or None, **kw)

    from logitless.jax.formulas.cross_entropy import LossStats

    loss_spec = P(tok) if none else P()
    out_specs = (loss_spec, LossStats(lse=P(tok), num_tokens=P(), argmax=P(tok))) if stats else loss_spec
    out = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs)(*args)
    return out if stats else (out, None)
