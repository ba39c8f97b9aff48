"""``python -m logitless_bench --suite jax-sharded``: the JAX linear cross-entropy on all
local devices under ``jax.jit`` with ``NamedSharding`` inputs (a MaxText-style trainer's
setting), data, tensor and 2-D parallel, against XLA with the logits. Needs only jax.

Modes (mesh over all local devices, axes ("data", "model"), Auto axis types unless
``--explicit``):
    data     x and the targets split over the tokens, the weight replicated
    tensor   the weight split over the vocabulary, x replicated
    2d       both (needs >= 4 devices)
    fsdp     x, the targets and the weight's vocabulary over one axis ("data"): logitless
             gathers x (3 N < 2 V, the vocabulary split) or the weight (dW then comes back
             reduce-scattered); the collectives column shows which each method moves
Methods:
    xla-logits        fp32 logits materialised, log_softmax, mean (what XLA does alone)
    xla-logits-bf16   bf16 logits ``x @ w.T``, f32 log-sum-exp minus the label's logit (what
                      MaxText and most JAX code do; ``jax_timing.bf16_logits_loss``, its code
                      in the result files), sharded the same way
    logitless-xla     logitless.jax.linear_cross_entropy(implementation="xla")
    logitless-mosaic  implementation="mosaic_gpu" (SM90 GPUs)
    logitless         implementation=None (the automatic choice)
    logp-xla-logits   token log-probs + entropy at T = 0.7 with the fp32 logits materialised
    logp              logitless.jax.linear_log_probs(temperature=0.7, entropy=True)
                      (the RL case: loss = mean(log p) + 0.01 mean(H)), automatic backend
    logp-xla          the same with implementation="xla"; the logp rows are
                      also compared with the same op on ONE device (global shape, unsharded
                      inputs on device 0: time and temp bytes measured once per op, the
                      "1 device" rows; logp-xla-logits against the automatic one), column
                      "vs 1-dev op"
Metrics per mode and method: fwd+bwd median ms (jit of value_and_grad w.r.t. x and
weight), its ratio to ONE device's three GEMMs of the whole problem (3 x the time of
``jnp.dot(x, w.T)`` of the global shape on device 0: 1.0 = one GPU's GEMM cost, 0.5 =
two GPUs at perfect scaling), XLA's temporary bytes per device of the compiled fwd+bwd
(``memory_analysis().temp_size_in_bytes``), the collectives of the compiled HLO (kind x
count and the largest operand), |loss - xla-logits loss|.
Files: benchmarks/results/jax-sharded-<tag>-<date>.json/.md and latest-jax-sharded-<tag>.*.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import time
from collections import Counter

from .common import table_report, write_results
from .jax_timing import environment as jax_environment
from .jax_timing import median_ms as _median_ms

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

MODES = ("data", "tensor", "2d", "fsdp")
METHODS = ("xla-logits", "xla-logits-bf16", "logitless-xla", "logitless-mosaic", "logitless", "logp-xla-logits",
           "logp-xla", "logp")
#: Methods of the log-prob rows (their own reference loss and one-device baseline).
LOGP_METHODS = ("logp-xla-logits", "logp-xla", "logp")
LOGP_TEMPERATURE = 0.7
#: llama3.1-8b's LM head and 8192 tokens in all (the issue's setting).
DEFAULT_SHAPE = (8192, 4096, 128256)
CPU_SHAPE = (256, 64, 4096)


def build_parser():
    p = argparse.ArgumentParser(prog="python -m logitless_bench --suite jax-sharded",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=("jax-sharded",), default="jax-sharded")
    p.add_argument("--tokens", type=int, help=f"tokens in all (default {DEFAULT_SHAPE[0]}; CPU {CPU_SHAPE[0]})")
    p.add_argument("--hidden", type=int, help=f"default {DEFAULT_SHAPE[1]}")
    p.add_argument("--vocab", type=int, help=f"default {DEFAULT_SHAPE[2]}")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--methods", help=f"comma-separated subset of {','.join(METHODS)} (default: all that apply)")
    p.add_argument("--explicit", action="store_true", help="Explicit mesh axis types (sharding in types)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="the small CPU shape")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="jax-sharded",
                   help="result files <name>-<tag>-<date>.* and latest-<name>-<tag>.* (e.g. jax-sharded-logp)")
    p.add_argument("--max-minutes", type=float, help="no new row starts past this")
    return p


_COLL = re.compile(r"=\s*(\(*[a-z0-9]+\[[^=]*?)\s+(all-gather|all-reduce|all-to-all|collective-permute|"
                   r"reduce-scatter)(?:-start)?\(")
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")


def hlo_collectives(hlo_text: str) -> list:
    """[(kind, [(dtype, shape), ...])] of the collectives in compiled HLO text, async ones
    ("-start", nested tuple shapes) included (also tests_jax's HLO checks)."""
    return [(m.group(2), [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(m.group(1))])
            for m in _COLL.finditer(hlo_text)]


def collectives(hlo_text: str) -> dict:
    """{kind: {"count": k, "largest": "bf16[...]"}} of the collectives in compiled HLO."""
    counts, largest = Counter(), {}
    for kind, shapes in hlo_collectives(hlo_text):
        counts[kind] += 1
        for dt, shape in shapes:
            size = 1
            for d in shape:
                size *= d
            if size > largest.get(kind, (0, ""))[0]:
                largest[kind] = (size, f"{dt}[{','.join(map(str, shape))}]")
    return {k: {"count": c, "largest": largest.get(k, (0, "-"))[1]} for k, c in sorted(counts.items())}


def _fmt_coll(c: dict) -> str:
    return ", ".join(f"{k} x{v['count']} ({v['largest']})" for k, v in c.items()) or "none"


def environment(argv):
    import jax

    from .jax_timing import baseline_source

    return {**jax_environment(argv), "devices": len(jax.devices()), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "baseline_code": baseline_source()}


def _loss_fn(method):
    import jax
    import jax.numpy as jnp

    from logitless.jax import linear_cross_entropy

    if method == "xla-logits":
        def f(x, w, t):
            z = jnp.dot(x, w.T, preferred_element_type=jnp.float32)
            lp = jax.nn.log_softmax(z, axis=-1)
            return -jnp.mean(jnp.take_along_axis(lp, t[:, None], axis=-1))
        return f
    if method == "xla-logits-bf16":
        from .jax_timing import bf16_logits_loss

        return bf16_logits_loss
    if method == "logp-xla-logits":
        def f(x, w, t):
            z = jnp.dot(x, w.T, preferred_element_type=jnp.float32) / LOGP_TEMPERATURE
            lp = jax.nn.log_softmax(z, axis=-1)
            ent = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
            return jnp.mean(jnp.take_along_axis(lp, t[:, None], axis=-1)) + 0.01 * jnp.mean(ent)
        return f
    if method in ("logp", "logp-xla"):
        from logitless.jax import linear_log_probs

        impl = "xla" if method == "logp-xla" else None

        def f(x, w, t):
            lp, ent = linear_log_probs(x, w, t, temperature=LOGP_TEMPERATURE, entropy=True, implementation=impl)
            return jnp.mean(lp) + 0.01 * jnp.mean(ent)
        return f
    impl = {"logitless-xla": "xla", "logitless-mosaic": "mosaic_gpu", "logitless": None}[method]
    return lambda x, w, t: linear_cross_entropy(x, w, t, implementation=impl)


def _mesh(mode, explicit):
    import jax
    from jax.sharding import AxisType

    n = len(jax.devices())
    shape = {"data": (n, 1), "tensor": (1, n), "2d": (2, n // 2), "fsdp": (n, 1)}[mode]
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * 2
    return jax.make_mesh(shape, ("data", "model"), axis_types=types)


COLUMNS = ("mode", "method", "fwd+bwd ms", "f+b / 1 dev 3 GEMMs", "vs 1-dev op", "temp MiB/dev", "|loss-xla|",
           "collectives", "compile s", "note")


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if v == 0 or abs(v) >= 1e-2 else f"{v:.2e}"
    return str(v)


def markdown(data) -> str:
    m = data["meta"]
    n, h, v = data["settings"]["shape"]
    lines = [f"# JAX linear cross-entropy, sharded: {m['devices']} x {m['device']}, {m['date']}", "",
             f"jax {m['jax']}; `{m['command']}`; {n} tokens in all, H {h}, V {v}, {data['settings']['dtype']}; "
             f"one device's 3 GEMMs of the whole problem: {_fmt(data['gemm3_ms'])} ms (= 1.0); "
             f"warmup {data['settings']['warmup']}, reps {data['settings']['reps']}"
             f"{'' if data.get('complete') else ' — **partial**'}", "",
             "temp MiB/dev: XLA's compiled temporary bytes per device of the jitted fwd+bwd "
             "(`memory_analysis().temp_size_in_bytes`); collectives: kinds x count (largest operand) in "
             "the compiled HLO; vs 1-dev op (logp rows): fwd+bwd time / the same op's on one device "
             "(the \"1 device\" row); |loss-xla| of a logp row: against logp-xla-logits.", ""]
    if m.get("baseline_code"):
        lines += ["xla-logits-bf16, under `jax.jit(jax.value_and_grad(...))` with the inputs sharded as the row says:",
                  "", "```python", m["baseline_code"].rstrip(), "```", ""]
    return table_report(lines, COLUMNS, data["rows"], _fmt, data.get("notes", []))


def save(data, out_dir):
    dev = data["meta"]["device"]
    model = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Za-z]?)\b", dev)  # "NVIDIA H100 80GB HBM3" -> H100
    tag = "cpu" if data["meta"]["platform"] == "cpu" else (model.group(1) if model else dev.split()[-1])
    tag = re.sub(r"[^A-Za-z0-9]+", "", tag) or "dev"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    base = data["settings"].get("name", "jax-sharded")
    return write_results(out_dir, (f"{base}-{tag}-{stamp}", f"latest-{base}-{tag}"), data, markdown(data))[1::2]


def run(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from logitless.jax.ops.common.choice import is_sm90

    t_start = time.perf_counter()
    cpu = args.cpu or jax.devices()[0].platform == "cpu"
    base = CPU_SHAPE if cpu else DEFAULT_SHAPE
    n, h, v = (args.tokens or base[0], args.hidden or base[1], args.vocab or base[2])
    dtype = jnp.dtype(args.dtype)
    # Default: the automatic choice only where it is not already one of the others.
    methods = args.methods.split(",") if args.methods else (
        ["xla-logits", "xla-logits-bf16", "logitless-xla", "logitless"] + (["logitless-mosaic"] if is_sm90() else []))
    modes = [m for m in args.modes.split(",") if m]
    ndev = len(jax.devices())
    data = {"meta": environment(argv), "settings": {"shape": [n, h, v], "dtype": dtype.name, "warmup": args.warmup,
                                                   "reps": args.reps, "explicit": args.explicit,
                                                   "name": args.name},
            "rows": [], "notes": [], "complete": False}

    key = jax.random.PRNGKey(0)
    kx, kw, kt = jax.random.split(key, 3)
    x = jax.random.normal(kx, (n, h), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (v, h), jnp.float32) / np.sqrt(h) * 2).astype(dtype)
    t = jax.random.randint(kt, (n,), 0, v, jnp.int32)

    d0 = jax.devices()[0]
    x0, w0 = jax.device_put(x, d0), jax.device_put(w, d0)
    gemm = jax.jit(lambda x, w: jnp.dot(x, w.T))
    try:
        data["gemm3_ms"] = 3 * _median_ms(gemm, (x0, w0), args.warmup, args.reps)
    except Exception as exc:  # e.g. out of memory for the global logits on one device
        data["gemm3_ms"] = None
        data["notes"].append(f"one-device GEMM failed: {type(exc).__name__}: {str(exc)[:200]}")
    del x0, w0
    print(f"[jax-sharded] {ndev} devices, shape {n}x{h}x{v} {dtype.name}, 3 GEMMs on one device: "
          f"{data['gemm3_ms']} ms", flush=True)

    data["logp_1dev_ms"] = {}
    for method in [m for m in ("logp", "logp-xla") if m in methods]:
        row = {"mode": "1 device", "method": method}
        try:
            x0, w0, t0 = (jax.device_put(a, d0) for a in (x, w, t))
            compiled = jax.jit(jax.value_and_grad(_loss_fn(method), argnums=(0, 1))).lower(x0, w0, t0).compile()
            mem = compiled.memory_analysis()
            if mem is not None:
                row["temp MiB/dev"] = mem.temp_size_in_bytes / 2**20
            row["fwd+bwd ms"] = _median_ms(compiled, (x0, w0, t0), args.warmup, args.reps)
            row["vs 1-dev op"] = 1.0
            if data.get("gemm3_ms"):
                row["f+b / 1 dev 3 GEMMs"] = row["fwd+bwd ms"] / data["gemm3_ms"]
            data["logp_1dev_ms"][method] = row["fwd+bwd ms"]
            del x0, w0, t0, compiled
        except Exception as exc:
            row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        data["rows"].append(row)
        print("[jax-sharded] " + " | ".join(f"{c}={_fmt(row.get(c))}" for c in COLUMNS), flush=True)

    specs = {"data": (P("data"), P()), "tensor": (P(), P("model")), "2d": (P("data"), P("model")),
             "fsdp": (P("data"), P("data"))}
    for mode in modes:
        if mode == "2d" and ndev < 4:
            data["notes"].append(f"2d skipped: {ndev} device(s) (needs >= 4)")
            continue
        if mode != "2d" and ndev < 2:
            data["notes"].append(f"{mode}: one device only (no sharding)")
        mesh = _mesh(mode, args.explicit)
        xs_spec, ws_spec = specs[mode]
        xs = jax.device_put(x, NamedSharding(mesh, xs_spec))
        ws = jax.device_put(w, NamedSharding(mesh, ws_spec))
        ts = jax.device_put(t, NamedSharding(mesh, P(xs_spec[0] if len(xs_spec) else None)))
        ref_loss = {}
        for method in methods:
            if args.max_minutes and time.perf_counter() - t_start > 60 * args.max_minutes:
                data["notes"].append(f"time limit: {mode}/{method} and later rows not run")
                break
            row = {"mode": mode, "method": method}
            try:
                f = _loss_fn(method)
                fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
                c0 = time.perf_counter()
                compiled = fn.lower(xs, ws, ts).compile()
                row["compile s"] = round(time.perf_counter() - c0, 1)
                mem = compiled.memory_analysis()
                if mem is not None:
                    row["temp MiB/dev"] = mem.temp_size_in_bytes / 2**20
                coll = collectives(compiled.as_text())
                row["collectives"] = _fmt_coll(coll)
                row["collectives_detail"] = coll
                ms = _median_ms(compiled, (xs, ws, ts), args.warmup, args.reps)
                row["fwd+bwd ms"] = ms
                if data.get("gemm3_ms"):
                    row["f+b / 1 dev 3 GEMMs"] = ms / data["gemm3_ms"]
                family = "logp" if method in LOGP_METHODS else "ce"
                one = data["logp_1dev_ms"]
                base = one.get(method, one.get("logp", one.get("logp-xla")))  # logits row: vs the op
                if family == "logp" and base:
                    row["vs 1-dev op"] = ms / base
                loss = float(compiled(xs, ws, ts)[0])
                if method in ("xla-logits", "logp-xla-logits"):
                    ref_loss[family] = loss
                elif family in ref_loss:
                    row["|loss-xla|"] = abs(loss - ref_loss[family])
            except Exception as exc:
                row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            data["rows"].append(row)
            print("[jax-sharded] " + " | ".join(f"{c}={_fmt(row.get(c))}" for c in COLUMNS), flush=True)
            save(data, args.out)
    data["complete"] = True
    paths = save(data, args.out)
    print(markdown(data))
    print(f"[jax-sharded] wrote {paths[0]} (+ .json)")
    return 0


def main(argv=None) -> int:
    return run(argv)
