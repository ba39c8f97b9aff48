"""``python -m logitless_bench --suite tp``: vocab-parallel (tensor-parallel) cross-entropy.

One process per visible GPU (NCCL; on a machine without 2 GPUs: 2 CPU processes over
gloo at a toy size, a harness check only). The LM head (V, H) is split over the ranks
by rows (torch's Shard(0) blocks); x (N, H) and the targets are the same on every
rank. Methods, each a forward + backward of the mean cross-entropy giving the full dx
on every rank and this rank's dW rows:

    logitless-tp      logitless.linear_cross_entropy(x, W_r, t, process_group=pg)
    logitless-tp@512MiB   the same with memory_budget=512 MiB (more kept columns)
    megatron-style    local logits x W_r^T (bf16, then fp32), all-reduce MAX of the row
                      max, SUM of sum-exp and of the target logit (Megatron's
                      vocab_parallel_cross_entropy), dx all-reduced (in bf16)
    dtensor-loss-parallel  torchtitan: nn.Linear + ColwiseParallel(use_local_output=False),
                      F.cross_entropy on the fp32 Shard(-1) logits under loss_parallel()
    logitless-1gpu    logitless on rank 0 with the whole weight (the others wait)

RL log-probs (issue 20 item 6; chosen with --methods): per-token log p(token) and the
entropy at temperature 0.7, upstream gradients on both outputs (fixed random weights
g1, g2: the objective sum(g1 logp + g2 H)):

    logitless-tp-logp      logitless.linear_log_probs(..., entropy=True, process_group=pg)
    megatron-style-logp    local fp32 logits / T, all-reduce MAX, then one SUM of (sum-exp,
                           sum e a, target logit), the gradient from both outputs by hand
    verl-tp-logp           verl's fused kernel with dist_process_group (when importable)
    logitless-1gpu-logp    logitless on rank 0 with the whole weight

Distillation (chosen with --methods): a student and a teacher head of the same H, both
split over the ranks, mean generalized JSD, no hard labels:

    logitless-tp-jsd       logitless.linear_jsd(beta=0.5, process_group=pg) (the mixture's
                           two passes over the columns)
    logitless-tp-kl        the same at beta = 0 (forward KL: one pass, each rank's divergence merged)
    logits-tp-jsd          the logits way: local fp32 logits of both heads, the global
                           log-softmax from an all-reduced MAX and SUM, the JSD summed over ranks
    logitless-1gpu-jsd     logitless at beta 0.5 on rank 0 with the whole weights

Top-k distillation (chosen with --methods; issue 64): the teacher's top-K ids and log-probs
(K = TOPK_K, of a random distribution: the same on every rank), the forward KL with a tail
bucket, mean over tokens:

    logitless-tp-topk      logitless.linear_topk_kl(x, W_r, ids, logp, process_group=pg)
    logitless-1gpu-topk    the same on rank 0 with the whole weight

Columns: fwd+bwd time (the slowest rank's median) as a ratio of ONE GPU's three cuBLAS
GEMMs of the whole problem (x W^T, dz W, dz^T x: 3 x the time of x @ W^T on rank 0; the
distillation rows: four, the teacher's logits too);
peak extra memory per GPU (the largest rank's, beyond inputs and the gradients the
call returns); the loss' relative error vs a float64 reference (chunked, on rank 0)
and vs logitless on one GPU. JSON + markdown: <out>/latest-tp-<device>.{json,md} and
dated copies.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import report
from .rl import reference as rl_reference
from .timing import gemm_ms, peak_extra_bytes, release_memory, time_ms

#: (name, tokens, hidden, vocab) at bf16: the issue's two shapes.
SHAPES = [("llama3.1-8b", 8192, 4096, 128256), ("qwen3-8b", 16384, 4096, 151936)]
CPU_SHAPES = [("cpu-toy", 64, 32, 1001)]
METHODS = ("logitless-tp", "logitless-tp@512MiB", "megatron-style", "dtensor-loss-parallel", "logitless-1gpu")
#: The log-prob methods (not in the default list: pass them with --methods).
LOGP_METHODS = ("logitless-tp-logp", "megatron-style-logp", "verl-tp-logp", "logitless-1gpu-logp")
TEMPERATURE = 0.7
#: The distillation methods (with --methods) and the mixture's beta of the *-jsd rows.
JSD_METHODS = ("logitless-tp-jsd", "logitless-tp-kl", "logits-tp-jsd", "logitless-1gpu-jsd")
JSD_BETA = 0.5
#: The top-k distillation methods (with --methods) and the teacher's K.
TOPK_METHODS = ("logitless-tp-topk", "logitless-1gpu-topk")
TOPK_K = 20


def jsd_beta(method: str) -> float:
    """The beta of a distillation method: 0 (forward KL) for logitless-tp-kl, else JSD_BETA."""
    return 0.0 if method == "logitless-tp-kl" else JSD_BETA


def family(method: str) -> str:
    """"ce", "logp" or "jsd": which loss a method computes (its unit, reference, 1-GPU row)."""
    if method in TOPK_METHODS:
        return "topk"
    return "logp" if method in LOGP_METHODS else "jsd" if method in JSD_METHODS else "ce"


def blocks(v: int, world: int) -> list[int]:
    """torch's Shard(0) row counts of V rows over ``world`` ranks (ceil blocks, the last short)."""
    step = -(-v // world)
    return [max(0, min(step, v - r * step)) for r in range(world)]


# --- the Megatron-style baseline ----------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient (Megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.pg)
        return g, None


def _shifted_local(z, target, start, pg):
    """(z - the global row max, the target's local column (0 where another rank holds
    it), whether this rank holds it, the row indices) of the local logits ``z`` (N, V_r)
    whose columns start at global class ``start``; one all-reduce MAX over ``pg``."""
    m = z.max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=pg)
    local = target - start
    inside = (local >= 0) & (local < z.shape[1])
    idx = torch.where(inside, local, torch.zeros_like(local))
    return z - m[:, None], idx, inside, torch.arange(z.shape[0], device=z.device)


