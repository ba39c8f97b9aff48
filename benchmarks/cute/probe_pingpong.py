"""GPU probe of the consumer ping-pong CuTe DSL forward (benchmarks/cute/fused_forward_pingpong.py).

    python benchmarks/cute/probe_pingpong.py [--part correctness|timing|all] [--json out.json]
        [--rounds 5] [--budget-s 150]

1. correctness vs torch float64 of lse and the per-row loss at the cooperative probe's 6
   shapes plus ping-pong edge cases (a split of one tile: warpgroup B idle; odd tile counts per
   split; an empty split; V % 256 != 0 for the 128 x 128 tile), both tiles (64 x 256, 5
   stages: "pp5"; 128 x 128, 6 stages: "pp128"), and at H = 4096 ring depth 4, the setmaxnreg
   24/240 split and the 7-stage 128 x 128 ring; criterion per
   row: |ours - ref| <= |torch bf16 logits path - ref| + 1e-4; the
   partials themselves are compared to float64 ones in the kernel's (N, 2 * splits) layout
   (column 2 s + g) to say where a failure comes from;
2. timing with the baselines INTERLEAVED: per shape, ``--rounds`` rounds, each timing every
   contender once with triton.testing.do_bench (median of its runs), in the same order:
   cuBLAS ``x @ w.T`` (bf16 out), logitless's Triton forward
   (``linear_cross_entropy(..., reduction='none')`` under no_grad and ``override(cute=False)``:
   with the DSL importable the planner would pick its CuTe backend), the cooperative CuTe
   kernel (the library's ``cute_lib`` forward, the planner's splits) and the ping-pong
   kernel at a few splits / variants (64 x 256: pp5 at 3 splits, pp4 and pp5r240 at the middle
   one at the first shape; 128 x 128: pp128 at 2 splits); the table reports each contender's median over rounds
   and its ratio to cuBLAS's median (a baseline timed once, first, ran 10% slow on the H100 in
   session 5). All contenders run on V = 128000 (the CuTe kernels need V % 256 == 0; 128256 is
   not), so the ratios compare the same work; TFLOP/s are 2 N H V / time.
   Shapes, in this order (the budget may cut the last): 4096 x 4096, 2048 x 2048,
   8192 x 7168 (x 128000).
Without CUDA (SMOKE) it runs the correctness harness with float64 torch partials in the
ping-pong layout standing in for the kernel, and checks that the harness catches a wrong
partial column (a test that can fail).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


CASES = [(128, 64, 256, 1), (256, 256, 1024, 3), (384, 576, 2304, 4), (512, 1024, 8192, 7),
         (1024, 4096, 32000 // 256 * 256, 16), (256, 7168, 4096, 2),
         # ping-pong edge cases: N = 64 (one row block) and one tile per split (B idle),
         # 5 tiles per split (A 3, B 2), 11 tiles over 4 splits (3, 3, 3, 2), 3 tiles over
         # 5 splits (ceil -> 1 per split, splits 3, 4 empty)
         (64, 64, 1024, 4), (192, 4096, 2560, 2), (320, 128, 2816, 4), (128, 256, 768, 5),
         # V % 256 != 0: the 128 x 128 tile only (9 vocabulary tiles of 128 over 2 splits)
         (256, 4096, 1152, 2)]
VARIANTS = {"pp5": {"stages": 5, "regs": (40, 232)}, "pp4": {"stages": 4, "regs": (40, 232)},
            "pp5r240": {"stages": 5, "regs": (24, 240)},
            "pp128": {"stages": 6, "regs": (40, 232), "tile": (128, 128)},
            "pp128s7": {"stages": 7, "regs": (40, 232), "tile": (128, 128)}}


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


def _library_kernel():
    """The library's cooperative CuTe forward (``cute_lib.launch.forward_partials``: one 128 x 256
    tile shared by two consumer warpgroups) behind the call shape of the ping-pong module, or
    None when it does not import. It replaced the session-5 probe copy ``fused_forward.py``."""
    try:
        launch = importlib.import_module("logitless.cute_lib.launch")
        partials = importlib.import_module("logitless.triton_lib.launch").partials
    except Exception as exc:  # noqa: BLE001
        print("logitless.cute_lib did not import:", exc)
        return None

    def run(x, w, t, s):
        parts = partials(3, s, x.shape[0], x.device)
        launch.forward_partials("probe", x, w, t, parts, s)
        return parts

    return type("Library", (), {"fused_forward_partials": staticmethod(run)})


def _fits(variant, case) -> bool:
    tm, tn = VARIANTS[variant].get("tile", (64, 256))
    return case[0] % tm == 0 and case[2] % tn == 0


def pingpong_partials(x, w, target, splits, tile_n=256):
    """The kernel's partials in float64 torch: (N, 2 * splits), column 2 s + g holds the
    statistics of split s's tiles g, g + 2, ... (tile j of a split -> warpgroup j % 2)."""
    torch = importlib.import_module("torch")
    z = x.double() @ w.double().T
    n, v = z.shape
    vt = v // tile_n
    per = (vt + splits - 1) // splits
    kw = {"dtype": torch.float64, "device": z.device}
    m = torch.full((n, 2 * splits), float("-inf"), **kw)
    e = torch.zeros(n, 2 * splits, **kw)
    t = torch.zeros(n, 2 * splits, **kw)
    zt = z.gather(1, target.clamp(min=0)[:, None])[:, 0]
    for s in range(splits):
        tiles = list(range(s * per, min((s + 1) * per, vt)))
        for g in (0, 1):
            mine = tiles[g::2]
            if not mine:
                continue
            cols = torch.cat([torch.arange(j * tile_n, (j + 1) * tile_n, device=z.device)
                              for j in mine])
            zs = z[:, cols]
            c = 2 * s + g
            m[:, c] = zs.max(dim=1).values
            e[:, c] = torch.exp(zs - m[:, c:c + 1]).sum(dim=1)
            inside = torch.isin(target, cols)
            t[:, c] = torch.where(inside, zt, 0.0)
    return m, e, t


