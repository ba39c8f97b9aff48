"""linear_jsd's fused forward for the KL limits against the chunked forward, interleaved.

    python benchmarks/probe_jsd_kl.py [--shapes A,B,C,D] [--betas 0,1] [--rounds 5] [--json out.json]
                                      [--tile-sweep | --stages-fb | --group-sweep]

For beta 0 (forward KL) and 1 (reverse KL) on 16-bit inputs the Triton forward computes both
heads' logits tiles and the online row statistics in one kernel (``jsd_kl_forward_kernel``);
``override(jsd_fused_forward=False)`` gives the chunked forward (cuBLAS fp32 logit chunks of
``budget / 8V`` rows + the statistics kernels), which 0 < beta < 1 always takes. Each round times,
per shape: the unit GEMMs of the floor (student and teacher logits, dx, dW: cuBLAS), then per
beta the forward (no grad) and forward+backward of both variants, in an order rotated per round
(``benchmarks/cute/interleave.py``); a ratio is the median over rounds of the same round's
ratio. Also per variant: peak extra memory of one step and the per-token losses' largest
relative difference between the two (fp32 rounding expected), and the cost model's predictions.
Default budget (256 MiB). Without CUDA: a tiny shape on the interpreter (harness check only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cute"))
import interleave  # noqa: E402
from _probe_common import probe_meta, write_json  # noqa: E402

#: (tokens, student H, teacher H, V): A = 8B <- 70B (ANCHORS), B = same size 2048 (ANCHORS),
#: C = Qwen2.5-0.5B <- 7B (a small student), D = A at 16k tokens.
SHAPES = {"A": (4096, 4096, 8192, 128256), "B": (4096, 2048, 2048, 151936),
          "C": (4096, 896, 3584, 151936), "D": (16384, 4096, 8192, 128256)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="A,B,C")
    ap.add_argument("--betas", default="0,1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting rounds after this")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tile-sweep", action="store_true",
                    help="instead: the fused forward (beta 1, no grad) under each of TILES, against the chunked one")
    ap.add_argument("--stages-fb", action="store_true",
                    help="instead: forward+backward (beta 1 fused, beta 0.5) and the fused forward under each "
                         "of STAGES_TILES, against the first")
    ap.add_argument("--group-sweep", action="store_true",
                    help="instead: the same under each row-block group of GROUPS (override group_rows)")
    a = ap.parse_args()
    cuda = "TRITON_INTERPRET" not in os.environ and _has_cuda()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    import logitless
    from logitless.planning import cost_model
    from logitless.planning.overrides import override
    from logitless_bench import timing
    from logitless_bench.distill import make_inputs
    from logitless.ops.linear_jsd.bench_shapes import DistillShape

    dev = torch.device("cuda" if cuda else "cpu")
    shapes = {k: SHAPES[k] for k in a.shapes.split(",")} if cuda else {"tiny": (24, 16, 24, 200)}
    betas = [float(b) for b in a.betas.split(",")]
    bench = interleave.gpu_bench(warmup=3, rep=30) if cuda else interleave.cpu_bench(reps=1)
    record = probe_meta(budget_mib=256, rounds=a.rounds, shapes={}, note="CPU interpreter: harness only"
                        if not cuda else "")
    deadline = time.monotonic() + a.budget_s
    if a.tile_sweep:
        return _tile_sweep(a, shapes, dev, bench, record, deadline, cuda)
    if a.stages_fb or a.group_sweep:
        return _sweep_fb(a, shapes, dev, bench, record, deadline, cuda)
    for label, (n, hs, ht, v) in shapes.items():
        shape = DistillShape(label, n, hs, ht, v)
        xs, ws, xt, wt, t = make_inputs(shape, dev, 0)
        xg, wg = xs.detach().requires_grad_(), ws.detach().requires_grad_()
        measures = {"floor": _floor(bench, xs, ws, xt, wt)} if cuda else {}
        for beta in betas:
            for fused in (True, False):
                name = f"beta{beta:g}/{'fused' if fused else 'chunked'}"

                def fwd(beta=beta, fused=fused):
                    with override(jsd_fused_forward=fused), torch.no_grad():
                        logitless.linear_jsd(xs, ws, xt, wt, t, beta=beta, backend="triton")

                def step(beta=beta, fused=fused):
                    xg.grad = wg.grad = None
                    with override(jsd_fused_forward=fused):
                        logitless.linear_jsd(xg, wg, xt, wt, t, beta=beta, backend="triton").backward()

                measures[name + "/fwd"] = lambda f=fwd: bench(f)
                measures[name + "/fb"] = lambda s=step: bench(s)
        res = interleave.interleaved(measures, rounds=a.rounds if cuda else 1,
                                     deadline=deadline if cuda else None)
        rows = {}
        for beta in betas:
            for fused in (True, False):
                name = f"beta{beta:g}/{'fused' if fused else 'chunked'}"
                row = {k: res.get(f"{name}/{k}", {}).get("ms") for k in ("fwd", "fb")}
                if cuda and res.get("floor", {}).get("ms"):
                    fl = res["floor"]["ms"]
                    row["fb_x_floor"] = row["fb"] / fl if row["fb"] else None
                    per = [f / g for f, g in zip(res[f"{name}/fb"]["samples"], res["floor"]["samples"])]
                    row["fb_x_floor_rounds"] = per

                    def one(beta=beta, fused=fused):
                        xg.grad = wg.grad = None
                        with override(jsd_fused_forward=fused):
                            logitless.linear_jsd(xg, wg, xt, wt, t, beta=beta, backend="triton").backward()
                    _, peak = timing.peak_extra_bytes(one, device=dev, exclude_bytes=0)
                    row["peak_extra_mib"] = None if peak is None else peak / 2**20
                pred = cost_model.predict_jsd_recompute(cost_model.device_model(dev), n, hs, ht, v, 2,
                                                        256 * 2**20 // (8 * v),
                                                        fused_forward=fused)
                row.update(pred_fwd_ms=pred.fwd_s * 1e3, pred_fb_ms=pred.time_s * 1e3)
                rows[name] = row
            f_s = res.get(f"beta{beta:g}/fused/fb", {}).get("samples") or []
            c_s = res.get(f"beta{beta:g}/chunked/fb", {}).get("samples") or []
            ratios = sorted(f / c for f, c in zip(f_s, c_s))
            rows[f"beta{beta:g}/fb_fused_over_chunked"] = dict(
                median=ratios[len(ratios) // 2] if ratios else None, rounds=ratios)
        # per-token losses of the two forwards (fp32 rounding apart)
        for beta in betas:
            with torch.no_grad():
                with override(jsd_fused_forward=True):
                    lf = logitless.linear_jsd(xs, ws, xt, wt, t, beta=beta, backend="triton", reduction="none")
                with override(jsd_fused_forward=False):
                    lc = logitless.linear_jsd(xs, ws, xt, wt, t, beta=beta, backend="triton", reduction="none")
            rows[f"beta{beta:g}/loss_rel_diff"] = ((lf - lc).abs().max() / lc.abs().max().clamp_min(1e-30)).item()
        if cuda:
            rows["floor_ms"] = res["floor"]["ms"]
        from logitless.planning.plans import jsd_kl_fused

        rows["planner_fused"] = jsd_kl_fused(n, v, hs, ht, 2, 256 * 2**20, dev)  # this device's model
        record["shapes"][label] = dict(tokens=n, hs=hs, ht=ht, vocab=v, rows=rows, rounds=res.get("_rounds"))
        _print(label, shape, rows, betas, res)
        if a.json:
            write_json(a.json, record)
        del xs, ws, xt, wt, xg, wg
        timing.release_memory(dev)
    return 0


#: (block_n, block_v, block_h, num_warps, num_stages) tried by --tile-sweep (the first: shipped;
#: session 7's first sweep, 3-stage shipped, is ``probe-jsd-kl-tiles-H100-2026-11-24``).
TILES = [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 5), (64, 256, 64, 8, 4),
         (128, 128, 32, 8, 8), (64, 128, 64, 4, 5)]


def _tile_sweep(a, shapes, dev, bench, record, deadline, cuda) -> int:
    """Forward only (no grad), beta 1: the fused kernel under each tile configuration and the
    chunked forward, interleaved; ratios to the chunked forward per round."""
    import logitless
    from logitless.planning.overrides import override
    from logitless_bench.distill import make_inputs
    from logitless.ops.linear_jsd.bench_shapes import DistillShape

    import torch

    tiles = TILES if cuda else [(16, 32, 16, 4, 1)]
    for label, (n, hs, ht, v) in shapes.items():
        xs, ws, xt, wt, t = make_inputs(DistillShape(label, n, hs, ht, v), dev, 0)

        def fwd(fused, cfg=None):
            ov = dict(jsd_fused_forward=fused)
            if cfg is not None:
                ov["tiles"] = cfg
            with override(**ov), torch.no_grad():
                logitless.linear_jsd(xs, ws, xt, wt, t, beta=1.0, backend="triton")
        measures = {"chunked": lambda: bench(lambda: fwd(False))}
        for cfg in tiles:
            measures[str(cfg)] = lambda c=cfg: bench(lambda: fwd(True, c))
        res = interleave.interleaved(measures, rounds=a.rounds if cuda else 1, baseline="chunked",
                                     deadline=deadline if cuda else None)
        print(f"\ntile sweep {label}: {n} tokens, H {hs} <- {ht}, V {v}; fused forward (beta 1) / chunked", flush=True)
        print(f"chunked: {res['chunked'].get('ms', float('nan')):.2f} ms")
        for cfg in tiles:
            r = res[str(cfg)]
            if "error" in r and not r.get("samples"):
                print(f"{cfg}: error {r['error'][:160]}")
                continue
            print(f"{cfg}: {r['ms']:.2f} ms, {r.get('ratio', float('nan')):.3f} "
                  f"({r.get('ratio_min', float('nan')):.3f}-{r.get('ratio_max', float('nan')):.3f})", flush=True)
        record["shapes"][label] = dict(tokens=n, hs=hs, ht=ht, vocab=v,
                                       sweep={k: {kk: vv for kk, vv in r.items() if kk != "samples"}
                                              for k, r in res.items() if k != "_rounds"})
        if a.json:
            write_json(a.json, record)
        del xs, ws, xt, wt
    return 0


#: --stages-fb: linear_jsd's tiles (forward and backward kernels) with 3, 4 and 5 stages.
STAGES_TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 8, 5)]
#: --group-sweep: row blocks per group of the program order (forward and backward kernels;
#: the first is the working-set rule's 11 on an H100 at 128 x 128 tiles).
GROUPS = [11, 4, 6, 8, 16, 32]


def _sweep_configs(a, cuda):
    """(title, [(name, override fields)]) of --stages-fb or --group-sweep; the first is the
    ratios' base."""
    if a.group_sweep:
        groups = GROUPS if cuda else [2, 1]
        return "group sweep", [(f"G={g}", dict(group_rows=g)) for g in groups]
    tiles = STAGES_TILES if cuda else [(16, 32, 16, 4, 1), (16, 32, 16, 4, 2)]
    return "stages", [(f"{t[4]} stages {t}", dict(tiles=t)) for t in tiles]


