"""What the JAX benchmarks share (``jax_suite``, ``jax_sharded``, ``jax_bwd``): the median wall time of a
jitted call, its kernels' times from a device profile, and the environment fields every JAX result file
records. Needs only jax; importing it imports neither torch nor the torch suites (``logitless_bench/__init__``
is lazy)."""

from __future__ import annotations

import datetime
import platform
import statistics
import time


def median_ms(fn, args, warmup, reps) -> float:
    """Median ms of ``jax.block_until_ready(fn(*args))`` over ``reps`` calls after
    ``warmup`` calls (the first compiles unless fn is already compiled); host wall time,
    calls back to back, so a call's dispatch is in its time."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def environment(argv) -> dict:
    """device (its kind, or "cpu (<processor>)"), platform, jax, jaxlib, python, date
    (UTC, to the minute) and the command line of a JAX benchmark run."""
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {
        "device": dev.device_kind if dev.platform != "cpu" else f"cpu ({platform.processor() or platform.machine()})",
        "platform": dev.platform,
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m logitless_bench " + " ".join(argv),
    }


def device_profile(fn, args, steps: int = 3) -> dict:
    """Per-step GPU time of ``fn(*args)`` by kernel and by XLA op, from a ``jax.profiler``
    trace of ``steps`` calls (after one untimed call): see ``trace_tables``; with
    "timeline" (``trace_timeline``) of a trace of one more call alone."""
    import jax

    jax.block_until_ready(fn(*args))
    out = trace_tables(_trace_events(fn, args, steps), steps)
    out["timeline"] = trace_timeline(_trace_events(fn, args, 1))
    return out


def _trace_events(fn, args, steps: int) -> list:
    import glob
    import gzip
    import json
    import os
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                jax.block_until_ready(fn(*args))
        files = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
        if not files:
            return []
        with gzip.open(files[0]) as fh:
            return json.load(fh)["traceEvents"]


def trace_timeline(events, top: int = 6) -> dict:
    """One call's GPU timeline from its trace events: "span ms" (first kernel's start to
    the last one's end, on the device's CUDA streams), "busy ms" (kernels' time), and the
    ``top`` longest "gaps" (ms with the kernels before and after): where the GPU idles."""
    meta = [e for e in events if e.get("ph") == "M"]
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in meta if e.get("name") == "process_name"}
    device = {p for p, n in procs.items() if "/device:" in n and "CPU" not in n}
    streams = {(e["pid"], e["tid"]) for e in meta if e.get("name") == "thread_name" and e["pid"] in device
               and e.get("args", {}).get("name", "").startswith("Stream")}
    ks = sorted((e["ts"], e.get("dur", 0), e.get("name", "?")) for e in events
                if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams)
    if not ks:
        return {}
    gaps, end = [], ks[0][0]
    for prev, cur in zip(ks, ks[1:]):
        end = max(end, prev[0] + prev[1])
        if cur[0] > end:
            gaps.append({"ms": (cur[0] - end) / 1e3, "after": prev[2][:60], "before": cur[2][:60]})
    span = max(t + d for t, d, _ in ks) - ks[0][0]
    return {"span ms": span / 1e3, "busy ms": sum(d for _, d, _ in ks) / 1e3,
            "gaps": sorted(gaps, key=lambda g: -g["ms"])[:top]}


def trace_tables(events, steps: int) -> dict:
    """From Chrome trace events of a device profile: {line kind: [{"name", "calls", "ms"}]}
    per step, longest first, for the device processes' lines ("stream": the CUDA streams'
    kernels, "ops": the "XLA Ops" line, "other": the rest), and "threads": their names."""
    meta = [e for e in events if e.get("ph") == "M"]
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in meta if e.get("name") == "process_name"}
    device = {p for p, n in procs.items() if "/device:" in n and "CPU" not in n}
    threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in meta
               if e.get("name") == "thread_name" and e["pid"] in device}

    def kind(name):
        return "stream" if name.startswith("Stream") else "ops" if name == "XLA Ops" else "other"

    tables: dict = {}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device:
            continue
        k = kind(threads.get((e["pid"], e.get("tid")), ""))
        name = e.get("name", "?")
        row = tables.setdefault(k, {}).setdefault(name, {"name": name, "calls": 0, "ms": 0.0})
        row["calls"] += 1
        row["ms"] += e.get("dur", 0) / 1e3
    out = {k: sorted(({**r, "calls": r["calls"] / steps, "ms": r["ms"] / steps} for r in t.values()),
                     key=lambda r: -r["ms"]) for k, t in tables.items()}
    out["threads"] = sorted(set(threads.values()))
    return out


# The baseline of issue 62: what MaxText and most JAX training code do (bf16 logits from the
# GEMM, an f32 loss), under jax.jit. Its source is written into the result files.


def bf16_logits_loss(x, w, t):
    """Mean cross-entropy with bf16 logits ``x @ w.T`` ((V, H) weight), f32 log-sum-exp."""
    import jax
    import jax.numpy as jnp

    logits = (x @ w.T).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(lse - jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0])


def bf16_logits_loss_hv(x, kernel, t):
    """The same with a flax (H, V) kernel: ``x @ kernel``."""
    import jax
    import jax.numpy as jnp

    logits = (x @ kernel).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return jnp.mean(lse - jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0])


def baseline_source() -> str:
    """The bf16-logits baselines' code, for the result files."""
    import inspect

    return inspect.getsource(bf16_logits_loss) + "\n" + inspect.getsource(bf16_logits_loss_hv)