def _load(name, optional=False):
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001
        if optional:
            return None
        raise RuntimeError(f"{name} (cutlass DSL) did not import: {exc}") from exc


def _merge_from_source():
    """merge_partials of fused_forward_pingpong.py without importing cutlass (CPU smoke)."""
    src = open(os.path.join(HERE, "fused_forward_pingpong.py")).read()
    ns: dict = {}
    exec(compile("import importlib\n" + src[src.index("def merge_partials"):],  # noqa: S102
                 "merge_partials", "exec"), ns)
    return ns["merge_partials"]


def correctness(pp, device="cuda", cases=None, variants=None, save=None) -> list:
    torch = importlib.import_module("torch")
    rows = []
    cases = cases or CASES
    variants = variants or [(v, c) for v in ("pp5", "pp128") for c in cases] + [
        (v, c) for v in ("pp4", "pp5r240", "pp128s7") for c in cases if c[1] == 4096]
    variants = [(v, c) for v, c in variants if _fits(v, c)]
    for variant, (n, h, v, splits) in variants:
        rec = {"variant": variant, "n": n, "h": h, "v": v, "splits": splits}
        try:
            x, w, target = make_inputs(n, h, v, device, seed=n + h + v)
            m, e, t = pp.fused_forward_partials(x, w, target, splits, **VARIANTS[variant])
            if device == "cuda":
                torch.cuda.synchronize()
            lse, loss = pp.merge_partials(m, e, t, target)
            rl, rloss, lb, lossb = reference(x, w, target)
            pm, pe, pt = pingpong_partials(x, w, target, splits,
                                           VARIANTS[variant].get("tile", (64, 256))[1])
            fin = torch.isfinite(pm)
            rec["partials_err"] = {
                "m_abs": (m.double() - pm)[fin].abs().max().item() if fin.any() else 0.0,
                "m_inf_match": bool((torch.isfinite(m) == fin).all().item()),
                "e_rel": ((e.double() - pe).abs() / pe.clamp(min=1e-30))[fin].max().item()
                if fin.any() else 0.0,
                "t_abs": (t.double() - pt).abs().max().item()}
            err_l = (lse.double() - rl).abs()
            err_loss = (loss.double() - rloss).abs()
            ok_rows = (err_l <= (lb - rl).abs() + 1e-4) & (err_loss <= (lossb - rloss).abs() + 1e-4)
            rec.update(max_err_lse=err_l.max().item(), max_err_loss=err_loss.max().item(),
                       torch_bf16_err_lse=(lb - rl).abs().max().item(),
                       bad_rows=int((~ok_rows).sum().item()),
                       finite=bool(torch.isfinite(lse).all().item()),
                       ok=bool(ok_rows.all().item() and torch.isfinite(lse).all().item()
                               and rec["partials_err"]["m_inf_match"]))
        except Exception as exc:  # noqa: BLE001
            rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        print(json.dumps(rec), flush=True)
        rows.append(rec)
        if save:  # a part killed by its timeout still leaves the rows done
            save(rows)
    return rows


