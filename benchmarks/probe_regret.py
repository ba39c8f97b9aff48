"""Planner regret of linear_cross_entropy (issue 23): does the cost model pick the fastest
plan that fits the memory budget?

For each shape (the six anchors and a few small-H model heads), bf16, at the default
budget (256 MiB), it takes the cost model's candidates (``cost_model.candidates``, plus
with ``DeviceModel.wide_chunks = 2``: also the 2x and 4x wider chunks that the shipped
family leaves out above ~60% of L2, e.g. 8192 and 16384 columns at 4096 tokens),
keeps those that fit the budget (raised to the floor plan's memory, as ``choose`` does)
and of them: the planner's choice and up to ``--others`` promising alternatives (the
best of each chunk width, the floor, half the kept columns, gradient-in-forward and
"keep" where they fit, then the next best predicted). Where fewer than three fit (the
floor is the only one at deepseek-v3 and 16k tokens), up to two plans over the budget
are timed too, marked ``fits: false`` and left out of the regret.

Each candidate is forced with ``planning.overrides.override`` (``strategy`` and ``plan``),
its loss and gradients are checked against the planner's choice (the same numbers up to
bf16 rounding: a different chunking only reorders fp32 sums and rounds dz differently),
its peak memory beyond the inputs and gradients is measured, then forward+backward is
timed with CUDA events in interleaved rounds: each round times the cuBLAS GEMM unit
(x @ W^T) first, then every candidate in a rotated order, and a candidate's time is
the median over rounds of (its time / the round's GEMM) x the median GEMM (the H100's
clocks drift 5-10% over a run). The forward alone is timed the same way (grad enabled,
so kept columns are stored) for the cost-model refit.

Reported per shape: chosen vs best measured among the fitting ones (regret %), each
candidate's predicted vs measured f+b and forward, and f+b / 3 GEMMs; and a
torch.profiler per-kernel breakdown of the chosen plan at gemma3-4b and gpt-oss-120b.
JSON (``regret.json``) and the table (``regret.md``) go to --out;
``benchmarks/fit_cost_model.py`` refits the DeviceModel from the JSON.

    python benchmarks/probe_regret.py --out $OUT                 # H100, ~2 min
    python benchmarks/probe_regret.py --smoke --out /tmp/regret  # CPU interpreter, tiny
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time

if "--smoke" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _probe_common import probe_meta, write_json  # noqa: E402

import logitless  # noqa: E402
from logitless.planning import cost_model as cm  # noqa: E402
from logitless.planning import memo as _memo  # noqa: E402
from logitless.planning import plans as _plans  # noqa: E402
from logitless.planning.overrides import override  # noqa: E402

DEFAULT_BUDGET = 256 << 20

#: (tokens, hidden, vocab), in the order the GPU script prioritises them.
SHAPES = {
    "gemma3-4b": (4096, 2560, 262144),
    "gpt-oss-120b": (4096, 2880, 201088),
    "qwen3-8b": (4096, 4096, 151936),
    "llama3.1-8b": (4096, 4096, 128256),
    "deepseek-v3": (8192, 7168, 128256),
    "llama3.1-8b-16k": (16384, 4096, 128256),
    "llama3.2-1b": (4096, 2048, 128256),
    "gemma3-4b-8k": (8192, 2560, 262144),
    "gemma2-2b": (4096, 2304, 256000),
}
#: CPU smoke shapes (interpreter): (tokens, hidden, vocab, budget bytes).
SMOKE_SHAPES = {
    "smoke-a": (48, 24, 1000, 48 * 1000),
    "smoke-b": (40, 17, 517, 40 * 517),
    "smoke-c": (32, 16, 200, 16000),  # keep and gradient-in-forward fit
}
PROFILE_SHAPES = ("gemma3-4b", "gpt-oss-120b")


# --------------------------------------------------------------------------- candidates



#: The ``plan`` of the last ``forcing`` (the plans memoised under the forced strategy are its).
_FORCED: list = [None]


@contextlib.contextmanager
def forcing(fields: dict):
    """The context of a forced plan (``force``'s fields): ``override`` of the strategy, and
    the plan's columns (``plan``: TritonPlan -> TritonPlan) applied to every
    ``plans.triton_plan`` inside: the probe wraps the planner for the block (the library
    has no such switch). The plans' memo is cleared when the forced plan changes, so a
    candidate's timed calls plan once (interleaved rounds replan once per candidate and
    round: the median of the reps drops that call)."""
    reshape = fields.get("plan")
    with override(**{k: v for k, v in fields.items() if k != "plan"}):
        if reshape is None:
            yield
            return
        if _FORCED[0] is not reshape:
            _memo.clear()
            _FORCED[0] = reshape
        original = _plans.triton_plan
        _plans.triton_plan = lambda *args, **kwargs: reshape(original(*args, **kwargs))
        try:
            yield
        finally:
            _plans.triton_plan = original

def planner_args(n: int, h: int, v: int, itemsize: int, device) -> dict:
    """block_v, min_chunk and grad-in-forward eligibility as ``plans.lce_strategy`` takes
    them for this device (the CPU interpreter: its small tiles; gradient-in-forward is
    enumerated as on a GPU, since the probe forces it anyway)."""
    block_v = _plans._tiles(n, v, h, itemsize, device)[1]
    min_chunk = _plans.min_chunk_cols(v, block_v, device)
    return dict(block_v=block_v, min_chunk=min_chunk, grad_in_forward=v % _plans.ODD_V_ALIGN == 0)


def select_candidates(n, h, v, itemsize, budget, *, device_model=cm.DEFAULT, block_v=256, min_chunk=4096,
                      grad_in_forward=True, others=6, over=2):
    """[(Candidate, role, fits)]: the planner's choice ("chosen"), then up to ``others``
    fitting alternatives ("alt"), then up to ``over`` plans over the budget ("over",
    only while fewer than three fit). Labels are distinct. Pure: no device needed."""
    dev = device_model
    # the family with two more chunk doublings past the L2 rule (DeviceModel.wide_chunks)
    wide = dataclasses.replace(dev, wide_chunks=max(dev.wide_chunks, 2))
    pool = [c for c in cm.candidates(n, h, v, itemsize, device_model=wide, block_v=block_v, min_chunk=min_chunk,
                                     grad_in_forward=grad_in_forward)]
    widths = sorted({c.vocab_chunk for c in pool if c.strategy == "partial"})[:3]
    floor = cm.minimum(n, h, v, itemsize, device_model=dev, block_v=block_v, min_chunk=min_chunk)
    limit = max(budget, floor.memory)
    chosen = cm.choose(n, h, v, itemsize, budget, device_model=dev, grad_in_forward=grad_in_forward,
                       block_v=block_v, min_chunk=min_chunk)
    fitting = sorted((c for c in pool if c.memory <= limit), key=lambda c: c.time_s)
    picks = [chosen]

    def add(c):
        if c is not None and c.label not in {p.label for p in picks} and len(picks) < 1 + others:
            picks.append(c)

    def best(cs):
        cs = list(cs)
        return min(cs, key=lambda c: c.time_s) if cs else None

    for w in widths:
        add(best(c for c in fitting if c.strategy == "partial" and c.vocab_chunk == w))
    add(floor if floor.memory <= limit else None)
    half = (chosen.keep_cols // 2) // block_v * block_v if chosen.strategy == "partial" else 0
    add(best(c for c in fitting if c.strategy == "partial" and c.vocab_chunk == min_chunk
             and c.keep_cols <= half and c.keep_cols > 0))
    add(best(c for c in fitting if c.strategy == "grad_in_forward"))
    add(best(c for c in fitting if c.strategy == "keep"))
    for c in fitting:
        add(c)
    out = [(c, "chosen" if i == 0 else "alt", True) for i, c in enumerate(picks)]
    if len(picks) < 3:
        labels = {p.label for p in picks}
        extra = sorted((c for c in pool if c.memory > limit and c.label not in labels
                        and c.strategy == "partial" and c.keep_cols == 0), key=lambda c: c.memory)
        out += [(c, "over", False) for c in extra[:over]]
    return out


def force(c: cm.Candidate, v: int, block_v: int) -> dict:
    """override(...) fields that make linear_cross_entropy run candidate ``c``."""
    if c.strategy == "grad_in_forward":
        return dict(strategy=("grad_in_forward", c.token_chunk))
    padded = math.ceil(v / block_v) * block_v
    keep, chunk = (v, padded) if c.strategy == "keep" else (c.keep_cols, min(c.vocab_chunk, padded))

    def reshape(p):
        return dataclasses.replace(p, keep_cols=keep, vocab_chunk=chunk)

    reshape.__qualname__ = f"force_{c.label}"
    return dict(strategy=("partial", 0), plan=reshape)


def plan_bytes(plan, n: int, h: int, v: int, itemsize: int, strategy: str, token_chunk: int = 0,
               owned: bool = True) -> int:
    """Bytes of the temporaries the Triton backend allocates for ``plan`` beyond inputs,
    outputs and gradients, from the library's own buffer shapes (``launch``): kept
    columns (rows padded to 16 bytes) and their fp32 tile maxima, one recomputed dz
    chunk (none where an ``owned`` backward lays it in the spent kept columns:
    ``launch.dz_buffer``), the fp32 dx accumulator when there are several chunks;
    gradient-in-forward: one token chunk's kept logits and the fp32 dW accumulator across chunks."""
    from logitless.triton_lib import launch

    def kept(p, rows):
        if not p.keep_cols:
            return 0
        (r, c), (tiles, r2) = launch.kept_shapes_of(p, rows)
        return r * c * itemsize + tiles * r2 * 4

    if strategy == "grad_in_forward":
        m = min(token_chunk or n, n)
        acc = 4 * v * h if m < n and itemsize != 4 else 0
        return kept(dataclasses.replace(plan, keep_cols=v), m) + acc
    chunks = launch.backward_chunks(plan, v, plan.keep_cols)
    dz = n * (-(-min(plan.vocab_chunk, v - plan.keep_cols) // 8) * 8) * itemsize if plan.keep_cols < v else 0
    if owned and plan.keep_cols and dz <= n * launch.kept_shapes_of(plan, n)[0][1] * itemsize:
        dz = 0  # laid in the kept buffer
    acc = 4 * n * h if len(chunks) > 1 and itemsize != 4 else 0
    return kept(plan, n) + dz + acc


# --------------------------------------------------------------------------- timing


class Timer:
    """Milliseconds of fn(): CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, reps=1) -> float:
        times = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def rel_err(a, b, norm=False) -> float:
    a, b = a.detach().double(), b.detach().double()
    if norm:
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def kernel_breakdown(step, device, top=14) -> dict:
    """Per-kernel device time of one step() (torch.profiler), grouped into classes."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if device.type != "cuda":
            t = e.self_cpu_time_total
        if t and (device.type != "cuda" or getattr(e, "device_type", None) is None
                  or "CUDA" in str(getattr(e, "device_type", "CUDA"))):
            rows.append(dict(name=e.key[:90], count=e.count, us=float(t)))
    rows.sort(key=lambda r: -r["us"])
    if device.type == "cuda":  # kernels only (CPU-side ops have no device time)
        rows = [r for r in rows if not r["name"].startswith(("aten::", "cudaLaunch", "cuLaunch", "Memset"))
                or r["name"].startswith("Memset")]

    def klass(name):
        lo = name.lower()
        for key, cls in (("forward_stats", "fwd fused"), ("kept_dlogits", "kept dlogits"),
                         ("dlogits", "dlogits fused"), ("epilogue", "O(N) epilogues"),
                         ("coefficients", "O(N) epilogues"), ("gemm", "cuBLAS GEMM"), ("nvjet", "cuBLAS GEMM"),
                         ("xmma", "cuBLAS GEMM"), ("cutlass", "cuBLAS GEMM"), ("memset", "memset"),
                         ("reduce", "reductions"), ("elementwise", "elementwise"), ("copy", "copies")):
            if key in lo:
                return cls
        return "other"

    classes: dict = {}
    for r in rows:
        c = classes.setdefault(klass(r["name"]), dict(us=0.0, count=0))
        c["us"] += r["us"]
        c["count"] += r["count"]
    return dict(total_us=sum(r["us"] for r in rows), classes=classes, kernels=rows[:top])


# --------------------------------------------------------------------------- one shape


def probe_shape(name, n, h, v, budget, device, args, dev_model):
    itemsize = 2
    pa = planner_args(n, h, v, itemsize, device)
    sel = select_candidates(n, h, v, itemsize, budget, device_model=dev_model, others=args.others, **pa)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, h, device=device, generator=g, dtype=torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, h, device=device, generator=g) * h**-0.5).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, v, (n,), device=device, generator=g)
    gemm_out = torch.empty(n, v, device=device, dtype=torch.bfloat16)
    timer = Timer(device)
    cuda = device.type == "cuda"

    def gemm():
        torch.mm(x.detach(), w.detach().T, out=gemm_out)

    def make_steps(c):
        kw = force(c, v, pa["block_v"])

        def fb():
            x.grad = w.grad = None
            with forcing(kw):
                loss = logitless.linear_cross_entropy(x, w, t, memory_budget=budget)
                loss.backward()
            return loss

        def fwd():
            with forcing(kw):
                return logitless.linear_cross_entropy(x, w, t, memory_budget=budget)

        return kw, fb, fwd

    entries = []
    ref = None
    gemm()  # cuBLAS' workspace exists before the first peak is measured
    if cuda:  # and cuBLASLt's (the fp32-out addmm of dx), and the first kernels are compiled
        try:
            make_steps(sel[0][0])[1]()
        except Exception:  # noqa: BLE001 (reported with the candidate below)
            pass
    for c, role, fits in sel:
        kw, fb, fwd = make_steps(c)
        e = dict(shape=name, n=n, h=h, v=v, itemsize=itemsize, budget=budget, label=c.label, role=role,
                 fits=fits, strategy=c.strategy, keep_cols=c.keep_cols, vocab_chunk=c.vocab_chunk,
                 token_chunk=c.token_chunk, memory_model_mib=c.memory / 2**20, pred_ms=c.time_s * 1e3,
                 pred_fwd_ms=c.fwd_s * 1e3)
        try:
            with forcing(kw):
                plan = _plans.triton_plan(n, v, h, itemsize, budget, device, keep_allowed=True)
            e["plan"] = dict(keep_cols=plan.keep_cols, vocab_chunk=plan.vocab_chunk, block_v=plan.block_v)
            e["plan_mib"] = plan_bytes(plan, n, h, v, itemsize, c.strategy, c.token_chunk) / 2**20
            if role == "chosen" and cuda:  # what the library runs with no override
                d_plan = _plans.triton_plan(n, v, h, itemsize, budget, device, keep_allowed=True)
                d_strat = _plans.lce_strategy(n, v, h, itemsize, budget, device)
                e["default_matches"] = bool(
                    d_strat.label == c.label if c.strategy == "grad_in_forward" else
                    d_strat.strategy != "grad_in_forward"
                    and (d_plan.keep_cols, d_plan.vocab_chunk) == (plan.keep_cols, plan.vocab_chunk))
            x.grad = w.grad = None  # freed before the baseline: fb() allocates them anew
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            loss = fb()
            if cuda:
                torch.cuda.synchronize()
                e["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - base - x.grad.nbytes
                                       - w.grad.nbytes) / 2**20
            got = (loss.detach().float(), x.grad.detach().clone(), w.grad.detach().clone())
            if ref is None:
                ref = got
                e.update(loss=got[0].item(), err_loss=0.0, err_dx=0.0, err_dw=0.0, err_dx_norm=0.0,
                         err_dw_norm=0.0, same=True)
            else:
                e.update(loss=got[0].item(), err_loss=rel_err(got[0], ref[0]), err_dx=rel_err(got[1], ref[1]),
                         err_dw=rel_err(got[2], ref[2]), err_dx_norm=rel_err(got[1], ref[1], True),
                         err_dw_norm=rel_err(got[2], ref[2], True))
                # bf16 rounding: a few units in the last place of the largest entry (2^-8
                # relative), the loss in fp32; normwise well below one ulp.
                e["same"] = bool(e["err_loss"] < 1e-4 and e["err_dx"] < 2**-5 and e["err_dw"] < 2**-5
                                 and e["err_dx_norm"] < 2**-7 and e["err_dw_norm"] < 2**-7)
            del got
            fwd()  # warm the forward-only path (kept columns stored, nothing consumed)
            e["fb"], e["fw"] = fb, fwd
            e["ok"] = True
        except Exception as exc:  # noqa: BLE001 (a candidate that fails must not stop the others)
            e.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            print(f"  {c.label}: FAILED {e['error']}", flush=True)
        entries.append(e)
    live = [e for e in entries if e["ok"]]
    gemm()
    # interleaved rounds: GEMM, then each candidate's f+b and forward, in rotated order
    gemm_ms, ratios, fratios = [], {e["label"]: [] for e in live}, {e["label"]: [] for e in live}
    for r in range(args.rounds):
        gm = timer(gemm, reps=args.gemm_reps)
        gemm_ms.append(gm)
        order = live[r % len(live):] + live[: r % len(live)] if live else []
        for e in order:
            ratios[e["label"]].append(timer(e["fb"], reps=args.reps) / gm)
            fratios[e["label"]].append(timer(e["fw"], reps=args.reps) / gm)
    gmed = statistics.median(gemm_ms) if gemm_ms else float("nan")
    for e in entries:
        e.pop("fb", None)
        e.pop("fw", None)
        e["gemm_ms"] = gmed
        if e["ok"]:
            e["fb_ms"] = statistics.median(ratios[e["label"]]) * gmed
            e["fwd_ms"] = statistics.median(fratios[e["label"]]) * gmed
            e["fb_ms_spread"] = (max(ratios[e["label"]]) - min(ratios[e["label"]])) * gmed
            e["x3gemm"] = e["fb_ms"] / (3 * gmed)
            e["pred_over_meas"] = e["pred_ms"] / e["fb_ms"]
            e["pred_fwd_over_meas"] = e["pred_fwd_ms"] / e["fwd_ms"]
    fitting = [e for e in entries if e["ok"] and e["fits"]]
    chosen = next((e for e in entries if e["role"] == "chosen"), None)
    summary = dict(shape=name, n=n, h=h, v=v, budget=budget, **pa, gemm_ms=gmed, gemm_ms_all=gemm_ms,
                   pred_gemm_ms=cm.gemm_s(dev_model, n, v, h, itemsize) * 1e3)
    if fitting and chosen is not None and chosen["ok"]:
        best = min(fitting, key=lambda e: e["fb_ms"])
        summary.update(chosen=chosen["label"], chosen_ms=chosen["fb_ms"], chosen_x3=chosen["x3gemm"],
                       best=best["label"], best_ms=best["fb_ms"], best_x3=best["x3gemm"],
                       regret_pct=100 * (chosen["fb_ms"] / best["fb_ms"] - 1),
                       all_same=all(e.get("same", False) for e in entries if e["ok"]),
                   default_matches=chosen.get("default_matches"),
                       within_budget=all(e.get("peak_extra_mib", 0) <= max(budget, e["memory_model_mib"] * 2**20)
                                         / 2**20 * 1.02 + 1 for e in fitting))
    if args.profile and name in args.profile_shapes and chosen is not None and chosen["ok"]:
        _, fb, _ = make_steps(next(c for c, role, _ in sel if role == "chosen"))
        fb()
        summary["profile"] = kernel_breakdown(fb, device)
    return summary, entries  # x, W, the GEMM output and the closures go with this frame


