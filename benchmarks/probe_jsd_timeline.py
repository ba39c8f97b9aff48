"""Timeline of linear_jsd's forward (and forward+backward): where the time between kernels goes.

Session 4's profile of the bf16 forward at 4096 x (4096 <- 8192) x 128256 summed ~23.5 ms of
kernels against 29.9 ms timed (probe-jsd2-H100-2026-11-23). This probe records a
torch.profiler trace (CPU + CUDA) of warm calls at jsd2's shapes and reads it as a
timeline: every device activity (kernel, memset, memcpy) in order with its start, its
duration, the idle gap before it and its queue delay (start minus the end of the host
call that launched it: ~0 means the GPU had nothing queued and waited for the host), and,
for the large gaps, what the host was doing then (the CPU ops and CUDA runtime/driver
calls overlapping the gap). Per call:

    timed    CUDA events around the call after an L2 flush (timing.time_ms's method),
             median of --reps, without the profiler
    host     perf_counter around the call, no sync: the host's own time per call
    span     first kernel start to last kernel end, from the trace
    busy     sum of device activity; idle = span - busy, split into host-starved idle
             (the next activity was launched after the previous one ended: the queue was
             empty) and the rest
    syncs    torch.cuda.set_sync_debug_mode("warn") warnings during one call; and the
             synchronising runtime calls seen in the trace (cudaStreamSynchronize,
             cudaDeviceSynchronize, cudaMemcpy(Async) device->host, cudaMalloc, cudaFree,
             cudaEventSynchronize)

Each shape runs twice, ``--modes kgrid,fast``: ``kgrid`` = ``override(fast_launch=False)``
(every Triton launch through ``kernel[grid]``: the launch path before this change) and
``fast`` = the shipped default (``launch.run_kernel``'s cached launches, which linear_jsd's
kernels take since this change). Full per-kernel lists go to --log; the screen gets the
gaps and a summary table.

    python benchmarks/probe_jsd_timeline.py --json OUT.json --log OUT.log
    TRITON_INTERPRET=1 python benchmarks/probe_jsd_timeline.py --cpu-smoke   (checks the script)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _probe_common import probe_meta, write_json  # noqa: E402

import logitless  # noqa: E402
from logitless.planning.overrides import override  # noqa: E402

SHAPES = {  # jsd2's anchors: (tokens, hidden_s, hidden_t, vocab)
    "llama-8k->4k": (4096, 4096, 8192, 128256),
    "qwen-2k->2k": (4096, 2048, 2048, 151936),
    "llama-512tok": (512, 4096, 8192, 128256),
}
DEVICE_CATS = ("kernel", "gpu_memset", "gpu_memcpy")
HOST_CATS = ("cuda_runtime", "cuda_driver")
SYNCING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMalloc", "cudaFree",
           "cudaMemcpy", "cudaHostAlloc", "cudaFreeHost", "cuMemAlloc", "cuMemFree", "cuStreamSynchronize",
           "cuCtxSynchronize")


def mode_ctx(mode):
    return override(fast_launch=False) if mode == "kgrid" else contextlib.nullcontext()


def timeline(trace: dict, label: str, gap_us: float = 20.0) -> dict:
    """The device activities launched inside the CPU range ``label`` (a record_function)
    of a chrome trace, in order, with gaps, queue delays and the host calls during the
    large gaps. Pure function of the trace (tests feed it a synthetic one)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges = [e for e in ev if e.get("name") == label and e.get("cat") in ("user_annotation", "cpu_op")]
    if not ranges:
        return dict(error=f"no CPU range {label!r} in the trace")
    r0 = min(e["ts"] for e in ranges)
    r1 = max(e["ts"] + e["dur"] for e in ranges)
    host_calls = [e for e in ev if e.get("cat") in HOST_CATS]
    any_launch = {e["args"]["correlation"]: e for e in host_calls if "correlation" in e.get("args", {})}
    launch_of = {c: e for c, e in any_launch.items() if r0 <= e["ts"] <= r1}
    # device work launched inside the range; work whose launch the trace lacks counts when
    # it starts inside the range or within 1 s after it (its queue delay then unknown)
    dev = sorted((e for e in ev if e.get("cat") in DEVICE_CATS and (
        e.get("args", {}).get("correlation") in launch_of
        or (e.get("args", {}).get("correlation") not in any_launch and r0 <= e["ts"] <= r1 + 1e6))),
        key=lambda e: e["ts"])
    unlaunched = 0
    cpu_ops = [e for e in ev if e.get("cat") in ("cpu_op", "user_annotation") and e.get("name") != label]
    rows, prev_end = [], None
    starved = other = 0.0
    gaps = []
    for e in dev:
        lau = launch_of.get(e.get("args", {}).get("correlation"))
        if lau is None:  # (no launch record: treated as launched before the GPU ran dry)
            unlaunched += 1
            lau = dict(ts=e["ts"], dur=0.0, name="?")
            lau_end = -float("inf")
        else:
            lau_end = lau["ts"] + lau["dur"]
        gap = 0.0 if prev_end is None else max(0.0, e["ts"] - prev_end)
        row = dict(name=e["name"][:70], cat=e["cat"], start_us=round(e["ts"] - r0, 2), dur_us=round(e["dur"], 2),
                   gap_us=round(gap, 2), queue_us=round(e["ts"] - lau_end, 2) if lau["name"] != "?" else None,
                   launched_us=round(lau["ts"] - r0, 2), launch_call=lau["name"])
        if prev_end is not None and gap > 0:
            if lau_end >= prev_end:  # launched after the GPU ran dry: waiting on the host
                starved += gap
            else:
                other += gap
        if gap >= gap_us and prev_end is not None:
            lo, hi = prev_end, e["ts"]
            during = collections.Counter()
            for c in cpu_ops + host_calls:
                ov = min(hi, c["ts"] + c["dur"]) - max(lo, c["ts"])
                if ov > 0:
                    during[f"{c['name'][:48]} (tid {c.get('tid')})"] += ov
            gaps.append(dict(before=row["name"], index=len(rows), gap_us=round(gap, 2),
                             host_starved=lau_end >= prev_end,
                             host_during=[(k, round(v, 1)) for k, v in during.most_common(8)]))
        rows.append(row)
        prev_end = e["ts"] + e["dur"] if prev_end is None else max(prev_end, e["ts"] + e["dur"])
    calls = collections.Counter(e["name"] for e in host_calls if r0 <= e["ts"] <= r1)
    busy = sum(e["dur"] for e in dev)
    span = (prev_end - dev[0]["ts"]) if dev else 0.0
    by_kernel = collections.defaultdict(lambda: [0, 0.0])
    for e in dev:
        by_kernel[e["name"][:70]][0] += 1
        by_kernel[e["name"][:70]][1] += e["dur"]
    return dict(host_range_us=round(r1 - r0, 1), span_us=round(span, 1), busy_us=round(busy, 1),
                idle_us=round(span - busy, 1), idle_host_starved_us=round(starved, 1),
                idle_other_us=round(other, 1), first_kernel_after_us=round(dev[0]["ts"] - r0, 1) if dev else None,
                activities=len(dev), without_launch_record=unlaunched, gaps=gaps, rows=rows,
                kernels=sorted(([k, c, round(d, 1)] for k, (c, d) in by_kernel.items()), key=lambda r: -r[2]),
                runtime_calls=dict(calls.most_common()),
                syncing_calls={k: v for k, v in calls.items() if any(k.startswith(s) for s in SYNCING)})


