"""Interleaved timing for the CuTe probes: baseline and candidates measured in rounds.

A ratio ``candidate / cuBLAS`` from two measurements taken seconds apart carries whatever the
GPU's clock did in between: the first H100 run of probe_fused_forward.py timed cuBLAS once,
first, at 675 TFLOP/s, and 743 an hour later, which moved the CuTe forward from ~1.07x to
0.97x cuBLAS. Here every round measures every candidate once (one ``do_bench`` median each,
the order rotated by one per round so that no candidate always runs right after the same
neighbour or first), and a candidate's time is the median over rounds; the spread
(max - min) / median over rounds is reported with it, and each ratio to the baseline is the
median over rounds of the per-round ratios (the baseline and the candidate of the same round
saw the same clock state), with its own min and max.
"""

from __future__ import annotations

import statistics
import time


def gpu_bench(warmup: int = 10, rep: int = 40):
    """``fn -> ms``: triton.testing.do_bench's median (L2 flushed between calls)."""
    import importlib

    do_bench = importlib.import_module("triton.testing").do_bench

    def bench(fn):
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

    return bench


def cpu_bench(reps: int = 5):
    """``fn -> ms``: median wall time of ``reps`` calls (the CPU smoke test of the harness)."""
    def bench(fn):
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    return bench


def interleaved(measures: dict, rounds: int = 5, baseline: str | None = None,
                deadline: float | None = None) -> dict:
    """Time every entry of ``measures`` (name -> callable returning milliseconds) once per
    round, for ``rounds`` rounds, in an order rotated by one per round. A measure that raises
    is dropped from later rounds (its error kept). ``deadline`` (time.monotonic() value): stop
    starting new rounds after it (at least one round runs).

    Returns {name: {"ms": median, "min", "max", "spread": (max - min) / median, "n": rounds
    done, "samples": [...], "error"?}, "_rounds": rounds done} and, with ``baseline``, per
    candidate "ratio" (median over rounds of candidate / baseline of the same round),
    "ratio_min", "ratio_max"."""
    names = list(measures)
    samples: dict = {k: [] for k in names}
    per_round: list = []
    errors: dict = {}
    done = 0
    for r in range(rounds):
        if r > 0 and deadline is not None and time.monotonic() > deadline:
            break
        order = names[r % len(names):] + names[:r % len(names)] if names else []
        this = {}
        for k in order:
            if k in errors:
                continue
            try:
                this[k] = float(measures[k]())
                samples[k].append(this[k])
            except Exception as exc:  # noqa: BLE001
                errors[k] = f"{type(exc).__name__}: {str(exc)[:200]}"
        per_round.append(this)
        done += 1
    out: dict = {"_rounds": done}
    for k in names:
        s = samples[k]
        rec: dict = {"n": len(s), "samples": [round(v, 5) for v in s]}
        if s:
            med = statistics.median(s)
            rec.update(ms=med, min=min(s), max=max(s),
                       spread=(max(s) - min(s)) / med if med > 0 else float("nan"))
        if k in errors:
            rec["error"] = errors[k]
        out[k] = rec
    if baseline is not None and baseline in names:
        for k in names:
            if k == baseline:
                continue
            ratios = [t[k] / t[baseline] for t in per_round
                      if k in t and baseline in t and t[baseline] > 0]
            if ratios:
                out[k].update(ratio=statistics.median(ratios), ratio_min=min(ratios),
                              ratio_max=max(ratios))
    return out


def self_test() -> dict:
    """CPU: a baseline whose speed drifts 2x over the rounds, a candidate always 1.5x the
    baseline of the same moment: the per-round ratio must come out 1.5 (a one-shot
    baseline would say anything between 0.75 and 1.5), a raising measure is dropped."""
    state = {"t": 0}

    def clock():
        state["t"] += 1
        return 1.0 + state["t"] / 10.0  # slower and slower

    calls = {"bad": 0}

    def bad():
        calls["bad"] += 1
        raise RuntimeError("no kernel")

    res = interleaved({"base": clock, "cand": lambda: 1.5 * (1.0 + state["t"] / 10.0),
                       "bad": bad}, rounds=6, baseline="base")
    ok = (abs(res["cand"]["ratio"] - 1.5) < 0.2 and res["_rounds"] == 6
          and res["base"]["n"] == 6 and calls["bad"] == 1 and "error" in res["bad"]
          and res["base"]["spread"] > 0.3)
    return {"ok": ok, "cand_ratio": res["cand"]["ratio"], "base_spread": res["base"]["spread"]}


if __name__ == "__main__":
    import json

    print(json.dumps(self_test()))