def smoke() -> dict:
    """CPU: the harness with float64 torch partials standing in for the kernel passes, and the
    same harness fails when one partial column is wrong (so the GPU check can fail)."""
    torch = importlib.import_module("torch")
    merge = _merge_from_source()
    cases = [(64, 64, 1024, 4), (128, 96, 2816, 3), (128, 64, 768, 5)]

    def stand_in(bad: bool):
        def partials(x, w, t, s, tile=(64, 256), **_):
            m, e, tt = (a.float() for a in pingpong_partials(x, w, t, s, tile[1]))
            if bad:  # one non-empty column (warpgroup B's where there is one) loses its sum
                full = [int(c) for c in (e.sum(dim=0) > 0).nonzero()[:, 0]]
                col = ([c for c in full if c % 2] or full)[0]
                e = e.clone()
                e[:, col] = 0.0
            return m, e, tt
        return type("StandIn", (), {"fused_forward_partials": staticmethod(partials),
                                    "merge_partials": staticmethod(merge)})

    cases.append((128, 64, 1152, 2))  # V % 256 != 0: pp128 only
    variants = [(v, c) for v in ("pp5", "pp128") for c in cases if _fits(v, c)]
    good = correctness(stand_in(False), "cpu", variants=variants)
    bad = correctness(stand_in(True), "cpu", variants=variants)
    # the 2x-splits layout merged equals the plain one-column-per-split reference
    x, w, target = make_inputs(128, 64, 2816, "cpu")
    lse, loss = merge(*pingpong_partials(x, w, target, 3), target)
    rl, rloss, _, _ = reference(x, w, target)
    merge_err = max((lse - rl).abs().max().item(), (loss - rloss).abs().max().item())
    out = {"harness_ok": all(r["ok"] for r in good),
           "harness_catches_a_wrong_column": not any(r["ok"] for r in bad),
           "merge_err_float64": merge_err, "torch": torch.__version__}
    # the timing harness itself, on tiny CPU shapes with the stand-in kernel and a CPU clock
    trows = timing(stand_in(False), rounds=2, budget_s=60, ff=stand_in(False), device="cpu",
                   shapes=[((128, 64, 1024), (1, 2, 4), (2, 4))], bench=_cpu_bench)
    want = {"cublas", "triton", f"cute_ws_s{library_splits(128, v=1024)}", "pp5_s1", "pp5_s2",
            "pp5_s4", "pp4_s2", "pp5r240_s2", "pp128_s2", "pp128_s4"}
    got = {k[:-3] for k in trows[0] if k.endswith("_ms") and not k.endswith("_rounds_ms")}
    out["timing_dry_run"] = {"contenders": sorted(got), "missing": sorted(want - got),
                             "errors": {k: v for k, v in trows[0].items() if k.endswith("_error")}}
    out["ok"] = out["harness_ok"] and out["harness_catches_a_wrong_column"] and merge_err < 1e-9 \
        and not out["timing_dry_run"]["missing"] and "cublas_x_cublas" in trows[0]
    return out, good, trows


