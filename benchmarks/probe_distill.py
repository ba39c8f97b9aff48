"""Probe for linear_jsd's Triton backend on a GPU: forward, forward+backward and the
GEMM floor at one shape, for a few tiles of the fused backward kernel.

    PYTHONPATH=src python benchmarks/probe_distill.py [--tokens 4096 --hs 4096 --ht 8192 --vocab 128256]

Prints one line per tile configuration (block_n, block_v, block_h, num_warps, num_stages)
of ``_plans.JSD_CUDA_TILES[2]``: forward ms, forward+backward ms, their ratio to the
floor (four cuBLAS GEMMs) and the backward share; the first line is the default.
``--schedule``: the backward kernel's plain against its grouped program order instead.
``--issue23 [--json PATH]``: issue 23's A/B instead (each also runs on the CPU interpreter
at a tiny shape with ``--cpu-smoke``): the forward with split-row statistics against one
program per row block (``override(num_sms=1)`` gives the old launch), forward chunks of
128 rows (the old rounding, via the budget) against the default, the default plan's
forward+backward with the cost model's prediction, and gradient-in-forward (the model's
choice at ``--big-budget-mib``, and forced for every token at once) with peak memory.
"""

from __future__ import annotations

import argparse

import torch

import logitless
from logitless.ops.linear_jsd.bench_shapes import DistillShape
from logitless.planning.overrides import override
from logitless.planning.plans import JSD_CUDA_TILES
from logitless_bench import timing
from logitless_bench.distill import gemm_floor_ms, make_inputs

