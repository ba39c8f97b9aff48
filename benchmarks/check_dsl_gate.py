"""On a GPU: which forward the planner takes with the installed CuTe DSL (or without it), and
whether its numbers equal the Triton path's.

    python benchmarks/check_dsl_gate.py [--json out.json] [--expect cute|fallback]

Per anchor shape (bf16, no_grad unless noted): ``linear_cross_entropy`` (mean) and
``linear_log_probs(entropy=True, temperature=0.7)`` as shipped (no override: the planner's
own choice, ``planning.cute.forward_plan`` + ``cute_lib.launch.ready``), the CuTe launches
(``took_cute``: ``launches`` wraps ``cute_lib.launch._launch``), the max |difference| to
the same call with ``override(cute=False)`` (the Triton forward), and the
``CuteFallbackWarning``s raised.
One forward + backward row (the kept-columns path). ``--expect fallback`` (no DSL, or an
unsupported one): asserts no CuTe launch, exactly one fallback warning in the process,
and results bitwise equal to Triton's; ``--expect cute``: asserts no fallback warning and
that the CuTe kernel ran where planned. Exit status 1 when an expectation fails.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
import warnings

SHAPES = [(4096, 4096, 128256), (8192, 7168, 128256), (16384, 4096, 128256), (2048, 2048, 128256),
          (4096, 2560, 262144), (4096, 4096, 151936), (1000, 4096, 32003), (1024, 768, 50257)]


@contextlib.contextmanager
def launches():
    """A list that gets (splits, keep_cols) of each CuTe kernel launch of an op while inside."""
    from logitless.cute_lib import launch as cute_launch

    seen, original = [], cute_launch._launch

    def launch(fs, key, x, weight, tgt, parts, splits, *, keep, op=None, **kw):
        if op is not None:
            seen.append({"splits": splits, "keep_cols": keep[0].shape[1] if keep is not None else 0})
        return original(fs, key, x, weight, tgt, parts, splits, keep=keep, op=op, **kw)

    cute_launch._launch = launch
    try:
        yield seen
    finally:
        cute_launch._launch = original


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--expect", choices=("cute", "fallback"), default=None)
    args = ap.parse_args()
    import torch
    import triton

    import logitless
    from logitless.planning import cute
    from logitless.planning.overrides import override

    recorder = warnings.catch_warnings(record=True)
    record = recorder.__enter__()  # every warning of the run (the fallback one comes once per process)
    warnings.simplefilter("always", cute.CuteFallbackWarning)
    out = {"command": " ".join([sys.executable] + sys.argv),
           "date": datetime.datetime.utcnow().isoformat() + "Z",
           "device": torch.cuda.get_device_name(),
           "versions": {"torch": torch.__version__, "triton": triton.__version__,
                        "python": platform.python_version(), "nvidia-cutlass-dsl": cute.dsl_version()},
           "dsl_problem": cute.dsl_problem(), "supported": [cute.DSL_MIN, cute.DSL_BELOW], "rows": []}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}), flush=True)
    ok = True
    all_warnings = []  # (the records seen so far)
    for n, h, v in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(v, h, device="cuda", generator=g) * (2.0 / h ** 0.5)).to(torch.bfloat16)
        t = torch.randint(0, v, (n,), device="cuda", generator=g)
        layout = (True, x.stride(), w.stride(), x.data_ptr() % 16, w.data_ptr() % 16)
        plan = cute.forward_plan(x.device, x.dtype, n, v, h, cute.layout_fits(layout, h, x.dtype))
        row = {"n": n, "h": h, "v": v, "plan": repr(plan)}
        ops = {"ce": lambda: (logitless.linear_cross_entropy(x, w, t),),
               "logp": lambda: logitless.linear_log_probs(x, w, t, entropy=True, temperature=0.7)}
        with torch.no_grad():
            for name, fn in ops.items():
                with launches() as seen:
                    got = fn()
                with override(cute=False):
                    ref = fn()
                warned = [str(r.message) for r in record[len(all_warnings):]
                          if issubclass(r.category, cute.CuteFallbackWarning)]
                all_warnings = [r for r in record]
                row[f"{name}_took_cute"] = len(seen) > 0
                row[f"{name}_splits"] = seen[0]["splits"] if seen else None
                row[f"{name}_maxdiff_vs_triton"] = max((a.float() - b.float()).abs().max().item()
                                                       for a, b in zip(got, ref))
                row[f"{name}_bitwise_triton"] = all(torch.equal(a, b) for a, b in zip(got, ref))
                row[f"{name}_warnings"] = warned
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        x = w = t = None
        torch.cuda.empty_cache()

    # forward + backward (kept columns) at one anchor: the planner's choice vs Triton
    n, h, v = 4096, 4096, 128256
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=g) * (2.0 / h ** 0.5)).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    res = {}
    for label, ov in (("auto", {}), ("triton", {"cute": False})):
        with override(**ov), launches() as seen:
            loss = logitless.linear_cross_entropy(x, w, t)
            gx, gw = torch.autograd.grad(loss, (x, w))
        res[label] = (loss.detach(), gx, gw, seen)
    fb = {"n": n, "h": h, "v": v, "grad": True, "took_cute": len(res["auto"][3]) > 0,
          "kept_cols": res["auto"][3][0]["keep_cols"] if res["auto"][3] else None}
    for i, name in enumerate(("loss", "dx", "dw")):
        a, b = res["auto"][i].float(), res["triton"][i].float()
        fb[f"{name}_maxdiff_vs_triton"] = (a - b).abs().max().item()
        fb[f"{name}_rel_vs_triton"] = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    out["rows"].append(fb)
    print(json.dumps(fb), flush=True)
    all_warnings = [str(r.message) for r in record if issubclass(r.category, cute.CuteFallbackWarning)]
    out["fallback_warnings"] = all_warnings

    took = [r.get("ce_took_cute") or r.get("logp_took_cute") or r.get("took_cute") for r in out["rows"]]
    if args.expect == "fallback":
        ok = (not any(took) and len(all_warnings) == 1
              and all(r.get("ce_bitwise_triton", True) and r.get("logp_bitwise_triton", True) for r in out["rows"]))
    elif args.expect == "cute":
        ok = not all_warnings and any(took) and out["dsl_problem"] is None
    out["expect"], out["ok"] = args.expect, ok
    print("warnings:", all_warnings)
    print(f"{'N x H x V':>20} | plan | CE cute? maxdiff | LP cute? maxdiff")
    for r in out["rows"][:-1]:
        print(f"{r['n']}x{r['h']}x{r['v']:>7} | {r['plan'][:48]:48} | {r['ce_took_cute']!s:5} "
              f"{r['ce_maxdiff_vs_triton']:.2e} | {r['logp_took_cute']!s:5} {r['logp_maxdiff_vs_triton']:.2e}")
    print("f+b:", json.dumps(fb))
    print("expect", args.expect, "ok", ok)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
