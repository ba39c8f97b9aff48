"""backend="helion" on a GPU (issue 44): what ``benchmarks/gpu/helion.sh`` runs, one step per call.

    python benchmarks/helion_gpu.py info                 versions, device, whether Helion runs (and why not)
    python benchmarks/helion_gpu.py tune KERNEL          Helion's autotuner on one kernel (TUNE_KERNELS)
                                                         at its suite's shape -> $OUT/tune-KERNEL.json
    python benchmarks/helion_gpu.py merge                $OUT/tune-*.json -> $OUT/configs/<device class>.json
    python benchmarks/helion_gpu.py bench                helion vs triton at the anchors -> $OUT/helion-<class>.json
    python benchmarks/helion_gpu.py lowerings            the lce kernels through Helion's CuTe and Pallas
                                                         code generators -> $OUT/lowerings.json

SMOKE=1: the CPU path (HELION_INTERPRET=1, tiny fp32 shapes; "torch" stands in for "triton";
``tune`` takes Helion's default config of the kernel instead of autotuning, and checks that it
lowers to Triton source). Shapes, bf16, x ~ N(0, 1), W ~ N(0, 1/H):
  lce     8192 x 4096 x 128256 (linear_cross_entropy, mean)
  distill llama-8k->4k: 4096 tokens, student H 4096, teacher H 8192, V 128256 (linear_jsd, beta 0.5, T 1)
  rl      qwen3-8b-8k: 8192 x 4096 x 151936 (linear_log_probs, T 0.7, entropy, random upstream gradients)
Timing: ``logitless_bench.timing`` (median of CUDA-event times after an L2 flush); forward with
inputs that need no gradient, forward+backward with them; peak extra MiB of forward+backward.
Each Helion row carries its agreement with the other backend (max |diff| / max |value| of the
loss and each gradient) and the fallback warning if Helion did not run (then its times are not
Helion's). ``helion-tuned`` rows read the configs that ``merge`` wrote (``LOGITLESS_HELION_CONFIGS``).
BENCH_METHODS (e.g. "helion-tuned") measures only those methods.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

SMOKE = os.environ.get("SMOKE", "0") not in ("", "0")
if SMOKE:
    os.environ.setdefault("HELION_INTERPRET", "1")  # read when the kernels are decorated

import torch  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp/out"))
DEVICE = torch.device("cpu") if SMOKE else torch.device("cuda", 0)
DTYPE = torch.float32 if SMOKE else torch.bfloat16
OTHER = "torch" if SMOKE else "triton"

#: (name, tokens, hidden, vocab[, teacher hidden]) per suite.
SHAPES = {
    "lce": (256, 64, 1000) if SMOKE else (8192, 4096, 128256),
    "distill": (128, 32, 1000, 48) if SMOKE else (4096, 4096, 128256, 8192),
    "rl": (128, 64, 1003) if SMOKE else (8192, 4096, 151936),
}
TUNE_KERNELS = ("ce_forward", "ce_dz", "jsd_stats", "jsd_dz")
#: The forward's vocabulary split is an argument, not a config field: the search runs at the
#: split ``configs.forward_span`` gives this tile (the shipped one on the H100).
FORWARD_SPAN_TILE = {"block_sizes": [128, 256, 64]}
#: Kernels that share a tuned config: the log-probs backward runs the same kernel, the
#: log-probs forward the same loops and tiles (its other statistics are a few more registers).
SHARED = {"ce_dz": ("logp_dz",), "ce_forward": ("logp_forward",)}
#: Hand-picked configs seeded into each search beside the heuristic's (block sizes in
#: ``configs.KERNEL_DIMS`` order): wider tiles in 8 warps, and for the distill forward
#: (one chunk of fp32 logits, memory-bound) one or two rows per program, wide vocabulary tiles.
SEEDS = {
    "ce_forward": [dict(block_sizes=[64, 256, 64], num_warps=8, num_stages=5)],
    "ce_dz": [dict(block_sizes=[128, 256, 64], num_warps=8, num_stages=3),
              dict(block_sizes=[128, 128, 64], num_warps=8, num_stages=4),
              dict(block_sizes=[64, 256, 64], num_warps=8, num_stages=4)],
    "jsd_stats": [dict(block_sizes=[1, 2048], num_warps=8, num_stages=2),
                  dict(block_sizes=[1, 4096], num_warps=16, num_stages=2),
                  dict(block_sizes=[2, 1024], num_warps=8, num_stages=3)],
    "jsd_dz": [dict(block_sizes=[128, 128, 64, 64], num_warps=8, num_stages=3),
               dict(block_sizes=[64, 256, 64, 64], num_warps=8, num_stages=3)],
}


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _randn(g, *size, scale=1.0):
    return (torch.randn(*size, generator=g, device=DEVICE, dtype=torch.float32) * scale).to(DTYPE)


def _generator(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


# ----------------------------------------------------------------------------- info


def info() -> dict:
    import importlib.metadata as md

    from logitless.helion_lib import runtime
    from logitless.ops.common import helion_choice

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ok = runtime.available()
    shim = [str(w.message) for w in seen if issubclass(w.category, runtime.HelionTorchShimWarning)]
    versions = {}
    for name in ("torch", "triton", "helion", "scikit-learn", "nvidia-cutlass-dsl"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    from logitless.helion_lib import configs

    out = {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
           "device_class": configs.device_class(DEVICE), "versions": versions, "helion_available": ok,
           "cause": helion_choice.cause(), "shim_warning": shim[0] if shim else None,
           "torch_cuda": torch.version.cuda}
    print(json.dumps(out, indent=1))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "info.json").write_text(json.dumps(out, indent=1))
    return out


# ----------------------------------------------------------------------------- tune


def _tune_args(kernel: str):
    """The kernel function and its arguments at the tuning shape (TUNE_TOKENS tokens,
    default the suite's): the lce shape's mean cross-entropy, no option, for ``ce_*``; the
    distill shape's JSD (beta 0.5, T 1) for ``jsd_*``. A ``*_dz`` kernel gets one
    vocabulary chunk of the backward, ``jsd_stats`` one row chunk of the forward's fp32
    logits (what a 256 MiB budget gives at that shape)."""
    from logitless.helion_lib import grad_kernels

    jsd = kernel.startswith("jsd")
    n, h, v = SHAPES["distill"][:3] if jsd else SHAPES["lce"]
    n = int(os.environ.get("TUNE_TOKENS", n))
    g = _generator(0)
    x, w = _randn(g, n, h), _randn(g, v, h, scale=h ** -0.5)
    t = torch.randint(0, v, (n,), generator=g, device=DEVICE)
    c = grad_kernels.vocab_chunk(n, h, v, x.element_size(), 256 * 2**20)
    if jsd:
        from logitless.helion_lib import jsd_kernels
        from logitless.helion_lib import linear_jsd as hjsd
        from logitless.options import JSDOptions

        ht = SHAPES["distill"][3]
        xt, wt = _randn(g, n, ht), _randn(g, v, ht, scale=ht ** -0.5)
        opts = JSDOptions(beta=0.5)
        if kernel == "jsd_stats":
            from logitless.planning.logits import jsd_forward_rows
            from logitless.triton_lib.launch import head_logit_chunks

            rows = jsd_forward_rows(n, v, 256 * 2**20, DEVICE.type == "cuda")
            _, _, zs, zt = next(head_logit_chunks(x, w, None, xt, wt, None, rows))
            return jsd_kernels.jsd_row_stats, hjsd.stats_args(zs, zt, t[:rows], opts), (rows, h, v)
        stats = hjsd.jsd_forward(x, w, None, xt, wt, None, t, opts)
        args = hjsd.backward_args(x, w[:c], None, xt, wt[:c], None, t, stats, torch.full((n,), 1.0 / n, device=DEVICE),
                                  opts)
        return jsd_kernels.jsd_dlogits, args, (n, h, c)
    from logitless.formulas.cross_entropy import grad_coefficients
    from logitless.helion_lib import ce_kernels, configs
    from logitless.helion_lib import linear_cross_entropy as hce
    from logitless.options import CrossEntropyOptions

    opts = CrossEntropyOptions()
    if kernel == "ce_forward":  # one search at one split: the shipped tile's (``configs.forward_span``)
        span = configs.forward_span(FORWARD_SPAN_TILE, {"n": n, "v": v, "h": h}, DEVICE)
        return ce_kernels.ce_forward, hce.forward_args(x, w, None, t, None, opts, span=span), (n, h, v)
    lse = hce.lce_forward(x, w, None, t, None, opts).lse
    coef = grad_coefficients(lse, t, torch.full((n,), 1.0 / n, device=DEVICE), v, None, opts)
    args = hce.backward_args(x, w[:c], None, t, None, lse, coef, opts.softcap)
    return grad_kernels.linear_dlogits, args, (n, h, c)


def tune(kernel: str) -> dict:
    """Helion's autotuner (effort "quick", a wall-clock budget of TUNE_BUDGET s, seeded with
    our heuristic's config, which also gives the accuracy baseline; PatternSearch when
    scikit-learn is absent, as Helion's default LFBOTreeSearch needs it) on one kernel; its
    config, and both configs timed."""
    import importlib.util

    from logitless.helion_lib import configs, runtime
    from logitless_bench.timing import time_ms

    runtime.require()  # imports helion after runtime's torch shims (torch 2.11)
    import helion

    base, args, (n, h, v) = _tune_args(kernel)
    default = configs.default_config(kernel, {"n": n, "v": v, "h": h})
    budget = int(os.environ.get("TUNE_BUDGET", "30"))
    if importlib.util.find_spec("sklearn") is None:
        os.environ.setdefault("HELION_AUTOTUNER", "PatternSearch")
    result = {"kernel": kernel, "tokens": n, "hidden": h, "vocab": v, "dtype": str(DTYPE).replace("torch.", ""),
              "device_class": configs.device_class(DEVICE), "default_config": default, "budget_s": budget,
              "autotuner": os.environ.get("HELION_AUTOTUNER", "LFBOTreeSearch")}
    # The accuracy baseline is our heuristic's config (Helion's own default config has 16-wide
    # blocks: slow at this shape).
    reference = base.bind(args)
    if not SMOKE:
        reference.set_config(helion.Config(**default))
    settings = {**runtime.kernel_settings(), "autotune_effort": "quick", "autotune_budget_seconds": budget,
                "autotune_seed_configs": [helion.Config(**c) for c in [default, *SEEDS.get(kernel, [])]],
                "autotune_progress_bar": False,
                "autotune_baseline_fn": lambda *a: reference(*a),
                "autotune_log": str(OUT / f"autotune-{kernel}")}  # every config tried: autotune-KERNEL.csv
    tuned = helion.kernel(base.fn, **settings)
    t0 = time.perf_counter()
    if SMOKE:  # no autotuning on the CPU: Helion's own default config, lowered to Triton source
        from helion.runtime.settings import RefMode

        compiled = helion.kernel(base.fn, **{**runtime.kernel_settings(), "ref_mode": RefMode.OFF})
        found = dict(compiled.bind(args).config_spec.default_config())
        code = runtime.triton_code(compiled, args, found)
        assert "@triton.jit" in code and ("tl.dot" in code or "h" not in configs.KERNEL_DIMS[kernel])
        result["autotuner"] = "none (SMOKE: Helion's default config)"
    else:
        found = dict(tuned.bind(args).autotune(args, force=True))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["config"] = found
    if not SMOKE:
        for label, cfg in (("default_ms", default), ("tuned_ms", found)):
            bound = base.bind(args)
            bound.set_config(helion.Config(**cfg))
            result[label] = round(time_ms(lambda: bound(*args), device=DEVICE, warmup=2, reps=5), 3)
    print(json.dumps(result, indent=1, default=str))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"tune-{kernel}.json").write_text(json.dumps(result, indent=1, default=str))
    return result


#: The dtypes a config tuned for one also fits (the same itemsize).
SAME_SIZE = {"bfloat16": ["bfloat16", "float16"], "float16": ["bfloat16", "float16"]}


def config_file(results: list) -> dict:
    """The ``helion_lib/configs/<device class>.json`` content of tuning results: per kernel
    (and the kernels sharing its config, ``SHARED``) one entry for every shape, with where
    it was tuned as ``tuned_at`` (``configs.pick`` reads ``config`` and the bounds only)."""
    from logitless.helion_lib import configs

    out: dict = {}
    for r in sorted(results, key=lambda r: r["kernel"]):
        config = {k: v for k, v in r["config"].items() if k in configs.PORTABLE_FIELDS}
        dtypes = SAME_SIZE.get(r["dtype"], [r["dtype"]])  # smem and registers fit the same itemsize
        entry = {"min_tokens": None, "max_tokens": None, "max_hidden": None, "dtypes": dtypes, "config": config,
                 "tuned_at": f"{r['tokens']}x{r['hidden']}x{r['vocab']} {r['dtype']}, {r['autotuner']}, "
                             f"{r.get('default_ms')} -> {r.get('tuned_ms')} ms"}
        for name in (r["kernel"],) + SHARED.get(r["kernel"], ()):
            out[name] = [entry]
    return out


def best_of_log(kernel: str, csv_path: Path) -> dict | None:
    """The fastest config of a search log (``autotune-KERNEL.csv``, written as the search
    goes) with status "ok": the result of a tuning process stopped before it finished
    (not re-verified by Helion's final selection)."""
    import csv

    best = None
    with open(csv_path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("status") != "ok" or not row.get("perf_ms"):
                continue
            if best is None or float(row["perf_ms"]) < float(best["perf_ms"]):
                best = row
    if best is None:
        return None
    # the column is ``str(helion.Config)``: "Config(block_sizes=[64, 128], indexing='...', ...)"
    config = eval(best["config"], {"__builtins__": {}}, {"Config": dict, "helion": type("H", (), {"Config": dict})})  # noqa: S307
    return {"kernel": kernel, "config": config, "perf_ms": float(best["perf_ms"]),
            "autotuner": f"stopped early: best 'ok' row of {csv_path.name}"}


def merge() -> dict:
    results = [json.loads(Path(p).read_text()) for p in sorted(glob.glob(str(OUT / "tune-*.json")))]
    from logitless.helion_lib import configs

    done = {r["kernel"] for r in results}
    for kernel in TUNE_KERNELS:
        path = OUT / f"autotune-{kernel}.csv"
        n, h, v = SHAPES["distill" if kernel.startswith("jsd") else "lce"][:3]
        if kernel not in done and path.exists():
            found = best_of_log(kernel, path)
            if found is not None:
                found.update(tokens=int(os.environ.get("TUNE_TOKENS", n)), hidden=h, vocab=v,
                             dtype=str(DTYPE).replace("torch.", ""), tuned_ms=found["perf_ms"],
                             device_class=configs.device_class(DEVICE))
                print(f"merge: {kernel} from its search log ({found['perf_ms']} ms)")
                results.append(found)
    if not results:
        print("merge: no tune-*.json in", OUT)
        return {}
    cls = results[0]["device_class"]
    content = config_file(results)
    (OUT / "configs").mkdir(parents=True, exist_ok=True)
    (OUT / "configs" / f"{cls}.json").write_text(json.dumps(content, indent=1) + "\n")
    print(f"merge: {sorted(content)} -> {OUT / 'configs' / (cls + '.json')}")
    return content


# ----------------------------------------------------------------------------- other lowerings


def lowerings() -> dict:
    """Helion's CuTe and Pallas lowerings of the three lce kernels (code generation only, bf16,
    64 x 64 x 256, the heuristic's configs): "OK, <lines>" or the first line of the error.
    Needs nvidia-cutlass-dsl >= 4.7 and apache-tvm-ffi (cute), jax (pallas) importable; on a
    torch without CUDA 13 the cute backend's CUDA check is skipped (nothing is launched)."""
    from logitless.helion_lib import runtime

    runtime.require()  # imports helion after runtime's torch shims (torch 2.11)
    import helion
    import helion._compat
    from helion.runtime.settings import RefMode

    from logitless.helion_lib import ce_kernels, configs, grad_kernels
    from logitless.helion_lib import linear_cross_entropy as hce
    from logitless.options import CrossEntropyOptions

    if not helion._compat.requires_cuda_version("13"):
        helion._compat.requires_cuda_version = lambda v: True  # code generation only
    n, h, v = 64, 64, 256
    x, w = torch.randn(n, h, dtype=torch.bfloat16), torch.randn(v, h, dtype=torch.bfloat16)
    t, opts = torch.randint(0, v, (n,)), CrossEntropyOptions()
    lse, coef = torch.zeros(n), torch.zeros(3, n)
    cases = [("ce_forward", ce_kernels.ce_forward, hce.forward_args(x, w, None, t, None, opts)),
             ("ce_dz", grad_kernels.linear_dlogits, hce.backward_args(x, w, None, t, None, lse, coef, opts.softcap))]
    out = {}
    for backend in ("cute", "pallas"):
        for name, base, args in cases:
            try:
                kernel = helion.kernel(base.fn, **{**runtime.kernel_settings(), "ref_mode": RefMode.OFF,
                                                   "backend": backend})
                cfg = helion.Config(**configs.default_config(name, {"n": n, "v": v, "h": h}))
                out[f"{backend} {name}"] = f"OK, {len(kernel.bind(args).to_triton_code(cfg).splitlines())} lines"
            except Exception as e:  # noqa: BLE001 - the error is the result
                out[f"{backend} {name}"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            print(f"{backend} {name}: {out[f'{backend} {name}']}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "lowerings.json").write_text(json.dumps(out, indent=1))
    return out


# ----------------------------------------------------------------------------- bench


def _cases():
    """(suite, call(backend, grad) -> (loss, leaves), upstream gradient or None)."""
    import logitless

    n, h, v = SHAPES["lce"]
    g = _generator(1)
    lce = (_randn(g, n, h), _randn(g, v, h, scale=h ** -0.5), torch.randint(0, v, (n,), generator=g, device=DEVICE))

    def call_lce(backend, grad):
        x, w = (a.detach().requires_grad_(grad) for a in lce[:2])
        return logitless.linear_cross_entropy(x, w, lce[2], backend=backend), (x, w)

    n, h, v, ht = SHAPES["distill"]
    g = _generator(2)
    dis = (_randn(g, n, h), _randn(g, v, h, scale=h ** -0.5), _randn(g, n, ht), _randn(g, v, ht, scale=ht ** -0.5),
           torch.randint(0, v, (n,), generator=g, device=DEVICE))

    def call_distill(backend, grad):
        xs, ws = (a.detach().requires_grad_(grad) for a in dis[:2])
        loss = logitless.linear_jsd(xs, ws, dis[2], dis[3], dis[4], beta=0.5, temperature=1.0, backend=backend)
        return loss, (xs, ws)

    n, h, v = SHAPES["rl"]
    g = _generator(3)
    rl = (_randn(g, n, h), _randn(g, v, h, scale=h ** -0.5), torch.randint(0, v, (n,), generator=g, device=DEVICE))
    up = (torch.randn(n, generator=g, device=DEVICE), torch.randn(n, generator=g, device=DEVICE))

    def call_rl(backend, grad):
        x, w = (a.detach().requires_grad_(grad) for a in rl[:2])
        logp, ent = logitless.linear_log_probs(x, w, rl[2], temperature=0.7, entropy=True, backend=backend)
        return (logp * up[0]).sum() + (ent * up[1]).sum(), (x, w)

    return {"lce": call_lce, "distill": call_distill, "rl": call_rl}


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _measure(call, backend: str, deadline: float) -> dict:
    from logitless.ops.common import helion_choice
    from logitless.ops.common.helion_choice import HelionFallbackWarning
    from logitless_bench.timing import peak_extra_bytes, time_ms_spread

    row: dict = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        loss, leaves = call(backend, True)
        grads = torch.autograd.grad(loss, leaves)
        _sync()
        row["first_call_s"] = round(time.perf_counter() - t0, 2)  # compiles included
    fell = [str(w.message) for w in seen if issubclass(w.category, HelionFallbackWarning)]
    # (warned once per process and cause: a later row that falls back for the same cause has
    # only helion_choice.cause() to say so)
    row["fallback"] = (fell[0] if fell else helion_choice.cause()) if backend == "helion" else None
    # one more untimed call (the warm-up of the forward+backward timing), then as many reps
    # as fit the time left (at least 3, at most 10)
    t0 = time.perf_counter()
    loss2, leaves2 = call(backend, True)
    torch.autograd.grad(loss2, leaves2)
    _sync()
    one = time.perf_counter() - t0
    reps = max(3, min(10, int(max(deadline - time.perf_counter(), 0) / 4 / max(one, 1e-3))))

    def fwd():
        with torch.no_grad():
            call(backend, False)

    def fb():
        loss_, leaves_ = call(backend, True)
        torch.autograd.grad(loss_, leaves_)

    row["fwd_ms"], row["fwd_spread"] = (round(x, 3) for x in time_ms_spread(fwd, device=DEVICE, warmup=1, reps=reps))
    row["fb_ms"], row["fb_spread"] = (round(x, 3) for x in time_ms_spread(fb, device=DEVICE, warmup=0, reps=reps))
    row["reps"] = reps
    if DEVICE.type == "cuda":
        grad_bytes = sum(t.numel() * t.element_size() for t in leaves)
        _, peak = peak_extra_bytes(fb, device=DEVICE, exclude_bytes=grad_bytes)
        row["peak_extra_mib"] = round(peak / 2**20, 1)
    return row, (loss.detach(), [gr.detach() for gr in grads])


def _bench_rows(report: dict, cases: dict, methods: list, tuned_dir: Path, start: float, per_case: float):
    """Measures every (suite, method) into ``report["rows"]``, the suite's first method as
    the reference of the others' agreement; writes the report after each row."""
    from logitless.helion_lib import configs

    for suite, call in cases.items():
        ref = None
        for i, method in enumerate(methods):
            if method == "helion-tuned":
                os.environ[configs.USER_DIR_ENV] = str(tuned_dir)
            else:
                os.environ.pop(configs.USER_DIR_ENV, None)
            deadline = start + per_case * (len(methods) * list(cases).index(suite) + i + 1)
            backend = "helion" if method.startswith("helion") else method
            try:
                row, (loss, grads) = _measure(call, backend, deadline)
            except Exception as e:  # noqa: BLE001 - a failing row is reported, the others still run
                row, loss = {"error": f"{type(e).__name__}: {str(e).strip()[:500]}"}, None
            if loss is not None and ref is None:
                ref = (loss, grads)
            elif loss is not None:
                row["vs_" + OTHER] = {"loss": _rel(loss, ref[0]), "grads": [_rel(a, b) for a, b in zip(grads, ref[1])]}
            row.update(suite=suite, method=method)
            report["rows"].append(row)
            print(json.dumps(row, default=str), flush=True)
            _write(report)
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()


def _write(report: dict) -> Path:
    name = "helion-cpu.json" if SMOKE else f"helion-{report['device_class'].replace('nvidia-', '')}.json"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(json.dumps(report, indent=1, default=str))
    return OUT / name


def bench() -> dict:
    from logitless.helion_lib import configs

    seconds = float(os.environ.get("BENCH_SECONDS", "120"))
    start = time.perf_counter()
    tuned_dir = OUT / "configs"
    tuned = tuned_dir.is_dir() and any(tuned_dir.glob("*.json"))
    methods = [OTHER, "helion"] + (["helion-tuned"] if tuned else [])
    if os.environ.get("BENCH_METHODS"):  # e.g. "helion-tuned" alone: a failing config makes Helion fall
        methods = os.environ["BENCH_METHODS"].split()  # back for the rest of its process, so run it apart
    report = {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu",
              "device_class": configs.device_class(DEVICE), "torch": torch.__version__, "dtype": str(DTYPE),
              "shapes": SHAPES, "methods": methods, "rows": []}
    cases = _cases()
    per_case = seconds / (len(cases) * len(methods))
    try:
        _bench_rows(report, cases, methods, tuned_dir, start, per_case)
    except KeyboardInterrupt:  # (helion.sh's time limit: SIGINT) the rows measured so far are reported
        report["interrupted"] = True
        print("bench: interrupted", flush=True)
    os.environ.pop(configs.USER_DIR_ENV, None)
    for suite in cases:
        rows = {r["method"]: r for r in report["rows"] if r["suite"] == suite and "fb_ms" in r}
        if OTHER in rows:
            for m, r in rows.items():
                if m != OTHER:
                    r["fwd_ratio"] = round(r["fwd_ms"] / rows[OTHER]["fwd_ms"], 3)
                    r["fb_ratio"] = round(r["fb_ms"] / rows[OTHER]["fb_ms"], 3)
    print("bench ->", _write(report))
    print(f"{'suite':8} {'method':13} {'fwd ms':>9} {'f+b ms':>9} {'fwd x':>6} {'f+b x':>6} {'MiB':>7}  "
          "agreement / note")
    for r in report["rows"]:
        note = r.get("error") or (("FELL BACK: " + r["fallback"][:60]) if r.get("fallback") else "")
        agree = r.get("vs_" + OTHER)
        if agree:
            note = f"loss {agree['loss']:.1e} grads {max(agree['grads']):.1e} " + note
        print(f"{r['suite']:8} {r['method']:13} {r.get('fwd_ms', math.nan):9.2f} {r.get('fb_ms', math.nan):9.2f} "
              f"{r.get('fwd_ratio', math.nan):6.2f} {r.get('fb_ratio', math.nan):6.2f} "
              f"{r.get('peak_extra_mib', math.nan):7.1f}  {note}")
    return report


if __name__ == "__main__":
    step = sys.argv[1] if len(sys.argv) > 1 else "info"
    if step == "tune":
        tune(sys.argv[2])
    else:
        {"info": info, "merge": merge, "bench": bench, "lowerings": lowerings}[step]()
