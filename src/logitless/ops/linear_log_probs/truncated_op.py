"""The torch.library custom ops of linear_log_probs' truncated / batch-invariant path
(the math and the threshold passes: ``truncation``, whose docstring says what crosses
from the forward to the backward and why its shapes are fixed).

    logitless::llp_truncated_forward(x, weight, bias, tokens, top_k, top_p, min_p, <options>,
        backend, budget, k_max (-1: read from top_k), block (rows per block, 0: not
        batch-invariant), need_grad, <vocab parallel>)
        -> logp, entropy, lse, tau, cand, cols, inside, keep, keep_max, plan
    logitless::llp_truncated_backward(grad_logp, grad_entropy, ...) -> dx, dw, db

Built from ``SPEC`` (``ops.common.spec``), as the default op's. A vocab-parallel head:
the implementations build ``vocab_parallel.ShardedBackend`` from the group's name.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from logitless.formulas.common import compute_dtype
from logitless.formulas.truncation import Truncation, check_values
from logitless.ops.common.autocast import disabled as no_autocast
from logitless.ops.common.autograd import fake_grad_outputs, grad_outputs
from logitless.ops.common.dispatch import load_backend
from logitless.ops.common.invariant import blocks as _blocks
from logitless.ops.common.invariant import invariant_rows
from logitless.ops.common.kept import fake_kept, fake_kept_tensors, kept_buffers, nothing_kept
from logitless.ops.common.spec import OpSpec, build, options, scalar, tensor
from logitless.ops.common.validate import check_targets_in_range
from logitless.options import LogProbOptions, VocabParallelOptions
from logitless.planning.plans import LinearPlan

from .truncation import (
    MAX_CANDIDATES,
    _pad_vec,
    _padded,
    _padded_trunc,
    _put,
    _searches,
    _take,
    candidate_count,
    search_triton,
    thresholds,
)
from .vocab_parallel import ShardedBackend


def tensor_k_max(top_k: Tensor, block) -> int:
    """The largest per-token top_k (a host sync); under batch_invariant (``block``) at
    least MAX_CANDIDATES - 1: one C whatever the neighbours' top_k."""
    k_max = int(top_k.max())
    if block and k_max < MAX_CANDIDATES:
        k_max = MAX_CANDIDATES - 1
    return k_max


def _sparse_width(backend: str, v: int, k_max: int, need_grad: bool, truncated: bool, parallel: bool):
    """Columns of the forward op's ``cand``/``cols`` outputs (the sparse backward's
    candidates, padded), or None when the call cannot take the sparse backward: only the
    Triton candidates pass gives them. ``k_max`` -1 (a per-token top_k not read on the
    host): the widest C."""
    if not (truncated and need_grad and not parallel and backend == "triton"):
        return None
    c = candidate_count(k_max) if k_max >= 0 else MAX_CANDIDATES
    return min(c, v) if c <= MAX_CANDIDATES else None


def _may_keep(backend: str, k_max: int, block: int, need_grad: bool, truncated: bool, softcap, parallel: bool):
    """Whether the forward may keep columns for the backward (the backend's forward over
    all rows, ``need_grad``): not blocked (a plan that keeps may tile differently), not
    with a soft-cap and a threshold, and never where the Triton search may run (its
    outputs need no forward) or may not (``k_max`` -1): the fake must know the shapes."""
    if block or not need_grad or (truncated and softcap is not None):
        return False
    return parallel or backend != "triton" or (k_max >= 0 and candidate_count(k_max) > MAX_CANDIDATES)


def _backend_of(backend: str, tp: VocabParallelOptions, weight: Tensor, device, ordered: bool):
    """The backend module, or over a vocab-parallel head its ``ShardedBackend``."""
    impl = load_backend(__package__, backend)
    return ShardedBackend(backend, impl, tp, weight, device, ordered) if tp.parallel else impl


