"""JAX linear_log_probs with truncated sampling (top-k / top-p / min-p) and/or
``batch_invariant=True`` ("xla" backend), on one device or per device under sharded
jit. Math: ``logitless.jax.formulas.truncation``.

Threshold pass (``thresholds``), from the hidden states in chunks (no tokens x V):
a running top-C per row (C static: 64, or k + 1 for a Python-int top_k, 1025 for a
per-token top_k array), the row max, min and s = sum exp(a - max); ``resolve`` gives
tau for the rows their candidates settle. Rows they do not (top-p over a flat row, a
wide min-p set, a per-token k >= C) take, under ``lax.cond`` only when there are any
(no host sync), a bisection on the value: ``BISECTION_STEPS`` passes that each count
per row the values above a trial t and their mass in the kept set, with
ok(t) = [t >= max + log min_p] & [count(a > t) < k] & [mass(a > t) < top_p Z1], Z1 the
mass of the min-p/top-k set (its own bisection first); tau = the lowest t found ok
(exact up to the values within the last interval: float ties). Cost of that fallback:
about 2 x 40 GEMM passes.

The forward and backward are the "xla" backend's with ``tau`` (columns a < tau out of
the statistics and of dz); log p = -inf outside the kept set, with no gradient there.

batch_invariant: the forward's rows run in blocks of ``INVARIANT_ROWS`` (a ``lax.map``
over blocks, the last padded), so every GEMM of a row has one shape whatever the batch;
the backward runs once over all the rows with the blocked forward's lse and tau (as the
torch op: gradients deterministic, not batch-invariant). Cost: up to one block of
padding rows, and the forward's blocks run one after another.

Sharded (jit with NamedSharding inputs, Auto or Explicit mesh; the machinery of
``sharded.py`` / ``jax/sharding.py``): the whole computation above is the per-device
local computation. Tokens split: each device its own rows, nothing gathered. Weight
split over the vocabulary: each device's top-C of its columns, one all-gather of
(N_l, C) per vocab device and a top-C of them (the global top-C: the same candidates
as one device), the row max / min / sum merged (MAX, MIN, SUM of (N_l,)); the
fallback's counts and masses summed per pass; then the merged forward and backward
of ``sharded.local_forward`` / ``local_backward`` with tau. Branch predicates (any row
unresolved, any top-p) are reduced over every mesh axis so all devices take the same
branch. With batch_invariant every float SUM over devices is added in device order
(``sharding.sum_over``): a row's bits do not depend on the batch for a given mesh;
with the tokens split only, they are the unsharded call's.
"""

from __future__ import annotations

import functools
from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax import sharding as shd
from logitless.jax.formulas import log_probs as lpf
from logitless.jax.formulas.truncation import resolve
from logitless.jax.ops.common.chunks import chunk_loop, put, take
from logitless.jax.ops.common.contract import local_plan, vh_shape, w_axis
from logitless.jax.ops.linear_log_probs import sharded
from logitless.jax.ops.linear_log_probs import xla_backend as xla
from logitless.jax.ops.linear_log_probs.backends import BACKENDS
from logitless.jax.ops.linear_log_probs.contract import LlpResiduals
from logitless.options import LogProbOptions

BISECTION_STEPS = 40
#: Rows per block with batch_invariant=True, per platform (others: 1024).
INVARIANT_ROWS = {"cpu": 64}


class Config(NamedTuple):
    opts: LogProbOptions
    budget: int
    num_classes: int
    candidates: int  # 0: no truncation
    rows: int = 0  # rows per block with batch_invariant (0: not invariant)
    weight_layout: str = "vh"  # "hv": an (H, V) weight


class _Merge(NamedTuple):
    """The threshold pass's collectives over the vocab axes (none: all columns local);
    ``every``: all the axes the call is split over (global branch predicates);
    ``ordered``: float sums in device order (batch invariance)."""

    vocab: tuple = ()
    every: tuple = ()
    ordered: bool = False

    def sum(self, a):
        return shd.sum_over(a, self.vocab, self.ordered)

    def max(self, a):
        return lax.pmax(a, self.vocab) if self.vocab else a

    def min(self, a):
        return lax.pmin(a, self.vocab) if self.vocab else a

    def top(self, cand, c: int):
        """The top ``c`` of every device's candidates (one all-gather of (N_l, C_l))."""
        if not self.vocab:
            return cand
        return lax.top_k(lax.all_gather(cand, self.vocab, axis=1, tiled=True), c)[0]

    def any(self, pred):
        p = jnp.any(pred)
        return lax.pmax(p.astype(jnp.int32), self.every) > 0 if self.every else p


def _layout(cfg: Config) -> str:
    return cfg.weight_layout


