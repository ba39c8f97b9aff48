"""Vocab-parallel linear_jsd per rank: the KL limits' one pass (the merge) against two, and
the second pass of 0 < beta < 1, against the op without a group.

    python benchmarks/probe_tp_jsd.py [--shapes A,B] [--tp 2] [--betas 0,1,0.5] [--rounds 5] [--json out.json]
    torchrun --nproc_per_node N benchmarks/probe_tp_jsd.py [...]       (a real TP group of N GPUs)

A rank of a TP group holds V / tp rows of both heads. At beta 0 or 1 the forward merges
each rank's own divergence sum with the log-sum-exps
(``ops.linear_jsd.vocab_parallel._merge_kl_limits``: the backend's forward over the rank's
columns, then the two small collectives); ``override(jsd_tp_merge=False)`` forces the
second pass over the rank's columns with the merged lse's, which 0 < beta < 1 always
takes (the backend's ``column_sums``; on the Triton backend cuBLAS logit chunks and one
Triton sweep).

One process (default): the per-rank work on ONE GPU, a one-process group (NCCL on CUDA,
gloo on the CPU) whose only rank holds the V / tp rows, so the collectives cost nothing
(on a real group they move 3-4 x N floats). Under torchrun (WORLD_SIZE > 1, tp = the
world size): every rank builds the full heads (same seed) and keeps its block of rows;
each measure runs a fixed number of calls on every rank (do_bench would pick its
repetitions per rank and desynchronise the collectives), and the slowest rank's median is
reported; no deadline (every rank runs the same rounds); rank 0 prints and writes.

Each round times, interleaved (``benchmarks/cute/interleave.py``): the four cuBLAS GEMMs of
the rank's floor, then per beta the forward (no grad) and forward+backward of: ``tp`` (the
shipped path: the merge at the KL limits, two passes elsewhere), ``two-pass`` (forced; KL
limits only), and ``1-gpu`` (the op on the rank's columns without a group: the rank's work
with no TP). Ratios are the median over rounds of the same round's ratio. Checks: the
per-token losses' and the gradients' (dx, dW) largest relative difference of the TP op
against the op without a group (one process: on the same columns; several: on the full
heads), and the losses' at the KL limits tp vs two-pass (fp32 rounding expected). Default
budget (256 MiB). Without CUDA: a tiny shape on the interpreter over gloo (harness check
only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cute"))
import interleave  # noqa: E402
from _probe_common import probe_meta, write_json  # noqa: E402

#: (tokens, student H, teacher H, full V) as probe_jsd_kl's A and B.
SHAPES = {"A": (4096, 4096, 8192, 128256), "B": (4096, 2048, 2048, 151936)}
METHODS = ("tp", "two-pass", "1-gpu")


def _group(cuda: bool):
    """The process group: torchrun's (WORLD_SIZE > 1: a real TP group, one GPU per rank),
    else a one-process group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return dist.group.WORLD