def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor, top_k: Optional[Tensor],
             top_p: Optional[Tensor], min_p: Optional[Tensor], opts: LogProbOptions, backend: str, budget: int,
             k_max: int, block: int, need_grad: bool, tp: VocabParallelOptions):
    """x (N, H), tokens (N,) int64, the per-token truncation (top_k, top_p, min_p: (N,)
    each, or None for none) -> logp, entropy ((0,) without), lse, tau ((0,) without
    truncation), cand, cols, inside (the sparse backward's candidates and rows: (N, W)
    padded with -inf and column V, (N,) bool; (0, 0) and (0,) when the call cannot take
    it, ``_sparse_width``), keep, keep_max, plan (kept columns, as the default op's)."""
    n = x.shape[0]
    width = _sparse_width(backend, weight.shape[0], k_max, need_grad, top_k is not None, tp.parallel)
    may_keep = _may_keep(backend, k_max, block, need_grad, top_k is not None, opts.softcap, tp.parallel)
    block = block or None
    trunc = None
    if top_k is not None:
        if x.device.type == "cpu":
            check_values(top_k, top_p, min_p)
        if k_max < 0 and n:  # (host sync: the largest top_k)
            k_max = tensor_k_max(top_k, block)
        trunc = Truncation(top_k, top_p, min_p, k_max if k_max >= 0 else None)
    sharded = tp.parallel
    impl = backend
    backend = _backend_of(impl, tp, weight, x.device, block is not None)
    v = backend.vocab_size if sharded else weight.shape[0]
    check_targets_in_range(tokens, v, opts.ignore_index, name="tokens")
    sd = compute_dtype(x.dtype)
    plan = None
    with no_autocast(x.device):
        kept = None
        # the sparse backward (every row's kept set inside its candidates): their columns
        sparse = [] if width is not None else None
        logp = x.new_empty(n, dtype=sd)
        ent = x.new_empty(n, dtype=sd) if opts.entropy else None
        lse = x.new_empty(n, dtype=sd)
        taus = x.new_empty(n, dtype=sd) if trunc is not None else x.new_empty(0, dtype=sd)
        for n0, n1, pad in _blocks(n, block):
            xb, tb = _padded(x, tokens, n0, n1, pad, opts.ignore_index)
            tau = outs = left = None
            if trunc is not None:
                tr = _padded_trunc(trunc, n0, n1, pad)
                if sharded:  # (the chunked pass, merged over the group)
                    tau = backend.thresholds(xb, weight, bias, opts, tr, budget)
                elif xb.shape[0] and _searches(impl, tr):
                    tau, outs, left, *sp = search_triton(xb, weight, bias, tb, opts, tr, budget,
                                                         invariant=block is not None, indices=sparse is not None)
                    if sparse is not None and sp[0] is not None:
                        sparse.append(tuple(t[:n1 - n0] for t in sp[0]))
                    else:
                        sparse = None
                    if left is not None:  # (the chunked fallback for these rows)
                        tau[left] = thresholds(xb[left], weight, bias, opts, tr.rows(left), budget, impl)
                else:
                    tau = thresholds(xb, weight, bias, opts, tr, budget, impl)
                    sparse = None if xb.shape[0] else sparse
                taus[n0:n1] = tau[:n1 - n0]
            if xb.shape[0] == 0:
                continue
            if outs is not None and left is None:  # every row's outputs from the threshold pass
                lp, en, ls = outs
            elif outs is not None and block is None:  # the forward over the fallback's rows only
                # (not under batch_invariant: a plan for these rows may tile them otherwise)
                xl = xb[left]
                lplan = backend.plan(xl, weight, bias, opts, budget=budget, need_grad=False, cute=False)
                fl, _ = backend.forward(xl, weight, bias, tb[left], opts, plan=lplan, budget=budget, outputs=True,
                                        tau=tau[left])
                lp, en, ls = (_put(o, f, left) for o, f in zip(outs, fl))
            else:
                bplan = backend.plan(xb, weight, bias, opts, budget=budget, need_grad=may_keep, cute=False)
                (lp, en, ls), kept = backend.forward(xb, weight, bias, tb, opts, plan=bplan, budget=budget,
                                                     outputs=True, tau=tau)
                plan = bplan if kept is not None else None
                if outs is not None:  # the threshold pass's outputs, but for the fallback's rows
                    lp, en, ls = (_take(o, f, left) for o, f in zip(outs, (lp, en, ls)))
            logp[n0:n1] = lp[:n1 - n0].to(sd)
            lse[n0:n1] = ls[:n1 - n0].to(sd)
            if ent is not None:
                ent[n0:n1] = en[:n1 - n0].to(sd)
    if width is None:
        cand, cols, inside = x.new_empty((0, 0), dtype=torch.float32), tokens.new_empty((0, 0), dtype=torch.int32), \
            tokens.new_empty(0, dtype=torch.bool)
    elif sparse:  # padded to the fixed width: the padding is never kept (-inf), its column V
        cand, cols, inside = (torch.cat(parts) for parts in zip(*sparse))
        if cand.shape[1] < width:
            cand = F.pad(cand, (0, width - cand.shape[1]), value=-math.inf)
            cols = F.pad(cols, (0, width - cols.shape[1]), value=v)
    else:  # (no candidates: every row takes the dense backward)
        cand = x.new_empty((n, width), dtype=torch.float32)
        cols = tokens.new_empty((n, width), dtype=torch.int32)
        inside = tokens.new_zeros(n, dtype=torch.bool)
    if kept is None:
        kept = nothing_kept(x)
    if ent is None:
        ent = x.new_empty(0, dtype=sd)
    return logp, ent, lse, taus, cand, cols.to(torch.int32), inside, kept[0], kept[1], plan


