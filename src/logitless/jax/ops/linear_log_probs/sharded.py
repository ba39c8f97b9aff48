"""Sharded execution of ``linear_log_probs``: the backend per device, no gather of the
tokens or of the weight (machinery in ``logitless/jax/sharding.py``).

Under ``jax.jit`` with ``NamedSharding`` inputs on several devices, the forward
statistics and the backward run per device (``custom_partitioning`` on an Auto mesh,
``jax.shard_map`` on an Explicit mesh):

* tokens split (data parallel): each device computes its own tokens; log p and H stay
  split; dW and db are summed over the token axes (reduce-scattered back where the
  weight is split along a token axis, FSDP);
* weight split over the vocabulary (tensor parallel, V_l rows per device, member i
  holding classes [i V_l, (i + 1) V_l)): the backend reduces the local columns to
  (lse_l, a_t,l, H_l), merged per token with one MAX and one packed SUM of O(tokens):

      M = pmax lse_l,  d_l = lse_l - M
      S = psum e^d_l,  U = psum e^d_l (d_l - H_l),  a_t = psum a_t,l
      lse = M + log S,  H = log S - U / S,  log p = a_t - lse

  (e^d_l (d_l - H_l) is shard l's entropy sum u = sum_c e^(a_c - M)(a_c - M); a_t,l is
  0 unless the token is one of the local columns). The backward is the unsharded one
  on the local columns with the global lse: dx summed over the vocab axes (O(tokens x
  H)), dW keeps its local rows;
* both (a 2-D mesh): both of the above. H is never split (XLA reshards an H-split
  operand); a vocabulary that does not divide by the vocab axes' size is computed
  replicated along them (W gathered), as for linear_cross_entropy.

An (H, V) weight (``weight_layout="hv"``) is split along its columns the same way and
passed to the backend as it is (its ``weight_layout="hv"``); dW keeps that layout.

Memory per device: the backend's own (its chunks are planned from the local shapes, so
``memory_budget`` is per device) plus O(tokens) for the merge.
"""

from __future__ import annotations

import dataclasses
import functools
from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax import sharding as shd
from logitless.jax.formulas import log_probs as lpf
from logitless.jax.ops.common import contract
from logitless.jax.ops.linear_log_probs.backends import BACKENDS
from logitless.jax.ops.linear_log_probs.contract import LlpResiduals
from logitless.options import LogProbOptions


def _tau_kw(tau) -> dict:
    """The "xla" backend's ``tau`` (truncation) only when there is one."""
    return {} if tau is None else {"tau": tau}


def local_forward(backend, x2d, w, bias, tokens, config, *, opts: LogProbOptions, vocab_axes: tuple, tau=None,
                  ordered: bool = False):
    """(lse, a_t, H|None) of this device's tokens over all classes: the local columns by
    ``backend.forward`` under ``config``, merged over ``vocab_axes`` (module docstring).
    ``tau`` (N_l,): the truncation threshold (columns a < tau left out; the "xla"
    backend's ``tau``); ``ordered``: the SUM in device order (``sharding.sum_over``;
    batch invariance)."""
    if not vocab_axes:
        return tuple(backend.forward(x2d, w, bias, tokens, config, opts=opts, **_tau_kw(tau)))
    t, in_range = shd.local_targets(tokens, vocab_axes, w.shape[contract.w_axis(config.weight_layout)])
    # A token off this device's columns is -1 here, and so is the backend's ignore_index:
    # a local id can never collide with it (the statistics of ignored tokens are masked
    # from the global tokens afterwards).
    lopts = dataclasses.replace(opts, ignore_index=-1)
    lse_l, at_l, h_l = backend.forward(x2d, w, bias, jnp.where(in_range, t, -1), config, opts=lopts,
                                       **_tau_kw(tau))
    at_l = jnp.where(in_range, at_l, 0.0)

    def parts(d):
        e = jnp.exp(d)
        # (a device whose columns are all below tau: lse_l -inf, H_l NaN, no mass)
        return [e, at_l] + ([] if h_l is None else [jnp.where(e > 0, e * (d - h_l), 0.0)])

    m, sums = shd.vocab_merge(lse_l, vocab_axes, parts, ordered)
    log_s = jnp.log(sums[0])
    ent = None if h_l is None else log_s - sums[2] / sums[0]
    return m + log_s, sums[1], ent