class _VocabParallelCE(torch.autograd.Function):
    """Megatron's _VocabParallelCrossEntropy on fp32 local logits (N, V_r)."""

    @staticmethod
    def forward(ctx, logits, target, start, pg):
        logits, idx, inside, rows = _shifted_local(logits, target, start, pg)
        predicted = torch.where(inside, logits[rows, idx], 0.0)
        dist.all_reduce(predicted, group=pg)
        exp = logits.exp_()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=pg)
        loss = torch.log(sum_exp) - predicted
        exp.div_(sum_exp[:, None])
        ctx.save_for_backward(exp, idx, inside)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, idx, inside = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        softmax[rows, idx] -= inside.to(softmax.dtype)
        softmax.mul_(g[:, None])
        return softmax, None, None, None


def megatron_style(x, w_local, target, start, pg):
    logits = F.linear(_CopyToTP.apply(x, pg), w_local)
    return _VocabParallelCE.apply(logits.float(), target, start, pg).mean()


class _VocabParallelLogProbs(torch.autograd.Function):
    """Per-token log p(target) and entropy of softmax(a), a = fp32 local logits / T (N, V_r),
    vocabulary split over ``pg``: all-reduce MAX of the row max, one SUM of (sum-exp,
    sum e (a - m), target's a - m). Backward from both outputs:
    da_j = g1 (1[j = t] - p_j) - g2 p_j (log p_j + H)."""

    @staticmethod
    def forward(ctx, a, target, start, pg):
        a, idx, inside, rows = _shifted_local(a, target, start, pg)
        e = a.exp()
        packed = torch.stack([e.sum(dim=-1), (e * a).sum(dim=-1), torch.where(inside, a[rows, idx], 0.0)])
        dist.all_reduce(packed, group=pg)
        s, u, at = packed.unbind(0)
        logs = torch.log(s)
        logp = at - logs
        ent = logs - u / s
        a.sub_(logs[:, None])  # log p
        ctx.save_for_backward(a, ent, idx, inside)
        return logp, ent

    @staticmethod
    def backward(ctx, g1, g2):
        logp_all, ent, idx, inside = ctx.saved_tensors
        p = logp_all.exp()
        da = -(g1[:, None] * p) - g2[:, None] * p * (logp_all + ent[:, None])
        rows = torch.arange(da.shape[0], device=da.device)
        da[rows, idx] += torch.where(inside, g1, torch.zeros_like(g1))
        return da, None, None, None