def _forward_fake(x, weight, bias, tokens, top_k, top_p, min_p, opts, backend, budget, k_max, block, need_grad,
                  tp):
    n = x.shape[0]
    sd = compute_dtype(x.dtype)
    kept = fake_kept_tensors(x)
    if _may_keep(backend, k_max, block, need_grad, top_k is not None, opts.softcap, tp.parallel):
        impl = load_backend(__package__, backend)
        kept = fake_kept(x, weight, tp.tp_group, tp.vocab_size, lambda n, v, h: impl.kept_shapes(
            impl.plan(x, weight, bias, opts, budget=budget, need_grad=True, cute=False), n))
    width = _sparse_width(backend, weight.shape[0], k_max, need_grad, top_k is not None, tp.parallel)
    rows, cand_shape = (0, (0, 0)) if width is None else (n, (n, width))
    return (
        x.new_empty(n, dtype=sd),
        x.new_empty(n if opts.entropy else 0, dtype=sd),
        x.new_empty(n, dtype=sd),
        x.new_empty(n if top_k is not None else 0, dtype=sd),
        x.new_empty(cand_shape, dtype=torch.float32),
        tokens.new_empty(cand_shape, dtype=torch.int32),
        tokens.new_empty(rows, dtype=torch.bool),
        *kept,
        None,  # the plan (the scaffolding's fixed-size tensor)
    )