def _sweep_fb(a, shapes, dev, bench, record, deadline, cuda) -> int:
    """Forward+backward at the default budget (beta 1 with the fused forward forced, beta
    0.5) and the fused forward alone (beta 1) under each configuration of
    ``_sweep_configs`` (they reach the fused forward and the backward's two-head dz kernel
    alike), with the floor; ratios to the first configuration per round."""
    import logitless
    from logitless.planning.overrides import override
    from logitless_bench.distill import make_inputs
    from logitless.ops.linear_jsd.bench_shapes import DistillShape

    import torch

    title, configs = _sweep_configs(a, cuda)
    for label, (n, hs, ht, v) in shapes.items():
        xs, ws, xt, wt, t = make_inputs(DistillShape(label, n, hs, ht, v), dev, 0)
        xg, wg = xs.detach().requires_grad_(), ws.detach().requires_grad_()

        def step(beta, ov):
            xg.grad = wg.grad = None
            with override(**ov, jsd_fused_forward=True if beta in (0.0, 1.0) else None):
                logitless.linear_jsd(xg, wg, xt, wt, t, beta=beta, backend="triton").backward()

        def fwd(ov):
            with override(**ov, jsd_fused_forward=True), torch.no_grad():
                logitless.linear_jsd(xs, ws, xt, wt, t, beta=1.0, backend="triton")
        def chunked():
            with override(jsd_fused_forward=False), torch.no_grad():
                logitless.linear_jsd(xs, ws, xt, wt, t, beta=1.0, backend="triton")
        measures = {"floor": _floor(bench, xs, ws, xt, wt)} if cuda else {}
        measures["beta 1 fwd chunked (shipped tiles and order)"] = lambda: bench(chunked)
        kinds = {"beta 1 f+b": lambda ov: step(1.0, ov), "beta 0.5 f+b": lambda ov: step(0.5, ov),
                 "beta 1 fwd": fwd}
        for kind, fn in kinds.items():
            for name, ov in configs:
                measures[f"{kind} {name}"] = lambda f=fn, o=ov: bench(lambda: f(o))
        res = interleave.interleaved(measures, rounds=a.rounds if cuda else 1, deadline=deadline if cuda else None)
        fl = res.get("floor", {}).get("ms")
        print(f"\n{title} {label}: {n} tokens, H {hs} <- {ht}, V {v}" + (f"; floor {fl:.2f} ms" if fl else ""),
              flush=True)
        ch = res["beta 1 fwd chunked (shipped tiles and order)"]
        print(f"beta 1 fwd chunked (shipped tiles and order): {ch.get('ms', float('nan')):.2f} ms", flush=True)
        for kind in kinds:
            base = res[f"{kind} {configs[0][0]}"]
            for name, _ in configs:
                r = res[f"{kind} {name}"]
                if not r.get("samples") or not base.get("samples"):
                    print(f"{kind} {name}: error {r.get('error', base.get('error', ''))[:160]}")
                    continue
                per = sorted(x / y for x, y in zip(r["samples"], base["samples"]))
                xf = f", {r['ms'] / fl:.3f}x floor" if fl and "f+b" in kind else ""
                print(f"{kind} {name}: {r['ms']:.2f} ms{xf}; / {configs[0][0]} "
                      f"{per[len(per) // 2]:.3f} ({per[0]:.3f}-{per[-1]:.3f})", flush=True)
        record["shapes"][label] = dict(tokens=n, hs=hs, ht=ht, vocab=v,
                                       sweep={k: {kk: vv for kk, vv in r.items()}
                                              for k, r in res.items() if k != "_rounds"})
        if a.json:
            write_json(a.json, record)
        del xs, ws, xt, wt, xg, wg
    return 0


