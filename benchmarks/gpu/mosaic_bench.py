"""Standalone timing of the "mosaic_gpu" JAX backend against jnp.dot (cuBLAS) on an H100.

For each shape (bf16): one GEMM x @ W^T (jitted jnp.dot, the cuBLAS-equivalent), our
forward for a few tile configs, our backward (default 256 MiB budget, and a budget
that holds one chunk), forward+backward through the public API when it is importable;
ratios: forward / GEMM and (forward + backward) / (3 GEMMs). Errors against float64 on
a subset of rows (lse, target logit, dx rows) and of vocab columns (dW rows).
Every case is wrapped: a failure prints its traceback and the run goes on.

    python benchmarks/gpu/mosaic_bench.py --out DIR [--shapes llama3.1-8b,gemma3-4b]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback

import numpy as np
from _jax_bench_common import after_each_case, median_ms, run_case

SHAPES = {
    "llama3.1-8b": (4096, 4096, 128256),
    "gemma3-4b": (4096, 2560, 262144),
    "small": (1000, 512, 4000),
    "tiny": (64, 64, 256),  # CPU smoke test of this script (interpret mode)
}


def timeit(fn, *args):
    return median_ms(fn, *args, iters=6, warmup=1)


def bench_shape(label, n, h, v, mg, res, rows=32, cols=256):
    import jax
    import jax.numpy as jnp

    res.update({"shape": [n, h, v], "dtype": "bfloat16"})
    key = jax.random.key(0)
    kx, kw, kt = jax.random.split(key, 3)
    x = jax.random.normal(kx, (n, h), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (v, h), jnp.float32) * (2.0 / np.sqrt(h))).astype(jnp.bfloat16)
    t = jax.random.randint(kt, (n,), 0, v, jnp.int32)
    jax.block_until_ready((x, w, t))

    gemm = jax.jit(lambda x, w: jnp.dot(x, w.T))
    run_case("gemm", lambda: {"ms": timeit(gemm, x, w)}, res, "gemm")
    g = res["gemm"].get("ms")

    configs = {
        "n128v128s4lag0": mg.FwdConfig(128, 128, 4, lag=0),
        "n128v128s4lag2": mg.FwdConfig(128, 128, 4, lag=2),  # the default
        "n128v128s4lag3": mg.FwdConfig(128, 128, 4, lag=3),
        "n64v256s4lag2": mg.FwdConfig(64, 256, 4, lag=2),
    }
    fwd_out = {}
    best = None
    for cname, cfg in configs.items():
        f = jax.jit(lambda x, w, t, cfg=cfg: mg.forward(x, w, None, t, softcap=None, need_smooth=False,
                                                        budget=None, config=cfg))

        def case(f=f, cname=cname):
            ms = timeit(f, x, w, t)
            fwd_out[cname] = f(x, w, t)
            return {"ms": ms, "x_gemm": ms / g if g else None}

        run_case(f"fwd {cname}", case, res, f"fwd_{cname}")
        ms = res[f"fwd_{cname}"].get("ms")
        if ms is not None and (best is None or ms < res[f"fwd_{best}"]["ms"]):
            best = cname
    res["fwd_best"] = best

    # Errors against float64 on a subset of rows (and columns for dW).
    def errors():
        if best is None:
            return {"error": "no forward ran"}
        lse, tl, _ = fwd_out[best]
        xs = np.asarray(x[:rows].astype(jnp.float32), np.float64)
        wf = np.asarray(w.astype(jnp.float32), np.float64)
        z = xs @ wf.T
        m = z.max(1)
        lse_ref = m + np.log(np.exp(z - m[:, None]).sum(1))
        ts = np.asarray(t[:rows])
        e = {
            "lse_max_abs": float(np.abs(np.asarray(lse[:rows], np.float64) - lse_ref).max()),
            "target_logit_max_abs": float(np.abs(np.asarray(tl[:rows], np.float64) - z[np.arange(rows), ts]).max()),
        }
        # XLA's plain bf16 path (logits in bf16, then log_softmax in fp32) for contrast.
        zb = jnp.dot(x[:rows], w.T).astype(jnp.float32)
        e["xla_bf16_lse_max_abs"] = float(np.abs(np.asarray(jax.nn.logsumexp(zb, axis=1), np.float64) - lse_ref).max())
        # Backward of the mean cross-entropy: A = B = 1/N, C = 0.
        coef = jnp.stack([jnp.full((n,), 1.0 / n), jnp.full((n,), 1.0 / n), jnp.zeros((n,))]).astype(jnp.float32)
        dx, dw, _ = jax.jit(lambda x, w, t, lse, c: mg.backward(x, w, None, t, lse, c, softcap=None, budget=None))(
            x, w, t, lse, coef)
        onehot = np.zeros_like(z)
        onehot[np.arange(rows), ts] = 1.0
        dz = (np.exp(z - lse_ref[:, None]) - onehot) / n
        dx_ref = dz @ wf
        e["dx_rel"] = float(np.abs(np.asarray(dx[:rows].astype(jnp.float32), np.float64) - dx_ref).max()
                            / np.abs(dx_ref).max())
        xf = np.asarray(x.astype(jnp.float32), np.float64)
        zc = xf @ wf[:cols].T
        lse_all = np.asarray(lse, np.float64)  # ours, checked above on the row subset
        tt = np.asarray(t)
        oh = (tt[:, None] == np.arange(cols)[None, :]).astype(np.float64)
        dzc = (np.exp(zc - lse_all[:, None]) - oh) / n
        dw_ref = dzc.T @ xf
        e["dw_rel"] = float(np.abs(np.asarray(dw[:cols].astype(jnp.float32), np.float64) - dw_ref).max()
                            / np.abs(dw_ref).max())
        return e

    run_case("errors vs float64", errors, res, "errors")

    # Backward timings (given the forward's lse).
    if best is not None:
        lse = fwd_out[best][0]
        coef = jnp.stack([jnp.full((n,), 1.0 / n), jnp.full((n,), 1.0 / n), jnp.zeros((n,))]).astype(jnp.float32)
        # Budgets: the default (256 MiB: ~24k-column dz chunks at 4096 tokens), 4096-column
        # chunks (dz chunk of 32 MiB stays in L2, more dx passes), and one chunk (no W
        # slices, no dW concatenation; N x V x 2 bytes of dz).
        for bname, budget in (("budget256M", None), ("chunk4096", 4 * n * h + 2 * n * 4096 + 1024),
                              ("one_chunk", 2 * n * v + 4 * n * h + 2**20)):
            bwd = jax.jit(lambda x, w, t, lse, c, budget=budget: mg.backward(
                x, w, None, t, lse, c, softcap=None, budget=budget, config=configs[best]))
            run_case(f"bwd {bname}", lambda bwd=bwd: {"ms": timeit(bwd, x, w, t, lse, coef)}, res, f"bwd_{bname}")
            fms = res[f"fwd_{best}"]["ms"]
            bms = res[f"bwd_{bname}"].get("ms")
            if g and bms:
                res[f"fwd_bwd_{bname}_x_3gemm"] = (fms + bms) / (3 * g)
        # dz kernel alone (one chunk of 16384 columns): its share of the backward.
        def dz_only():
            c = min(16384, (v // 128) * 128)
            f = jax.jit(lambda x, w, t, lse, cf: mg.dz_chunk(x, w, t, lse, cf, c0=0, chunk=c, cfg=configs[best]))
            ms = timeit(f, x, w, t, lse, coef)
            gg = jax.jit(lambda x, w: jnp.dot(x, w[:c].T))
            gms = timeit(gg, x, w)
            return {"chunk": c, "ms": ms, "gemm_same_cols_ms": gms, "x_gemm": ms / gms}
        run_case("dz kernel alone", dz_only, res, "dz_chunk")

    # Through the public API (what users call), if it is on this branch.
    def api_case():
        from logitless.jax import linear_cross_entropy

        f = jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, t, implementation="mosaic_gpu"),
                                       argnums=(0, 1)))
        ms = timeit(f, x, w)
        fo = jax.jit(lambda x, w: linear_cross_entropy(x, w, t, implementation="mosaic_gpu"))
        fms = timeit(fo, x, w)
        return {"fwd_ms": fms, "fwd_bwd_ms": ms, "fwd_x_gemm": fms / g if g else None,
                "fwd_bwd_x_3gemm": ms / (3 * g) if g else None}

    run_case("public api (value_and_grad)", api_case, res, "api")
    return res


def write_table(results, meta, out, final=False):
    """Markdown table of the results so far (also after each shape: a timeout keeps it)."""
    lines = ["| shape | GEMM ms | fwd ms (best cfg) | fwd/GEMM | bwd ms (256M / 4096-col / 1 chunk) "
             "| (fwd+bwd)/3 GEMM (same) | api fwd+bwd/3 GEMM | lse err | dx rel | dw rel |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in results["shapes"].items():
        if "error" in r:
            lines.append(f"| {label} | error: {r['error'][:80]} |")
            continue
        g = r.get("gemm", {}).get("ms")
        b = r.get("fwd_best")
        f = r.get(f"fwd_{b}", {}).get("ms") if b else None
        b1 = r.get("bwd_budget256M", {}).get("ms")
        b2 = r.get("bwd_one_chunk", {}).get("ms")
        b3 = r.get("bwd_chunk4096", {}).get("ms")
        e = r.get("errors", {})
        api = r.get("api", {})
        fmt = lambda val, s="{:.3f}": "-" if val is None else s.format(val)
        lines.append(
            f"| {label} | {fmt(g)} | {fmt(f)} ({b}) | {fmt(f / g if f and g else None, '{:.3f}x')} | "
            f"{fmt(b1)} / {fmt(b3)} / {fmt(b2)} | {fmt(r.get('fwd_bwd_budget256M_x_3gemm'), '{:.3f}x')} / "
            f"{fmt(r.get('fwd_bwd_chunk4096_x_3gemm'), '{:.3f}x')} / "
            f"{fmt(r.get('fwd_bwd_one_chunk_x_3gemm'), '{:.3f}x')} | {fmt(api.get('fwd_bwd_x_3gemm'), '{:.3f}x')} | "
            f"{fmt(e.get('lse_max_abs'), '{:.2e}')} | {fmt(e.get('dx_rel'), '{:.2e}')} | "
            f"{fmt(e.get('dw_rel'), '{:.2e}')} |")
    table = "\n".join(lines)
    with open(os.path.join(out, "mosaic-bench.md"), "w") as fh:
        fh.write(f"{meta}\n\n{table}\n")
    if final:
        print(table)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--shapes", default="llama3.1-8b,gemma3-4b")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import jax

    from logitless.jax.ops.linear_cross_entropy import mosaic_gpu_backend as mg

    dev = jax.devices()[0]
    meta = {
        "device": getattr(dev, "device_kind", str(dev)),
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }
    print(meta, flush=True)
    results = {"meta": meta, "shapes": {}}

    def save():
        with open(os.path.join(args.out, "mosaic-bench.json"), "w") as fh:
            json.dump(results, fh, indent=1, default=str)
        write_table(results, meta, args.out)

    after_each_case(save)
    for label in args.shapes.split(","):
        n, h, v = SHAPES[label]
        print(f"== {label} ({n}, {h}, {v}) bf16", flush=True)
        try:
            results["shapes"][label] = {}
            bench_shape(label, n, h, v, mg, res=results["shapes"][label])
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            results["shapes"][label] = {"error": f"{type(e).__name__}: {e}"}
        with open(os.path.join(args.out, "mosaic-bench.json"), "w") as fh:
            json.dump(results, fh, indent=1, default=str)
        write_table(results, meta, args.out)

    write_table(results, meta, args.out, final=True)


if __name__ == "__main__":
    main()
