"""GPU probe of the CuTe DSL d(logits) kernel (benchmarks/cute/dlogits.py) on the H100.

    python benchmarks/cute/probe_dlogits.py [--part correctness|timing|all] [--json out.json]

1. correctness vs float64: dz[n, j] = g_n (exp(z[n, j] - lse_n) - [v0 + j == t_n]) at
   N in {1, 129, 1000}, C in {256, 4099, 16384}, H in {64, 4096}, a chunk [v0, v0 + C) inside a
   larger W (v0 = 0 and v0 = 1000), targets around the chunk, zero g on ignored rows, both
   epilogues (TMA store of 256- or 128-column boxes, direct) and two grid sizes (persistent: one CTA per SM; one CTA per
   tile). Per element: |ours - ref| <= |torch bf16 - ref| + 2^-8 |ref| + 1e-6, where the torch
   bf16 path is z = x @ w.T in bf16 (cuBLAS), the formula in fp32, rounded to bf16 (the extra
   2^-8 |ref| is the one bf16 rounding both paths make, which can land on either side). The
   dz buffer is pre-filled with NaN and its row stride padded to a multiple of 8: the padding
   columns must stay NaN (the TMA store clips at C).
2. timing (triton.testing.do_bench median, ms) at 4096 x 4096 (C = 16384 and 32768 of
   V = 128256) and 8192 x 7168 (C = 16384): cuBLAS x @ W[v0:v1].T with bf16 output, the
   library's Triton dlogits kernel at the same chunk (one linear_cross_entropy backward with
   the plan forced to vocab_chunk = C and no kept columns, per-kernel CUDA time from
   torch.profiler), the CuTe kernel's variants, and the chunk's two cuBLAS GEMMs of the
   backward (dW = dz^T x, dx += dz W in fp32); the backward estimate per chunk is
   (dz + dW GEMM + dx GEMM) / (3 GEMMs of the chunk).
Without CUDA (SMOKE) it runs the correctness harness with a float64 torch stand-in for the
kernel on the CPU (checks the harness, the reference and the NaN-padding check).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def make_inputs(n, h, v, v0, c, device, seed=0):
    torch = importlib.import_module("torch")
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, h, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(v, h, generator=g, device=device) / h ** 0.5 * 2).to(torch.bfloat16)
    # targets mostly inside the chunk (so the one-hot term is exercised), some outside
    lo, hi = max(v0 - 8, 0), min(v0 + c + 8, v)
    target = torch.randint(lo, hi, (n,), generator=g, device=device).to(torch.int32)
    target[::7] = -100
    coef = torch.rand(n, generator=g, device=device) + 0.25
    coef[target == -100] = 0.0
    # an input of the kernel, not checked: fp32 logits are close enough (+0.5: as if the rest
    # of the vocabulary added mass, so that the chunk's probabilities sum below 1)
    lse = torch.logsumexp(x.float() @ w[v0:v0 + c].float().T, dim=1) + 0.5
    return x, w, target, coef, lse


def reference(x, w, v0, v1, lse, coef, target):
    """(float64 dz, torch bf16-path dz as float64)."""
    torch = importlib.import_module("torch")
    c = v1 - v0
    cols = torch.arange(v0, v1, device=x.device)
    onehot = (cols[None, :] == target[:, None].long())
    z = x.double() @ w[v0:v1].double().T
    ref = coef.double()[:, None] * (torch.exp(z - lse.double()[:, None]) - onehot.double())
    zb = (x @ w[v0:v1].T).float()
    tb = coef[:, None] * (torch.exp(zb - lse[:, None]) - onehot.float())
    assert ref.shape == (x.shape[0], c)
    return ref, tb.to(torch.bfloat16).double()


def stand_in(x, w, v0, v1, lse, g, target, dz=None, **_):
    """What the kernel computes, in float64 torch rounded to bf16 (the SMOKE harness check)."""
    ref, _ = reference(x, w, v0, v1, lse, g, target)
    dz[:] = ref.to(dz.dtype)
    return dz


def dz_buffer(n, c, device):
    torch = importlib.import_module("torch")
    ld = (c + 7) // 8 * 8
    buf = torch.full((n, ld), float("nan"), device=device, dtype=torch.bfloat16)
    return buf, buf[:, :c]


def correctness(run, device="cuda", cases=None, variants=None, save=None) -> list:
    torch = importlib.import_module("torch")
    rows = []
    cases = cases or [(n, h, c, v0) for h in (64, 4096) for n in (1, 129, 1000)
                      for c in (256, 4099, 16384) for v0 in ((0, 1000) if c == 4099 else (0,))]
    # (epilogue, ctas: 0 = one per SM (persistent), 1 = one per tile, ring stages)
    variants = variants or [("tma", 1, 3), ("tma", 0, 3), ("tma128", 0, 4), ("direct", 1, 3)]
    for n, h, c, v0 in cases:
        v = v0 + c + 37
        x, w, target, coef, lse = make_inputs(n, h, v, v0, c, device, seed=n + h + c + v0)
        ref, tb = reference(x, w, v0, v0 + c, lse, coef, target)
        bound = (tb - ref).abs() + ref.abs() * 2.0 ** -8 + 1e-6
        for ep, ctas, stages in variants:
            rec = {"n": n, "h": h, "c": c, "v0": v0, "epilogue": ep, "stages": stages,
                   "grid": "1/SM" if ctas == 0 else "1/tile"}
            try:
                buf, dz = dz_buffer(n, c, device)
                tiles = -(-n // 128) * -(-c // 256)
                run(x, w, v0, v0 + c, lse, coef, target, dz, epilogue=ep, stages=stages,
                    ctas=tiles if ctas == 1 else 0)
                if device == "cuda":
                    torch.cuda.synchronize()
                err = (dz.double() - ref).abs()
                rec.update(
                    max_err=err.max().item(), torch_bf16_err=(tb - ref).abs().max().item(),
                    worst_excess=(err - bound).max().item(),
                    finite=bool(torch.isfinite(dz).all().item()),
                    pad_untouched=bool(buf[:, c:].isnan().all().item()),
                )
                rec["ok"] = bool((err <= bound).all().item()) and rec["finite"] \
                    and rec["pad_untouched"]
            except Exception as exc:  # noqa: BLE001
                rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(json.dumps(rec), flush=True)
            rows.append(rec)
            if save:
                save(rows)
    return rows


def _profiled_triton_dlogits(x, w, target, chunk):
    """Mean CUDA time (ms) of the library's dlogits_kernel launches in one LCE backward with
    vocab_chunk = chunk and no kept columns; also the backward's wall time."""
    torch = importlib.import_module("torch")
    import dataclasses

    logitless = importlib.import_module("logitless")
    override = importlib.import_module("logitless.planning.overrides").override

    xr = x.detach().clone().requires_grad_(True)
    wr = w.detach().clone().requires_grad_(True)

    def plan(p):
        return dataclasses.replace(p, vocab_chunk=chunk, keep_cols=0)

    def step():
        xr.grad = wr.grad = None
        with override(plan=plan):
            # reduction "none": no gradient-in-forward strategy, so the backward recomputes
            logitless.linear_cross_entropy(xr, wr, target, reduction="none",
                                           backend="triton").sum().backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    found, table = {}, []
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None)
        if total is None:
            total = getattr(e, "cuda_time_total", 0.0)
        table.append((e.key[:60], e.count, total / 1e3))
        if "dlogits_kernel" in e.key and "kept" not in e.key:
            found["count"] = found.get("count", 0) + e.count
            found["total_ms"] = found.get("total_ms", 0.0) + total / 1e3
    table.sort(key=lambda r: -r[2])
    res = {"top_kernels": table[:6]}
    if found.get("count"):
        res["triton_dz_ms"] = found["total_ms"] / found["count"]
        res["triton_dz_launches_per_bwd"] = found["count"] / 3
    return res


