"""Launch functions of the Helion linear_jsd kernels (``jsd_kernels``).

Student xs (N, Hs), ws (V, Hs), optional bs; teacher xt (N, Ht), wt (V, Ht), optional bt;
int64 target (N,) (used by the hard-label term; ignore_index tokens get g = 0 from the op).
The forward returns the (6, N) fp32 statistics of ``formulas.jsd`` (``token_loss`` turns
them into the loss): per chunk of rows (``planning.logits.jsd_forward_rows`` of the memory
budget, as the Triton backend's), cuBLAS writes both heads' fp32 logits once
(``triton_lib.launch.head_logit_chunks``) and ``jsd_kernels.jsd_row_stats`` reduces them.
The backward takes them and the per-token upstream gradient g (``formulas.jsd.upstream``:
0 at ignored tokens) and returns the student's dx, dW, db.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from logitless.formulas.jsd import NUM_STATS
from logitless.helion_lib import configs
from logitless.helion_lib.runtime import launch, require
from logitless.options import JSDOptions, check_memory_budget
from logitless.planning.logits import jsd_forward_rows


def _scalars(opts: JSDOptions) -> tuple:
    beta = opts.beta
    mode = 1 if beta == 0.0 else (2 if beta == 1.0 else 0)
    log_beta = math.log(beta) if 0.0 < beta < 1.0 else 0.0
    log_1mbeta = math.log1p(-beta) if 0.0 < beta < 1.0 else 0.0
    cap_s = float(opts.student_softcap) if opts.student_softcap is not None else 1.0
    cap_t = float(opts.teacher_softcap) if opts.teacher_softcap is not None else 1.0
    scal = (1.0 / opts.temperature, cap_s, cap_t, log_beta, log_1mbeta)
    flags = (mode, opts.needs_lse1, opts.student_softcap is not None, opts.teacher_softcap is not None)
    return scal, flags


def stats_args(zs, zt, target, opts) -> tuple:
    """The arguments of ``jsd_kernels.jsd_row_stats`` for a chunk's fp32 logits zs, zt."""
    scal, flags = _scalars(opts)
    return (zs, zt, target, *scal, *flags)


def backward_args(xs, ws, bs, xt, wt, bt, target, stats, g, opts) -> tuple:
    scal, flags = _scalars(opts)
    _, wp, _ = opts.weights
    return (xs, ws, bs, xt, wt, bt, target, stats.float().contiguous(), g.float().contiguous(), *scal,
            float(wp), float(opts.hard_label_weight), *flags)


def _target(target: Optional[Tensor], n: int, device) -> Tensor:
    return target if target is not None else torch.full((n,), -1, dtype=torch.int64, device=device)


def jsd_forward(xs: Tensor, ws: Tensor, bs: Optional[Tensor], xt: Tensor, wt: Tensor, bt: Optional[Tensor],
                target: Optional[Tensor], opts: JSDOptions, config: Optional[dict] = None,
                budget: Optional[int] = None, rows: Optional[int] = None) -> Tensor:
    """The (6, N) fp32 statistics (rows ``formulas.jsd.LSE_S`` ... ``ZTGT``), in chunks of
    ``rows`` tokens (default ``logits.jsd_forward_rows`` of ``budget`` bytes, default
    ``options.DEFAULT_MEMORY_BUDGET``): both heads' fp32 logits by cuBLAS, then
    ``jsd_kernels.jsd_row_stats`` on them."""
    require()
    from logitless.helion_lib import jsd_kernels as K
    from logitless.triton_lib.launch import head_logit_chunks

    n, v = xs.shape[0], ws.shape[0]
    stats = torch.empty((NUM_STATS, n), dtype=torch.float32, device=xs.device)
    if n == 0:
        return stats
    target = _target(target, n, xs.device)
    rows = rows or jsd_forward_rows(n, v, check_memory_budget(budget), xs.device.type == "cuda")
    cfg = config or configs.pick("jsd_stats", configs.sizes(xs, ws), xs.device)
    for n0, n1, zs, zt in head_logit_chunks(xs, ws, bs, xt, wt, bt, rows):
        stats[:, n0:n1] = launch(K.jsd_row_stats, stats_args(zs, zt, target[n0:n1], opts), cfg)
    return stats


def jsd_backward(xs: Tensor, ws: Tensor, bs: Optional[Tensor], xt: Tensor, wt: Tensor, bt: Optional[Tensor],
                 target: Optional[Tensor], stats: Tensor, g: Tensor, opts: JSDOptions,
                 config: Optional[dict] = None, need_dx: bool = True, need_dw: bool = True,
                 budget: Optional[int] = None, chunk: Optional[int] = None, dx_acc: bool = False,
                 ) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """The student's (dx, dW, db or None); db in fp32. g: (N,) upstream gradient per token.
    ``jsd_kernels.jsd_dlogits`` per vocabulary chunk of ``chunk`` columns (default
    ``grad_kernels.vocab_chunk`` of ``budget`` bytes), cuBLAS for the gradients
    (``grad_kernels.chunked_backward``; ``dx_acc``: dx as its fp32 accumulator).
    ``need_dx`` / ``need_dw`` False skip that part (None in its place; db comes with dW).
    """
    require()
    from logitless.helion_lib import jsd_kernels as K
    from logitless.helion_lib.grad_kernels import chunked_backward, empty_gradients, vocab_chunk

    n, v = xs.shape[0], ws.shape[0]
    if n == 0:
        return empty_gradients(xs, ws, bs, dx_acc)
    cfg = config or configs.pick("jsd_dz", configs.sizes(xs, ws), xs.device)
    args = backward_args(xs, ws, bs, xt, wt, bt, _target(target, n, xs.device), stats, g, opts)
    chunk = chunk or vocab_chunk(n, xs.shape[1], v, xs.element_size(), budget)
    # chunked: the student's and the teacher's W and bias rows; the target at 6
    return chunked_backward(K.jsd_dlogits, args, (1, 2, 4, 5), 6, cfg, chunk, need_dx=need_dx, need_dw=need_dw,
                            dx_acc=dx_acc)