def _xla_config(x2d, w, bias, cfg: Config):
    """The "xla" backend and its Config for these (per-device, per-block) shapes, made once
    per shapes (``contract.local_plan``): the threshold pass, the forward and the backward
    of the same rows share it."""
    backend = BACKENDS["xla"]
    return backend, local_plan(backend, tuple(x2d.shape), vh_shape(w.shape, cfg.weight_layout),
                               jnp.dtype(x2d.dtype), cfg.budget, cfg.weight_layout, bias is not None)


def _tiles(x2d, w, bias, cfg: Config, body, carry):
    """body(a, r0, nr, c0, carry) over the (row chunk x column chunk) tiles of a."""
    n = x2d.shape[0]
    layout = _layout(cfg)
    vaxis = w_axis(cfg.weight_layout)
    plan = _xla_config(x2d, w, bias, cfg)[1].plan

    def col_step(c0, vc, carry):
        wj = take(w, c0, vc, vaxis)
        bj = None if bias is None else take(bias, c0, vc)

        def row_step(r0, nr, carry):
            return body(xla._scaled(take(x2d, r0, nr), wj, bj, cfg.opts, layout), r0, nr, c0, carry)

        return chunk_loop(n, plan.token_chunk, row_step, carry)

    return chunk_loop(w.shape[vaxis], plan.vocab_chunk, col_step, carry)


def thresholds(x2d, w, bias, trunc, cfg: Config, merge: Optional[_Merge] = None):
    """tau (N,) of this device's rows over all V classes (its columns merged by ``merge``;
    None: one device holds them all)."""
    merge = _Merge() if merge is None else merge
    k, p, mp = trunc
    n, v = x2d.shape[0], cfg.num_classes
    c = min(v, cfg.candidates)
    c_local = min(w.shape[w_axis(cfg.weight_layout)], cfg.candidates)
    cdt = lpf.compute_dtype(x2d.dtype)

    def body(a, r0, nr, c0, carry):
        cand, m, s, lo = carry
        both = jnp.concatenate([take(cand, r0, nr), a], axis=1)
        cand = put(cand, lax.top_k(both, c_local)[0], r0)
        mr, sr, _ = lpf.online_update(a, take(m, r0, nr), take(s, r0, nr), None)
        lo = put(lo, jnp.minimum(take(lo, r0, nr), jnp.min(a, axis=1)), r0)
        return cand, put(m, mr, r0), put(s, sr, r0), lo

    init = (jnp.full((n, c_local), -jnp.inf, cdt), jnp.full((n,), -jnp.inf, cdt), jnp.zeros((n,), cdt),
            jnp.full((n,), jnp.inf, cdt))
    cand, m_l, s_l, rmin = _tiles(x2d, w, bias, cfg, body, init)
    m = merge.max(m_l)
    s = merge.sum(s_l * jnp.exp(m_l - m))  # (one device: m_l == m, the factor 1)
    cand, rmin = merge.top(cand, c), merge.min(rmin)
    tau, ok = resolve(cand, s, v, k, p.astype(cdt), mp.astype(cdt))

    def fallback(tau):
        return jnp.where(ok, tau, _bisection(x2d, w, bias, trunc, cfg, m, rmin, merge))

    return lax.cond(merge.any(~ok), fallback, lambda t: t, tau)


def _bisection(x2d, w, bias, trunc, cfg: Config, m, rmin, merge: _Merge):
    k, p, mp = trunc
    n, v = x2d.shape[0], cfg.num_classes
    cdt = m.dtype
    tau_m = jnp.where(mp > 0, m + jnp.log(jnp.maximum(mp, 1e-38)).astype(cdt), -jnp.inf)
    k_on = (k > 0) & (k < v)

    def stats(t, floor):
        """count(a > t) and sum over a > t, a >= floor of exp(a - m), per row."""
        def body(a, r0, nr, c0, carry):
            cnt, mass = carry
            tr, fr, mr = take(t, r0, nr)[:, None], take(floor, r0, nr)[:, None], take(m, r0, nr)[:, None]
            above = a > tr
            cnt = put(cnt, take(cnt, r0, nr) + jnp.sum(above, axis=1, dtype=jnp.int32), r0)
            e = jnp.where(above & (a >= fr), jnp.exp(a - mr), 0.0)
            return cnt, put(mass, take(mass, r0, nr) + jnp.sum(e, axis=1), r0)

        cnt, mass = _tiles(x2d, w, bias, cfg, body, (jnp.zeros((n,), jnp.int32), jnp.zeros((n,), cdt)))
        return merge.sum(cnt), merge.sum(mass)

    def search(ok_of):
        lo0 = rmin - 1.0

        def step(_, lohi):
            lo, hi = lohi
            mid = lo + (hi - lo) / 2
            good = ok_of(mid)
            return jnp.where(good, lo, mid), jnp.where(good, mid, hi)

        lo, hi = lax.fori_loop(0, BISECTION_STEPS, step, (lo0, m))
        return jnp.where(ok_of(lo0), -jnp.inf, hi)

    def ok1(t):
        cnt, _ = stats(t, t)
        return (t >= tau_m) & (~k_on | (cnt < k))

    tau1 = search(ok1)
    p_on = p < 1
    _, z1 = stats(jnp.full((n,), -jnp.inf, cdt), tau1)

    def ok(t):
        cnt, mass = stats(t, tau1)
        return (t >= tau_m) & (~k_on | (cnt < k)) & (~p_on | (mass < p.astype(cdt) * z1))

    return lax.cond(merge.any(p_on), lambda: search(ok), lambda: tau1)


