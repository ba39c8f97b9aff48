"""Mosaic GPU backward, old vs new kernel settings in one process (issue 37).

``python -m logitless_bench.jax_bwd [--shapes a,b] [--old k=v,..] [--new k=v,..] [--parts all|dz|none]
[--out DIR]`` (SM90 GPU, jax only). Per tokamax shape: one GEMM (``jnp.dot(x, w.T)``), the
forward, and fwd+bwd of ``mosaic_gpu_backend`` (forward, mean-loss coefficients, backward)
with the backward's ``config`` = OLD and NEW (``--old``/``--new``: FwdConfig fields; default
the default config against ``dz_store=32``, the dz tile stored in 32-column pieces), each
timed twice (old, new, old, new); dx and dW of the two must be bitwise equal (same
products in the same order). Temporaries: XLA's compiled memory analysis of the forward
and of each fwd+bwd. On the first shape, one vocab chunk's parts: the dz kernel
(old/new) and (``--parts all``) the two XLA GEMMs (dx += dz W_c, dW_c = dz^T x) and the
backward's XLA loop alone (GEMMs, W slices, in-place dW updates), scaled to the whole
vocabulary. Writes jax-bwd-<device>-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

COLUMNS = ("shape", "layout", "gemm ms", "fwd ms", "f+b old ms", "f+b new ms", "new/old", "fwd/1 GEMM",
           "f+b old/3 GEMMs", "f+b new/3 GEMMs", "fwd temp MiB", "f+b temp MiB old", "f+b temp MiB new", "bitwise")


def _fb(mg, cfg, layout):
    import jax.numpy as jnp

    def fb(x, w, t):
        lse, tl, _ = mg.forward(x, w, None, t, weight_layout=layout)
        n = x.shape[0]
        g = jnp.full((n,), 1.0 / n, jnp.float32)
        coef = jnp.stack([g, g, jnp.zeros_like(g)])  # mean cross-entropy: dz = (p - onehot) / N
        dx, dw, _ = mg.backward(x, w, None, t, lse, coef, config=cfg, weight_layout=layout)
        return jnp.mean(lse - tl), dx, dw

    return fb


def _parts(mg, ml, x, w, t, reps, old, new, dz_only=False):
    """ms of one chunk's dz kernel (old/new) and GEMMs, times the number of chunks."""
    import jax
    import jax.numpy as jnp

    from .jax_timing import median_ms

    n, h = x.shape
    v = w.shape[0]
    chunk = ml.chunk_columns(n, v, h, 2, None, 128)
    lse = jnp.full((n,), 12.0, jnp.float32)
    coef = jnp.ones((3, n), jnp.float32) / n
    out = {"chunk": chunk, "chunks": v / chunk}
    for name, cfg in (("dz old", old), ("dz new", new)):
        f = jax.jit(lambda x, w, t, lse_, c, cfg=cfg: mg.dz_chunk(x, w, t, lse_, c, c0=0, chunk=chunk, cfg=cfg))
        out[name] = median_ms(f, (x, w, t, lse, coef), 2, reps) * v / chunk
    if dz_only:
        return out
    dz = jax.random.normal(jax.random.key(1), (n, chunk), jnp.bfloat16) * 1e-4
    dx = jnp.zeros((n, h), jnp.float32)
    c0 = jnp.int32(chunk)  # a traced offset, as in the loop
    fdx = jax.jit(lambda dx, dz, w, c0: dx + jnp.dot(dz, jax.lax.dynamic_slice_in_dim(w, c0, chunk, 0),
                                                       preferred_element_type=jnp.float32))
    fdw = jax.jit(lambda dz, x: jax.lax.dot_general(dz, x, (((0,), (0,)), ((), ())),
                                                    preferred_element_type=jnp.bfloat16))
    out["dx gemm"] = median_ms(fdx, (dx, dz, w, c0), 2, reps) * v / chunk
    out["dW gemm"] = median_ms(fdw, (dz, x), 2, reps) * v / chunk
    nfull = v // chunk

    def xla_loop(dz, x, w):  # chunked_backward's XLA side alone (one dz for every chunk)
        def body(i, c):
            dx, dw = c
            c0 = i * chunk
            dx = dx + jnp.dot(dz, jax.lax.dynamic_slice_in_dim(w, c0, chunk, 0), preferred_element_type=jnp.float32)
            dw_c = jax.lax.dot_general(dz, x, (((0,), (0,)), ((), ())), preferred_element_type=w.dtype)
            return dx, jax.lax.dynamic_update_slice_in_dim(dw, dw_c, c0, 0)

        return jax.lax.fori_loop(0, nfull, body, (jnp.zeros(x.shape, jnp.float32), jnp.zeros_like(w)))

    out["xla loop"] = median_ms(jax.jit(xla_loop), (dz, x, w), 2, reps) * v / (nfull * chunk)
    return out


