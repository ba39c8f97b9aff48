"""``python -m logitless_bench compare OLD.json NEW.json``: a regression report.

Reads two result files written by ``report.Results.save`` (same suite) and compares
them over the (shape, method) rows both measured with status "ok":

- ratios NEW / OLD (below 1 = faster) of forward, backward (= fwd+bwd - fwd) and step
  (fwd+bwd) times; by default on the run's own units (``--basis unit``: fwd / 1 GEMM
  and fwd+bwd / 3 GEMMs for lce, f+b / the four-GEMM floor for distill (which times
  no forward alone: step only), the copy-bandwidth fractions for ce), because the
  cuBLAS unit itself moves by up to 10% between runs of one day; ``--basis ms``
  compares raw milliseconds;
- the geomean of each ratio over logitless's rows, and separately over the peers'
  rows: peers did not change between the runs, so their geomean is the drift of the
  machine, the figure to read ours against;
- a per-shape (per-model) table, the top improvements, and every regression beyond
  noise, judged for forward, backward and step each and listed per metric (a slower
  forward hidden in an unchanged step is still a regression). **Noise**: a ratio
  counts as a regression when it exceeds 1 + max(--threshold (default 3%), the rows'
  own recorded spread (``*_spread`` keys: relative inter-quartile range, old + new,
  when the files have them), |peer drift - 1| of that metric);
- **too noisy to judge**: a metric whose recorded spread (old + new) is above
  --max-spread (default 10%) and whose ratio is above 1 + max(threshold, drift) is
  neither a regression nor "no regression": it is listed apart (measure it again);
- correctness changes: a row ok -> failed/skipped (or back), and an error column
  (|loss - ref|, dx/dW/grad relative error) that grew by more than 2x and beyond a
  small floor;
- rows only in one file.

The markdown is printed and written beside NEW.json as
``<new stem>.vs.<old stem>.md``. Exit status 0, or 1 with ``--fail-on-regression``
when a regression or a correctness change is found (with ``--fail-on-noisy`` also when
a metric is too noisy to judge).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import OrderedDict
from pathlib import Path

#: Relative change below which a ratio is never called a regression.
DEFAULT_THRESHOLD = 0.03
#: Recorded spread (old + new, relative) above which a slower ratio cannot be judged.
DEFAULT_MAX_SPREAD = 0.10
#: Error columns and the absolute floor below which their growth is not reported.
ERROR_COLUMNS = {"loss_abs_err": 1e-5, "dx_rel_err": 1e-3, "dw_rel_err": 1e-3, "grad_rel_err": 1e-3}
METRICS = ("fwd", "bwd", "step")
METRIC_NAMES = {"fwd": "forward", "bwd": "backward", "step": "step (fwd+bwd)"}


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def load(path) -> dict:
    data = json.loads(Path(path).read_text())
    if "rows" not in data or "suite" not in data:
        raise SystemExit(f"{path}: not a logitless_bench result file (no 'rows'/'suite')")
    return data


def _times(row: dict, data: dict, basis: str) -> dict:
    """{metric: value} of one row, lower is better; None where not measured."""
    fwd, step = _num(row.get("fwd_ms")), _num(row.get("fwdbwd_ms"))
    if basis == "unit":
        if data["suite"] == "lce":
            unit = _num(row.get("gemm_ms")) or _num(data.get("units", {}).get("gemm_ms", {}).get(row["shape"]))
        elif data["suite"] == "distill":  # the row's own four-GEMM floor, measured in the same run
            unit = _num(row.get("floor_ms"))
        else:  # ce: time x copy bandwidth = bytes-equivalent; any fixed unit of the run works
            copy = _num(data.get("units", {}).get("copy_GBps"))
            unit = 1.0 / copy if copy else None
        if unit is None:
            return {m: None for m in METRICS}
        fwd = fwd / unit if fwd is not None else None
        step = step / unit if step is not None else None
    bwd = step - fwd if fwd is not None and step is not None and step > fwd else None
    return {"fwd": fwd, "bwd": bwd, "step": step}


def _spread(row: dict, times: dict, metric: str) -> float:
    """Relative spread of one metric of a row (0 when the file records none). The
    backward is a difference: its spread is (spread_step * step + spread_fwd * fwd) / bwd."""
    s_fwd, s_step = _num(row.get("fwd_spread")) or 0.0, _num(row.get("fwdbwd_spread")) or 0.0
    if metric == "fwd":
        return s_fwd
    if metric == "step":
        return s_step
    if times["bwd"]:
        return (s_step * times["step"] + s_fwd * times["fwd"]) / times["bwd"]
    return 0.0


def geomean(values) -> float | None:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def judge(ratio: float | None, spread: float, drift: float | None, threshold: float,
          max_spread: float) -> tuple[str, float]:
    """(verdict, noise) of one metric of one row: "regression" when ratio > 1 + noise,
    noise = max(threshold, spread, |drift - 1|); "noisy" when it is not but the ratio is
    above 1 + max(threshold, |drift - 1|) and the spread is above max_spread (a slowdown
    the row's own spread can neither confirm nor rule out); else "ok" (or "-" without
    a ratio)."""
    machine = max(threshold, abs(drift - 1) if drift else 0.0)
    noise = max(machine, spread)
    if ratio is None:
        return "-", noise
    if ratio > 1 + noise:
        return "regression", noise
    if ratio > 1 + machine and spread > max_spread:
        return "noisy", noise
    return "ok", noise


def compare(old: dict, new: dict, *, basis: str = "unit", threshold: float = DEFAULT_THRESHOLD,
            top: int = 5, max_spread: float = DEFAULT_MAX_SPREAD) -> dict:
    """The comparison as data (``render`` turns it into markdown)."""
    if old["suite"] != new["suite"]:
        raise SystemExit(f"different suites: {old['suite']} vs {new['suite']}")
    old_by = {(r["shape"], r["method"]): r for r in old["rows"]}
    new_by = {(r["shape"], r["method"]): r for r in new["rows"]}
    common = [k for k in new_by if k in old_by]
    only_old = [k for k in old_by if k not in new_by]
    only_new = [k for k in new_by if k not in old_by]

    pairs = []
    for key in common:
        o, n = old_by[key], new_by[key]
        if o["status"] != "ok" or n["status"] != "ok":
            continue
        to, tn = _times(o, old, basis), _times(n, new, basis)
        ratios = {m: (tn[m] / to[m] if to[m] and tn[m] is not None else None) for m in METRICS}
        spread = {m: _spread(o, to, m) + _spread(n, tn, m) for m in METRICS}
        pairs.append({"shape": key[0], "method": key[1], "peer": bool(n.get("peer", o.get("peer"))),
                      "ratios": ratios, "spread": spread})

    def gm(rows, metric):
        return geomean(p["ratios"][metric] for p in rows)

    ours = [p for p in pairs if not p["peer"]]
    peers = [p for p in pairs if p["peer"]]
    geo = {m: gm(ours, m) for m in METRICS}
    drift = {m: gm(peers, m) for m in METRICS}

    regressions, noisy = [], []
    for p in ours:
        p["verdict"] = {}
        for m in METRICS:
            r = p["ratios"][m]
            verdict, noise = judge(r, p["spread"][m], drift[m], threshold, max_spread)
            p["verdict"][m] = verdict
            if verdict == "regression":
                regressions.append({**p, "metric": m, "ratio": r, "noise": noise})
            elif verdict == "noisy":
                noisy.append({**p, "metric": m, "ratio": r, "noise": noise})
    regressions.sort(key=lambda q: -q["ratio"])
    noisy.sort(key=lambda q: -q["ratio"])
    by_metric = {m: [q for q in regressions if q["metric"] == m] for m in METRICS}
    improvements = sorted((p for p in ours if p["ratios"]["step"] is not None), key=lambda q: q["ratios"]["step"])
    improvements = [p for p in improvements if p["ratios"]["step"] < 1 - threshold][:top]

    per_shape = OrderedDict()
    for p in ours:
        per_shape.setdefault(p["shape"], []).append(p)
    shape_rows = [{"shape": s, "methods": len(ps), **{m: gm(ps, m) for m in METRICS}} for s, ps in per_shape.items()]

    correctness = []
    for key in common:
        o, n = old_by[key], new_by[key]
        if o["status"] != n["status"]:
            correctness.append({"shape": key[0], "method": key[1],
                                "change": f"status {o['status']} -> {n['status']}",
                                "reason": n.get("reason") or o.get("reason") or ""})
            continue
        for col, floor in ERROR_COLUMNS.items():
            eo, en = _num(o.get(col)), _num(n.get(col))
            if en is None:
                if eo is not None and n["status"] == "ok" and col in n:
                    correctness.append({"shape": key[0], "method": key[1], "change": f"{col} {eo:.1e} -> {n.get(col)}",
                                        "reason": ""})
                continue
            if eo is None:
                continue
            if en > floor and en > 2 * eo:
                correctness.append({"shape": key[0], "method": key[1], "change": f"{col} {eo:.1e} -> {en:.1e}",
                                    "reason": ""})
    return {
        "suite": new["suite"], "basis": basis, "threshold": threshold, "max_spread": max_spread,
        "old": _describe(old), "new": _describe(new),
        "common": len(common), "compared": len(pairs), "ours": len(ours), "peers": len(peers),
        "geomean": geo, "drift": drift, "per_shape": shape_rows, "pairs": pairs,
        "regressions": regressions, "regressions_by_metric": by_metric, "noisy": noisy,
        "improvements": improvements, "correctness": correctness,
        "only_old": only_old, "only_new": only_new,
    }


def _describe(data: dict) -> str:
    meta = data.get("meta", {})
    git = (meta.get("git") or {}).get("commit", "")
    return (f"{meta.get('device', '?')}, {meta.get('date', '?')}, torch {meta.get('torch')}, "
            f"triton {meta.get('triton')}"
            + (f", git {git[:10]}" if git else ""))


def _r(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * (v - 1):+.1f}%"


def _table(header, rows) -> list:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def render(c: dict, old_path="OLD", new_path="NEW") -> str:
    units = {"lce": "run units (fwd / 1 GEMM, fwd+bwd / 3 GEMMs)", "distill": "run units (f+b / the four-GEMM floor)"}
    basis = units.get(c["suite"], "run units (time x copy bandwidth)") if c["basis"] == "unit" else "milliseconds"
    g, d = c["geomean"], c["drift"]
    out = [f"# logitless bench compare ({c['suite']})", "",
           f"- old: `{old_path}` ({c['old']})", f"- new: `{new_path}` ({c['new']})",
           f"- basis: {basis}; ratio = new / old, below 1 is faster",
           f"- rows: {c['common']} in both, {c['compared']} ok in both ({c['ours']} logitless, {c['peers']} peers); "
           f"{len(c['only_old'])} only in old, {len(c['only_new'])} only in new",
           f"- noise: a ratio above 1 + max({100 * c['threshold']:.0f}%, the rows' recorded spread, "
           f"the peers' drift) is a regression; a slower ratio whose rows' spread is above "
           f"{100 * c['max_spread']:.0f}% is too noisy to judge", "",
           "## Geomean (logitless rows)", ""]
    out += _table(["", "forward", "backward", "step (fwd+bwd)"],
                  [["logitless new/old", _r(g["fwd"]), _r(g["bwd"]), _r(g["step"])],
                   ["peers new/old (machine drift)", _r(d["fwd"]), _r(d["bwd"]), _r(d["step"])]])
    out += ["", "## Per model (geomean over logitless methods)", ""]
    out += _table(["shape", "methods", "forward", "backward", "step"],
                  [[s["shape"], s["methods"], _r(s["fwd"]), _r(s["bwd"]), _r(s["step"])] for s in c["per_shape"]])
    by_metric = c["regressions_by_metric"]
    out += ["", f"## Regressions beyond noise ({len(c['regressions'])})", "",
            "per metric: " + ", ".join(f"{METRIC_NAMES[m]} {len(by_metric[m])}" for m in METRICS), ""]
    for m in METRICS:
        if by_metric[m]:
            out += [f"### {METRIC_NAMES[m]} ({len(by_metric[m])})", ""]
            out += _table(["shape", "method", "new/old", "noise"],
                          [[q["shape"], q["method"], f"{_r(q['ratio'])} ({_pct(q['ratio'])})",
                            f"{100 * q['noise']:.1f}%"] for q in by_metric[m]])
            out.append("")
    if not c["regressions"]:
        out.append("none beyond noise" + (f", but {len(c['noisy'])} slower metric(s) too noisy to judge (below)"
                                          if c["noisy"] else ""))
    out += ["", f"## Too noisy to judge ({len(c['noisy'])})", ""]
    if c["noisy"]:
        out += [f"Slower than 1 + max(threshold, drift) with a recorded spread (old + new) above "
                f"{100 * c['max_spread']:.0f}%: neither a regression nor none; measure again.", ""]
        out += _table(["shape", "method", "metric", "new/old", "spread (old + new)"],
                      [[q["shape"], q["method"], METRIC_NAMES[q["metric"]], f"{_r(q['ratio'])} ({_pct(q['ratio'])})",
                        f"{100 * q['spread'][q['metric']]:.1f}%"] for q in c["noisy"]])
    else:
        out.append("none")
    out += ["", "## Top improvements (step)", ""]
    if c["improvements"]:
        out += _table(["shape", "method", "forward", "backward", "step"],
                      [[p["shape"], p["method"], _r(p["ratios"]["fwd"]), _r(p["ratios"]["bwd"]),
                        f"{_r(p['ratios']['step'])} ({_pct(p['ratios']['step'])})"] for p in c["improvements"]])
    else:
        out.append("none beyond noise")
    out += ["", f"## Correctness changes ({len(c['correctness'])})", ""]
    if c["correctness"]:
        out += [f"- {q['shape']} / {q['method']}: {q['change']}" + (f" ({q['reason']})" if q["reason"] else "")
                for q in c["correctness"]]
    else:
        out.append("none (same statuses; no error column grew beyond 2x and its floor)")
    if c["only_old"] or c["only_new"]:
        out += ["", "## Rows in one file only", ""]
        out += [f"- only old: {s} / {m}" for s, m in c["only_old"]]
        out += [f"- only new: {s} / {m}" for s, m in c["only_new"]]
    mark = {"regression": " !", "noisy": " ?"}
    out += ["", "## Every compared row", "", "(! a regression, ? too noisy to judge)", ""]
    out += _table(["shape", "method", "forward", "backward", "step"],
                  [[p["shape"], p["method"] + (" (peer)" if p["peer"] else "")]
                   + [_r(p["ratios"][m]) + mark.get(p.get("verdict", {}).get(m), "") for m in METRICS]
                   for p in c["pairs"]])
    return "\n".join(out) + "\n"


def output_path(new_path, old_path) -> Path:
    new_path, old_path = Path(new_path), Path(old_path)
    return new_path.with_name(f"{new_path.stem}.vs.{old_path.stem}.md")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m logitless_bench compare",
                                description="Regression report between two benchmark JSON files of one suite.")
    p.add_argument("old", help="the reference run (JSON written by python -m logitless_bench)")
    p.add_argument("new", help="the run to judge; the markdown is written beside it")
    p.add_argument("--basis", choices=("unit", "ms"), default="unit",
                   help="compare ratios to the run's own unit (default) or raw milliseconds")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help="relative change below which nothing is a regression (default %(default)s)")
    p.add_argument("--max-spread", type=float, default=DEFAULT_MAX_SPREAD,
                   help="recorded spread (old + new) above which a slower ratio is too noisy to judge "
                        "(default %(default)s)")
    p.add_argument("--top", type=int, default=5, help="improvements listed (default %(default)s)")
    p.add_argument("--out", help="markdown path (default: <new stem>.vs.<old stem>.md beside NEW)")
    p.add_argument("--fail-on-regression", action="store_true",
                   help="exit 1 when a regression or a correctness change is found")
    p.add_argument("--fail-on-noisy", action="store_true",
                   help="exit 1 also when a slower metric is too noisy to judge")
    args = p.parse_args(argv)
    c = compare(load(args.old), load(args.new), basis=args.basis, threshold=args.threshold, top=args.top,
                max_spread=args.max_spread)
    text = render(c, args.old, args.new)
    print(text)
    path = Path(args.out) if args.out else output_path(args.new, args.old)
    path.write_text(text)
    print(f"wrote {path}")
    if args.fail_on_regression and (c["regressions"] or c["correctness"]):
        return 1
    if args.fail_on_noisy and c["noisy"]:
        return 1
    return 0
