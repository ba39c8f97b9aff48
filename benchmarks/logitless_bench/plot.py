"""PNG plots of a suite's results (matplotlib, Agg backend; optional).

lce: one subplot per shape, x = peak extra MiB (log scale), y = fwd+bwd / 3 GEMMs,
     one labelled marker per method, the Pareto front (less memory and less time) as a line.
ce:  one subplot per dtype, x = case, y = achieved bandwidth as % of the copy bandwidth.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from typing import Optional

MARKERS = "osD^v<>pPX*h"


def plot(data: dict, paths) -> Optional[str]:
    """Writes the plot to every path in ``paths``; returns None, or why it did not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ("matplotlib is not installed: no PNG. Install it and run "
                "`python -m logitless_bench --from-json FILE.json` to draw it later.")
    except Exception as exc:  # noqa: BLE001  (a broken install, e.g. clashing binary modules on the path)
        return (f"matplotlib does not import ({type(exc).__name__}: {str(exc)[:120]}): no PNG. Run "
                "`python -m logitless_bench --from-json FILE.json` elsewhere to draw it.")
    fig = (_lce if data["suite"] in ("lce", "precision") else _ce)(data, plt)
    if fig is None:
        return "nothing measured yet: no PNG"
    try:
        for p in paths:
            tmp = str(p) + ".tmp.png"
            fig.savefig(tmp, dpi=110, bbox_inches="tight")
            os.replace(tmp, p)
    finally:
        plt.close(fig)
    return None


def _styles(methods):
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {m: (colors[i % len(colors)], MARKERS[i % len(MARKERS)]) for i, m in enumerate(methods)}


def _subplots(plt, n):
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _title(data, what):
    meta = data["meta"]
    where = meta["device"] if meta.get("gpu") else "CPU, small smoke case, NOT the benchmark"
    return f"logitless {data['suite']}: {what} ({where}, {meta['date'][:10]})"


def _lce(data, plt):
    rows = [r for r in data["rows"] if r.get("fwdbwd_per_3gemm") is not None]
    if not rows:
        return None
    shapes = list(OrderedDict.fromkeys(r["shape"] for r in rows))
    methods = list(OrderedDict.fromkeys(r["method"] for r in data["rows"]))
    style = _styles(methods)
    fig, axes = _subplots(plt, len(shapes))
    for ax, shape in zip(axes, shapes):
        pts = [r for r in rows if r["shape"] == shape]
        ax.set_title(data["shapes"].get(shape, {}).get("label", shape), fontsize=10)
        if all(r.get("peak_extra_mib") is None for r in pts):  # the CPU: no memory statistics
            names = [r["method"] for r in pts]
            ax.barh(names, [r["fwdbwd_per_3gemm"] for r in pts], color=[style[n][0] for n in names])
            ax.set_xlabel("fwd+bwd / 3 GEMMs (peak memory not measured on CPU)")
            ax.invert_yaxis()
            continue
        pts = [r for r in pts if r.get("peak_extra_mib") is not None]
        xy = [(max(r["peak_extra_mib"], 0.5), r["fwdbwd_per_3gemm"], r["method"]) for r in pts]
        for x, y, m in xy:
            color, marker = style[m]
            ax.scatter([x], [y], color=color, marker=marker, s=55, label=m, zorder=3)
            ax.annotate(m, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
        front, best = [], math.inf  # Pareto front: sorted by memory, keep what is faster
        for x, y, _ in sorted(xy):
            if y < best:
                front.append((x, y))
                best = y
        if len(front) > 1:
            ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="0.6", lw=1, zorder=1)
        ax.axhline(1.0, color="0.75", ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("peak extra memory, MiB (log; values < 0.5 drawn at 0.5)")
        ax.set_ylabel("fwd+bwd time / 3 GEMMs")
        ax.grid(True, which="both", alpha=0.25)
    _figure_legend(fig, axes)
    fig.suptitle(_title(data, "time vs memory, lower-left is better"), fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    return fig


def _ce(data, plt):
    rows = [r for r in data["rows"] if r.get("fwdbwd_frac_copy") is not None or r.get("fwd_frac_copy") is not None]
    if not rows:
        return None
    info = data["shapes"]
    dtypes = list(OrderedDict.fromkeys(info[r["shape"]]["dtype"] for r in rows))
    methods = list(OrderedDict.fromkeys(r["method"] for r in data["rows"]))
    style = _styles(methods)
    fig, axes = _subplots(plt, len(dtypes))
    for ax, dtype in zip(axes, dtypes):
        cases = [s for s in info if info[s]["dtype"] == dtype]
        for m in methods:
            by = {r["shape"]: r for r in rows if r["method"] == m}
            for key, ls in (("fwdbwd_frac_copy", "-"), ("fwd_frac_copy", ":")):
                ys = [100 * by[c][key] if c in by and by[c].get(key) is not None else float("nan") for c in cases]
                if all(math.isnan(y) for y in ys):
                    continue
                color, marker = style[m]
                label = f"{m} fwd+bwd" if key == "fwdbwd_frac_copy" else f"{m} fwd"
                ax.plot(range(len(cases)), ys, ls=ls, marker=marker, color=color, label=label)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{info[c]['tokens']}x{info[c]['vocab']}" for c in cases], rotation=30, fontsize=8)
        ax.set_ylabel("achieved bandwidth, % of copy")
        ax.set_title(dtype, fontsize=10)
        ax.axhline(100, color="0.75", ls="--", lw=0.8)
        ax.grid(True, alpha=0.25)
    _figure_legend(fig, axes)
    copy = data["units"].get("copy_GBps")
    fig.suptitle(_title(data, f"bandwidth, solid fwd+bwd, dotted fwd (copy = {copy:.0f} GB/s)" if copy
                        else "bandwidth"), fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    return fig


def _figure_legend(fig, axes):
    """One legend below the subplots, each label once."""
    handles = {}
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(5, len(handles)), fontsize=8,
                   bbox_to_anchor=(0.5, -0.02))
