"""Refit the cost model's device constants (``cost_model.DeviceModel``) to measured times.

Input: the JSON of ``benchmarks/probe_regret.py`` (one or more runs of one device class).
Every timed candidate gives two points, its forward+backward (``fb_ms`` against the
model's ``time_s``) and its forward alone (``fwd_ms`` against ``fwd_s``), and every shape
a third, the cuBLAS GEMM unit (``gemm_ms`` against ``gemm_s``). The constants named by
--fields are fitted by least squares on log time,

    min over log(theta):  sum_points (log pred(theta) - log measured)^2
                          + ridge * sum_fields (log theta - log theta_0)^2

(Levenberg-Marquardt, numerical Jacobian; the ridge keeps a constant that no point
constrains at its shipped value), and the script prints old vs new constants, the max
and median |pred/measured - 1| before and after, the planner's choice per shape under
each (and the measured time of that plan where the probe timed it), and the one line
that applies the refit in ``src/logitless/planning/cost_model.py``:

    H100 = DeviceModel("H100", sms=132, gemm_flops_16=..., ...)

(H200 is derived from H100 by ``replace``: its compute constants follow.) Only 16-bit
rows are used (the fp32/TF32 constants are another fit). Nothing is changed by this
script; ``--json PATH`` writes the new constants and the statistics.

    python benchmarks/fit_cost_model.py $OUT/regret.json [more.json] [--ridge 0.05]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from logitless.planning import cost_model as cm  # noqa: E402

#: Constants fitted by default: the rates and bandwidths the bf16 plans' times depend on.
FIELDS = ("gemm_flops_16", "fused_forward", "fused_dlogits", "keep_store_bw", "kept_pass_bw", "acc_bw",
          "hbm_bw", "fixed_s", "l2_reread", "gemm_wave")


def predict(dev: cm.DeviceModel, row: dict) -> cm.Candidate:
    """The cost model's Candidate for a probe row (its strategy and chunking)."""
    n, h, v, s = row["n"], row["h"], row["v"], row["itemsize"]
    block_v = (row.get("plan") or {}).get("block_v", 256)
    if row["strategy"] == "keep":
        return cm.predict_keep(dev, n, h, v, s, block_v)
    if row["strategy"] == "grad_in_forward":
        return cm.predict_grad_in_forward(dev, n, h, v, s, row["token_chunk"], False, block_v)
    return cm.predict_partial(dev, n, h, v, s, row["keep_cols"], row["vocab_chunk"], block_v)


def points(rows: list[dict], shapes: list[dict]) -> list[tuple]:
    """(kind, payload, measured seconds): "fb"/"fwd" of each timed row, "gemm" per shape."""
    out = []
    for r in rows:
        if not r.get("ok") or r.get("itemsize", 2) != 2:
            continue
        if r.get("fb_ms"):
            out.append(("fb", r, r["fb_ms"] * 1e-3))
        if r.get("fwd_ms"):
            out.append(("fwd", r, r["fwd_ms"] * 1e-3))
    for s in shapes:
        if s.get("gemm_ms") and s["gemm_ms"] == s["gemm_ms"]:
            out.append(("gemm", s, s["gemm_ms"] * 1e-3))
    return out


def predicted(dev: cm.DeviceModel, kind: str, p: dict) -> float:
    if kind == "gemm":
        return cm.gemm_s(dev, p["n"], p["v"], p["h"], 2)
    c = predict(dev, p)
    return c.time_s if kind == "fb" else c.fwd_s


def with_fields(base: cm.DeviceModel, fields, logs) -> cm.DeviceModel:
    return dataclasses.replace(base, **{f: float(math.exp(x)) for f, x in zip(fields, logs)})


def errors(dev, pts, kind=None) -> list[float]:
    return [predicted(dev, k, p) / m - 1 for k, p, m in pts if kind is None or k == kind]