def megatron_style_logp(x, w_local, target, start, pg, temperature=TEMPERATURE):
    logits = F.linear(_CopyToTP.apply(x, pg), w_local)
    return _VocabParallelLogProbs.apply(logits.float() / temperature, target, start, pg)


class _AllReduceSum(torch.autograd.Function):
    """A sum over the ranks. Backward: ``"sum"`` all-reduces the gradient (each rank holds
    part of d/d(sum), as for a normalizer that every rank's terms use), ``"identity"``
    passes it on (the summed loss itself: every rank seeds its own term once)."""

    @staticmethod
    def forward(ctx, a, pg, backward):
        ctx.pg, ctx.mode = pg, backward
        a = a.clone()
        dist.all_reduce(a, group=pg)
        return a

    @staticmethod
    def backward(ctx, g):
        if ctx.mode == "sum":
            g = g.contiguous().clone()
            dist.all_reduce(g, group=ctx.pg)
        return g, None, None


def _tp_log_softmax(z, pg):
    """log-softmax of fp32 local logits (N, V_r) over the whole split vocabulary."""
    m = z.detach().max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=pg)
    z = z - m[:, None]
    return z - _AllReduceSum.apply(z.exp().sum(dim=-1), pg, "sum").log()[:, None]


def logits_tp_jsd(xs, ws_local, xt, wt_local, pg, beta=JSD_BETA):
    """The vocab-parallel logits way: mean generalized JSD of both heads' local fp32 logits."""
    lp = _tp_log_softmax(F.linear(_CopyToTP.apply(xs, pg), ws_local).float(), pg)
    with torch.no_grad():
        lq = _tp_log_softmax(F.linear(xt, wt_local).float(), pg)
    lm = torch.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
    local = beta * (lq.exp() * (lq - lm)).sum(-1) + (1 - beta) * (lp.exp() * (lp - lm)).sum(-1)
    return _AllReduceSum.apply(local, pg, "identity").mean()


def _jsd_loss(method, xs, ws, xt, wt, pg):
    """The mean distillation loss of one JSD method (ws, wt: this rank's rows, or the
    whole heads for the one-GPU row)."""
    import logitless

    if method == "logits-tp-jsd":
        return logits_tp_jsd(xs, ws, xt, wt, pg)
    return logitless.linear_jsd(xs, ws, xt, wt, beta=jsd_beta(method),
                                process_group=None if method == "logitless-1gpu-jsd" else pg)


def _verl_lce():
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

    return linear_cross_entropy


# --- the worker ---------------------------------------------------------------------

def _reference_loss(x, w, target) -> float:
    """Mean cross-entropy in float64, 1024 tokens at a time (rank 0)."""
    total = 0.0
    wd = w.double()
    for n0 in range(0, x.shape[0], 1024):
        z = x[n0:n0 + 1024].double() @ wd.T
        total += F.cross_entropy(z, target[n0:n0 + 1024], reduction="sum").item()
        del z
    return total / x.shape[0]


def _reference_jsd(xs, ws, xt, wt, beta) -> float:
    """Mean generalized JSD in float64, 1024 tokens at a time (rank 0)."""
    from logitless.ops.linear_jsd.reference import linear_jsd_reference

    total = 0.0
    for n0 in range(0, xs.shape[0], 1024):
        total += linear_jsd_reference(xs[n0:n0 + 1024], ws, xt[n0:n0 + 1024], wt, beta=beta,
                                      reduction="sum").item()
    return total / xs.shape[0]


def _topk_teacher(n, v, device, g):
    """The teacher's top-TOPK_K ids and log-probs of a random distribution (logits N(0, 4)),
    1024 tokens at a time; the same on every rank (the generator's seed)."""
    ids = torch.empty(n, TOPK_K, dtype=torch.int64, device=device)
    lp = torch.empty(n, TOPK_K, dtype=torch.float32, device=device)
    for n0 in range(0, n, 1024):
        z = torch.randn(min(1024, n - n0), v, device=device, generator=g) * 2
        lp[n0:n0 + 1024], ids[n0:n0 + 1024] = torch.log_softmax(z, -1).topk(TOPK_K, -1)
        del z
    return ids, lp