CONFIGS = [None, (128, 64, 64, 8, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 2), (128, 128, 32, 8, 4)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hs", type=int, default=4096)
    p.add_argument("--ht", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--schedule", action="store_true",
                   help="instead of tiles: the plain against the grouped program order, 3 interleaved rounds")
    p.add_argument("--issue23", action="store_true", help="issue 23's A/B (see the module docstring)")
    p.add_argument("--big-budget-mib", type=int, default=8192)
    p.add_argument("--json", default=None)
    p.add_argument("--cpu-smoke", action="store_true", help="--issue23 on the CPU interpreter, tiny shape")
    a = p.parse_args()
    if a.issue23:
        return issue23(a)
    dev = torch.device("cuda")
    shape = DistillShape("probe", a.tokens, a.hs, a.ht, a.vocab)
    xs, ws, xt, wt, t = make_inputs(shape, dev, 0)
    floor = gemm_floor_ms(xs, ws, xt, wt, warmup=2, reps=a.reps)
    print(f"shape {shape.label}: floor {floor['floor']:.2f} ms "
          + ", ".join(f"{k} {v:.2f}" for k, v in floor.items() if k != "floor"), flush=True)
    default = JSD_CUDA_TILES[2]
    xg, wg = xs.detach().requires_grad_(), ws.detach().requires_grad_()

    def setup():
        xg.grad = wg.grad = None

    def step():
        logitless.linear_jsd(xg, wg, xt, wt, t).backward()

    if a.schedule:
        times = {False: [], True: []}
        for _ in range(3):
            for group in (False, True):
                with override(kernel_options=dict(group=group)):
                    times[group].append(timing.time_ms(step, device=dev, setup=setup, warmup=2, reps=a.reps))
        for group, ts in times.items():
            ts = sorted(ts)
            order = "grouped" if group else "plain"
            print(f"{order} order: fwd+bwd {ts[1]:.2f} ms ({ts[1] / floor['floor']:.2f}x floor; "
                  f"rounds {', '.join(f'{x:.2f}' for x in ts)})", flush=True)
        return
    for cfg in CONFIGS:
        try:
            with override(tiles=cfg or default):
                with torch.no_grad():
                    fwd = timing.time_ms(lambda: logitless.linear_jsd(xs, ws, xt, wt, t), device=dev, warmup=2,
                                         reps=a.reps)
                fb = timing.time_ms(step, device=dev, setup=setup, warmup=2, reps=a.reps)
            print(f"tiles {cfg or default}{' (default)' if cfg is None else ''}: fwd {fwd:.2f} ms "
                  f"({fwd / floor['floor']:.2f}x floor), fwd+bwd {fb:.2f} ms ({fb / floor['floor']:.2f}x floor), "
                  f"bwd ~{fb - fwd:.2f} ms", flush=True)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is a result
            print(f"tiles {cfg}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
        timing.release_memory(dev)


def issue23(a) -> None:
    """Issue 23's measurements at one shape; one line each, and a JSON record."""
    import json
    import os
    import platform
    import time

    import triton

    from logitless.planning import cost_model
    from logitless.planning.plans import linear_jsd_plan, linear_jsd_strategy

    if a.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dev = torch.device("cpu")
        a.tokens, a.hs, a.ht, a.vocab, a.reps = 8, 16, 24, 96, 1
    else:
        dev = torch.device("cuda")
    shape = DistillShape("probe", a.tokens, a.hs, a.ht, a.vocab)
    xs, ws, xt, wt, t = make_inputs(shape, dev, 0)
    itemsize = xs.element_size()
    record = dict(shape=shape.label, tokens=a.tokens, hs=a.hs, ht=a.ht, vocab=a.vocab, dtype=str(xs.dtype),
                  device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
                  torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command="probe_distill.py --issue23",
                  rows={})
    warm, reps = (0, 1) if a.cpu_smoke else (2, a.reps)
    backend = "triton"
    if dev.type == "cuda":
        floor = gemm_floor_ms(xs, ws, xt, wt, warmup=2, reps=a.reps)
    else:
        floor = {"floor": float("nan")}
    record["floor"] = {k: v for k, v in floor.items() if k != "warnings"}
    print(f"shape {shape.label}: floor {floor['floor']:.2f} ms "
          + ", ".join(f"{k} {v:.2f}" for k, v in floor.items() if k not in ("floor", "warnings")), flush=True)
    dm = cost_model.device_model(dev)
    xg, wg = xs.detach().requires_grad_(), ws.detach().requires_grad_()

    def setup():
        xg.grad = wg.grad = None

    def run(name, budget, forced=None, stats_single=False, backward=True):
        ov = {}
        if forced is not None:
            ov["strategy"] = forced
        if stats_single:
            ov["num_sms"] = 1  # one program per row block: the launch before issue 23
        row = dict(budget_mib=budget / 2**20)
        try:
            with override(**ov):
                plan = linear_jsd_plan(a.tokens, a.vocab, a.hs, itemsize, budget, dev)
                strat = linear_jsd_strategy(a.tokens, a.vocab, a.hs, a.ht, itemsize, budget, dev)
                row.update(forward_rows=plan.forward_rows, strategy=strat.strategy, token_chunk=strat.token_chunk)
                with torch.no_grad():
                    row["fwd_ms"] = timing.time_ms(
                        lambda: logitless.linear_jsd(xs, ws, xt, wt, t, memory_budget=budget, backend=backend),
                        device=dev, warmup=warm, reps=reps)
                if backward:
                    def fwd_grad():
                        return logitless.linear_jsd(xg, wg, xt, wt, t, memory_budget=budget, backend=backend)

                    def step():
                        fwd_grad().backward()

                    if strat.strategy == "grad_in_forward":  # the forward that also forms the gradients
                        row["fwd_with_grad_ms"] = timing.time_ms(fwd_grad, device=dev, setup=setup, warmup=warm,
                                                                 reps=reps)

                    row["fb_ms"] = timing.time_ms(step, device=dev, setup=setup, warmup=warm, reps=reps)
                    _, peak = timing.peak_extra_bytes(step, device=dev, setup=setup,
                                                      exclude_bytes=xs.numel() * itemsize + ws.numel() * itemsize)
                    row["peak_extra_mib"] = None if peak is None else peak / 2**20
                    row["fb_x_floor"] = row["fb_ms"] / floor["floor"]
            name_s = strat.strategy
            pred = (cost_model.predict_jsd_grad_in_forward(dm, a.tokens, a.hs, a.ht, a.vocab, itemsize,
                                                           strat.token_chunk, False)
                    if name_s == "grad_in_forward" else
                    cost_model.predict_jsd_recompute(dm, a.tokens, a.hs, a.ht, a.vocab, itemsize, plan.forward_rows))
            row.update(pred_fwd_ms=pred.fwd_s * 1e3, pred_fb_ms=pred.ms, pred_memory_mib=pred.memory / 2**20)
        except Exception as exc:  # noqa: BLE001 - a failing part is a result, the others still run
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        record["rows"][name] = row
        print(name + ": " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in row.items()), flush=True)
        timing.release_memory(dev)

    default = 256 * 2**20
    old_rows = 128 * 8 * a.vocab
    run("stats one program per row block (before), default budget", default, stats_single=True, backward=False)
    run("stats split rows (issue 23), default budget", default, backward=False)
    run("forward chunks of 128 rows (old rounding), split stats", old_rows, backward=False)
    run("default plan (256 MiB)", default)
    run(f"model's choice at {a.big_budget_mib} MiB", a.big_budget_mib * 2**20)
    run("gradient-in-forward forced, one chunk", a.big_budget_mib * 2**20, forced=("grad_in_forward", a.tokens))
    run("gradient-in-forward forced, 1024-token chunks", a.big_budget_mib * 2**20, forced=("grad_in_forward", 1024))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
