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
``--jsd2 [--json PATH] [--profile-json PATH]``: issue 23's leftovers (each also runs on
the CPU interpreter at a tiny shape with ``--cpu-smoke``): the default plan at bf16 and
at fp32 matmul precision "high" (operands pre-rounded to TF32 in the backward against
rounding in the kernel, ``override(tf32_preround=False)``; floor = four cuBLAS TF32
GEMMs; errors against float64), the eager fast path against the custom ops at a small
(host-bound) token count, and a torch.profiler per-kernel table of one bf16 forward
(the forward's time beyond its two GEMMs).
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
from logitless_bench.precision import matmul_precision

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
    p.add_argument("--cpu-smoke", action="store_true", help="--issue23/--jsd2 on the CPU interpreter, tiny shape")
    p.add_argument("--jsd2", action="store_true", help="issue 23's leftovers (see the module docstring)")
    p.add_argument("--small-tokens", type=int, default=512, help="--jsd2: tokens of the host-bound rows")
    p.add_argument("--profile-json", default=None, help="--jsd2: the forward's per-kernel table")
    a = p.parse_args()
    if a.issue23:
        return issue23(a)
    if a.jsd2:
        return jsd2(a)
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


def profile_forward(step, dev, top: int = 14) -> dict:
    """One call of ``step`` (a forward) under torch.profiler after a warm-up: per kernel
    name, its launches and total device ms, sorted by time; plus the sum over kernels."""
    from torch.profiler import ProfilerActivity, profile

    step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "cuda_time_total", 0.0)
        self_dev = getattr(e, "self_device_time_total", None)
        if self_dev is None:
            self_dev = getattr(e, "self_cuda_time_total", 0.0)
        if dev.type == "cuda" and self_dev <= 0:
            continue
        if dev.type != "cuda" and not e.key.startswith(("aten::", "jsd", "triton")):
            continue
        ms = (self_dev if dev.type == "cuda" else e.self_cpu_time_total) / 1e3
        rows.append(dict(kernel=e.key[:90], calls=e.count, ms=ms))
    rows.sort(key=lambda r: -r["ms"])
    return dict(total_ms=sum(r["ms"] for r in rows), kernels=rows[:top], others=len(rows[top:]),
                others_ms=sum(r["ms"] for r in rows[top:]), clock="device" if dev.type == "cuda" else "cpu")