def local_backward(backend, res: LlpResiduals, coef, config, *, opts: LogProbOptions, vocab_axes: tuple, tau=None):
    """(dx, dW_l, db_l) by ``backend.backward`` under the forward's ``config``, with the
    global lse and coefficients (``res.tokens``: global ids); dx summed over
    ``vocab_axes``; ``tau``: the forward's truncation threshold."""
    if not vocab_axes:
        return tuple(backend.backward(res, coef, config, opts=opts, **_tau_kw(tau)))
    t, in_range = shd.local_targets(res.tokens, vocab_axes, res.w.shape[contract.w_axis(config.weight_layout)])
    lopts = dataclasses.replace(opts, ignore_index=-1)
    dx, dw, db = backend.backward(res._replace(tokens=jnp.where(in_range, t, -1)), coef, config, opts=lopts,
                                  **_tau_kw(tau))
    return lax.psum(dx, vocab_axes), dw, db


class _Static(NamedTuple):
    opts: LogProbOptions
    backend: str
    budget: int
    has_bias: bool
    weight_layout: str = "vh"


def _split(args, has_bias: bool):
    """(x2d, w, bias|None, *rest) from the operands with or without bias."""
    if has_bias:
        return args
    x2d, w, *rest = args
    return (x2d, w, None, *rest)


def _local(static: _Static, x2d, w):
    """(backend, Config) for these per-device shapes (``contract.local_backend``)."""
    return contract.local_backend(BACKENDS, static.backend, x2d.shape, w.shape, x2d.dtype,
                                  softcap=static.opts.softcap, has_bias=static.has_bias, budget=static.budget,
                                  weight_layout=static.weight_layout)


def _fwd_local(static: _Static):
    def local(args, axes, scatter):
        x2d, w, bias, tokens = _split(args, static.has_bias)
        backend, config = _local(static, x2d, w)
        lse, at, ent = local_forward(backend, x2d, w, bias, tokens, config, opts=static.opts, vocab_axes=axes.vocab)
        return (lse, at) if ent is None else (lse, at, ent)

    return local


def _bwd_local(static: _Static):
    def local(args, axes, scatter):
        x2d, w, bias, tokens, lse, coef = _split(args, static.has_bias)
        backend, config = _local(static, x2d, w)
        dx, dw, db = local_backward(backend, LlpResiduals(x2d, w, bias, tokens, lse), coef, config,
                                    opts=static.opts, vocab_axes=axes.vocab)
        dw, db = shd.reduce_weight_grads(dw, db, axes.token, scatter)
        return (dx, dw, db) if static.has_bias else (dx, dw)

    return local


def _kinds(static: _Static):
    b = ("b",) if static.has_bias else ()
    fwd = (("x", "w") + b + ("n",), ("n",) * (3 if static.opts.entropy else 2))
    bwd = (("x", "w") + b + ("n", "n", "kn"), ("x", "w") + b)
    return fwd, bwd


@functools.cache
def _partitioned(static: _Static):
    (fi, fo), (bi, bo) = _kinds(static)
    vaxis = contract.w_axis(static.weight_layout)
    return (shd.partitioned(_fwd_local(static), in_kinds=fi, out_kinds=fo, vaxis=vaxis),
            shd.partitioned(_bwd_local(static), in_kinds=bi, out_kinds=bo, vaxis=vaxis))


def _mapped(static: _Static, mesh, axes: shd.Axes, scatter):
    (fi, fo), (bi, bo) = _kinds(static)
    vaxis = contract.w_axis(static.weight_layout)
    return (shd.mapped(_fwd_local(static), mesh, axes, in_kinds=fi, out_kinds=fo, vaxis=vaxis),
            shd.mapped(_bwd_local(static), mesh, axes, in_kinds=bi, out_kinds=bo, vaxis=vaxis, scatter=scatter))