def _reference_topk(x, w, ids, lp) -> float:
    """Mean forward KL with a tail bucket in float64, 512 tokens at a time (rank 0)."""
    from logitless.ops.linear_topk_kl.reference import linear_topk_kl_reference

    total = 0.0
    for n0 in range(0, x.shape[0], 512):
        s = slice(n0, n0 + 512)
        total += linear_topk_kl_reference(x[s], w, ids[s], lp[s], reduction="sum").item()
    return total / x.shape[0]


def _max_over_ranks(value, device):
    t = torch.tensor([float("nan") if value is None else value], dtype=torch.float64, device=device)
    if value is None:
        t.fill_(-1.0)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    v = t.item()
    return None if v < 0 else v


def past_deadline(deadline, device) -> bool:
    """Whether any rank is past the deadline (one collective: every rank decides alike)."""
    if not deadline:
        return False
    late = torch.tensor([float(time.time() > deadline)], device=device)
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())


def _logp_outputs(method, wg, target, start, pg):
    """x -> (log-probs, entropy) of one log-prob method (None on the idle ranks of a 1-GPU row)."""
    import logitless

    if wg is None:
        return None
    if method == "logitless-1gpu-logp":
        return lambda x: logitless.linear_log_probs(x, wg, target, temperature=TEMPERATURE, entropy=True)
    if method == "logitless-tp-logp":
        return lambda x: logitless.linear_log_probs(x, wg, target, temperature=TEMPERATURE, entropy=True,
                                                    process_group=pg)
    if method == "megatron-style-logp":
        return lambda x: megatron_style_logp(x, wg, target, start, pg)
    verl = _verl_lce()  # ImportError: reported in the row
    return lambda x: tuple(verl(x, wg, target, TEMPERATURE, "none", pg))