def timing(dl, quick=False, save=None) -> list:
    torch = importlib.import_module("torch")
    do_bench = importlib.import_module("triton.testing").do_bench
    launch = None
    try:
        launch = importlib.import_module("logitless.triton_lib.launch")
    except Exception as exc:  # noqa: BLE001
        print("logitless did not import:", exc)
    rows = []
    shapes = [(4096, 4096, 128256, 16384), (4096, 4096, 128256, 32768),
              (8192, 7168, 128256, 16384)]
    for n, h, v, c in shapes:
        rec = {"n": n, "h": h, "v": v, "c": c}
        try:
            v0 = 0
            x, w, target, coef, lse = make_inputs(n, h, v, v0, c, "cuda")
            target = torch.randint(0, v, (n,), device="cuda", dtype=torch.int32)
            coef = torch.full((n,), 1.0 / n, device="cuda")
            wc = w[v0:v0 + c]
            flops = 2.0 * n * h * c
            rec["cublas_ms"] = do_bench(lambda: x @ wc.T, return_mode="median")  # noqa: B023
            rec["cublas_tflops"] = flops / rec["cublas_ms"] * 1e-9
            dz = torch.empty(n, c, device="cuda", dtype=torch.bfloat16)
            dw = torch.empty(c, h, device="cuda", dtype=torch.bfloat16)
            acc = torch.zeros(n, h, device="cuda", dtype=torch.float32)
            rec["dw_gemm_ms"] = do_bench(lambda: torch.mm(dz.T, x, out=dw),  # noqa: B023
                                         return_mode="median")
            if launch is not None:
                rec["dx_gemm_ms"] = do_bench(lambda: launch.dx_accumulate(acc, dz, wc),  # noqa: B023
                                             return_mode="median")
            else:
                rec["dx_gemm_ms"] = do_bench(lambda: torch.addmm(  # noqa: B023
                    acc, dz, wc, out_dtype=torch.float32, out=acc), return_mode="median")
            try:
                rec.update(_profiled_triton_dlogits(x, w, target.long(), c))
            except Exception as exc:  # noqa: BLE001
                rec["triton_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            if save:
                save(rows + [rec])
            variants = [("tma", 3, 0), ("tma128", 4, 0), ("tma", 3, -1), ("direct", 4, 0)]
            if quick:
                variants = variants[:1]
            for ep, stages, ctas in variants:
                key = f"cute_{ep}_s{stages}_{'pers' if ctas == 0 else 'tile'}"
                tiles = -(-n // 128) * -(-c // 256)
                kw = dict(epilogue=ep, stages=stages, ctas=tiles if ctas < 0 else 0)
                try:
                    t0 = time.perf_counter()
                    dl.dlogits_chunk(x, w, v0, v0 + c, lse, coef, target, dz, **kw)
                    torch.cuda.synchronize()
                    rec[key + "_first_s"] = round(time.perf_counter() - t0, 2)
                    ms = do_bench(lambda: dl.dlogits_chunk(  # noqa: B023
                        x, w, v0, v0 + c, lse, coef, target, dz, **kw), return_mode="median")  # noqa: B023
                    rec[key + "_ms"] = ms
                    rec[key + "_tflops"] = flops / ms * 1e-9
                    if save:  # a hang in a later variant keeps what was measured
                        save(rows + [rec])
                except Exception as exc:  # noqa: BLE001
                    rec[key + "_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            gemm3 = 3 * rec["cublas_ms"]
            two = rec["dw_gemm_ms"] + rec["dx_gemm_ms"]
            cute = [rec[k] for k in rec if k.startswith("cute_") and k.endswith("_ms")]
            if cute:
                rec["best_cute_ms"] = min(cute)
                rec["bwd_est_cute_vs_3gemm"] = (min(cute) + two) / gemm3
            if "triton_dz_ms" in rec:
                rec["bwd_est_triton_vs_3gemm"] = (rec["triton_dz_ms"] + two) / gemm3
            rec["chunks_of_v"] = math.ceil(v / c)
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(rec), flush=True)
        rows.append(rec)
        if save:
            save(rows)
        torch.cuda.empty_cache()
    return rows


def smoke() -> tuple:
    """CPU: the harness with the float64 stand-in passes, and catches a wrong kernel."""
    torch = importlib.import_module("torch")
    cases = [(1, 64, 256, 0), (129, 64, 300, 0), (37, 96, 261, 5)]
    good = correctness(stand_in, "cpu", cases, variants=[("stand-in", 0, 3)])

    def wrong(x, w, v0, v1, lse, g, target, dz=None, **kw):
        stand_in(x, w, v0, v1, lse, g, target, dz)
        dz[:, 0] += 0.01  # a one-column error (the one-hot term shifted, say) must be caught
        return dz

    bad = correctness(wrong, "cpu", cases[:1], variants=[("wrong", 0, 3)])
    ok = all(r["ok"] for r in good) and not any(r["ok"] for r in bad)
    return {"ok": ok, "harness_passes_stand_in": all(r["ok"] for r in good),
            "harness_catches_wrong": not any(r["ok"] for r in bad),
            "torch": torch.__version__}, good


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--part", choices=["all", "correctness", "timing"], default="all")
    args = ap.parse_args()
    torch = importlib.import_module("torch")
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__}

    def saver(key):
        def save(rows):
            out[key] = rows
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)
        return save

    if not torch.cuda.is_available():
        out["smoke"], out["correctness"] = smoke()
        print(json.dumps(out["smoke"]))
        ok = out["smoke"]["ok"]
    else:
        out["device"] = torch.cuda.get_device_name()
        dl = importlib.import_module("dlogits")
        cutlass = importlib.import_module("cutlass")
        out["cutlass"] = getattr(cutlass, "__version__", "?")
        if args.part in ("all", "correctness"):
            out["correctness"] = correctness(dl.dlogits_chunk, save=saver("correctness"))
        if args.part in ("all", "timing"):
            out["timing"] = timing(dl, args.quick, save=saver("timing"))
        ok = all(r.get("ok") for r in out.get("correctness", [])) if "correctness" in out else True
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
