"""GPU probe of the CuTe DSL fused forward (benchmarks/cute/fused_forward.py) on the H100.

    python benchmarks/cute/probe_fused_forward.py [--json out.json] [--quick]

1. correctness vs torch float64 of lse and the per-row loss at several shapes and splits
   (uneven splits, an empty split, ignore_index rows), both kernel variants (warp-specialised
   and the inline-producer fallback); criterion per row: |ours - ref| <= |torch bf16 logits
   path - ref| + 1e-4 (the bf16 torch path: logits = x @ w.T in bf16, logsumexp in fp32);
2. timing vs cuBLAS ``x @ w.T`` (bf16 out) and vs logitless's Triton forward
   (``linear_cross_entropy(..., reduction='none')`` under no_grad) at 4096 x 4096 x 128256 and
   8192 x 7168 x 128256 (splits swept), with TFLOP/s, INTERLEAVED (interleave.py: every
   candidate and the baseline once per round, do_bench medians, medians over --rounds rounds,
   spreads, throughput vs cuBLAS from per-round ratios).
Without CUDA (SMOKE) it self-tests ``merge_partials`` on partials computed by torch and runs the
correctness harness with those partials standing in for the kernel, and the timing harness's
rounds on the stand-in (CPU wall clock).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def torch_partials(x, w, target, splits, tile_n=256):
    """What the kernel computes, in float64 torch (the SMOKE self-test of the merge)."""
    torch = importlib.import_module("torch")
    z = x.double() @ w.double().T
    n, v = z.shape
    vt = v // tile_n
    per = (vt + splits - 1) // splits
    kw = {"dtype": torch.float64, "device": z.device}
    m = torch.full((n, splits), float("-inf"), **kw)
    e = torch.zeros(n, splits, **kw)
    t = torch.zeros(n, splits, **kw)
    for s in range(splits):
        lo, hi = s * per * tile_n, min((s + 1) * per, vt) * tile_n
        if hi <= lo:
            continue
        zs = z[:, lo:hi]
        m[:, s] = zs.max(dim=1).values
        e[:, s] = torch.exp(zs - m[:, s:s + 1]).sum(dim=1)
        inside = (target >= lo) & (target < hi)
        t[:, s] = torch.where(inside, z.gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0)
    return m, e, t


def reference(x, w, target, ignore_index=-100):
    torch = importlib.import_module("torch")
    z = x.double() @ w.double().T
    lse = torch.logsumexp(z, dim=1)
    zt = z.gather(1, target.clamp(min=0)[:, None])[:, 0]
    loss = torch.where(target == ignore_index, torch.zeros_like(lse), lse - zt)
    zb = (x @ w.T).float()
    lse_b = torch.logsumexp(zb, dim=1).double()
    zt_b = zb.gather(1, target.clamp(min=0)[:, None])[:, 0].double()
    loss_b = torch.where(target == ignore_index, torch.zeros_like(lse_b), lse_b - zt_b)
    return lse, loss, lse_b, loss_b


def make_inputs(n, h, v, device, seed=0, ignore_every=7):
    torch = importlib.import_module("torch")
    g = torch.Generator(device=device).manual_seed(seed)  # on the device: 8192 x 7168 x 128256
    x = torch.randn(n, h, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(v, h, generator=g, device=device) / h ** 0.5 * 2).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), generator=g, device=device)
    target[::ignore_every] = -100
    return x, w, target


def smoke() -> dict:
    """CPU: the merge of torch-made partials equals the float64 reference."""
    ff = _load_ff(optional=True)
    merge = ff.merge_partials if ff else None
    if merge is None:  # no cutlass here: exercise the same merge formula from the source
        src = open(os.path.join(HERE, "fused_forward.py")).read()
        ns = {}
        start = src.index("def merge_partials")
        exec(compile("import importlib\n" + src[start:], "merge_partials", "exec"), ns)  # noqa: S102
        merge = ns["merge_partials"]
    out = {}
    for n, h, v, splits in ((128, 64, 256, 1), (256, 96, 1024, 3), (128, 64, 2048, 5)):
        x, w, target = make_inputs(n, h, v, "cpu")
        m, e, t = torch_partials(x, w, target, splits)
        lse, loss = merge(m, e, t, target)
        rl, rloss, _, _ = reference(x, w, target)
        out[f"{n}x{h}x{v}/s{splits}"] = max((lse - rl).abs().max().item(),
                                            (loss - rloss).abs().max().item())
    out["ok"] = all(val < 1e-9 for val in out.values())
    # the GPU correctness harness itself, with torch's float64 partials standing in for the kernel
    stand_in = type("StandIn", (), {
        "fused_forward_partials": staticmethod(lambda x, w, t, s, specialised=True: tuple(
            a.float() for a in torch_partials(x, w, t, s))),
        "merge_partials": staticmethod(merge)})
    rows = correctness(stand_in, "cpu", [(128, 64, 256, 1), (256, 96, 1024, 3)])
    out["harness_ok"] = all(r["ok"] for r in rows)
    # the interleaved timing harness, on the stand-in with CPU wall-clock timing
    il = importlib.import_module("interleave")
    trows = timing(stand_in, quick=True, rounds=3, shapes=[(64, 64, 512)], device="cpu",
                   bench=il.cpu_bench(3))
    out["timing_harness_ok"] = all(
        r.get("rounds") == 3 and "cublas_ms" in r and "cute_ws_s8_throughput_vs_cublas" in r
        and "error" not in r for r in trows) and il.self_test()["ok"]
    out["ok"] = out["ok"] and out["harness_ok"] and out["timing_harness_ok"]
    return out, rows


def _load_ff(optional=False):
    try:
        return importlib.import_module("fused_forward")
    except Exception as exc:  # noqa: BLE001
        if optional:
            return None
        raise RuntimeError(f"fused_forward (cutlass DSL) did not import: {exc}") from exc


def correctness(ff, device="cuda", cases=None, save=None) -> list:
    torch = importlib.import_module("torch")
    rows = []
    cases = cases or [(128, 64, 256, 1), (256, 256, 1024, 3), (384, 576, 2304, 4),
                      (512, 1024, 8192, 7), (1024, 4096, 32000 // 256 * 256, 16),
                      (256, 7168, 4096, 2)]
    for spec in (True, False):
        for n, h, v, splits in cases:
            rec = {"n": n, "h": h, "v": v, "splits": splits, "specialised": spec}
            try:
                x, w, target = make_inputs(n, h, v, device, seed=n + h + v)
                m, e, t = ff.fused_forward_partials(x, w, target, splits, specialised=spec)
                if device == "cuda":
                    torch.cuda.synchronize()
                lse, loss = ff.merge_partials(m, e, t, target)
                rl, rloss, lb, lossb = reference(x, w, target)
                # the partials themselves, for debugging a failure (max over rows and splits)
                pm, pe, pt = torch_partials(x, w, target, splits)
                fin = torch.isfinite(pm)
                rec["partials_err"] = {
                    "m_abs": (m.double() - pm)[fin].abs().max().item() if fin.any() else 0.0,
                    "m_inf_match": bool((torch.isfinite(m) == fin).all().item()),
                    "e_rel": ((e.double() - pe).abs() / pe.clamp(min=1e-30))[fin].max().item()
                    if fin.any() else 0.0,
                    "t_abs": (t.double() - pt).abs().max().item()}
                err_l = (lse.double() - rl).abs()
                err_loss = (loss.double() - rloss).abs()
                bound_l = (lb - rl).abs() + 1e-4
                bound_loss = (lossb - rloss).abs() + 1e-4
                rec.update(max_err_lse=err_l.max().item(), max_err_loss=err_loss.max().item(),
                           torch_bf16_err_lse=(lb - rl).abs().max().item(),
                           finite=bool(torch.isfinite(lse).all().item()),
                           ok=bool((err_l <= bound_l).all().item()
                                   and (err_loss <= bound_loss).all().item()
                                   and torch.isfinite(lse).all().item()))
            except Exception as exc:  # noqa: BLE001
                rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(json.dumps(rec), flush=True)
            rows.append(rec)
            if save:  # a part killed by its timeout still leaves the rows done
                save(rows)
    return rows


def timing(ff, quick=False, save=None, rounds=5, budget_s=60.0, shapes=None, device="cuda",
           bench=None) -> list:
    """Per shape: cuBLAS (the baseline), the Triton forward and the CuTe variants, each timed
    once per round (interleave.interleaved: do_bench median per measurement, the order
    rotated per round), medians over rounds, spreads, and per-round ratios to cuBLAS (the
    first H100 run timed cuBLAS once, first, ~10% slow: 675 vs 743 TFLOP/s an hour later).
    ``budget_s``: each shape's rounds get budget_s / len(shapes) seconds from their start (a
    new round starts only within it; the first always runs)."""
    torch = importlib.import_module("torch")
    il = importlib.import_module("interleave")
    bench = bench or il.gpu_bench(warmup=25, rep=100)
    try:
        lce = importlib.import_module("logitless").linear_cross_entropy
    except Exception as exc:  # noqa: BLE001
        lce = None
        print("logitless did not import:", exc)
    rows = []
    shapes = shapes or [(4096, 4096, 128256), (8192, 7168, 128256)]
    for n, h, v in shapes:
        rec = {"n": n, "h": h, "v": v, "rounds_wanted": rounds}
        try:
            x, w, target = make_inputs(n, h, v, device, ignore_every=10**9)
            flops = 2.0 * n * h * v
            v_pad = v // 256 * 256  # the kernel needs V % 256 == 0: time it on the 128000 head
            w_k = w[:v_pad].contiguous()
            t_k = target.clamp(max=v_pad - 1)
            rec["cute_v"] = v_pad
            measures = {"cublas": lambda: bench(lambda: x @ w.T)}  # noqa: B023
            work = {"cublas": flops}
            if lce is not None:
                def triton_fwd():
                    with torch.no_grad():
                        return lce(x, w, target, reduction="none")  # noqa: B023

                triton_fwd()
                measures["triton"] = lambda f=triton_fwd: bench(f)
                work["triton"] = flops
            for spec in ((True,) if quick else (True, False)):
                for splits in ((8,) if quick else (1, 4, 8, 16)):
                    key = f"cute_{'ws' if spec else 'inl'}_s{splits}"
                    try:  # the first call compiles: outside the rounds
                        t0 = time.perf_counter()
                        ff.fused_forward_partials(x, w_k, t_k, splits, specialised=spec)
                        if device == "cuda":
                            torch.cuda.synchronize()
                        rec[key + "_first_s"] = round(time.perf_counter() - t0, 2)
                        measures[key] = (lambda sp=splits, spc=spec: bench(  # noqa: B023
                            lambda: ff.fused_forward_partials(x, w_k, t_k, sp, specialised=spc)))  # noqa: B023
                        work[key] = 2.0 * n * h * v_pad
                    except Exception as exc:  # noqa: BLE001
                        rec[key + "_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            # each shape's rounds get budget_s / shapes seconds from their start
            deadline = time.monotonic() + budget_s / len(shapes)
            res = il.interleaved(measures, rounds=rounds, baseline="cublas", deadline=deadline)
            rec["rounds"] = res.pop("_rounds")
            for name, r in res.items():
                if "ms" in r:
                    rec[name + "_ms"] = r["ms"]
                    rec[name + "_spread"] = r["spread"]
                    rec[name + "_tflops"] = work[name] / r["ms"] * 1e-9
                if "ratio" in r:
                    # time ratio per round -> throughput ratio (the CuTe rows do v_pad / v of
                    # the work): median, and its range over rounds
                    scale = work[name] / flops
                    rec[name + "_throughput_vs_cublas"] = scale / r["ratio"]
                    rec[name + "_throughput_vs_cublas_range"] = [scale / r["ratio_max"],
                                                                 scale / r["ratio_min"]]
                if "error" in r:
                    rec[name + "_error"] = r["error"]
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(rec), flush=True)
        rows.append(rec)
        if save:
            save(rows)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--part", choices=["all", "correctness", "timing"], default="all")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds (interleaved)")
    ap.add_argument("--budget", type=float, default=60.0,
                    help="timing: seconds of rounds (split evenly between the shapes; a new "
                         "round starts only within its shape's share; one always runs)")
    args = ap.parse_args()
    torch = importlib.import_module("torch")
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "torch": torch.__version__}
    if not torch.cuda.is_available():
        out["smoke"], out["correctness"] = smoke()
        print(json.dumps(out))
        ok = out["smoke"]["ok"]
    else:
        out["device"] = torch.cuda.get_device_name()
        ff = _load_ff()
        cutlass = importlib.import_module("cutlass")
        out["cutlass"] = getattr(cutlass, "__version__", "?")
        def saver(key):
            def save(rows):
                out[key] = rows
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(out, f, indent=1)
            return save

        if args.part in ("all", "correctness"):
            out["correctness"] = correctness(ff, save=saver("correctness"))
        if args.part in ("all", "timing"):
            out["timing"] = timing(ff, args.quick, save=saver("timing"), rounds=args.rounds,
                                   budget_s=args.budget)
        ok = all(r.get("ok") for r in out.get("correctness", [])) if "correctness" in out else True
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
