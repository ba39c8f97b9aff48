"""GPU probe of the CuTe DSL d(logits) kernel (benchmarks/cute/dlogits.py) on the H100.

    python benchmarks/cute/probe_dlogits.py [--part correctness|timing|all] [--json out.json]
        [--rounds 5] [--budget 30]

1. correctness vs float64: dz[n, j] = g_n (exp(z[n, j] - lse_n) - [v0 + j == t_n]) at
   N in {1, 129, 1000}, C in {256, 4099, 16384}, H in {64, 4096}, a chunk [v0, v0 + C) inside a
   larger W (v0 = 0 and v0 = 1000), plus ragged C = 5, 261, 16391; targets around the chunk,
   zero g on ignored rows, the epilogues (TMA store of 256- or 128-column boxes, direct) and
   two grid sizes (persistent: one CTA per SM; one CTA per tile). Per element:
   |ours - ref| <= |torch bf16 - ref| + 2^-8 |ref| + 1e-6, where the torch bf16 path is
   z = x @ w.T in bf16 (cuBLAS), the formula in fp32, rounded to bf16 (the extra 2^-8 |ref|
   is the one bf16 rounding both paths make, which can land on either side). dz is a column
   slice of a NaN-filled buffer (8 columns left of it, >= 64 right, row stride % 64 == 0):
   everything outside dz must stay NaN; ``pad_written_cols`` says how far right of C a store
   reached. For H = 64 and a ragged C the first H100 run's code (``exact_tail=False``: TMA
   store extent C) runs too, as a diagnosis outside the verdict: a TMA store writes whole
   16-byte chunks, so it should reach -C mod 8 columns past C, no further.
2. timing at 4096 x 4096 (C = 16384 and 32768 of V = 128256) and 8192 x 7168 (C = 16384):
   cuBLAS x @ W[v0:v1].T with bf16 output (the baseline), the CuTe kernel's variants, the
   library's Triton dlogits kernel at the same chunk (two linear_cross_entropy backwards with
   the plan forced to vocab_chunk = C and no kept columns, per-kernel CUDA time from
   torch.profiler) and the chunk's two cuBLAS GEMMs of the backward (dW = dz^T x, dx += dz W
   in fp32), all INTERLEAVED (interleave.py): each round times every one once (do_bench
   median), medians over rounds, the spread over rounds, and the ratio to cuBLAS as the
   median of per-round ratios (one slow clock state cannot bias a ratio); the backward
   estimate per chunk is (dz + dW GEMM + dx GEMM) / (3 GEMMs of the chunk).
Without CUDA (SMOKE) it runs the correctness harness with a float64 torch stand-in for the
kernel on the CPU (the harness passes it, catches a one-column error and a store 3 columns
past C), and the timing harness's rounds on the stand-in with CPU wall-clock timing.
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


PAD_LEFT = 8  # dz starts 8 columns (16 bytes) into its buffer: a column slice of a wider one


def dz_buffer(n, c, device):
    """A NaN-filled bf16 buffer and dz = a column slice of it: 8 columns on its left, at least
    64 on its right (row stride a multiple of 64), so that a store past C (or before 0) shows
    and its width can be measured (pad_written_cols)."""
    torch = importlib.import_module("torch")
    ld = (PAD_LEFT + c + 63) // 64 * 64 + 64
    buf = torch.full((n, ld), float("nan"), device=device, dtype=torch.bfloat16)
    return buf, buf[:, PAD_LEFT:PAD_LEFT + c]


def pad_report(buf, c) -> dict:
    """Whether everything outside dz is still NaN; how many columns right of C were written
    (the last written one's distance from C), whether any left of column 0 was."""
    right = ~buf[:, PAD_LEFT + c:].isnan()
    left = ~buf[:, :PAD_LEFT].isnan()
    cols = right.any(dim=0).nonzero()
    return {"pad_untouched": not bool(right.any().item() or left.any().item()),
            "pad_written_cols": int(cols.max().item()) + 1 if cols.numel() else 0,
            "left_written": bool(left.any().item())}


# (epilogue, ctas: 0 = one per SM (persistent), 1 = one per tile, ring stages, exact_tail)
VARIANTS = [("tma", 1, 3, True), ("tma", 0, 3, True), ("tma128", 0, 4, True),
            ("direct", 1, 3, True)]
# the first H100 run's code (TMA store extent C): a diagnosis, expected to write past a
# ragged C by up to the next 16-byte boundary (pad_written_cols = -C mod 8 here), not
# counted in the verdict
RAW = ("tma", 0, 3, False)


def default_cases():
    cases = [(n, h, c, v0) for h in (64, 4096) for n in (1, 129, 1000)
             for c in (256, 4099, 16384) for v0 in ((0, 1000) if c == 4099 else (0,))]
    # ragged C of every kind: below 8 columns, 7 past a multiple of 8, a 261-column chunk
    cases += [(129, 64, 5, 3), (300, 64, 261, 0), (300, 64, 16391, 8), (1000, 4096, 16391, 0)]
    # the ragged ones first (the question of this run), a part cut by its timeout keeps them
    return sorted(cases, key=lambda cs: cs[2] % 8 == 0)


def correctness(run, device="cuda", cases=None, variants=None, save=None, raw=True) -> list:
    torch = importlib.import_module("torch")
    rows = []
    cases = cases or default_cases()
    variants = variants or VARIANTS
    for n, h, c, v0 in cases:
        v = v0 + c + 37
        x, w, target, coef, lse = make_inputs(n, h, v, v0, c, device, seed=n + h + c + v0)
        ref, tb = reference(x, w, v0, v0 + c, lse, coef, target)
        bound = (tb - ref).abs() + ref.abs() * 2.0 ** -8 + 1e-6
        todo = list(variants) + ([RAW] if raw and h == 64 and c % 8 else [])
        for ep, ctas, stages, exact in todo:
            rec = {"n": n, "h": h, "c": c, "v0": v0, "epilogue": ep, "stages": stages,
                   "grid": "1/SM" if ctas == 0 else "1/tile"}
            if not exact:
                rec.update(exact_tail=False, diagnostic=True)
            try:
                buf, dz = dz_buffer(n, c, device)
                tiles = -(-n // 128) * -(-c // 256)
                run(x, w, v0, v0 + c, lse, coef, target, dz, epilogue=ep, stages=stages,
                    ctas=tiles if ctas == 1 else 0, exact_tail=exact)
                if device == "cuda":
                    torch.cuda.synchronize()
                err = (dz.double() - ref).abs()
                rec.update(
                    max_err=err.max().item(), torch_bf16_err=(tb - ref).abs().max().item(),
                    worst_excess=(err - bound).max().item(),
                    finite=bool(torch.isfinite(dz).all().item()), **pad_report(buf, c))
                rec["ok"] = bool((err <= bound).all().item()) and rec["finite"] \
                    and rec["pad_untouched"]
            except Exception as exc:  # noqa: BLE001
                rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(json.dumps(rec), flush=True)
            rows.append(rec)
            if save:
                save(rows)
    return rows


def verdict(rows) -> bool:
    """All non-diagnostic rows pass (the RAW rows diagnose, they may fail)."""
    return all(r.get("ok") for r in rows if not r.get("diagnostic"))


def _triton_dlogits_measure(x, w, target, chunk):
    """A measure (-> ms) for interleave.interleaved: the mean CUDA time of the library's
    dlogits_kernel launches in two LCE backwards with vocab_chunk = chunk and no kept columns
    (torch.profiler, per-kernel device time); warmed up here; also the top kernels."""
    torch = importlib.import_module("torch")
    import dataclasses

    logitless = importlib.import_module("logitless")
    override = importlib.import_module("logitless.planning.overrides").override

    xr = x.detach().clone().requires_grad_(True)
    wr = w.detach().clone().requires_grad_(True)
    info: dict = {}

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

    def measure():
        acts = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        count, total, table = 0, 0.0, []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None)
            if t is None:
                t = getattr(e, "cuda_time_total", 0.0)
            table.append((e.key[:60], e.count, t / 1e3))
            if "dlogits_kernel" in e.key and "kept" not in e.key:
                count += e.count
                total += t / 1e3
        table.sort(key=lambda r: -r[2])
        info["top_kernels"] = table[:6]
        if not count:
            raise RuntimeError("no dlogits_kernel launch in the profile")
        info["launches_per_bwd"] = count / 2
        return total / count

    return measure, info


def timing(dl, quick=False, save=None, rounds=5, budget_s=30.0, shapes=None,
           device="cuda", bench=None) -> list:
    """Per shape: every candidate once per round (interleave.interleaved), medians over
    rounds, ratios to cuBLAS per round. ``budget_s``: each shape's rounds get
    budget_s / len(shapes) seconds from their start (a new round starts only within it, the
    first always runs; the variants' first calls, i.e. their compiles, come before)."""
    torch = importlib.import_module("torch")
    il = importlib.import_module("interleave")
    bench = bench or il.gpu_bench()
    launch = None
    try:
        launch = importlib.import_module("logitless.triton_lib.launch")
    except Exception as exc:  # noqa: BLE001
        print("logitless did not import:", exc)
    rows = []
    shapes = shapes or [(4096, 4096, 128256, 16384), (4096, 4096, 128256, 32768),
                        (8192, 7168, 128256, 16384)]
    for n, h, v, c in shapes:
        rec = {"n": n, "h": h, "v": v, "c": c, "rounds_wanted": rounds}
        try:
            v0 = 0
            x, w, target, coef, lse = make_inputs(n, h, v, v0, c, device)
            target = torch.randint(0, v, (n,), device=device, dtype=torch.int32)
            coef = torch.full((n,), 1.0 / n, device=device)
            wc = w[v0:v0 + c]
            flops = 2.0 * n * h * c
            dz = torch.empty(n, c, device=device, dtype=torch.bfloat16)
            dw = torch.empty(c, h, device=device, dtype=torch.bfloat16)
            acc = torch.zeros(n, h, device=device, dtype=torch.float32)
            measures = {"cublas": lambda: bench(lambda: x @ wc.T)}  # noqa: B023
            variants = [("tma", 3, 0), ("tma128", 4, 0), ("tma", 3, -1), ("direct", 4, 0)]
            if quick:
                variants = variants[:1]
            for ep, stages, ctas in variants:
                key = f"cute_{ep}_s{stages}_{'pers' if ctas == 0 else 'tile'}"
                tiles = -(-n // 128) * -(-c // 256)
                kw = dict(epilogue=ep, stages=stages, ctas=tiles if ctas < 0 else 0)
                try:  # the first call compiles: outside the rounds
                    t0 = time.perf_counter()
                    dl.dlogits_chunk(x, w, v0, v0 + c, lse, coef, target, dz, **kw)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    rec[key + "_first_s"] = round(time.perf_counter() - t0, 2)
                    measures[key] = (lambda kw=kw: bench(lambda: dl.dlogits_chunk(  # noqa: B023
                        x, w, v0, v0 + c, lse, coef, target, dz, **kw)))  # noqa: B023
                except Exception as exc:  # noqa: BLE001
                    rec[key + "_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            triton_info = {}
            if device == "cuda":
                try:
                    measures["triton_dz"], triton_info = _triton_dlogits_measure(
                        x, w, target.long(), c)
                except Exception as exc:  # noqa: BLE001
                    rec["triton_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            measures["dw_gemm"] = lambda: bench(lambda: torch.mm(dz.T, x, out=dw))  # noqa: B023
            if launch is not None:
                measures["dx_gemm"] = lambda: bench(  # noqa: B023
                    lambda: launch.dx_accumulate(acc, dz, wc))  # noqa: B023
            else:
                measures["dx_gemm"] = lambda: bench(lambda: torch.addmm(  # noqa: B023
                    acc, dz, wc, out_dtype=torch.float32, out=acc))  # noqa: B023
            # each shape's rounds get budget_s / shapes seconds from their start
            deadline = time.monotonic() + budget_s / len(shapes)
            res = il.interleaved(measures, rounds=rounds, baseline="cublas", deadline=deadline)
            rec["rounds"] = res.pop("_rounds")
            for name, r in res.items():
                key = "triton_dz" if name == "triton_dz" else name
                if "ms" in r:
                    rec[key + "_ms"] = r["ms"]
                    rec[key + "_spread"] = r["spread"]
                    rec[key + "_tflops"] = flops / r["ms"] * 1e-9
                if "ratio" in r:
                    rec[key + "_vs_cublas"] = r["ratio"]
                    rec[key + "_vs_cublas_range"] = [r["ratio_min"], r["ratio_max"]]
                if "error" in r:
                    rec[key + "_error"] = r["error"]
            rec.update({"triton_" + k: val for k, val in triton_info.items()})
            gemm3 = 3 * rec["cublas_ms"]
            two = rec["dw_gemm_ms"] + rec["dx_gemm_ms"]
            cute = {k: rec[k] for k in rec if k.startswith("cute_") and k.endswith("_ms")}
            if cute:
                best = min(cute, key=cute.get)
                rec["best_cute"] = best[:-3]
                rec["best_cute_ms"] = cute[best]
                rec["bwd_est_cute_vs_3gemm"] = (cute[best] + two) / gemm3
            if "triton_dz_ms" in rec:
                rec["bwd_est_triton_vs_3gemm"] = (rec["triton_dz_ms"] + two) / gemm3
                if cute:
                    rec["best_cute_vs_triton"] = cute[best] / rec["triton_dz_ms"]
            rec["chunks_of_v"] = math.ceil(v / c)
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(rec), flush=True)
        rows.append(rec)
        if save:
            save(rows)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def smoke() -> tuple:
    """CPU: the harness with the float64 stand-in passes, and catches a wrong kernel (a
    one-column error) and a store one column past C; the timing harness runs its rounds on
    the stand-in (tiny shapes, CPU wall clock)."""
    torch = importlib.import_module("torch")
    cases = [(1, 64, 256, 0), (129, 64, 300, 0), (37, 96, 261, 5), (9, 64, 5, 3)]
    good = correctness(stand_in, "cpu", cases, variants=[("stand-in", 0, 3, True)])

    def wrong(x, w, v0, v1, lse, g, target, dz=None, **kw):
        stand_in(x, w, v0, v1, lse, g, target, dz)
        dz[:, 0] += 0.01  # a one-column error (the one-hot term shifted, say) must be caught
        return dz

    def spill(x, w, v0, v1, lse, g, target, dz=None, **kw):
        stand_in(x, w, v0, v1, lse, g, target, dz)
        # what the first H100 run saw: columns up to the next 16-byte boundary written
        over = dz.as_strided((dz.shape[0], dz.shape[1] + 3), dz.stride())
        over[:, dz.shape[1]:] = 0.0
        return dz

    bad = correctness(wrong, "cpu", cases[:1], variants=[("wrong", 0, 3, True)])
    spilled = correctness(spill, "cpu", cases[2:3], variants=[("spill", 0, 3, True)])
    il = importlib.import_module("interleave")
    stub = type("StandIn", (), {"dlogits_chunk": staticmethod(stand_in)})
    trows = timing(stub, rounds=3, shapes=[(64, 64, 600, 256), (32, 128, 700, 300)],
                   device="cpu", bench=il.cpu_bench(3), budget_s=60)
    timing_ok = all(r.get("rounds") == 3 and "cublas_ms" in r and "cute_tma_s3_pers_vs_cublas"
                    in r and "bwd_est_cute_vs_3gemm" in r and "error" not in r for r in trows)
    res = {"harness_passes_stand_in": verdict(good),
           "harness_catches_wrong": not any(r["ok"] for r in bad),
           "harness_catches_store_past_c": not any(r["ok"] for r in spilled)
           and all(r.get("pad_written_cols") == 3 for r in spilled),
           "timing_harness": timing_ok,
           "interleave_self_test": il.self_test()["ok"],
           "torch": torch.__version__}
    res["ok"] = all(v for k, v in res.items() if k != "torch")
    return res, good + bad + spilled, trows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--part", choices=["all", "correctness", "timing"], default="all")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds (interleaved)")
    ap.add_argument("--budget", type=float, default=30.0,
                    help="timing: seconds of rounds (split evenly between the shapes; a new "
                         "round starts only within its shape's share; one always runs)")
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
        out["smoke"], out["correctness"], out["timing"] = smoke()
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
            out["timing"] = timing(dl, args.quick, save=saver("timing"), rounds=args.rounds,
                                   budget_s=args.budget)
        ok = verdict(out["correctness"]) if "correctness" in out else True
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