def fit(base: cm.DeviceModel, pts, fields=FIELDS, ridge=0.05, iters=60) -> cm.DeviceModel:
    """Levenberg-Marquardt on log time over log(constants), with a ridge toward ``base``."""
    fields = list(fields)
    x0 = np.array([math.log(getattr(base, f)) for f in fields])
    meas = np.array([math.log(m) for _, _, m in pts])

    def resid(x):
        dev = with_fields(base, fields, x)
        r = np.array([math.log(max(predicted(dev, k, p), 1e-12)) for k, p, _ in pts]) - meas
        return np.concatenate([r, math.sqrt(ridge) * (x - x0)])

    x, mu = x0.copy(), 1e-2
    r = resid(x)
    cost = float(r @ r)
    for _ in range(iters):
        eps = 1e-4
        jac = np.stack([(resid(x + eps * e) - r) / eps for e in np.eye(len(x))], axis=1)
        jtj, jtr = jac.T @ jac, jac.T @ r
        improved = False
        for _ in range(12):
            step = np.linalg.solve(jtj + mu * np.diag(np.diag(jtj) + 1e-9), -jtr)
            step = np.clip(step, -1.0, 1.0)  # at most e-fold per iteration
            rn = resid(x + step)
            cn = float(rn @ rn)
            if cn < cost:
                x, r, cost, mu, improved = x + step, rn, cn, mu / 3, True
                break
            mu *= 4
        if not improved or float(np.abs(step).max()) < 1e-6:
            break
    return with_fields(base, fields, x)


def stats(errs) -> dict:
    a = [abs(e) for e in errs]
    return dict(max=max(a), median=statistics.median(a), n=len(a)) if a else dict(max=float("nan"),
                                                                                  median=float("nan"), n=0)


def one_line(dev: cm.DeviceModel, base_name: str = "H100") -> str:
    """The line that defines the refitted model in cost_model.py (changed fields only,
    3 significant digits)."""
    default = cm.DeviceModel(dev.name, sms=dev.sms)

    def text(value) -> str:  # numbers to 3 digits; None (a field that falls back to another) as is
        return "None" if value is None else f"{value:.3g}"

    kw = [f"{f.name}={text(getattr(dev, f.name))}" for f in dataclasses.fields(dev)
          if f.name not in ("name", "sms") and text(getattr(dev, f.name)) != text(getattr(default, f.name))]
    return f'{base_name} = DeviceModel("{dev.name}", sms={dev.sms}' + "".join(", " + k for k in kw) + ")"


