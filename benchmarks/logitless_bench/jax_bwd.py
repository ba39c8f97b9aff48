"""Mosaic GPU backward, old vs new kernel settings in one process (issue 37).

``python -m logitless_bench.jax_bwd [--shapes a,b] [--old k=v,..] [--new k=v,..] [--profile]
[--out DIR]`` (SM90 GPU, jax only). Per tokamax shape: one GEMM (``jnp.dot(x, w.T)``), the
forward, and fwd+bwd of ``mosaic_gpu_backend`` (forward, mean-loss coefficients, backward)
with the backward's ``config`` = OLD and NEW (``--old``/``--new``: FwdConfig fields; default
the default config against ``dz_store=32``, the dz tile stored in 32-column pieces), each
timed twice (old, new, old, new); dx and dW of the two must be bitwise equal (same
products in the same order). Temporaries: XLA's compiled memory analysis of the forward
and of each fwd+bwd. Writes jax-bwd-<device>-<date>.{json,md}. ``--profile``: per shape
only NEW's fwd+bwd, with its kernels' times from a device profile, in place (a kernel
timed alone, one call each, had misled: docs/design.md), to jax-bwd-profile-<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

COLUMNS = ("shape", "layout", "gemm ms", "fwd ms", "f+b old ms", "f+b new ms", "new/old", "fwd/1 GEMM",
           "f+b old/3 GEMMs", "f+b new/3 GEMMs", "fwd temp MiB", "f+b temp MiB old", "f+b temp MiB new", "bitwise")


def _fb(mg, cfg, layout, keep=False):
    """fwd+bwd of the backend's functions under ``cfg``; ``keep``: the forward keeps
    exp(z - m) of the columns the default budget's plan keeps (``forward_keeping``) and
    the backward takes their dz from it."""
    import jax.numpy as jnp

    def fb(x, w, t):
        plan = None
        if keep:
            from logitless.jax.budget import default_memory_budget

            v = w.shape[0] if layout == "vh" else w.shape[1]
            plan = mg.plan_config(x.shape, (v, x.shape[1]), x.dtype, default_memory_budget(), layout)
        lse, tl, _, kept = mg.forward_keeping(x, w, None, t, config=cfg, weight_layout=layout,
                                              keep_cols=plan.keep if plan else 0)
        n = x.shape[0]
        g = jnp.full((n,), 1.0 / n, jnp.float32)
        coef = jnp.stack([g, g, jnp.zeros_like(g)])  # mean cross-entropy: dz = (p - onehot) / N
        dx, dw, _ = mg.backward(x, w, None, t, lse, coef, config=cfg, weight_layout=layout, kept=kept,
                                chunk=plan.chunk if plan else None, kept_chunk=plan.kept_chunk if plan else 0)
        return jnp.mean(lse - tl), dx, dw

    return fb


def _profile(mg, x, w, t, reps, cfg, keep=False):
    """In place: the fwd+bwd's ms, compile s, temporaries and device profile (kernels
    by name, per call: ``jax_timing.device_profile``)."""
    import time

    import jax

    from .jax_timing import device_profile, median_ms

    t0 = time.perf_counter()
    f = jax.jit(_fb(mg, cfg, "vh", keep)).lower(x, w, t).compile()
    compile_s = time.perf_counter() - t0
    ms = [median_ms(f, (x, w, t), 2, reps) for _ in range(2)]
    prof = device_profile(f, (x, w, t))
    row = {"f+b ms": min(ms), "f+b runs": ms, "compile s": compile_s,
           "temp MiB": f.memory_analysis().temp_size_in_bytes / 2**20,
           "kernel ms": sum(r["ms"] for r in prof.get("stream", [])), "kernels": prof.get("stream", [])[:24]}
    print({k: row[k] for k in ("f+b ms", "kernel ms", "compile s", "temp MiB")}, flush=True)
    for r in row["kernels"][:12]:
        print(f"   {r['ms']:8.3f} ms {r['calls']:6.1f}x  {r['name'][:100]}", flush=True)
    return row


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", help="names, comma-separated (default: the six tokamax shapes)")
    p.add_argument("--hv", default="llama3.1-8b", help="shapes also run with an (H, V) weight")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--old", default="", help="FwdConfig fields of OLD, k=v comma-separated")
    p.add_argument("--new", default="dz_store=32", help="FwdConfig fields of NEW, k=v comma-separated")
    p.add_argument("--keep", action="store_true",
                   help="the forward keeps exp(z - m) where the default budget's plan does (forward_keeping)")
    p.add_argument("--profile", action="store_true",
                   help="per shape only the fwd+bwd with NEW's config: ms, compile s and its kernels (device profile)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    old_cfg, new_cfg = _config(args.old), _config(args.new)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from logitless.jax.ops.linear_cross_entropy import mosaic_gpu_backend as mg

    from .jax_timing import median_ms
    from .shapes import JAX_SHAPES

    names = [s for s in (args.shapes or "").split(",") if s]
    shapes = [s for s in JAX_SHAPES if not names or s.name in names]
    hv = set(args.hv.split(",")) if args.hv else set()
    rows = []
    for s in shapes:
        kx, kw, kt = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(kx, (s.tokens, s.hidden), jnp.bfloat16)
        w = (jax.random.normal(kw, (s.vocab, s.hidden), jnp.float32) / np.sqrt(s.hidden)).astype(jnp.bfloat16)
        t = jax.random.randint(kt, (s.tokens,), 0, s.vocab, jnp.int32)
        gemm = median_ms(jax.jit(lambda x, w: jnp.dot(x, w.T)), (x, w), 2, args.reps)
        if args.profile:
            prof = {"shape": s.label, "gemm ms": gemm, **_profile(mg, x, w, t, args.reps, new_cfg, args.keep)}
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"jax-bwd-profile-{s.name}.json"), "w") as f:
                json.dump(prof, f, indent=1)
            continue
        for layout in ("vh", "hv") if s.name in hv else ("vh",):
            wl = w if layout == "vh" else w.T.copy()
            fwd_c = jax.jit(lambda x, w, t: mg.forward(x, w, None, t, weight_layout=layout)).lower(x, wl, t).compile()
            fwd = median_ms(fwd_c, (x, wl, t), 2, args.reps)
            fns = {k: jax.jit(_fb(mg, cfg, layout, args.keep)).lower(x, wl, t).compile()
                   for k, cfg in (("old", old_cfg), ("new", new_cfg))}
            mib = lambda c: c.memory_analysis().temp_size_in_bytes / 2**20
            outs = {k: jax.block_until_ready(f(x, wl, t)) for k, f in fns.items()}
            same = all(bool(jnp.array_equal(a, b)) for a, b in zip(outs["old"][1:], outs["new"][1:]))
            del outs
            ms = {k: [] for k in fns}
            for _ in range(2):
                for k, f in fns.items():
                    ms[k].append(median_ms(f, (x, wl, t), 2, args.reps))
            old, new = min(ms["old"]), min(ms["new"])
            row = dict(zip(COLUMNS, (s.label, layout, gemm, fwd, old, new, new / old, fwd / gemm, old / (3 * gemm),
                                     new / (3 * gemm), mib(fwd_c), mib(fns["old"]), mib(fns["new"]), same)))
            row["f+b old runs"], row["f+b new runs"] = ms["old"], ms["new"]
            rows.append(row)
            print(" | ".join(f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in COLUMNS),
                  flush=True)
            del wl
            _save(args, argv, rows, old_cfg, new_cfg)  # after each row: a run cut short keeps what it measured
        del x, w, t
    print("\n".join(_save(args, argv, rows, old_cfg, new_cfg)))
    return 0 if all(r["bitwise"] for r in rows) else 1


def _save(args, argv, rows, old, new):
    from .jax_suite import environment

    env = {**environment(argv), "command": "python -m logitless_bench.jax_bwd " + " ".join(argv)}
    tag = f"jax-bwd-{env['device'].split()[1] if len(env['device'].split()) > 1 else 'dev'}-{env['date'][:10]}"
    data = {"meta": env, "old": repr(old), "new": repr(new), "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, tag + ".json"), "w") as f:
        json.dump(data, f, indent=1)
    md = [f"# Mosaic GPU backward, old vs new: {env['device']}, {env['date']}", "",
          f"jax {env['jax']}; `{env['command']}`; best of two medians of {args.reps}; "
          f"old = `{old}`, new = `{new}` (None: chosen by `mosaic_lib`); temp MiB: "
          "`memory_analysis().temp_size_in_bytes` of the compiled fwd and fwd+bwd", "",
          "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    md += ["| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS) + " |"
           for r in rows]
    with open(os.path.join(args.out, tag + ".md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return md


def _config(spec: str = ""):
    """A FwdConfig from "k=v,k=v" (ints; "None")."""
    from logitless.jax.mosaic_lib import FwdConfig

    kw = {}
    for item in filter(None, spec.split(",")):
        k, _, val = item.partition("=")
        kw[k.strip()] = None if val.strip() == "None" else int(val)
    return FwdConfig(**kw)


if __name__ == "__main__":
    raise SystemExit(main())