def _unrolled(x8, w, rowdat, tgt, *, n, v, cfg, budget, epilogue, interpret=None, vary=None, layout="vh"):
    """chunked_backward ("vh") as a Python loop: static W slices and static in-place dW
    updates; an optimization barrier per chunk keeps one chunk's temporaries alive."""
    import jax.numpy as jnp
    from jax import lax

    from logitless.jax import mosaic_lib as ml

    vw, h = w.shape
    bv = cfg.block_v
    chunk = ml.backward_chunk(n, vw, h, jnp.dtype(x8.dtype).itemsize, budget, bv)
    dx, dw = jnp.zeros(x8.shape, jnp.float32), lax.empty(w.shape, w.dtype)
    for c0 in range(0, vw, chunk):
        cw = min(chunk, vw - c0)
        xb, dx, dw = lax.optimization_barrier((x8, dx, dw))  # chunk i after chunk i - 1
        dz = ml.dz_call(xb, w, rowdat, tgt, jnp.full((1,), c0 // bv, jnp.int32), v=v, chunk=-(-cw // bv) * bv,
                        cfg=cfg, epilogue=epilogue, interpret=interpret, layout=layout)[:, :cw]
        dx = dx + jnp.dot(dz, w[c0:c0 + cw], preferred_element_type=jnp.float32)
        dw = dw.at[c0:c0 + cw].set(lax.dot_general(dz, xb, (((0,), (0,)), ((), ())), preferred_element_type=w.dtype))
    return dx, dw


def _loops(mg, ml, x, w, t, reps, cfg, names=("fori-zeros", "fori", "unrolled")):
    """In place: f+b ms, compile s, temporaries and a device profile (kernels) per backward
    loop: "fori-zeros" (dW zero-initialised, as before), "fori" (the library's), "unrolled"."""
    import contextlib
    import time

    import jax
    import jax.numpy as jnp

    from .jax_timing import device_profile, median_ms

    @contextlib.contextmanager
    def loop(name):
        real, empty = ml.chunked_backward, jax.lax.empty
        ml.chunked_backward = _unrolled if name == "unrolled" else real
        if name == "fori-zeros":
            jax.lax.empty = jnp.zeros
        try:
            yield
        finally:
            ml.chunked_backward, jax.lax.empty = real, empty

    out, ref = [], None
    for lname in names:
        t0 = time.perf_counter()
        with loop(lname):
            f = jax.jit(_fb(mg, cfg, "vh")).lower(x, w, t).compile()
        compile_s = time.perf_counter() - t0
        res = jax.block_until_ready(f(x, w, t))
        ref = ref or res
        same = all(bool((a == b).all()) for a, b in zip(ref[1:], res[1:]))
        del res
        ms = [median_ms(f, (x, w, t), 2, reps) for _ in range(2)]
        prof = device_profile(f, (x, w, t))
        row = {"loop": lname, "f+b ms": min(ms), "f+b runs": ms, "bitwise": same, "compile s": compile_s,
               "temp MiB": f.memory_analysis().temp_size_in_bytes / 2**20,
               "kernel ms": sum(r["ms"] for r in prof.get("stream", [])), "kernels": prof.get("stream", [])[:24]}
        print({k: row[k] for k in ("loop", "f+b ms", "kernel ms", "bitwise", "compile s", "temp MiB")}, flush=True)
        for r in row["kernels"][:12]:
            print(f"   {r['ms']:8.3f} ms {r['calls']:6.1f}x  {r['name'][:100]}", flush=True)
        out.append(row)
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", help="names, comma-separated (default: the six tokamax shapes)")
    p.add_argument("--hv", default="llama3.1-8b", help="shapes also run with an (H, V) weight")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--parts-only", action="store_true", help="only the first shape's per-part times")
    p.add_argument("--parts", choices=("all", "dz", "none"), default="all",
                   help="first shape's per-part times: all, the dz kernels only, none")
    p.add_argument("--old", default="", help="FwdConfig fields of OLD, k=v comma-separated")
    p.add_argument("--new", default="dz_store=32", help="FwdConfig fields of NEW, k=v comma-separated")
    p.add_argument("--loops", default="", help="per shape: f+b, compile time and a device profile per backward "
                   "loop (NEW's config), comma-separated: fori-zeros, fori, unrolled")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    old_cfg, new_cfg = _config(args.old), _config(args.new)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from logitless.jax import mosaic_lib as ml
    from logitless.jax.ops.linear_cross_entropy import mosaic_gpu_backend as mg

    from .jax_timing import median_ms
    from .shapes import JAX_SHAPES

    names = [s for s in (args.shapes or "").split(",") if s]
    shapes = [s for s in JAX_SHAPES if not names or s.name in names]
    hv = set(args.hv.split(",")) if args.hv else set()
    rows, parts = [], None
    for s in shapes:
        kx, kw, kt = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(kx, (s.tokens, s.hidden), jnp.bfloat16)
        w = (jax.random.normal(kw, (s.vocab, s.hidden), jnp.float32) / np.sqrt(s.hidden)).astype(jnp.bfloat16)
        t = jax.random.randint(kt, (s.tokens,), 0, s.vocab, jnp.int32)
        gemm = median_ms(jax.jit(lambda x, w: jnp.dot(x, w.T)), (x, w), 2, args.reps)
        if args.loops:
            loops = _loops(mg, ml, x, w, t, args.reps, new_cfg, args.loops.split(","))
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"jax-bwd-loops-{s.name}.json"), "w") as f:
                json.dump({"shape": s.label, "gemm ms": gemm, "rows": loops}, f, indent=1)
            continue
        if parts is None and args.parts != "none":
            parts = {"shape": s.name,
                     **_parts(mg, ml, x, w, t, args.reps, old_cfg, new_cfg, dz_only=args.parts == "dz")}
            print(parts, flush=True)
            if args.parts_only:
                break
        for layout in ("vh", "hv") if s.name in hv else ("vh",):
            wl = w if layout == "vh" else w.T.copy()
            fwd_c = jax.jit(lambda x, w, t: mg.forward(x, w, None, t, weight_layout=layout)).lower(x, wl, t).compile()
            fwd = median_ms(fwd_c, (x, wl, t), 2, args.reps)
            fns = {k: jax.jit(_fb(mg, cfg, layout)).lower(x, wl, t).compile()
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
            _save(args, argv, rows, parts, old_cfg, new_cfg)  # after each row: a run cut short keeps what it measured
        del x, w, t
    print("\n".join(_save(args, argv, rows, parts, old_cfg, new_cfg)))
    return 0 if all(r["bitwise"] for r in rows) else 1


def _save(args, argv, rows, parts, old, new):
    from .jax_suite import environment

    env = {**environment(argv), "command": "python -m logitless_bench.jax_bwd " + " ".join(argv)}
    tag = f"jax-bwd-{env['device'].split()[1] if len(env['device'].split()) > 1 else 'dev'}-{env['date'][:10]}"
    data = {"meta": env, "old": repr(old), "new": repr(new), "rows": rows, "parts": parts}
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
    md += ["", "One vocab chunk's parts, times the chunk count (ms): " +
           ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in (parts or {}).items())]
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