def library_splits(n, sms=132, tile_m=128, tile_n=256, v=128000):
    """The library planner's CuTe splits (docs/cute_dsl.md): floor(2 SMs / row blocks)."""
    return max(1, min((2 * sms) // ((n + tile_m - 1) // tile_m), (v + tile_n - 1) // tile_n))


def _cpu_bench(fn, warmup=0, rep=0, return_mode="median"):
    """The dry run's stand-in for do_bench (CPU): median of 3 timed calls, in ms."""
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def timing(pp, rounds=5, budget_s=150.0, save=None, ff="load", device="cuda", shapes=None,
           bench=None) -> list:
    """Interleaved timing (see the module docstring). ``device``/``shapes``/``bench``/``ff``
    replace the GPU pieces in the CPU dry run of this harness (SMOKE)."""
    torch = importlib.import_module("torch")
    do_bench = bench or importlib.import_module("triton.testing").do_bench
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ff = _library_kernel() if ff == "load" else ff
    # the library's Triton kernel, not its CuTe backend (which the planner picks for a
    # forward-only call on Hopper when cutlass.cute imports, as it does here)
    os.environ["LOGITLESS_CUTE"] = "0"
    try:
        lce = importlib.import_module("logitless").linear_cross_entropy
        override = importlib.import_module("logitless.planning.overrides").override
    except Exception as exc:  # noqa: BLE001
        lce = None
        print("logitless did not import:", exc)
    t_start = time.perf_counter()
    rows = []
    # (shape, ping-pong 64 x 256 splits, 128 x 128 splits): ~128-512 CTAs of one per SM; the
    # pp4 / pp5r240 variants at the first shape only (each new H is a DSL compile per variant)
    shapes = shapes or [((4096, 4096, 128000), (2, 4, 8), (4, 8)),
                        ((2048, 2048, 128000), (4, 8, 16), (8, 16)),
                        ((8192, 7168, 128000), (1, 2, 4), (2, 4))]
    for shape_i, ((n, h, v), pp_splits, pp128_splits) in enumerate(shapes):
        if time.perf_counter() - t_start > budget_s:
            rows.append({"n": n, "h": h, "v": v, "skipped": "time budget"})
            continue
        x, w, target = make_inputs(n, h, v, device, ignore_every=10**9)
        t32 = target.to(torch.int32)  # the CuTe launchers' dtype: no conversion kernel timed
        flops = 2.0 * n * h * v
        rec = {"n": n, "h": h, "v": v, "rounds": rounds}
        fns = {"cublas": lambda: x @ w.T}
        if lce is not None:
            def triton_fwd():
                with torch.no_grad(), override(cute=False):  # a fresh context per call
                    return lce(x, w, target, reduction="none")
            fns["triton"] = triton_fwd
        if ff is not None:
            s_ws = library_splits(n, v=v)
            fns[f"cute_ws_s{s_ws}"] = lambda s=s_ws: ff.fused_forward_partials(x, w, t32, s)
        for s in pp_splits:
            fns[f"pp5_s{s}"] = lambda s=s: pp.fused_forward_partials(x, w, t32, s)
        mid = pp_splits[1]
        for var in ("pp4", "pp5r240") if shape_i == 0 else ():
            fns[f"{var}_s{mid}"] = lambda var=var: pp.fused_forward_partials(
                x, w, t32, mid, **VARIANTS[var])
        for s in pp128_splits:
            fns[f"pp128_s{s}"] = lambda s=s: pp.fused_forward_partials(
                x, w, t32, s, **VARIANTS["pp128"])
        times: dict = {k: [] for k in fns}
        for k, fn in list(fns.items()):  # first call: compile (CuTe) / autotune (Triton)
            try:
                t0 = time.perf_counter()
                fn()
                sync()
                rec[f"{k}_first_s"] = round(time.perf_counter() - t0, 2)
            except Exception as exc:  # noqa: BLE001
                rec[f"{k}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                del fns[k], times[k]
        for _r in range(rounds):
            if time.perf_counter() - t_start > budget_s:
                rec["rounds_done_before_budget"] = _r
                break
            for k, fn in fns.items():  # same order every round: baselines interleaved
                times[k].append(do_bench(fn, warmup=10, rep=40, return_mode="median"))
        for k, ts in times.items():
            if ts:
                med = statistics.median(ts)
                rec[f"{k}_ms"] = med
                rec[f"{k}_rounds_ms"] = [round(t, 4) for t in ts]
                rec[f"{k}_tflops"] = flops / med * 1e-9
        base = rec.get("cublas_ms")
        if base:
            for k in times:
                if f"{k}_ms" in rec:
                    rec[f"{k}_x_cublas"] = rec[f"{k}_ms"] / base
        print(json.dumps(rec), flush=True)
        rows.append(rec)
        if device == "cuda":
            torch.cuda.empty_cache()
        if save:
            save(rows)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--part", choices=["all", "correctness", "timing"], default="all")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="timing stops starting new rounds / shapes after this many seconds")
    args = ap.parse_args()
    torch = importlib.import_module("torch")
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "torch": torch.__version__, "command": " ".join(sys.argv)}

    def save_all():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)

    if not torch.cuda.is_available():
        out["smoke"], out["correctness"], out["timing"] = smoke()
        print(json.dumps(out))
        save_all()
        return 0 if out["smoke"]["ok"] else 1
    out["device"] = torch.cuda.get_device_name()
    try:
        out["triton"] = importlib.import_module("triton").__version__
    except Exception:  # noqa: BLE001
        pass
    pp = _load("fused_forward_pingpong")
    out["cutlass"] = getattr(importlib.import_module("cutlass"), "__version__", "?")

    def saver(key):
        def save(rows):
            out[key] = rows
            save_all()
        return save

    if args.part in ("all", "correctness"):
        out["correctness"] = correctness(pp, save=saver("correctness"))
    if args.part in ("all", "timing"):
        out["timing"] = timing(pp, args.rounds, args.budget_s, save=saver("timing"))
    save_all()
    return 0 if all(r.get("ok") for r in out.get("correctness", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