def jsd2(a) -> None:
    """Issue 23's leftovers at the 8B <- 70B anchor (and the same-size pair); one line
    per row, a JSON record, and the forward's per-kernel profile."""
    import json
    import os
    import platform
    import time

    import triton

    from logitless_bench.distill import jsd_reference, rel_err

    if a.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dev = torch.device("cpu")
        anchors = [DistillShape("tiny", 24, 16, 24, 96)]
        small = 8
        warm, reps = 0, 1
    else:
        dev = torch.device("cuda")
        anchors = [DistillShape("llama-8k->4k", a.tokens, a.hs, a.ht, a.vocab),
                   DistillShape("qwen-2k->2k", 4096, 2048, 2048, 151936)]
        small = a.small_tokens
        warm, reps = 2, a.reps
    record = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
                  torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command="probe_distill.py --jsd2",
                  rows={})

    def emit(name, row):
        record["rows"][name] = row
        print(name + ": " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in row.items()), flush=True)
        if a.json:  # after every row: a run cut off by its time limit still leaves the rows done
            with open(a.json, "w") as f:
                json.dump(record, f, indent=1)

    def timed(shape, dtype, setting="highest", preround=True, fast=True, errors=False, floor=True):
        row = dict(shape=shape.label, dtype=dtype, precision=setting)
        try:
            sh = DistillShape(shape.name, shape.tokens, shape.hidden_s, shape.hidden_t, shape.vocab, dtype)
            xs, ws, xt, wt, t = make_inputs(sh, dev, 0)
            xg, wg = xs.detach().requires_grad_(), ws.detach().requires_grad_()

            def setup():
                xg.grad = wg.grad = None

            def fwd_grad():
                return logitless.linear_jsd(xg, wg, xt, wt, t, backend="triton")

            def step():
                fwd_grad().backward()

            with matmul_precision(setting), override(tf32_preround=preround, eager_fast_path=fast):
                if floor and dev.type == "cuda":
                    row["floor_ms"] = gemm_floor_ms(xs, ws, xt, wt, warmup=2, reps=max(3, reps))["floor"]
                with torch.no_grad():
                    row["fwd_ms"] = timing.time_ms(lambda: logitless.linear_jsd(xs, ws, xt, wt, t, backend="triton"),
                                                   device=dev, warmup=warm, reps=reps)
                row["fb_ms"] = timing.time_ms(step, device=dev, setup=setup, warmup=warm, reps=reps)
                if row.get("floor_ms"):
                    row["fb_x_floor"] = row["fb_ms"] / row["floor_ms"]
                    row["fwd_x_2gemm"] = row["fwd_ms"] / (row["floor_ms"] / 2)  # (about: logits GEMMs ~ half)
                if errors:
                    setup()
                    loss = fwd_grad()
                    loss.backward()
                    ref_loss, ref_dx, ref_dw = jsd_reference(xs, ws, xt, wt)
                    row.update(loss_err=abs(loss.item() - ref_loss), dx_err=rel_err(xg.grad, ref_dx),
                               dw_err=rel_err(wg.grad, ref_dw))
                    # torch's own error at this setting: the naive formula (both logits by torch's matmul)
                    from logitless_bench.distill import naive_jsd

                    setup()
                    naive = naive_jsd(xg, wg, xt, wt, t)
                    naive.backward()
                    row.update(torch_loss_err=abs(naive.item() - ref_loss), torch_dx_err=rel_err(xg.grad, ref_dx),
                               torch_dw_err=rel_err(wg.grad, ref_dw))
        except Exception as exc:  # noqa: BLE001 - a failing row is a result, the others still run
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        timing.release_memory(dev)
        return row

    big = anchors[0]
    # 1. the forward's per-kernel table (bf16, default plan): where its time beyond the GEMMs goes
    try:
        xs, ws, xt, wt, t = make_inputs(big, dev, 0)
        with torch.no_grad():
            prof = profile_forward(lambda: logitless.linear_jsd(xs, ws, xt, wt, t, backend="triton"), dev)
        prof["shape"] = big.label
        print(f"forward profile {big.label} ({prof['clock']} ms): total {prof['total_ms']:.2f}")
        for r in prof["kernels"]:
            print(f"  {r['ms']:9.3f} ms  {r['calls']:4d}x  {r['kernel']}")
        print(f"  {prof['others_ms']:9.3f} ms  ({prof['others']} other kernels)", flush=True)
        record["profile"] = prof
        if a.json:
            with open(a.json, "w") as f:
                json.dump(record, f, indent=1)
        if a.profile_json:
            with open(a.profile_json, "w") as f:
                json.dump(prof, f, indent=1)
        timing.release_memory(dev)
    except Exception as exc:  # noqa: BLE001
        print(f"forward profile failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    # 2. bf16 default plan at the anchors (after the fused epilogues and the fast path)
    for shape in anchors:
        emit(f"bf16 default plan {shape.name}", timed(shape, "bfloat16"))
    # 3. fp32 at "high": pre-rounded backward operands against rounding in the kernel
    pre = timed(big, "float32", "high", preround=True, errors=True)
    emit(f"fp32 high pre-rounded {big.name}", pre)
    inkernel = timed(big, "float32", "high", preround=False, floor=False)
    if pre.get("floor_ms") and "fb_ms" in inkernel:  # the same floor (cuBLAS TF32 GEMMs)
        inkernel.update(floor_ms=pre["floor_ms"], fb_x_floor=inkernel["fb_ms"] / pre["floor_ms"])
    emit(f"fp32 high in-kernel rounding {big.name}", inkernel)
    # 4. host-bound: the eager fast path against the custom ops, few tokens
    few = DistillShape(big.name + f"-{small}tok", small, big.hidden_s, big.hidden_t, big.vocab)
    emit(f"bf16 {small} tokens fast path", timed(few, "bfloat16", floor=True))
    emit(f"bf16 {small} tokens custom ops", timed(few, "bfloat16", fast=False, floor=False))
    # (the fast path's gain is host time: on a GPU it shows while the launches outrun the kernels)


if __name__ == "__main__":
    main()