def count_sync_warnings(fn) -> int:
    """Warnings of torch.cuda.set_sync_debug_mode("warn") during one fn() (CUDA only)."""
    if not torch.cuda.is_available():
        return -1
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def timed(fn, setup, cuda, flush, reps, warmup=2):
    """(median ms by events after an L2 flush (CPU: perf_counter), median host ms per call)."""
    for _ in range(warmup):
        setup()
        fn()
    times, host = [], []
    if cuda:
        torch.cuda.synchronize()
    for _ in range(reps):
        setup()
        if cuda:
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            e.record()
            times.append((s, e))
    if cuda:
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in times]
    else:
        times = host
    return statistics.median(times), statistics.median(host)


def profile_call(fn, setup, cuda, flush, label):
    """A chrome trace (dict) of one warm call labelled ``label`` (after an L2 flush)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    setup()
    fn()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        setup()
        if cuda:
            flush.zero_()
        with record_function(label):
            fn()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"names of {list(SHAPES)} or N:HS:HT:V")
    ap.add_argument("--modes", default="kgrid,fast")
    ap.add_argument("--kinds", default="fwd,fb")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gap-us", type=float, default=20.0, help="gaps at least this long are explained")
    ap.add_argument("--json")
    ap.add_argument("--log", help="the full per-activity lists")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    if not cuda:
        args.shapes, args.reps, dtype = "24:16:24:96", 1, torch.float32
    meta = probe_meta(reps=args.reps, gap_us=args.gap_us)
    print(meta, flush=True)
    doc = dict(meta, rows=[])
    log = open(args.log, "w") if args.log else None
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev) if cuda else None
    summary = []
    for spec in args.shapes.split(","):
        if spec in SHAPES:
            name, (n, hs, ht, v) = spec, SHAPES[spec]
        else:
            n, hs, ht, v = (int(d) for d in spec.split(":"))
            name = spec
        g = torch.Generator(device="cpu").manual_seed(0)

        def rnd(*size, scale=1.0):
            return (torch.randn(*size, generator=g) * scale).to(dev, dtype)

        T = dict(xs=rnd(n, hs), ws=rnd(v, hs, scale=hs**-0.5), xt=rnd(n, ht), wt=rnd(v, ht, scale=ht**-0.5),
                 t=torch.randint(0, v, (n,), generator=g).to(dev))
        T.update(xg=T["xs"].clone().requires_grad_(), wg=T["ws"].clone().requires_grad_())

        def fwd():
            with torch.no_grad():
                return logitless.linear_jsd(T["xs"], T["ws"], T["xt"], T["wt"], T["t"], backend="triton")

        def fb():
            logitless.linear_jsd(T["xg"], T["wg"], T["xt"], T["wt"], T["t"], backend="triton").backward()

        def setup_fb():
            T["xg"].grad = T["wg"].grad = None

        fns = dict(fwd=(fwd, lambda: None), fb=(fb, setup_fb))
        results = {}
        for kind in args.kinds.split(","):
            fn, setup = fns[kind]
            for mode in args.modes.split(","):
                rec = dict(shape=name, n=n, hs=hs, ht=ht, v=v, kind=kind, mode=mode)
                try:
                    with mode_ctx(mode):
                        rec["timed_ms"], rec["host_ms"] = timed(fn, setup, cuda, flush, args.reps)
                        setup()
                        out = fn()
                        results[(kind, mode)] = (out.detach().clone() if kind == "fwd" else
                                                 torch.cat([T["xg"].grad.flatten(), T["wg"].grad.flatten()]))
                        rec["sync_warnings"] = count_sync_warnings(lambda: (setup(), fn()))
                        label = f"linear_jsd.{kind}"
                        tl = timeline(profile_call(fn, setup, cuda, flush, label), label, args.gap_us)
                except Exception as exc:  # noqa: BLE001 - a failing row is a result
                    rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                    print(f"{name} {kind} {mode}: {rec['error']}", flush=True)
                    doc["rows"].append(rec)
                    continue
                rows = tl.pop("rows", [])
                rec.update(tl)
                doc["rows"].append(rec)
                head = (f"{name} {kind} {mode}: timed {rec['timed_ms']:.3f} ms, host {rec['host_ms']:.3f} ms/call"
                        f" | trace: host range {tl.get('host_range_us', 0) / 1e3:.3f} ms, span "
                        f"{tl.get('span_us', 0) / 1e3:.3f}, busy {tl.get('busy_us', 0) / 1e3:.3f}, idle "
                        f"{tl.get('idle_us', 0) / 1e3:.3f} (host-starved {tl.get('idle_host_starved_us', 0) / 1e3:.3f}"
                        f", other {tl.get('idle_other_us', 0) / 1e3:.3f}), first kernel at "
                        f"{(tl.get('first_kernel_after_us') or 0) / 1e3:.3f} ms, {tl.get('activities')} activities"
                        f" ({tl.get('without_launch_record')} without a launch record)"
                        f" | sync warnings {rec['sync_warnings']}, syncing calls {tl.get('syncing_calls')}")
                print(head, flush=True)
                for gp in tl.get("gaps", [])[:12]:
                    print(f"   gap {gp['gap_us']:8.1f} us before #{gp['index']} {gp['before'][:40]}"
                          f" (host-starved {gp['host_starved']}): "
                          + "; ".join(f"{k} {v}" for k, v in gp["host_during"][:4]), flush=True)
                if log:
                    print(head, file=log)
                    print(f"   kernels by time: {tl.get('kernels')}", file=log)
                    print(f"   runtime calls: {tl.get('runtime_calls')}", file=log)
                    print(f"   {'#':>4} {'start us':>10} {'dur us':>9} {'gap us':>8} {'queue us':>9} "
                          f"{'launched':>9}  name", file=log)
                    for i, r in enumerate(rows):
                        q = "-" if r["queue_us"] is None else f"{r['queue_us']:.1f}"
                        print(f"   {i:4d} {r['start_us']:10.1f} {r['dur_us']:9.1f} {r['gap_us']:8.1f} "
                              f"{q:>9} {r['launched_us']:9.1f}  {r['name']} [{r['launch_call']}]",
                              file=log)
                    for gp in tl.get("gaps", []):
                        print(f"   gap {gp}", file=log)
                    log.flush()
                summary.append(rec)
                if args.json:
                    write_json(args.json, doc)
            modes = args.modes.split(",")
            if len(modes) > 1 and all((kind, m) in results for m in modes):
                same = all(torch.equal(results[(kind, modes[0])], results[(kind, m)]) for m in modes[1:])
                for rec in doc["rows"]:
                    if rec["shape"] == name and rec["kind"] == kind:
                        rec["bitwise_same_across_modes"] = same
        T.clear()
        results.clear()
        if cuda:
            torch.cuda.empty_cache()
    print("\n== jsd timeline summary (ms; idle = span - busy; starved = the GPU waited for a launch)")
    print(f"{'shape':14} {'kind':4} {'mode':5} {'timed':>8} {'host':>8} {'span':>8} {'busy':>8} {'idle':>7} "
          f"{'starved':>8} {'1st k':>6} {'acts':>5} {'syncw':>5} same")
    for r in summary:
        print(f"{r['shape'][:14]:14} {r['kind']:4} {r['mode']:5} {r['timed_ms']:8.3f} {r['host_ms']:8.3f} "
              f"{r.get('span_us', 0) / 1e3:8.3f} {r.get('busy_us', 0) / 1e3:8.3f} {r.get('idle_us', 0) / 1e3:7.3f} "
              f"{r.get('idle_host_starved_us', 0) / 1e3:8.3f} {(r.get('first_kernel_after_us') or 0) / 1e3:6.3f} "
              f"{r.get('activities', 0):5} {r.get('sync_warnings', -1):5} {r.get('bitwise_same_across_modes', '-')}")
    if args.json:
        write_json(args.json, doc)
    if log:
        log.close()


if __name__ == "__main__":
    main()