def _synced(bench, world: int, device):
    """``fn -> ms`` for a group of ``world`` processes: a fixed number of calls timed on
    each rank (``logitless_bench.timing.time_ms``; do_bench picks its repetitions per rank,
    which would desynchronise the collectives), the slowest rank's median."""
    if world == 1:
        return bench
    import torch
    import torch.distributed as dist
    from logitless_bench.timing import time_ms

    def timed(fn):
        ms = torch.tensor([time_ms(fn, device=device, warmup=3, reps=15)], dtype=torch.float64,
                          device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        return float(ms.item())

    return timed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="A,B")
    ap.add_argument("--tp", type=int, default=2, help="the TP size whose one rank is simulated")
    ap.add_argument("--betas", default="0,1,0.5")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting rounds after this")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    cuda = "TRITON_INTERPRET" not in os.environ and torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import logitless
    from logitless.ops.linear_jsd.bench_shapes import DistillShape
    from logitless.planning.overrides import override
    from logitless_bench.distill import make_inputs

    import torch.distributed as dist

    if cuda and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    pg = _group(cuda)
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = world if world > 1 else a.tp
    shapes = {k: SHAPES[k] for k in a.shapes.split(",")} if cuda else {"tiny": (24, 16, 24, 400)}
    betas = [float(b) for b in a.betas.split(",")]
    bench = _synced(interleave.gpu_bench(warmup=3, rep=30) if cuda else interleave.cpu_bench(reps=1), world, dev)
    if world > 1:
        note = f"{world} processes, one GPU each: the slowest rank's time, collectives included"
    else:
        note = "one GPU, a one-process group holding V / tp rows: the per-rank work, collectives not measured"
    record = probe_meta(budget_mib=256, tp=tp, world=world, rounds=a.rounds, shapes={},
                        note=note if cuda else "CPU interpreter over gloo: harness only")
    deadline = time.monotonic() + a.budget_s
    for label, (n, hs, ht, v_full) in shapes.items():
        v = -(-v_full // tp)
        if world > 1:  # the full heads on every rank (same seed), then this rank's rows
            xs, ws_full, xt, wt_full, t = make_inputs(DistillShape(label, n, hs, ht, v_full), dev, 0)
            mine = slice(rank * v, min(v_full, (rank + 1) * v))
            ws, wt = ws_full[mine].contiguous(), wt_full[mine].contiguous()
        else:
            xs, ws, xt, wt, t = make_inputs(DistillShape(label, n, hs, ht, v), dev, 0)
            ws_full = wt_full = None
        v = ws.shape[0]
        xg, wg = xs.detach().requires_grad_(), ws.detach().requires_grad_()

        def call(x, w, beta, method, **kw):
            group = None if method == "1-gpu" else pg
            with override(jsd_tp_merge=method != "two-pass"):
                return logitless.linear_jsd(x, w, xt, wt, t, beta=beta, backend="triton", process_group=group, **kw)

        measures = {}
        if cuda:
            with torch.no_grad():
                dz = torch.randn(n, v, device=dev, dtype=xs.dtype)
            measures["floor"] = lambda: (bench(lambda: xs @ ws.T) + bench(lambda: xt @ wt.T) + bench(lambda: dz @ ws)
                                         + bench(lambda: dz.T @ xs))
        for beta in betas:
            for method in METHODS:
                if method == "two-pass" and beta not in (0.0, 1.0):
                    continue  # (no merge there: "tp" is the two-pass path)

                def fwd(beta=beta, method=method):
                    with torch.no_grad():
                        call(xs, ws, beta, method)

                def step(beta=beta, method=method):
                    xg.grad = wg.grad = None
                    call(xg, wg, beta, method).backward()

                measures[f"beta{beta:g}/{method}/fwd"] = lambda f=fwd: bench(f)
                measures[f"beta{beta:g}/{method}/fb"] = lambda s=step: bench(s)
        # (several processes: no deadline, so that every rank runs the same rounds)
        res = interleave.interleaved(measures, rounds=a.rounds if cuda else 1,
                                     deadline=deadline if cuda and world == 1 else None)
        rows = {}

        def ratio(num, den):
            ns, ds = res.get(num, {}).get("samples") or [], res.get(den, {}).get("samples") or []
            r = sorted(x / y for x, y in zip(ns, ds))
            return r[len(r) // 2] if r else None

        for beta in betas:
            for method in METHODS:
                key = f"beta{beta:g}/{method}"
                if f"{key}/fwd" not in res:
                    continue
                row = {k: res[f"{key}/{k}"].get("ms") for k in ("fwd", "fb")}
                row["errors"] = {k: res[f"{key}/{k}"]["error"] for k in ("fwd", "fb") if "error" in res[f"{key}/{k}"]}
                if cuda:
                    row["fb_x_floor"] = ratio(f"{key}/fb", "floor")
                if method != "1-gpu":
                    row["fwd_x_1gpu"] = ratio(f"{key}/fwd", f"beta{beta:g}/1-gpu/fwd")
                    row["fb_x_1gpu"] = ratio(f"{key}/fb", f"beta{beta:g}/1-gpu/fb")
                rows[key] = row
            # the TP op against the op without a group: on the same columns (one process), or
            # on the full heads (several: the TP op's dx is the full one, its dW this rank's rows)
            w_ref, wt_ref = (ws, wt) if world == 1 else (ws_full, wt_full)
            with torch.no_grad():
                lt = call(xs, ws, beta, "tp", reduction="none")
                l1 = logitless.linear_jsd(xs, w_ref, xt, wt_ref, t, beta=beta, backend="triton", reduction="none")
            rows[f"beta{beta:g}/loss_rel_diff_1gpu"] = ((lt - l1).abs().max() / l1.abs().max().clamp_min(1e-30)).item()
            xg.grad = wg.grad = None
            call(xg, wg, beta, "tp").backward()
            dx_tp, dw_tp = xg.grad.float(), wg.grad.float()
            x1, w1 = xs.detach().requires_grad_(), w_ref.detach().requires_grad_()
            logitless.linear_jsd(x1, w1, xt, wt_ref, t, beta=beta, backend="triton").backward()
            dw_1 = w1.grad.float() if world == 1 else w1.grad.float()[rank * -(-v_full // tp):][:v]
            rows[f"beta{beta:g}/grad_rel_diff_1gpu"] = {
                name: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                for name, a, b in (("dx", dx_tp, x1.grad.float()), ("dw", dw_tp, dw_1))}
            del dx_tp, dw_tp, x1, w1, dw_1
            if beta in (0.0, 1.0):
                rows[f"beta{beta:g}/tp_over_two_pass"] = dict(
                    fwd=ratio(f"beta{beta:g}/tp/fwd", f"beta{beta:g}/two-pass/fwd"),
                    fb=ratio(f"beta{beta:g}/tp/fb", f"beta{beta:g}/two-pass/fb"))
                with torch.no_grad():
                    lm = call(xs, ws, beta, "tp", reduction="none")
                    l2 = call(xs, ws, beta, "two-pass", reduction="none")
                rows[f"beta{beta:g}/loss_rel_diff"] = ((lm - l2).abs().max() / l2.abs().max().clamp_min(1e-30)).item()
        if cuda:
            rows["floor_ms"] = res["floor"]["ms"]
        record["shapes"][label] = dict(tokens=n, hs=hs, ht=ht, vocab_full=v_full, vocab_local=v, rows=rows,
                                       rounds=res.get("_rounds"))
        if rank == 0:
            _print(label, n, hs, ht, v_full, v, tp, rows, betas, world)
            if a.json:
                write_json(a.json, record)
        del xs, ws, xt, wt, xg, wg, ws_full, wt_full
        if cuda:
            torch.cuda.empty_cache()
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def _print(label, n, hs, ht, v_full, v, tp, rows, betas, world) -> None:
    fl = rows.get("floor_ms")
    who = f"TP={tp} over {world} processes (rank 0's columns; times: the slowest rank)" if world > 1 else \
        f"one rank of TP={tp}"
    print(f"\n{label}: {who}: {n} tokens, H {hs} <- {ht}, V {v_full} ({v} per rank)"
          + (f"; rank floor (4 cuBLAS GEMMs) {fl:.2f} ms" if fl else ""), flush=True)
    print("| beta | method | fwd ms | f+b ms | f+b / floor | fwd / 1-gpu | f+b / 1-gpu |")
    print("|---|---|---|---|---|---|---|")
    for beta in betas:
        for method in METHODS:
            r = rows.get(f"beta{beta:g}/{method}")
            if r is None:
                continue
            print(f"| {beta:g} | {method} | {_f(r['fwd'])} | {_f(r['fb'])} | {_f(r.get('fb_x_floor'), '{:.3f}')} | "
                  f"{_f(r.get('fwd_x_1gpu'), '{:.3f}')} | {_f(r.get('fb_x_1gpu'), '{:.3f}')} |"
                  + (f" errors {r['errors']}" if r["errors"] else ""))
        gd = rows[f"beta{beta:g}/grad_rel_diff_1gpu"]
        print(f"| {beta:g} | tp vs 1-gpu | | | | | |  loss rel diff {rows[f'beta{beta:g}/loss_rel_diff_1gpu']:.2e}, "
              f"dx {gd['dx']:.2e}, dW {gd['dw']:.2e}")
        m = rows.get(f"beta{beta:g}/tp_over_two_pass")
        if m:
            print(f"| {beta:g} | tp / two-pass | {_f(m['fwd'], '{:.3f}')} | {_f(m['fb'], '{:.3f}')} | | | |"
                  f"  loss rel diff {rows[f'beta{beta:g}/loss_rel_diff']:.2e}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