def choices(dev, shapes, rows) -> list[dict]:
    """The planner's bf16 choice per shape under ``dev``, and its measured time if timed."""
    out = []
    for s in shapes:
        if "n" not in s or "budget" not in s:
            continue
        c = cm.choose(s["n"], s["h"], s["v"], 2, s["budget"], device_model=dev,
                      grad_in_forward=s.get("grad_in_forward", s["v"] % 8 == 0), block_v=s.get("block_v", 256),
                      min_chunk=s.get("min_chunk", 4096))
        timed = {r["label"]: r.get("fb_ms") for r in rows if r.get("shape") == s["shape"] and r.get("ok")}
        out.append(dict(shape=s["shape"], choice=c.label, pred_ms=c.time_s * 1e3, measured_ms=timed.get(c.label),
                        best=s.get("best"), best_ms=s.get("best_ms")))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="regret.json file(s) of probe_regret.py")
    ap.add_argument("--device-model", default=None, help="the model to refit (default: the JSON's)")
    ap.add_argument("--fields", default=",".join(FIELDS))
    ap.add_argument("--ridge", type=float, default=0.05)
    ap.add_argument("--json-out", dest="json_out", default=None, help="write the new constants and statistics")
    args = ap.parse_args(argv)
    rows, shapes, names = [], [], set()
    for path in args.json:
        with open(path) as f:
            d = json.load(f)
        rows += d.get("rows", [])
        shapes += [s for s in d.get("shapes", []) if "gemm_ms" in s]
        names.add(d.get("device_model", "H100"))
    name = args.device_model or (names.pop() if len(names) == 1 else "H100")
    base = cm.DEVICE_MODELS.get(name, cm.DEFAULT)
    pts = points(rows, shapes)
    if not pts:
        print("no timed 16-bit rows in", args.json)
        return None
    fields = [f for f in args.fields.split(",") if f]
    new = fit(base, pts, fields, args.ridge)
    print(f"refit of {base.name} on {len(pts)} points ({len(rows)} rows, {len(shapes)} shapes), ridge {args.ridge}")
    print(f"{'constant':16s} {'old':>12s} {'new':>12s} {'new/old':>8s}")
    for f in fields:
        o, n = getattr(base, f), getattr(new, f)
        print(f"{f:16s} {o:12.4g} {n:12.4g} {n / o:8.3f}")
    report = dict(device_model=base.name, fields=fields, ridge=args.ridge, old=dataclasses.asdict(base),
                  new=dataclasses.asdict(new), line=one_line(new, base.name), stats={})
    print(f"\n{'|pred/meas - 1|':22s} {'before max':>10s} {'median':>8s} {'after max':>10s} {'median':>8s} {'n':>4s}")
    for kind in ("fb", "fwd", "gemm", None):
        b, a = stats(errors(base, pts, kind)), stats(errors(new, pts, kind))
        report["stats"][kind or "all"] = dict(before=b, after=a)
        print(f"{kind or 'all':22s} {b['max']:10.3f} {b['median']:8.3f} {a['max']:10.3f} {a['median']:8.3f} "
              f"{a['n']:4d}")
    print("\nplanner's choice at each probed shape (bf16, its budget), before -> after the refit:")
    before, after = choices(base, shapes, rows), choices(new, shapes, rows)
    for b, a in zip(before, after):
        def ms(x):
            return "untimed" if x is None else f"{x:.3f} ms"
        print(f"  {b['shape']:18s} {b['choice']} ({ms(b['measured_ms'])}) -> {a['choice']} ({ms(a['measured_ms'])})"
              f" | best measured {b['best']} ({ms(b['best_ms'])})")
    report["choices"] = dict(before=before, after=after)
    # Wider chunks (DeviceModel.wide_chunks = 2): recommended when, under the refit, the
    # planner's choices with them were timed and are faster in sum than without.
    wide = dataclasses.replace(new, wide_chunks=2)
    with_wide = choices(wide, shapes, rows)
    pairs = [(a["measured_ms"], w["measured_ms"]) for a, w in zip(after, with_wide)]
    timed = [(a, w) for a, w in pairs if a is not None and w is not None]
    print("\nwith wide_chunks=2 under the refit:")
    for a, w in zip(after, with_wide):
        def ms(x):
            return "untimed" if x is None else f"{x:.3f} ms"
        print(f"  {w['shape']:18s} {w['choice']} ({ms(w['measured_ms'])}) vs {a['choice']} ({ms(a['measured_ms'])})")
    gain = (sum(a for a, _ in timed) / sum(w for _, w in timed) - 1) if timed else None
    recommend = bool(timed) and len(timed) == len(pairs) and gain > 0.01
    report.update(choices_wide=with_wide, wide_gain=gain, wide_recommended=recommend)
    if recommend:
        report["line"] = one_line(wide, base.name)
    print(f"  wide chunks: {'untimed' if gain is None else f'{100 * gain:+.1f}% in sum'} over {len(timed)}/{len(pairs)}"
          f" timed shapes -> {'recommended (in the line below)' if recommend else 'not recommended'}")
    print("\napply (src/logitless/planning/cost_model.py, replacing the H100 line):")
    print("    " + report["line"])
    if args.json_out:
        os.makedirs(os.path.dirname(args.json_out) or ".", exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
