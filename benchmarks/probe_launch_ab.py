"""In-process, interleaved A/B of Triton's launch path (issue 23 item 3, "fast launch").

``triton_lib.launch.run_kernel`` calls a cached compiled kernel directly on repeated
launches; ``override(fast_launch=False)`` sends every launch through ``kernel[grid]``.
Two separate processes of ``probe_overhead.py`` (one with LOGITLESS_FAST_LAUNCH=0) gave
contradictory numbers (fast on: eager 1.304 ms, host 1.230 ms/call; off: eager 0.977,
host 1.314), so here the modes alternate in rounds in ONE process, after the same
warm-up, on the same tensors, and every measurement is a distribution:

    on       shipped default (no override active)
    on_ovr   override(fast_launch=True): the same launches, but under an override (the
             planner's memo then hashes the Overrides object: its own cost, isolated)
    off      override(fast_launch=False): every launch through ``kernel[grid]``

"on_ovr" vs "off" is the A/B of the launch path alone; "on" vs "on_ovr" is the price of
being under an override. For each shape, step kind (``fb``: forward+backward of
linear_cross_entropy in bf16, ``fwd``: the forward on inputs without grad) and mode, each
round measures (rounds rotate the order of the modes):

    host     perf_counter around each call, K calls back to back, no sync (the host's
             time per call while the GPU keeps up or lags: < ~1000 queued launches)
    span     CUDA events around each of those calls (GPU time from the call's first
             enqueued work to its last; host-bound calls show the host's pace)
    loop     wall time of the K calls then a sync, per call (what a training loop sees)
    bench    ``triton.testing.do_bench``'s method: before each call, 256 MB zeroed (L2
             flush), events around the call, median: probe_overhead's "eager" column
    synced   sync, call, sync: one call's latency from an idle GPU

Median over rounds and the spread (p10-p90 of the round medians) per metric; gc
collections during the rounds (a gen-2 collection is ms); Triton launches per call by
path (fast / kernel[grid]); results bitwise equal across modes. ``--profile`` adds a
cProfile of 20 f+b calls per mode (top functions by own time).

    python benchmarks/probe_launch_ab.py --shapes 512:4096:32000,1024:2048:32000 --json OUT.json
    TRITON_INTERPRET=1 python benchmarks/probe_launch_ab.py --cpu-smoke   (checks the script)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _probe_common import probe_meta, write_json  # noqa: E402

import logitless  # noqa: E402
from logitless.planning.overrides import override  # noqa: E402
from logitless.triton_lib import launch  # noqa: E402

MODES = ("on", "on_ovr", "off")


def mode_ctx(mode):
    if mode == "on":
        return contextlib.nullcontext()
    return override(fast_launch=(mode == "on_ovr"))


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[i]


class GcCount:
    """gc collections (by generation) while active."""

    def __init__(self):
        self.counts = [0, 0, 0]

    def __call__(self, phase, info):
        if phase == "start":
            self.counts[info["generation"]] += 1

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def make_steps(n, h, v, dev, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, h, generator=g).to(dev, dtype).requires_grad_(True)
    w = (torch.randn(v, h, generator=g) * h**-0.5).to(dev, dtype).requires_grad_(True)
    t = torch.randint(0, v, (n,), generator=g).to(dev)
    xd, wd = x.detach(), w.detach()

    def fb():
        x.grad = w.grad = None
        loss = logitless.linear_cross_entropy(x, w, t)
        loss.backward()
        return loss

    def fwd():
        return logitless.linear_cross_entropy(xd, wd, t)

    def result(kind):
        out = (fb if kind == "fb" else fwd)()
        return [out.detach().clone()] + ([x.grad.clone(), w.grad.clone()] if kind == "fb" else [])

    return dict(fb=fb, fwd=fwd), result


def measure(step, k, cuda, cache):
    """One round of one mode: the metrics above (ms)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {}
    sync()
    host, starts, ends = [], [], []
    t_loop = time.perf_counter()
    for _ in range(k):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            s.record()
            step()
            e.record()
            host.append(time.perf_counter() - t0)
            starts.append(s)
            ends.append(e)
        else:
            t0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - t0)
    sync()
    out["loop"] = (time.perf_counter() - t_loop) / k * 1e3
    out["host"] = statistics.median(host) * 1e3
    out["host_mean"] = statistics.fmean(host) * 1e3
    if cuda:
        out["span"] = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
        bench = []
        for _ in range(max(3, k // 2)):
            cache.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            bench.append((s, e))
        sync()
        out["bench"] = statistics.median(s.elapsed_time(e) for s, e in bench)
    synced = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        synced.append(time.perf_counter() - t0)
    out["synced"] = statistics.median(synced) * 1e3
    return out


def launches_per_call(step, reps=3):
    before = dict(launch.LAUNCHES)
    for _ in range(reps):
        step()
    return {p: (launch.LAUNCHES[p] - before.get(p, 0)) / reps for p in ("fast", "triton")}


def profile_mode(step, mode, calls, cuda, top=14):
    with mode_ctx(mode):
        for _ in range(3):
            step()
        if cuda:
            torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(calls):
            step()
        pr.disable()
        if cuda:
            torch.cuda.synchronize()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    st.sort_stats("tottime").print_stats(top)
    total = st.total_tt / calls * 1e3
    calls_per = st.total_calls / calls
    return total, calls_per, buf.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="512:4096:32000,1024:2048:32000", help="TOKENS:HIDDEN:VOCAB[,...]")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--k", type=int, default=20, help="calls per round and mode")
    ap.add_argument("--kinds", default="fb,fwd")
    ap.add_argument("--profile", action="store_true", help="cProfile of f+b per mode (first shape)")
    ap.add_argument("--json")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape on the CPU (the interpreter)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    dev = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        args.shapes, args.rounds, args.k = "16:32:131", min(args.rounds, 2), min(args.k, 2)
    dtype = torch.bfloat16
    meta = probe_meta(fast_launch_env=launch.FAST_LAUNCH, rounds=args.rounds, k=args.k)
    print(meta, flush=True)
    cache = torch.empty(64 * 1024 * 1024, dtype=torch.int32, device=dev) if cuda else None
    doc = dict(meta, rows=[], profiles=[])
    for spec in args.shapes.split(","):
        n, h, v = (int(d) for d in spec.split(":"))
        steps, result = make_steps(n, h, v, dev, dtype)
        shape = f"{n}x{h}x{v}"
        # bitwise across modes (the same kernels either way)
        ref = {}
        same = True
        for kind in args.kinds.split(","):
            for mode in MODES:
                with mode_ctx(mode):
                    for _ in range(2):  # compile, then a launch of the cached kernel
                        r = result(kind)
                if kind in ref:
                    same &= all(torch.equal(a, b) for a, b in zip(ref[kind], r))
                else:
                    ref[kind] = r
        for kind in args.kinds.split(","):
            step = steps[kind]
            counts = {}
            for mode in MODES:  # warm-up, the same for each mode
                with mode_ctx(mode):
                    for _ in range(10 if cuda else 1):
                        step()
                    counts[mode] = launches_per_call(step, 3 if cuda else 1)
            per = {m: [] for m in MODES}
            gcs = {m: [0, 0, 0] for m in MODES}
            for r in range(args.rounds):
                order = MODES[r % 3:] + MODES[:r % 3]
                for mode in order:
                    with mode_ctx(mode), GcCount() as gcc:
                        per[mode].append(measure(step, args.k, cuda, cache))
                    gcs[mode] = [a + b for a, b in zip(gcs[mode], gcc.counts)]
            for mode in MODES:
                metrics = per[mode][0].keys()
                stats = {m: dict(median=statistics.median(x[m] for x in per[mode]),
                                 p10=pct([x[m] for x in per[mode]], 0.1), p90=pct([x[m] for x in per[mode]], 0.9))
                         for m in metrics}
                row = dict(shape=shape, n=n, h=h, v=v, kind=kind, mode=mode, launches=counts[mode],
                           gc=gcs[mode], bitwise_same_across_modes=same, **{m: s for m, s in stats.items()},
                           rounds=[{m: round(x[m], 4) for m in metrics} for x in per[mode]])
                doc["rows"].append(row)
                print(f"{shape:16} {kind:3} {mode:6} " + " | ".join(
                    f"{m} {s['median']:.3f} [{s['p10']:.3f},{s['p90']:.3f}]" for m, s in stats.items()
                    if m != "host_mean") + f" | launches fast {counts[mode]['fast']:.0f} triton "
                    f"{counts[mode]['triton']:.0f} | gc {gcs[mode]} | same {same}", flush=True)
            if args.json:
                write_json(args.json, doc)
        if args.profile and spec == args.shapes.split(",")[0]:
            for mode in MODES:
                total, calls_per, text = profile_mode(steps["fb"], mode, 20 if cuda else 2, cuda)
                doc["profiles"].append(dict(shape=shape, mode=mode, profiled_ms_per_call=total,
                                            python_calls_per_call=calls_per, top=text))
                print(f"-- cProfile {shape} fb {mode}: {total:.3f} ms/call under the profiler, "
                      f"{calls_per:.0f} Python calls/call", flush=True)
                print("\n".join(text.strip().splitlines()[-16:]), flush=True)
            if args.json:
                write_json(args.json, doc)
        del steps, result, ref
        if cuda:
            torch.cuda.empty_cache()
    # the summary: on_ovr vs off (the launch path), on vs on_ovr (the override's price)
    print("\n== A/B summary (median over rounds, ms; delta = off - on_ovr: > 0 means the fast launch saves)")
    rows = {(r["shape"], r["kind"], r["mode"]): r for r in doc["rows"]}
    for (shape, kind, mode), r in rows.items():
        if mode != "off":
            continue
        a, b, c = rows[(shape, kind, "on")], rows[(shape, kind, "on_ovr")], r
        cols = [m for m in ("bench", "span", "host", "loop", "synced") if m in c]
        print(f"{shape:16} {kind:3} " + " | ".join(
            f"{m} on {a[m]['median']:.3f} ovr {b[m]['median']:.3f} off {c[m]['median']:.3f} "
            f"d {c[m]['median'] - b[m]['median']:+.3f}" for m in cols))
    if args.json:
        write_json(args.json, doc)


if __name__ == "__main__":
    main()