def _floor(bench, xs, ws, xt, wt):
    """The four cuBLAS GEMMs of the floor (student and teacher logits, dx, dW), timed as one
    measure: a callable returning the sum of their medians."""
    import torch

    with torch.no_grad():
        dz = torch.randn(xs.shape[0], ws.shape[0], device=xs.device, dtype=xs.dtype)
    return lambda: (bench(lambda: xs @ ws.T) + bench(lambda: xt @ wt.T) + bench(lambda: dz @ ws)
                    + bench(lambda: dz.T @ xs))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _print(label, shape, rows, betas, res) -> None:
    fl = rows.get("floor_ms")
    print(f"\n{label}: {shape.tokens} tokens, H {shape.hidden_s} <- {shape.hidden_t}, V {shape.vocab}"
          + (f"; floor (4 cuBLAS GEMMs) {fl:.2f} ms" if fl else "")
          + f"; the planner's forward: {'fused' if rows.get('planner_fused') else 'chunked'}", flush=True)
    print("| beta | forward | fwd ms | f+b ms | f+b / floor | peak MiB | pred fwd / f+b ms |")
    print("|---|---|---|---|---|---|---|")
    for beta in betas:
        for kind in ("fused", "chunked"):
            r = rows[f"beta{beta:g}/{kind}"]
            fmt = (lambda x: f"{x:.2f}" if isinstance(x, float) else "-")
            print(f"| {beta:g} | {kind} | {fmt(r.get('fwd'))} | {fmt(r.get('fb'))} | {fmt(r.get('fb_x_floor'))} | "
                  f"{fmt(r.get('peak_extra_mib'))} | {r['pred_fwd_ms']:.2f} / {r['pred_fb_ms']:.2f} |")
        f, c = rows[f"beta{beta:g}/fused"], rows[f"beta{beta:g}/chunked"]
        if f.get("fb") and c.get("fb"):
            r = rows[f"beta{beta:g}/fb_fused_over_chunked"]
            spread = f" (rounds {min(r['rounds']):.3f}-{max(r['rounds']):.3f})" if r["rounds"] else ""
            print(f"beta {beta:g}: fused / chunked forward {f['fwd'] / c['fwd']:.3f}, f+b per round "
                  f"{r['median']:.3f}{spread}; per-token loss rel. diff "
                  f"{rows[f'beta{beta:g}/loss_rel_diff']:.2e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