def _backward(grad_logp, grad_entropy, x, weight, bias, tokens, lse, entropy_out, logp, tau, cand, cols, inside,
              keep, keep_max, plan, opts: LogProbOptions, backend: str, budget: int, need_dx: bool, need_dw: bool,
              need_db: bool, tp: VocabParallelOptions):
    """dx, dw, db (size 0 where not needed): the sparse backward for the rows ``inside``
    their candidates (when any), the backend's (with tau) for the others; overwrites
    ``keep`` (when not empty) with dz."""
    n = x.shape[0]
    has_bias = bias is not None
    need_db = need_db and has_bias
    ent = entropy_out if opts.entropy else None
    taus = tau if tau.numel() or n == 0 else None
    impl = _backend_of(backend, tp, weight, x.device, False)
    v = impl.vocab_size if tp.parallel else weight.shape[0]
    g_lp, g_h = grad_logp, grad_entropy
    if g_lp is not None:  # logp = -inf outside the kept set: piecewise constant there
        g_lp = torch.where(torch.isinf(logp), torch.zeros_like(g_lp), g_lp)
    if inside.numel() and bool(inside.any()):  # (host sync) kept sets inside the candidates: no GEMM there
        dense = (~inside).nonzero()[:, 0]
        dx, dw, db = _sparse_backward(impl, x, weight, bias, tokens, lse, ent, taus, g_lp, g_h, v, cand, cols,
                                      dense, opts, budget, need_dx, need_dw, need_db)
        return grad_outputs(x, dx, dw, db, need_dx, need_dw, need_db)
    dx = dw = db = None
    sd = compute_dtype(x.dtype)
    kept = kept_buffers(plan, keep, keep_max)  # the forward's buffers, laid out by its plan (one block)
    with no_autocast(x.device):
        # one block (the whole batch) under batch_invariant too: the module docstring
        for n0, n1, pad in _blocks(n, None):
            xb, tb = _padded(x, tokens, n0, n1, pad, opts.ignore_index)
            if xb.shape[0] == 0:
                continue
            gl = _pad_vec(g_lp, n0, n1, pad) if g_lp is not None else None
            gh = _pad_vec(g_h, n0, n1, pad) if (g_h is not None and opts.entropy) else None
            en = _pad_vec(ent, n0, n1, pad) if ent is not None else None
            ls = _pad_vec(lse, n0, n1, pad)
            tb_tau = _pad_vec(taus, n0, n1, pad, -math.inf) if taus is not None else None
            coef = impl.grad_coefficients(en, tb, gl, gh, v, opts, ls)
            if kept is not None:
                extra = dict(kept=kept, plan=plan)
            else:
                extra = dict(plan=impl.plan(xb, weight, bias, opts, budget=budget, need_grad=False, cute=False))
            bx, bw, bb = impl.backward(xb, weight, bias, tb, opts, ls, coef, need_dx=need_dx, need_dw=need_dw,
                                       need_db=need_db, budget=budget, tau=tb_tau, **extra)
            if need_dx:  # (one block of every row: its dx is the result, no second N x H buffer)
                if bx.shape[0] == n and n0 == 0 and bx.dtype == x.dtype and x.is_contiguous():
                    dx = bx
                else:
                    dx = torch.zeros_like(x) if dx is None else dx
                    dx[n0:n1] = bx[:n1 - n0]
            # several blocks: dW and db summed in fp32 (16-bit inputs), cast once
            if need_dw:
                dw = bw if dw is None else (dw.float() if dw.dtype != sd else dw).add_(bw)
            if need_db:
                db = bb if db is None else (db.float() if db.dtype != sd else db).add_(bb)
    if need_dx and dx is None:
        dx = torch.zeros_like(x)
    if need_dw:
        dw = torch.zeros_like(weight) if dw is None else dw.to(weight.dtype)
    if need_db:
        db = torch.zeros_like(bias) if db is None else db.to(bias.dtype)
    return grad_outputs(x, dx, dw, db, need_dx, need_dw, need_db)


def _backward_fake(grad_logp, grad_entropy, x, weight, bias, *_rest):
    *_, need_dx, need_dw, need_db, _tp = _rest
    return fake_grad_outputs(x, weight, bias, need_dx, need_dw, need_db)


def _sparse_backward(backend, x, weight, bias, tokens, lse, ent, taus, g_lp, g_h, v, cand, cols, dense, opts,
                     budget, need_dx, need_dw, need_db):
    """(dx, dW, db): the sparse backward (``triton_lib.log_probs_sparse``) of the rows
    whose kept set lies in their candidates, onto the dense backward of the others
    (``dense``, indices: the backend's over those rows only, tau as the forward's)."""
    from logitless.triton_lib import log_probs_sparse as LS

    with no_autocast(x.device):
        coef = backend.grad_coefficients(ent, tokens, g_lp, g_h if opts.entropy else None, v, opts, lse)
        tau = taus.index_fill(0, dense, math.inf)  # (the dense rows: nothing kept here)
        dz, col, cnt = LS.sparse_dlogits(cand, cols, tau, tokens, lse, coef, opts.softcap, opts.temperature,
                                         opts.entropy, v)
        bx = bw = bb = None
        if dense.numel():
            xd = x[dense]
            plan = backend.plan(xd, weight, bias, opts, budget=budget, need_grad=False, cute=False)
            bx, bw, bb = backend.backward(xd, weight, bias, tokens[dense], opts, lse[dense],
                                          coef[:, dense].contiguous(), need_dx=need_dx, need_dw=need_dw,
                                          need_db=need_db, budget=budget, tau=taus[dense], plan=plan)
        dx, dw, db = LS.sparse_backward(x, weight, bias, dz, col, cnt, need_dx=need_dx, need_dw=need_dw,
                                        need_db=need_db, dw=bw.contiguous() if bw is not None else None,
                                        db=bb.contiguous() if bb is not None else None)
        if bx is not None:
            dx[dense] = bx.to(dx.dtype)
        return (dx, dw.to(weight.dtype) if dw is not None else None,
                db.to(bias.dtype) if db is not None else None)