def _case(name, n, h, v, dtype, device, pg, warmup, reps, methods, log, deadline=None):
    import logitless

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = blocks(v, world)
    start = sum(rows[:rank])
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, h, device=device, dtype=dtype, generator=g)
    w = (torch.randn(v, h, device=device, dtype=dtype, generator=g) * h ** -0.5)
    target = torch.randint(0, v, (n,), device=device, generator=g)
    w_local = w[start:start + rows[rank]].clone()
    unit = 3 * gemm_ms(x, w, warmup=warmup, reps=reps) if rank == 0 else 0.0
    families = {family(m) for m in methods}
    ref = _reference_loss(x, w, target) if rank == 0 and "ce" in families else 0.0
    ref_logp = rl_reference(x, w, target, TEMPERATURE) if rank == 0 and "logp" in families else None
    xt = wt = wt_local = None
    ref_jsd = {}  # {beta: the float64 loss}
    if "jsd" in families:
        xt = torch.randn(n, h, device=device, dtype=dtype, generator=g)
        wt = torch.randn(v, h, device=device, dtype=dtype, generator=g) * h ** -0.5
        wt_local = wt[start:start + rows[rank]].clone()
        if rank == 0:
            ref_jsd = {b: _reference_jsd(x, w, xt, wt, b) for b in {jsd_beta(m) for m in methods if family(m) == "jsd"}}
    ids = lp_topk = None
    ref_topk = 0.0
    if "topk" in families:
        ids, lp_topk = _topk_teacher(n, v, device, g)
        ref_topk = _reference_topk(x, w, ids, lp_topk) if rank == 0 else 0.0
    # Upstream gradients of the two log-prob outputs (the same on every rank).
    g1 = torch.rand(n, device=device, generator=g)
    g2 = torch.rand(n, device=device, generator=g) * 0.1
    if device.type == "cuda" and rank != 0 and "dtensor-loss-parallel" not in methods:
        del w, wt  # the full weights only serve the one-GPU rows (rank 0) and the DTensor method
    release_memory(device)
    row = {"shape": name, "tokens": n, "hidden": h, "vocab": v, "dtype": str(dtype).replace("torch.", ""),
           "world": world, "blocks": rows, "unit_ms": unit, "reference_loss": ref, "methods": {}}
    one_gpu = {}  # {family: the one-GPU run's loss}
    for method in methods:
        if past_deadline(deadline, device):
            row["skipped"] = f"time limit before {method}"
            log(f"  {name:<12} time limit: skipping {method} and the rest")
            break
        xg = x.clone().requires_grad_()
        fn = wg = None
        grads = 0
        if method in JSD_METHODS:
            one = method == "logitless-1gpu-jsd"
            wg = (w if one else w_local).clone().requires_grad_() if (rank == 0 or not one) else None
            wtg = wt if one else wt_local
            grads = xg.numel() * xg.element_size() + (wg.numel() * wg.element_size() if wg is not None else 0)
            if wg is not None:
                fn = lambda xg=xg, wg=wg, wtg=wtg, method=method: _jsd_loss(  # noqa: E731
                    method, xg, wg, xt, wtg, pg).backward()
        elif method in LOGP_METHODS:
            one = method == "logitless-1gpu-logp"
            wg = (w if one else w_local).clone().requires_grad_() if (rank == 0 or not one) else None
            grads = xg.numel() * xg.element_size() + (wg.numel() * wg.element_size() if wg is not None else 0)
            try:
                outputs, build_error = _logp_outputs(method, wg, target, start, pg), None
            except Exception as exc:  # noqa: BLE001 (an optional peer: reported in its row)
                outputs, build_error = None, exc

            def fn(xg=xg, outputs=outputs):
                lp, ent = outputs(xg)
                (lp * g1 + ent * g2).sum().backward()
        elif method in TOPK_METHODS:
            one = method == "logitless-1gpu-topk"
            wg = (w if one else w_local).clone().requires_grad_() if (rank == 0 or not one) else None
            grads = xg.numel() * xg.element_size() + (wg.numel() * wg.element_size() if wg is not None else 0)
            if wg is not None:
                fn = lambda xg=xg, wg=wg, one=one: logitless.linear_topk_kl(  # noqa: E731
                    xg, wg, ids, lp_topk, process_group=None if one else pg).backward()
        elif method == "logitless-1gpu":
            if rank == 0:
                wg = w.clone().requires_grad_()
                fn = lambda: logitless.linear_cross_entropy(xg, wg, target).backward()  # noqa: E731
                grads = xg.numel() * xg.element_size() + wg.numel() * wg.element_size()
        elif method == "dtensor-loss-parallel":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

            mesh = init_device_mesh(device.type, (world,))
            lin = torch.nn.Linear(h, v, bias=False, device=device, dtype=dtype)
            with torch.no_grad():
                lin.weight.copy_(w)
            parallelize_module(lin, mesh, ColwiseParallel(use_local_output=False))

            def fn(lin=lin, xg=xg):
                logits = lin(xg)
                with loss_parallel():
                    loss = F.cross_entropy(logits.float(), target)
                    loss.backward()
                return loss

            wg = lin.weight
            grads = xg.numel() * xg.element_size() + w_local.numel() * w_local.element_size()
        else:
            wg = w_local.clone().requires_grad_()
            grads = xg.numel() * xg.element_size() + wg.numel() * wg.element_size()
            if method.startswith("logitless-tp"):
                budget = 512 * 2**20 if method.endswith("@512MiB") else None
                fn = lambda: logitless.linear_cross_entropy(  # noqa: E731
                    xg, wg, target, process_group=pg, memory_budget=budget).backward()
            else:
                fn = lambda: megatron_style(xg, wg, target, start, pg).backward()  # noqa: E731

        def setup(xg=xg, wg=wg, method=method):
            xg.grad = None
            if wg is not None:
                wg.grad = None
            if not method.startswith("logitless-1gpu"):
                dist.barrier()

        res = {}
        try:
            if method.startswith("logitless-1gpu") and rank != 0:
                ms = mem = None
            elif method in LOGP_METHODS:
                if build_error is not None:
                    raise build_error
                ms = time_ms(fn, device=device, setup=setup, warmup=warmup, reps=reps)
                setup()
                _, mem = peak_extra_bytes(fn, device=device, exclude_bytes=grads)
                with torch.no_grad():
                    lp, ent = outputs(x)
                if rank == 0:
                    res["logp_err_fp64"] = (lp.double() - ref_logp[0]).abs().max().item()
                    res["entropy_err_fp64"] = (ent.double() - ref_logp[1]).abs().max().item()
                    res["loss"] = float((lp.double() * g1.double()).sum() / n)  # for the 1-GPU column
            else:
                ms = time_ms(fn, device=device, setup=setup, warmup=warmup, reps=reps)
                setup()
                _, mem = peak_extra_bytes(fn, device=device, exclude_bytes=grads)
                # The loss of one more call (for the error columns), without its backward.
                with torch.no_grad():
                    if method in JSD_METHODS:
                        loss = _jsd_loss(method, x, wg, xt, wtg, pg)
                    elif method in TOPK_METHODS:
                        loss = logitless.linear_topk_kl(x, wg, ids, lp_topk,
                                                        process_group=None if method.startswith("logitless-1gpu")
                                                        else pg)
                    elif method.startswith("logitless-tp"):
                        loss = logitless.linear_cross_entropy(x, wg, target, process_group=pg)
                    elif method == "megatron-style":
                        loss = megatron_style(x, wg, target, start, pg)
                    elif method == "logitless-1gpu":
                        loss = logitless.linear_cross_entropy(x, wg, target)
                    else:
                        with loss_parallel():
                            loss = F.cross_entropy(lin(x).float(), target)
                        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
                res["loss"] = float(loss)
            if rank == 0 and method.startswith("logitless-1gpu"):
                one_gpu[family(method)] = res["loss"]
        except Exception as exc:  # noqa: BLE001 (a failing method must not stop the others)
            res["error"] = f"{type(exc).__name__}: {exc}"[:300]
            ms = mem = None
        if not method.startswith("logitless-1gpu"):
            ms = _max_over_ranks(ms, device)
            mem = _max_over_ranks(mem, device)
        res.update(ms=ms, peak_extra_mib=None if mem is None else mem / 2**20)
        row["methods"][method] = res
        fn = xg = wg = None
        release_memory(device)
        if not method.startswith("logitless-1gpu") or rank == 0:
            log(f"  {name:<12} {method:<22} " + (f"{ms:9.2f} ms" if ms is not None else "        -   ")
                + (f"  {mem / 2**20:9.0f} MiB" if mem is not None else "") + (f"  {res.get('error', '')}"))
    for method, res in row["methods"].items():
        if rank == 0 and res.get("loss") is not None:
            fam = family(method)
            # The distillation rows' unit: one GPU's four GEMMs (the teacher's logits too).
            res["ratio"] = res["ms"] / (unit * (4 / 3 if fam == "jsd" else 1)) if res.get("ms") and unit else None
            if fam == "ce":
                res["rel_err_fp64"] = abs(res["loss"] - ref) / abs(ref)
            elif fam == "jsd":
                r64 = ref_jsd[jsd_beta(method)]
                res["rel_err_fp64"] = abs(res["loss"] - r64) / abs(r64)
            elif fam == "topk":
                res["rel_err_fp64"] = abs(res["loss"] - ref_topk) / abs(ref_topk)
            ref1 = one_gpu.get(fam) if method != "logitless-tp-kl" else None
            if ref1 is not None:
                res["rel_err_1gpu"] = abs(res["loss"] - ref1) / abs(ref1)
    return row