# --------------------------------------------------------------------------- report


def table(summaries, entries) -> str:
    lines = ["| shape | chosen | f+b/3GEMM | best measured | f+b/3GEMM | regret | same | in budget |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        if "chosen" in s:
            lines.append(f"| {s['shape']} | {s['chosen']} | {s['chosen_x3']:.3f} | {s['best']} | {s['best_x3']:.3f} "
                         f"| {s['regret_pct']:+.1f}% | {s['all_same']} | {s['within_budget']} |")
        else:
            lines.append(f"| {s['shape']} | (failed) | | | | | | |")
    lines += ["", "| shape | candidate | role | MiB model/peak | pred ms | meas ms | pred/meas | fwd pred/meas "
              "| f+b/3GEMM | err dx/dW |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        if not e["ok"]:
            lines.append(f"| {e['shape']} | {e['label']} | {e['role']} | | | FAILED | | | | {e['error'][:60]} |")
            continue
        peak = e.get("peak_extra_mib")
        lines.append(
            f"| {e['shape']} | {e['label']} | {e['role']} | {e['memory_model_mib']:.0f}/"
            f"{'-' if peak is None else f'{peak:.0f}'} | {e['pred_ms']:.3f} | {e['fb_ms']:.3f} "
            f"| {e['pred_over_meas']:.3f} | {e['pred_fwd_over_meas']:.3f} | {e['x3gemm']:.3f} "
            f"| {e['err_dx']:.1e}/{e['err_dw']:.1e} |")
    for s in summaries:
        p = s.get("profile")
        if not p:
            continue
        lines += ["", f"profile of the chosen plan, {s['shape']} ({s.get('chosen')}): "
                  f"{p['total_us'] / 1e3:.3f} ms of kernels, GEMM unit {s['gemm_ms']:.3f} ms",
                  "| class | ms | launches | / GEMM |", "|---|---|---|---|"]
        for k, c in sorted(p["classes"].items(), key=lambda kv: -kv[1]["us"]):
            lines.append(f"| {k} | {c['us'] / 1e3:.3f} | {c['count']} | {c['us'] / 1e3 / s['gemm_ms']:.2f} |")
        lines += ["| kernel | ms | calls | |", "|---|---|---|---|"]
        for k in p["kernels"][:10]:
            lines.append(f"| {k['name'][:70]} | {k['us'] / 1e3:.3f} | {k['count']} | |")
    return "\n".join(lines)


def short(label: str) -> str:
    return (label.replace("partial(keep=", "p(k=").replace(",chunk=", ",c=")
            .replace("grad_in_forward(tokens=", "gif(t="))


def compact(summaries, entries) -> str:
    """The short form for a log's last screen: one line per shape, then per candidate."""
    lines = [f"{'shape':16s} {'chosen':18s} {'x3GEMM':>6s} {'best measured':18s} {'x3GEMM':>6s} {'regret':>7s} "
             "same budget"]
    for s in summaries:
        if "chosen" in s:
            lines.append(f"{s['shape'][:16]:16s} {short(s['chosen']):18s} {s['chosen_x3']:6.3f} {short(s['best']):18s} "
                         f"{s['best_x3']:6.3f} {s['regret_pct']:+6.1f}% {s['all_same']!s:5s} {s['within_budget']}")
        else:
            lines.append(f"{s['shape'][:16]:16s} {s.get('error', s.get('skipped', 'no result'))[:90]}")
    lines.append(f"{'shape':12s} {'candidate':18s} r {'MiB mdl/peak':>12s} {'pred':>7s} {'meas':>7s} {'p/m':>5s} "
                 f"{'fwd p/m':>7s} {'x3':>5s} same")
    for e in entries:
        head = f"{e['shape'][:12]:12s} {short(e['label']):18s} {e['role'][0]}"
        if not e["ok"]:
            lines.append(f"{head} FAILED {e['error'][:70]}")
            continue
        peak = e.get("peak_extra_mib")
        mem = f"{e['memory_model_mib']:.0f}/{'-' if peak is None else f'{peak:.0f}'}"
        lines.append(f"{head} {mem:>12s} {e['pred_ms']:7.2f} {e['fb_ms']:7.2f} {e['pred_over_meas']:5.2f} "
                     f"{e['pred_fwd_over_meas']:7.2f} {e['x3gemm']:5.3f} {e.get('same')}")
    for s in summaries:
        p = s.get("profile")
        if p:
            parts = ", ".join(f"{k} {c['us'] / 1e3:.2f} ms/{c['count']}"
                              for k, c in sorted(p["classes"].items(), key=lambda kv: -kv[1]["us"])[:7])
            lines.append(f"profile {s['shape']} ({short(s['chosen'])}, GEMM {s['gemm_ms']:.2f} ms): "
                         f"{p['total_us'] / 1e3:.2f} ms = {parts}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", default=None, help="comma-separated names (default: all, in priority order)")
    ap.add_argument("--budget", type=int, default=DEFAULT_BUDGET)
    ap.add_argument("--others", type=int, default=6, help="fitting alternatives per shape")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=1, help="timed calls per candidate per round (median)")
    ap.add_argument("--gemm-reps", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=1e9, help="seconds: no new shape after this")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--profile-shapes", default=",".join(PROFILE_SHAPES))
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    ap.add_argument("--render", default=None, help="print the compact table of this regret.json and exit")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            d = json.load(f)
        print(compact(d["shapes"], d["rows"]))
        return d["shapes"], d["rows"]
    args.profile_shapes = args.profile_shapes.split(",")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        shapes = {k: s for k, s in SMOKE_SHAPES.items() if not args.shapes or k in args.shapes.split(",")}
        args.profile_shapes = list(SMOKE_SHAPES)[:1]
        args.rounds = min(args.rounds, 2)
        args.gemm_reps = 1
    else:
        names = args.shapes.split(",") if args.shapes else list(SHAPES)
        shapes = {k: (*SHAPES[k], args.budget) for k in names}
    dev_model = cm.device_model(device)
    meta = probe_meta(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                      device_model=dev_model.name, device_model_constants=dataclasses.asdict(dev_model),
                      budget=args.budget, rounds=args.rounds, smoke=args.smoke)
    print({k: meta[k] for k in ("device", "torch", "triton", "date", "device_model")}, flush=True)
    summaries, entries = [], []
    start = time.time()
    for name, (n, h, v, budget) in shapes.items():
        if time.time() - start > args.time_limit:
            print(f"{name}: skipped (time limit {args.time_limit:.0f} s)", flush=True)
            summaries.append(dict(shape=name, n=n, h=h, v=v, budget=budget, skipped="time limit"))
            continue
        t0 = time.time()
        try:
            s, es = probe_shape(name, n, h, v, budget, device, args, dev_model)
        except Exception as exc:  # noqa: BLE001 (e.g. out of memory: the next shape still runs)
            s, es = dict(shape=name, n=n, h=h, v=v, budget=budget, error=f"{type(exc).__name__}: {exc}"[:300]), []
            if device.type == "cuda":
                torch.cuda.empty_cache()
        s["seconds"] = time.time() - t0
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        summaries.append(s)
        entries += es
        if "chosen" in s:
            print(f"{name} N={n} H={h} V={v}: chosen {s['chosen']} {s['chosen_x3']:.3f}x3 | best {s['best']} "
                  f"{s['best_x3']:.3f}x3 | regret {s['regret_pct']:+.1f}% | same {s['all_same']} "
                  f"[{s['seconds']:.0f} s]", flush=True)
        else:
            print(f"{name}: {s.get('error', 'no result')}", flush=True)
        write_json(os.path.join(args.out, "regret.json"), dict(meta, shapes=summaries, rows=entries))
    md = table(summaries, entries)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "regret.md"), "w") as f:
        f.write(f"# Planner regret, {meta['device']}, {meta['date']}\n\n`{meta['command']}`\n\n{md}\n")
    print(md, flush=True)
    print("== compact ==\n" + compact(summaries, entries) + "\n== end ==", flush=True)
    return summaries, entries


if __name__ == "__main__":
    main()