# ------------------------------------------------------------------------------------
# the local computations (one device, or one device's part under sharded jit)
# ------------------------------------------------------------------------------------


def _to_blocks(a, rows: int, pad):
    """(N, ...) -> (ceil(N / rows), rows, ...), the last block padded with ``pad``."""
    if a is None:
        return None
    nb = -(-a.shape[0] // rows)
    widths = ((0, nb * rows - a.shape[0]),) + ((0, 0),) * (a.ndim - 1)
    return jnp.pad(a, widths, constant_values=pad).reshape((nb, rows) + a.shape[1:])


def _from_blocks(a, n: int):
    return None if a is None else a.reshape((-1,) + a.shape[2:])[:n]


class _Static(NamedTuple):
    cfg: Config
    has_bias: bool
    has_trunc: bool


def _split(args, st: _Static):
    """(x2d, w, bias|None, tokens, [the other operands])."""
    x2d, w, bias, tokens, *rest = sharded._split(args, st.has_bias)
    return x2d, w, bias, tokens, rest


def _fwd_local(st: _Static):
    cfg = st.cfg

    def local(args, axes, scatter):
        x2d, w, bias, tokens, rest = _split(args, st)
        trunc = tuple(rest) if st.has_trunc else (None, None, None)
        merge = _Merge(axes.vocab, axes.token + axes.vocab, cfg.rows > 0)

        def rows(x, t, k, p, mp):
            tau = None if k is None else thresholds(x, w, bias, (k, p, mp), cfg, merge)
            backend, config = _xla_config(x, w, bias, cfg)
            lse, at, ent = sharded.local_forward(backend, x, w, bias, t, config, opts=cfg.opts,
                                                 vocab_axes=axes.vocab, tau=tau, ordered=merge.ordered)
            return lse, at, ent, tau

        if not cfg.rows:
            lse, at, ent, tau = rows(x2d, tokens, *trunc)
        else:  # blocks of cfg.rows rows in turn (padding rows: ignored tokens, no truncation)
            pads = (0, cfg.opts.ignore_index, 0, 1.0, 0.0)
            blk = tuple(_to_blocks(a, cfg.rows, v) for a, v in zip((x2d, tokens) + trunc, pads))
            lse, at, ent, tau = (_from_blocks(o, x2d.shape[0]) for o in lax.map(lambda b: rows(*b), blk))
        return tuple(o for o in (lse, at, ent, tau) if o is not None)

    return local


def _bwd_local(st: _Static):
    cfg = st.cfg

    def local(args, axes, scatter):
        x2d, w, bias, tokens, rest = _split(args, st)
        tau, lse, coef = rest if st.has_trunc else (None, *rest)

        # (batch_invariant: one backward over all the rows, as the torch op's: gradients
        # deterministic, not batch-invariant)
        backend, config = _xla_config(x2d, w, bias, cfg)
        dx, dw, db = sharded.local_backward(backend, LlpResiduals(x2d, w, bias, tokens, lse), coef, config,
                                            opts=cfg.opts, vocab_axes=axes.vocab, tau=tau)
        dw, db = shd.reduce_weight_grads(dw, db, axes.token, scatter)
        return (dx, dw, db) if st.has_bias else (dx, dw)

    return local


def _kinds(st: _Static):
    b = ("b",) if st.has_bias else ()
    tr = ("n",) if st.has_trunc else ()
    fwd = (("x", "w") + b + ("n",) + tr * 3, ("n",) * (2 + int(st.cfg.opts.entropy)) + tr)
    bwd = (("x", "w") + b + ("n",) + tr + ("n", "kn"), ("x", "w") + b)
    return fwd, bwd


@functools.cache
def _partitioned(st: _Static):
    (fi, fo), (bi, bo) = _kinds(st)
    vaxis = w_axis(st.cfg.weight_layout)
    return (shd.partitioned(_fwd_local(st), in_kinds=fi, out_kinds=fo, vaxis=vaxis),
            shd.partitioned(_bwd_local(st), in_kinds=bi, out_kinds=bo, vaxis=vaxis))


def _fns(st: _Static, explicit):
    """(forward, backward) on the operands: per device (``explicit``: (mesh, Axes,
    scatter) of an Explicit mesh; "auto": custom_partitioning) or on one device."""
    if explicit == "auto":
        return _partitioned(st)
    (fi, fo), (bi, bo) = _kinds(st)
    if explicit is None:
        return (lambda *a: _fwd_local(st)(a, shd.Axes(), None), lambda *a: _bwd_local(st)(a, shd.Axes(), None))
    mesh, axes, scatter = explicit
    vaxis = w_axis(st.cfg.weight_layout)
    return (shd.mapped(_fwd_local(st), mesh, axes, in_kinds=fi, out_kinds=fo, vaxis=vaxis),
            shd.mapped(_bwd_local(st), mesh, axes, in_kinds=bi, out_kinds=bo, vaxis=vaxis, scatter=scatter))


class _Call(NamedTuple):
    cfg: Config
    explicit: object = None  # None (one device), "auto" or (mesh, Axes, scatter)


def _operands(*arrays):
    return [a for a in arrays if a is not None]


def _outputs(x2d, w, bias, tokens, k, p, mp, call: _Call):
    cfg = call.cfg
    st = _Static(cfg, bias is not None, k is not None)
    fwd, _ = _fns(st, call.explicit)
    out = fwd(*_operands(x2d, w, bias, tokens, k, p, mp))
    lse, at = out[0], out[1]
    ent = out[2] if cfg.opts.entropy else None
    tau = out[-1] if st.has_trunc else None
    logp, h = lpf.token_outputs(lse, at, ent, tokens, cfg.num_classes, cfg.opts)
    return logp, (h if cfg.opts.entropy else jnp.zeros_like(logp)), lse, tau


@partial(jax.custom_vjp, nondiff_argnums=(7,))
def _core(x2d, w, bias, tokens, k, p, mp, call: _Call):
    return _outputs(x2d, w, bias, tokens, k, p, mp, call)[:2]


def _core_fwd(x2d, w, bias, tokens, k, p, mp, call):
    logp, h, lse, tau = _outputs(x2d, w, bias, tokens, k, p, mp, call)
    return (logp, h), (x2d, w, bias, tokens, tau, lse, h, logp)


def _core_bwd(call, res, cot):
    x2d, w, bias, tokens, tau, lse, h, logp = res
    cfg = call.cfg
    g_lp, g_h = cot
    g_lp = jnp.where(jnp.isinf(logp), 0.0, g_lp)  # -inf outside the kept set: no gradient
    coef = lpf.grad_coefficients(h if cfg.opts.entropy else None, tokens, g_lp,
                                 g_h if cfg.opts.entropy else None, cfg.num_classes, cfg.opts, dtype=lse.dtype)
    _, bwd = _fns(_Static(cfg, bias is not None, tau is not None), call.explicit)
    out = bwd(*_operands(x2d, w, bias, tokens, tau, lse, coef))
    dx, dw, db = out if len(out) == 3 else (*out, None)
    if isinstance(call.explicit, tuple):
        dx, dw, db = sharded._like(dx, x2d), sharded._like(dw, w), sharded._like(db, bias)
    return dx, dw, db, None, None, None, None


_core.defvjp(_core_fwd, _core_bwd)


def _where(x2d, w, cfg: Config):
    """None (one device), "auto" (a multi-device jit: custom_partitioning) or (mesh,
    Axes, scatter) (arrays typed with an Explicit mesh): as ``sharded.runner``."""
    vaxis = w_axis(cfg.weight_layout)
    explicit = shd.explicit_axes(x2d, w, vaxis)
    if explicit is not None:
        mesh, axes = explicit
        return mesh, axes, sharded._explicit_scatter(mesh, w, axes, vaxis)
    return "auto" if shd.use_partitioning() else None


def linear_log_probs_truncated(x2d, w, bias, tokens, trunc, cfg: Config, batch_invariant: bool):
    """(logp, entropy) (N,) of x2d (N, H), tokens (N,) int32; trunc: (k, p, min_p) or None;
    w in ``cfg.weight_layout``."""
    if batch_invariant:
        cfg = cfg._replace(rows=INVARIANT_ROWS.get(jax.default_backend(), 1024))
    k, p, mp = (None, None, None) if trunc is None else (lax.stop_gradient(a) for a in trunc)
    return _core(x2d, w, bias, tokens, k, p, mp, _Call(cfg, _where(x2d, w, cfg)))