class _Sharded(NamedTuple):
    """Static arguments of the sharded custom_vjp: the api's config (opts, backend,
    budget, num_classes) and, on an Explicit mesh, (mesh, Axes, FSDP scatter)."""

    cfg: object
    explicit: Optional[tuple] = None


def _fns(sc: _Sharded, has_bias: bool):
    static = _Static(sc.cfg.opts, sc.cfg.backend, sc.cfg.budget, has_bias, sc.cfg.weight_layout)
    if sc.explicit is None:
        return _partitioned(static)
    return _mapped(static, *sc.explicit)


def _operands(*arrays):
    return [a for a in arrays if a is not None]


def _outputs(x2d, w, bias, tokens, sc: _Sharded):
    fwd, _ = _fns(sc, bias is not None)
    out = fwd(*_operands(x2d, w, bias, tokens))
    lse, at, ent = out if len(out) == 3 else (*out, None)
    cfg = sc.cfg
    logp, h = lpf.token_outputs(lse, at, ent, tokens, cfg.num_classes, cfg.opts)
    return (logp, h) if cfg.opts.entropy else (logp,), lse, h


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sharded_llp(x2d, w, bias, tokens, sc: _Sharded):
    return _outputs(x2d, w, bias, tokens, sc)[0]


def _sharded_fwd(x2d, w, bias, tokens, sc):
    out, lse, h = _outputs(x2d, w, bias, tokens, sc)
    return out, (x2d, w, bias, tokens, lse, h)


def _like(ct, primal):
    """On an Explicit mesh: the cotangent with its primal's sharding type."""
    if ct is None:
        return None
    want = jax.typeof(primal).sharding
    if getattr(want, "mesh", None) is None or jax.typeof(ct).sharding == want:
        return ct
    return jax.sharding.reshard(ct, want)


def _sharded_bwd(sc, res, cotangents):
    x2d, w, bias, tokens, lse, h = res
    cfg = sc.cfg
    g_lp = cotangents[0]
    g_h = cotangents[1] if cfg.opts.entropy else None
    coef = lpf.grad_coefficients(h, tokens, g_lp, g_h, cfg.num_classes, cfg.opts, dtype=lse.dtype)
    _, bwd = _fns(sc, bias is not None)
    out = bwd(*_operands(x2d, w, bias, tokens, lse, coef))
    dx, dw, db = out if len(out) == 3 else (*out, None)
    if sc.explicit is not None:
        dx, dw, db = _like(dx, x2d), _like(dw, w), _like(db, bias)
    return dx, dw, db, None


_sharded_llp.defvjp(_sharded_fwd, _sharded_bwd)


def runner(x2d, weight, cfg):
    """The sharded function ``fn(x2d, weight, bias, tokens, cfg) -> outputs`` when this
    call runs on several devices (a multi-device jit, or arrays typed with an Explicit
    mesh that splits the tokens or the vocabulary); None for the single-device op
    (one device, inside a shard_map whose axes are all manual, or a backend that cannot
    be partitioned)."""
    if not BACKENDS[cfg.backend].can_partition():
        return None
    vaxis = contract.w_axis(cfg.weight_layout)
    explicit = shd.explicit_axes(x2d, weight, vaxis)
    if explicit is not None:
        mesh, axes = explicit
        scatter = _explicit_scatter(mesh, weight, axes, vaxis)
        return lambda x2d, w, b, t, cfg: _sharded_llp(x2d, w, b, t, _Sharded(cfg, (mesh, axes, scatter)))
    if not shd.use_partitioning():
        return None
    return lambda x2d, w, b, t, cfg: _sharded_llp(x2d, w, b, t, _Sharded(cfg))


def _explicit_scatter(mesh, weight, axes: shd.Axes, vaxis: int = 0):
    """The FSDP split of dW (``sharding.fsdp_scatter``) from the weight's sharding type."""

    class _Info(NamedTuple):
        shape: tuple
        sharding: object

    return shd.fsdp_scatter(mesh, _Info(tuple(weight.shape), jax.typeof(weight).sharding), axes, vaxis)