def _worker(rank: int, world: int, port: int, cpu: bool, opts: dict):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5))
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device,
                                timeout=datetime.timedelta(minutes=5))
    pg = dist.group.WORLD

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    rows = []
    interrupted = None
    try:
        for name, n, h, v in opts["shapes"]:
            if past_deadline(opts["deadline"], device):
                interrupted = "time limit"
                break
            dtype = torch.float32 if cpu else torch.bfloat16
            rows.append(_case(name, n, h, v, dtype, device, pg, opts["warmup"], opts["reps"], opts["methods"], log,
                              opts["deadline"]))
            if rows[-1].get("skipped"):
                interrupted = rows[-1]["skipped"]
    except KeyboardInterrupt as exc:
        interrupted = str(exc) or "interrupted"
    if rank == 0:
        _save(rows, device, opts, interrupted)
    dist.barrier()
    dist.destroy_process_group()


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _err_cell(r) -> str:
    if "logp_err_fp64" in r:  # the log-prob methods: max abs errors of both outputs
        return f"logp {r['logp_err_fp64']:.1e}, H {r['entropy_err_fp64']:.1e}"
    return _fmt(r.get("rel_err_fp64"), ".1e")


def markdown(data: dict) -> str:
    meta = data["meta"]
    lines = [f"# Vocab-parallel losses ({data['world']} ranks, {meta['device']})", "",
             f"{meta['date']} | torch {meta['torch']} | triton {meta['triton']} | cuda {meta['cuda']} | "
             f"`{meta['command']}`", "",
             "fwd+bwd: slowest rank's median, as a ratio of one GPU's three cuBLAS GEMMs of the whole problem "
             "(the *-jsd/-kl rows: four, the teacher's logits too; lower is better); "
             "memory: peak extra per GPU beyond inputs and returned gradients; errors: "
             "relative error of the loss vs float64 and vs logitless on one GPU; for the *-logp rows "
             f"(per-token log-prob and entropy at T = {TEMPERATURE}, upstream gradients on both): max abs error of "
             "both outputs vs float64, and the relative error of sum(g1 logp) / N vs logitless on one GPU.", "",
             "| shape | method | fwd+bwd ms | x 3 GEMMs | extra MiB/GPU | rel err fp64 | rel err 1-GPU |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in data["rows"]:
        for method, r in row["methods"].items():
            lines.append(f"| {row['shape']} ({row['tokens']}x{row['hidden']}x{row['vocab']}) | {method} | "
                         f"{_fmt(r.get('ms'), '.2f')} | {_fmt(r.get('ratio'), '.3f')} | "
                         f"{_fmt(r.get('peak_extra_mib'), '.0f')} | {_err_cell(r)} | "
                         f"{_fmt(r.get('rel_err_1gpu'), '.1e')} |" + (f" {r['error']}" if r.get("error") else ""))
    if data.get("note"):
        lines += ["", f"Note: {data['note']}"]
    return "\n".join(lines) + "\n"


def _save(rows, device, opts, interrupted):
    meta = report.environment(device)
    meta["command"] = opts["command"]  # the parent's, not the spawned worker's
    data = {"suite": "tp", "meta": meta, "world": opts["world"], "rows": rows, "complete": interrupted is None,
            "note": f"partial: {interrupted}" if interrupted else ""}
    out = Path(opts["out"])
    out.mkdir(parents=True, exist_ok=True)
    tag = meta["device_tag"]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    text = markdown(data)
    written = []
    for stem in (f"latest-tp-{tag}", f"tp-{tag}-{stamp}"):
        (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
        (out / f"{stem}.md").write_text(text)
        written += [out / f"{stem}.json", out / f"{stem}.md"]
    print("\n" + text, flush=True)
    print("files: " + " ".join(str(p) for p in written), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(args, cpu: bool) -> int:
    """``python -m logitless_bench --suite tp`` (options of cli.py: --shapes, --methods,
    --quick, --warmup, --reps, --max-minutes, --out, --cpu)."""
    world = 2 if cpu else torch.cuda.device_count()
    if not cpu and world < 2:
        print("[tp] needs >= 2 GPUs (one process per GPU); use --cpu for the gloo harness check", flush=True)
        return 2
    pool = CPU_SHAPES if cpu else SHAPES
    wanted = [s.strip() for s in (args.shapes or "").split(",") if s.strip()]
    if wanted:
        known = {s[0]: s for s in SHAPES + CPU_SHAPES}
        unknown = [w for w in wanted if w not in known]
        if unknown:
            raise SystemExit(f"unknown tp shape(s) {unknown}; known: {list(known)}")
        pool = [known[w] for w in wanted]
    if args.quick:
        pool = pool[:1]
    methods = [m.strip() for m in (args.methods or "").split(",") if m.strip()] or list(METHODS)
    known = METHODS + LOGP_METHODS + JSD_METHODS + TOPK_METHODS
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise SystemExit(f"unknown tp method(s) {unknown}; known: {list(known)}")
    if args.no_peers:
        methods = [m for m in methods if m.startswith("logitless")]
    if cpu:
        print(report.CPU_BANNER, flush=True)
    import shlex

    opts = dict(shapes=pool, methods=methods, world=world, out=args.out or "benchmarks/results",
                command=shlex.join(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv),
                warmup=args.warmup if args.warmup is not None else (1 if args.quick else 3),
                reps=args.reps if args.reps is not None else (3 if args.quick else 10),
                deadline=time.time() + 60 * args.max_minutes if args.max_minutes else None)
    print(f"[tp] {world} processes ({'gloo, CPU' if cpu else 'NCCL, one GPU each'}): "
          f"{', '.join(s[0] for s in pool)} x {', '.join(methods)}", flush=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.multiprocessing.spawn(_worker, args=(world, _free_port(), cpu, opts), nprocs=world, join=True)
    sys.stdout.flush()
    return 0