def linear_log_probs_truncated(x: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor,
                               trunc: Optional[Truncation], opts: LogProbOptions, impl: str, budget: int,
                               batch_invariant: bool, need_grad: bool, tp: VocabParallelOptions):
    """(logp, entropy or an empty tensor) of x (N, H), tokens (N,) int64, through the
    ``llp_truncated_forward`` custom op (``SPEC``). ``tp``: a vocab-parallel head."""
    block = invariant_rows(impl, x.device) if batch_invariant else 0
    k, p, mp, k_max = None, None, None, 0
    if trunc is not None:
        k, p, mp = trunc.top_k, trunc.top_p, trunc.min_p
        k_max = trunc.k_max if trunc.k_max is not None else -1
        if k_max < 0 and x.shape[0] and not torch.compiler.is_compiling():  # (eager: the host sync here)
            k_max = tensor_k_max(k, block)
    out = llp_truncated_forward_eager(x, weight, bias, tokens, k, p, mp, *opts.args(), impl, budget, k_max, block,
                                      need_grad, *tp.args())
    return out[0], out[1]


_HEAD = (tensor("x"), tensor("weight"), tensor("bias", True), tensor("tokens"))
_EXEC = (scalar("backend", str), scalar("budget", int))
_KEPT = ("keep", "keep_max")
_SPARSE = ("cand", "cols", "inside")
_TP = options("tp", VocabParallelOptions, defaulted=True)

#: logitless::llp_truncated_forward(x, weight, bias, tokens, top_k, top_p, min_p, <options>, backend,
#:     budget, k_max (-1: read from top_k), block (rows per block, 0: not batch-invariant), need_grad,
#:     <vocab parallel>) -> logp, entropy, lse, tau, cand, cols, inside, keep, keep_max, plan;
#: logitless::llp_truncated_backward(...) -> dx, dw, db. Fixed output shapes (``_forward_fake``):
#: every data-dependent step (host syncs, row subsets) runs inside the implementations.
SPEC = OpSpec(
    op="linear_log_probs",
    name="llp_truncated_forward",
    forward=(*_HEAD, tensor("top_k", True), tensor("top_p", True), tensor("min_p", True),
             options("opts", LogProbOptions), *_EXEC, scalar("k_max", int), scalar("block", int),
             scalar("need_grad", bool), _TP),
    outputs=("logp", "entropy_out", "lse", "tau", *_SPARSE, *_KEPT, "plan"),
    forward_impl=_forward,
    forward_fake=_forward_fake,
    backward_name="llp_truncated_backward",
    backward=(tensor("grad_logp", True), tensor("grad_entropy", True), *_HEAD, tensor("lse"), tensor("entropy_out"),
              tensor("logp"), tensor("tau"), *(tensor(k) for k in _SPARSE), *(tensor(k) for k in _KEPT),
              tensor("plan"), options("opts", LogProbOptions), *_EXEC, scalar("need_dx", bool),
              scalar("need_dw", bool), scalar("need_db", bool), _TP),
    backward_impl=_backward,
    backward_fake=_backward_fake,
    grads=("grad_logp", "grad_entropy") + (None,) * 8,
    grad_inputs=("x", "weight", "bias"),
    need={"need_dx": "x", "need_dw": "weight", "need_db": "bias"},
    mutates=("keep",),
    consumed=_KEPT,  # not saved: the first backward consumes them in place
    nothing=nothing_kept,
    materialize_grads=True,  # (as the autograd.Function this replaced: zeros for an unused output)
    plan_cls=LinearPlan,
)

_built = build(SPEC)
llp_truncated_forward, llp_truncated_backward = _built.forward_op, _built.backward_op
llp_truncated_forward_eager = _built.eager
