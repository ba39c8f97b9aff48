"""Results of one suite: environment, rows, and their JSON / markdown / PNG files.

Files (``--out``, default benchmarks/results/):
    <suite>-<device>-<date>.json/.md/.png     this run
    latest-<suite>-<device>.json/.md/.png     the same, under a stable name
All are rewritten after every shape, so a killed run leaves what it had measured.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import torch

from .common import write_results

TITLES = {
    "lce": "fused linear cross-entropy (x @ W.T -> mean cross-entropy)",
    "ce": "cross-entropy on materialised logits",
    "precision": "fused linear cross-entropy on fp32 inputs: matmul precision highest / high, autocast bf16",
}

METRICS = {
    "lce": """\
Metrics (lce): inputs x (B,H) ~ N(0,1), W (V,H) ~ N(0,1/H) in the shape's dtype (bf16 for the anchor
shapes), targets uniform in [0, V), mean reduction.
- **1 GEMM ms**: median time of `x @ W.T` (B,H)x(H,V) (cuBLAS on a GPU), measured in the same run: the unit.
- **fwd ms**: median of `reps` calls (after `warmup` calls) of the loss under torch.no_grad, inputs not
  requiring grad. GPU: CUDA events around each call, L2 flushed before it. CPU: time.perf_counter.
- **fwd+bwd ms**: same, for `loss = f(x, W, t); loss.backward()` with x and W requiring grad; x.grad and
  W.grad set to None (untimed) before each call.
- **fwd/1 GEMM** = fwd ms / 1 GEMM ms; **f+b/3 GEMMs** = fwd+bwd ms / (3 x 1 GEMM ms) (a forward+backward
  needs at least 3 GEMMs: logits, dx, dW). Ratios are the figure of merit; ms move between runs.
- **peak extra MiB**: one more fwd+bwd call: torch.cuda.max_memory_allocated during it minus
  memory_allocated before it (inputs, targets, reference all already there) minus the bytes of dx and dW.
  Temporary memory of the method. CPU: the process's resident memory instead (VmHWM during the call,
  reset before it, minus VmRSS before it; allocator caches included).
- **loss**, **|loss-ref|**: loss of that call and its absolute difference to a float64 reference;
  **dx err**, **dW err**: ||g - g_ref||_F / ||g_ref||_F of the gradients. The reference is computed on the
  device in float64, in chunks of tokens (never the whole float64 logits), closed form softmax - onehot.""",
    "precision": """\
Metrics (precision): the lce suite's columns (see there) on x (B,H), W (V,H) in fp32, one case per mode:
- **fp32-highest**: torch.set_float32_matmul_precision("highest") during the case; the unit (1 GEMM) is a cuBLAS
  fp32 `x @ W.T` at that setting (no TF32); logitless uses 3xTF32 tensor-core products.
- **fp32-high**: the same at "high": unit and torch eager use TF32, logitless TF32 products.
- **autocast-bf16**: fp32 x and W called inside `torch.autocast("cuda", torch.bfloat16)` (backward outside, as
  in training); the unit is a bf16 GEMM `x.bfloat16() @ W.bfloat16().T`; torch eager is
  `F.cross_entropy(F.linear(x, W).float(), y)`. Gradients arrive in fp32 (the parameters' dtype).
- Errors are against the float64 loss and gradients of the fp32 inputs (one reference per shape).""",
    "ce": """\
Metrics (ce): logits (N,V) ~ N(0,1) in the listed dtype, targets uniform, mean reduction.
- **copy GB/s**: a device-to-device copy of 1 GiB (CPU: 64 MiB), (bytes read + bytes written) / median
  time, measured in the same run: the unit.
- **fwd ms**, **fwd+bwd ms**: medians as in the lce suite (CUDA events, L2 flush, grads set to None).
  Methods marked in-place write into the logits; the logits are regenerated, untimed, before each call.
- **fwd GB/s** = N*V*s / fwd time (the logits read once); **f+b GB/s** = 3*N*V*s / fwd+bwd time (read
  in the forward, read again and the gradient written in the backward); **% copy** = that / copy GB/s.
- **peak extra MiB**: peak during one fwd+bwd minus memory before it minus the gradient's N*V*s bytes
  (negative when the gradient reuses the logits' storage).
- **|loss-ref|**, **grad err**: against a float64 reference of the same logits (rebuilt block by block
  from their seeds): absolute loss difference, ||g - g_ref||_F / ||g_ref||_F.""",
}

def _box(lines) -> str:
    width = max(len(x) for x in lines)
    rule = "*" * (width + 4)
    return "\n".join([rule] + [f"* {x:<{width}} *" for x in lines] + [rule])


CPU_BANNER = _box([
    "NO GPU FOUND (torch.cuda.is_available() is False, or --cpu was given).",
    "Below: a case sized for a CPU, timed on one thread (time.perf_counter); peak extra",
    "MiB is the process's resident memory during one call. The memory column holds on",
    "any device; the times are a CPU's. The numbers are NOT the benchmark: run this",
    "command on a CUDA GPU for the numbers of the shapes of docs/ANCHORS.md.",
])


# --------------------------------------------------------------------------- environment


def _version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git() -> dict:
    root = Path(__file__).resolve().parent  # git -C finds the checkout from any folder inside it
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except Exception:  # noqa: BLE001 - no git here
        return {}
    if head.returncode != 0:
        return {}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def device_tag(name: str) -> str:
    """A short name for file names: "NVIDIA H100 80GB HBM3" -> "H100"."""
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]{0,2})\b", name)
    return m.group(1) if m else (re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-") or "device")


def environment(device: torch.device) -> dict:
    from logitless import __version__

    from .peers import peer_versions

    now = datetime.datetime.now().astimezone()
    gpu = device.type == "cuda"
    if gpu:
        props = torch.cuda.get_device_properties(device)
        name = torch.cuda.get_device_name(device)
        dev_info = {"total_memory_gib": props.total_memory / 2**30, "multiprocessors": props.multi_processor_count,
                    "capability": f"{props.major}.{props.minor}"}
    else:
        name = platform.processor() or platform.machine() or "cpu"
        dev_info = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    return {
        "date": now.isoformat(timespec="seconds"),
        "command": shlex.join(getattr(sys, "orig_argv", None) or [sys.executable] + sys.argv),
        "cwd": os.getcwd(),
        "gpu": gpu,
        "device": name,
        "device_tag": device_tag(name) if gpu else "cpu",
        "device_info": dev_info,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "logitless": __version__,
        "git": _git(),
        "peers": peer_versions(),
    }


# --------------------------------------------------------------------------- results


def suite_data(suite: str, title: str, meta: dict, settings: tuple, methods: dict, **units) -> dict:
    """A suite's results (distill, rl) before its first row: ``settings`` (warmup, reps,
    seed), ``methods`` name -> description, ``units`` its per-shape units (e.g. floors={});
    rows and notes empty, not complete."""
    return {"suite": suite, "title": title, "meta": meta, "settings": dict(zip(("warmup", "reps", "seed"), settings)),
            "methods": methods, **units, "rows": [], "notes": [], "complete": False}


def suite_head(data) -> list:
    """The first markdown lines of a suite's report (distill, rl): "# <suite>: <title>",
    device and versions, the command, and on a CPU the banner that says so."""
    m = data["meta"]
    md = [f"# {data['suite']}: {data['title']}", "", f"{m['device']} | torch {m['torch']} | "
          f"triton {m['triton']} | {m['date']}", "", f"`{m['command']}`", ""]
    if not m["gpu"]:
        md += ["```", CPU_BANNER, "```", ""]
    return md


def suite_markdown(data, lines, table: str, metrics: str) -> str:
    """A suite's report (distill, rl): ``suite_head``, the suite's ``lines``, its table,
    its metrics' definitions, then the notes."""
    md = suite_head(data) + list(lines) + [table, "", metrics, ""] + [f"- note: {n}" for n in data["notes"]]
    return "\n".join(md) + "\n"


def save_suite(data, out_dir, markdown: str, *, clean: bool = False) -> list:
    """``<suite>-<device>-<today>.json/.md`` and ``latest-<suite>-<device>.json/.md`` of a
    suite's ``data`` (``clean``: NaN and inf written as strings); the paths written."""
    suite, tag = data["suite"], data["meta"]["device_tag"]
    stems = (f"{suite}-{tag}-{datetime.date.today().isoformat()}", f"latest-{suite}-{tag}")
    return write_results(out_dir, stems, _clean(data) if clean else data, markdown, default=str)


def fmt(v, spec: str) -> str:
    """``v`` formatted by ``spec``, "-" for None."""
    return "-" if v is None else format(v, spec)


def gemm_table(rows, errors: tuple) -> str:
    """The table of a suite timed in GEMM units (rl, topk): shape, method, status, forward / one
    GEMM, f+b / three GEMMs, times, peak extra memory, then ``errors`` ((header, row key), each
    formatted .1e)."""
    head = ("| shape | method | status | fwd/GEMM | f+b/3GEMM | fwd ms | f+b ms | peak extra MiB | "
            + "".join(f"{h} | " for h, _ in errors)).rstrip()
    lines = [head, "|" + "---|" * (8 + len(errors))]
    for r in rows:
        status = r["status"] if not r["reason"] else f"{r['status']}: {r['reason'][:80]}"
        lines.append(
            f"| {r['shape']} | {r['method']} | {status} | {fmt(r.get('fwd_per_gemm'), '.2f')} | "
            f"{fmt(r.get('fwdbwd_per_3gemm'), '.2f')} | {fmt(r.get('fwd_ms'), '.2f')} | "
            f"{fmt(r.get('fwdbwd_ms'), '.2f')} | {fmt(r.get('peak_extra_mib'), '.0f')} |"
            + "".join(f" {fmt(r.get(k), '.1e')} |" for _, k in errors))
    return "\n".join(lines)


def save_gemm_suite(data, out_dir, errors: tuple, metrics: str) -> list:
    """``save_suite`` of a suite timed in GEMM units: the units, ``gemm_table``, ``metrics``."""
    units = "GEMM units (ms): " + ", ".join(f"{k}: {v:.3f}" for k, v in data["gemm_ms"].items())
    return save_suite(data, out_dir, suite_markdown(data, [units, ""], gemm_table(data["rows"], errors), metrics))


def targets_and_notes(data, issue: str) -> list:
    """The markdown lines of a training suite's targets (a table: target, measured, met)
    and notes, each only where the data has some."""
    out = []
    if data.get("targets"):
        out += ["", f"Targets ({issue}):", "", "| target | measured | met |", "|---|---|---|"]
        out += [f"| {t} | {'-' if v is None or v != v else format(v, '.4f')} | "
                f"{'-' if ok is None else ('yes' if ok else 'NO')} |" for t, v, ok in data["targets"]]
    if data.get("notes"):
        out += ["", "Notes:"] + [f"- {n}" for n in data["notes"]]
    return out


def _clean(v):
    """JSON-safe: NaN/inf become strings, so the file is strict JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class Results:
    """Everything one suite measured; ``save()`` writes its three files (twice)."""

    def __init__(self, suite: str, meta: dict, out_dir, methods=(), *, settings: dict = None):
        self.out_dir = Path(out_dir)
        self.data = {
            "suite": suite,
            "title": TITLES[suite],
            "meta": meta,
            "settings": settings or {},
            "units": {},
            "shapes": {},
            "methods": {m.name: m.description for m in methods},
            "rows": [],
            "notes": [],
            "complete": False,
        }
        self._plot_message_shown = False

    @classmethod
    def from_json(cls, path, out_dir=None) -> Results:
        data = json.loads(Path(path).read_text())
        res = cls(data["suite"], data["meta"], out_dir or Path(path).parent)
        res.data = data
        return res

    def merge_previous(self, shapes, methods) -> str:
        """``--append``: starts from the latest file of this suite and device, keeping its
        rows of the (shape, method) pairs that this run does not measure."""
        latest = self.paths()["json"][1]
        suite = self.data["suite"]
        if not latest.exists():
            return f"[{suite}] --append: no {latest} yet, starting a new file"
        try:
            old = json.loads(latest.read_text())
        except (OSError, ValueError) as exc:
            return f"[{suite}] --append: {latest} unreadable ({exc}); starting a new file"
        measuring = {(s, m) for s in shapes for m in methods}
        kept = [r for r in old.get("rows", []) if (r["shape"], r["method"]) not in measuring]
        kept_shapes = list(OrderedDict.fromkeys(r["shape"] for r in kept))
        self.data["rows"] = kept + self.data["rows"]
        self.data["shapes"] = {s: i for s, i in old.get("shapes", {}).items() if s in kept_shapes}
        gemm = {s: ms for s, ms in old.get("units", {}).get("gemm_ms", {}).items() if s in kept_shapes}
        if gemm:
            self.data["units"]["gemm_ms"] = gemm
        self.data["methods"] = {**old.get("methods", {}), **self.data["methods"]}
        self.data["previous_runs"] = old.get("previous_runs", []) + [{
            "date": old["meta"]["date"], "command": old["meta"]["command"], "git": old["meta"].get("git"),
            "units": old.get("units", {}), "kept": sorted({f"{r['shape']}/{r['method']}" for r in kept})}]
        return (f"[{suite}] --append: keeping {len(kept)} row(s) of {latest} "
                f"(shapes {', '.join(kept_shapes) or '-'}); each row keeps the unit of its own run")

    # --- filling
    def record_unit(self, shape, unit, *, used: bool = True):
        """A measured ``timing.Unit``: the GEMM unit of ``shape``, or (shape None) the
        copy unit of the run; its spread and any warning are kept beside it. ``used``:
        the suite's ratios depend on it (else its warning is only recorded)."""
        units = self.data["units"]
        if shape is None:
            units["copy_GBps"], units["copy_spread"] = unit.rate / 1e9, unit.spread
            units["copy_warmup_s"] = unit.warmup_s
        else:
            units.setdefault("gemm_ms", {})[shape] = unit.ms
            units.setdefault("gemm_spread", {})[shape] = unit.spread
            units.setdefault("gemm_TFLOPs", {})[shape] = unit.rate / 1e12
            units.setdefault("gemm_warmup_s", {})[shape] = unit.warmup_s
        if unit.warning and used:
            where = f" ({shape})" if shape else ""
            units.setdefault("warnings", []).append(unit.warning.replace(f"{unit.name} =", f"{unit.name}{where} =", 1))

    def set_shape(self, name, info):
        self.data["shapes"][name] = info

    def note(self, text):
        self.data["notes"].append(text)

    def add(self, row):
        self.data["rows"].append(row)

    # --- files
    def paths(self) -> dict:
        meta = self.data["meta"]
        tag, day = meta["device_tag"], meta["date"][:10]
        base = f"{self.data.get('name', self.data['suite'])}-{tag}"  # "models": the lce rows of that suite
        return {ext: (self.out_dir / f"{base}-{day}.{ext}", self.out_dir / f"latest-{base}.{ext}")
                for ext in ("json", "md", "png")}

    def save(self, *, complete: bool = False) -> list:
        self.data["complete"] = complete
        self.out_dir.mkdir(parents=True, exist_ok=True)
        paths = self.paths()
        written = []
        texts = {"json": json.dumps(_clean(self.data), indent=1, allow_nan=False) + "\n", "md": markdown(self.data)}
        for ext, text in texts.items():
            for p in paths[ext]:
                tmp = p.with_name(p.name + ".tmp")
                tmp.write_text(text)
                os.replace(tmp, p)  # atomic: a kill never leaves half a file
                written.append(p)
        from .plot import plot

        msg = plot(self.data, paths["png"])
        if msg is None:
            written += list(paths["png"])
        elif not self._plot_message_shown:
            print(f"[plot] {msg}", flush=True)
            self._plot_message_shown = True
        return written


# --------------------------------------------------------------------------- formatting


def _f(v, spec, suffix=""):
    return "-" if v is None or isinstance(v, str) else f"{v:{spec}}{suffix}"


def _mib(v):
    if v is None:
        return "n/a"
    return f"{v:.0f}" if abs(v) >= 10 else f"{v:.1f}"


def format_row(row: dict) -> str:
    """One line per measured (shape, method), printed as soon as it is measured."""
    head = f"{row['suite']} {row['shape']:<16} {row['method']:<18}"
    if row["status"] == "skipped":
        return f"{head} skipped: {row['reason']}"
    if row["suite"] in ("lce", "precision"):
        text = (f"{head} fwd {_f(row.get('fwd_ms'), '.3f')} ms ({_f(row.get('fwd_per_gemm'), '.2f', 'x')})"
                f"  f+b {_f(row.get('fwdbwd_ms'), '.3f')} ms ({_f(row.get('fwdbwd_per_3gemm'), '.2f', 'x')})"
                f"  peak +{_mib(row.get('peak_extra_mib'))} MiB"
                f"  |dloss| {_f(row.get('loss_abs_err'), '.1e')} dx {_f(row.get('dx_rel_err'), '.1e')}"
                f" dW {_f(row.get('dw_rel_err'), '.1e')}")
        if row.get("pred_strategy") and not row.get("pred_off_device"):
            text += (f"  predicted {_f(row.get('pred_fwd_ms'), '.3f')} / {_f(row.get('pred_ms'), '.3f')} ms "
                     f"({row['pred_strategy']})")
    else:
        text = (f"{head} fwd {_f(row.get('fwd_ms'), '.3f')} ms {_f(row.get('fwd_GBps'), '.0f')} GB/s"
                f" ({_f(_pct(row.get('fwd_frac_copy')), '.0f', '%')})"
                f"  f+b {_f(row.get('fwdbwd_ms'), '.3f')} ms {_f(row.get('fwdbwd_GBps'), '.0f')} GB/s"
                f" ({_f(_pct(row.get('fwdbwd_frac_copy')), '.0f', '%')})"
                f"  peak +{_mib(row.get('peak_extra_mib'))} MiB"
                f"  |dloss| {_f(row.get('loss_abs_err'), '.1e')} grad {_f(row.get('grad_rel_err'), '.1e')}")
    if row["status"] == "failed":
        text += f"  FAILED: {row['reason']}"
    return text


def _pct(v):
    return None if v is None else 100 * v


def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _grid(data):
    """(shapes in order, methods in order, {(shape, method): row})."""
    shapes = list(OrderedDict.fromkeys(r["shape"] for r in data["rows"]))
    methods = list(OrderedDict.fromkeys(r["method"] for r in data["rows"]))
    return shapes, methods, {(r["shape"], r["method"]): r for r in data["rows"]}


def _cell(row, parts):
    if row is None:
        return ""
    if row["status"] == "skipped":
        return "skipped"
    text = " / ".join(parts(row))
    return text + (" (failed)" if row["status"] == "failed" else "")


def unit_text(data, shape) -> str:
    """One line about a unit: value, spread, rate (and its warning, loudly)."""
    units = data["units"]
    if shape is None:
        text = (f"{_f(units.get('copy_GBps'), '.1f')} GB/s (read + write), spread "
                f"{_f(_pct(units.get('copy_spread')), '.0f', '%')}, after {_f(units.get('copy_warmup_s'), '.1f')} s "
                "of warm-up")
        key = "copy ="
    else:
        text = (f"1 GEMM = {_f(units.get('gemm_ms', {}).get(shape), '.3f')} ms "
                f"({_f(units.get('gemm_TFLOPs', {}).get(shape), '.3g')} TFLOP/s, spread "
                f"{_f(_pct(units.get('gemm_spread', {}).get(shape)), '.0f', '%')}, after "
                f"{_f(units.get('gemm_warmup_s', {}).get(shape), '.1f')} s of warm-up)")
        key = f"({shape}) ="
    warnings = [w for w in units.get("warnings", []) if key in w]
    return text + "".join(f"\n{w}" for w in warning_lines(data, warnings))


#: Relative spread (inter-quartile range / median) of a row's timings reported as noisy.
NOISY_SPREAD = 0.25


def unit_warnings(data) -> list:
    """Why the run's units look wrong: the units' own checks (spread, rate outside the
    device class) and, for the lce suites, forward ratios below 1 (a loss that includes
    the GEMM cannot run faster than that GEMM alone: the unit was measured too slow)."""
    warnings = list(data.get("units", {}).get("warnings", []))
    info = data.get("meta", {}).get("device_info", {})
    load, cores = info.get("load_average_1min"), info.get("cpu_count")
    if _num(load) and cores and load > cores:
        warnings.append(f"BUSY MACHINE: load average {load:.1f} on {cores} cores when the run started: "
                        "other processes share the CPU, every time below is inflated and noisy.")
    noisy = sorted({f"{r['shape']}/{r['method']}" for r in data["rows"] if r.get("status") == "ok" and any(
        _num(r.get(k)) and r[k] > NOISY_SPREAD for k in ("fwd_spread", "fwdbwd_spread"))})
    if noisy:
        warnings.append(f"NOISY TIMINGS (spread above {NOISY_SPREAD:.0%} of the median): {', '.join(noisy)}.")
    if data["suite"] in ("lce", "precision"):
        fast = sorted({r["shape"] for r in data["rows"]
                       if r.get("status") == "ok" and _num(r.get("fwd_per_gemm")) and r["fwd_per_gemm"] < 0.8})
        if fast:
            warnings.append(f"UNIT LOOKS WRONG: forward ratios below 0.8x on {', '.join(fast)}: a loss that computes "
                            "the logits cannot beat one GEMM of them, so the 1 GEMM unit was measured too slow "
                            "(a busy or cold machine). Re-run on a quiet machine.")
    return warnings


def is_noise_warning(text: str) -> bool:
    """A warning that a busy machine gives by itself (load, spread of the timings), as
    opposed to a unit outside its device class or a ratio no loss can reach."""
    return text.startswith(("BUSY MACHINE", "NOISY TIMINGS", "UNIT LOOKS WRONG: forward ratios below")) or (
        "its timings spread by" in text and "outside what this device class does" not in text)


def warning_lines(data, warnings) -> list:
    """``!!!`` lines; on a CPU the busy machine's own warnings are plain notes (a shared CPU
    is noisy by nature, and the memory column does not depend on it)."""
    cpu = not data.get("meta", {}).get("gpu", True)
    return [f"note: {w}" if cpu and is_noise_warning(w) else f"!!! {w}" for w in warnings]


def summary(data) -> str:
    """The compact tables (printed at the end of a run, and at the top of the .md); any
    warning about the units comes first, next to the tables it concerns."""
    shapes, methods, by = _grid(data)
    info = data["shapes"]
    out = warning_lines(data, unit_warnings(data))
    if data["suite"] in ("lce", "precision"):
        out.append("fwd / 1 GEMM, fwd+bwd / 3 GEMMs, peak extra MiB:")
        rows = [[info.get(s, {}).get("label", s), _f(info.get(s, {}).get("gemm_ms"), ".2f")]
                + [_cell(by.get((s, m)), lambda r: (_f(r.get("fwd_per_gemm"), ".2f", "x"),
                                                    _f(r.get("fwdbwd_per_3gemm"), ".2f", "x"),
                                                    _mib(r.get("peak_extra_mib")))) for m in methods]
                for s in shapes]
        out.append(_table(["shape (B, H, V)", "1 GEMM ms"] + methods, rows))
        out.append("\nerrors vs float64: |loss - ref| / dx rel / dW rel:")
        rows = [[s] + [_cell(by.get((s, m)), lambda r: (_f(r.get("loss_abs_err"), ".0e"),
                                                        _f(r.get("dx_rel_err"), ".0e"),
                                                        _f(r.get("dw_rel_err"), ".0e"))) for m in methods]
                for s in shapes]
        out.append(_table(["shape"] + methods, rows))
        out.append(_predictions(data))
    else:
        copy = data["units"].get("copy_GBps")
        out.append(f"fwd % of copy bandwidth, fwd+bwd % of copy bandwidth, peak extra MiB "
                   f"(copy = {_f(copy, '.0f')} GB/s):")
        rows = [[s, _mib(info.get(s, {}).get("logits_mib"))]
                + [_cell(by.get((s, m)), lambda r: (_f(_pct(r.get("fwd_frac_copy")), ".0f", "%"),
                                                    _f(_pct(r.get("fwdbwd_frac_copy")), ".0f", "%"),
                                                    _mib(r.get("peak_extra_mib")))) for m in methods]
                for s in shapes]
        out.append(_table(["case (N x V - dtype)", "logits MiB"] + methods, rows))
        out.append("\nerrors vs float64: |loss - ref| / grad rel:")
        rows = [[s] + [_cell(by.get((s, m)), lambda r: (_f(r.get("loss_abs_err"), ".0e"),
                                                        _f(r.get("grad_rel_err"), ".0e")))
                       for m in methods] for s in shapes]
        out.append(_table(["case"] + methods, rows))
    out.append(_problems(data))
    return "\n".join(x for x in out if x)


def _predictions(data) -> str:
    """The planner's predicted times (``planning.cost_model``) beside the measured ones."""
    if not data.get("meta", {}).get("gpu", True):
        return ""  # GPU predictions beside CPU times say nothing (the JSON and All metrics keep them)
    rows = [[r["shape"], r["method"], r["pred_strategy"], _f(r.get("pred_fwd_ms"), ".2f"), _f(r.get("fwd_ms"), ".2f"),
             _f(r.get("pred_ms"), ".2f"), _f(r.get("fwdbwd_ms"), ".2f"),
             _f(r["fwdbwd_ms"] / r["pred_ms"] if _num(r.get("fwdbwd_ms")) and _num(r.get("pred_ms")) else None, ".2f")]
            for r in data["rows"] if r.get("pred_strategy")]
    if not rows:
        return ""
    model = next((r.get("pred_model") for r in data["rows"] if r.get("pred_model")), "?")
    return (f"\nplanner ({model} cost model): predicted vs measured ms:\n"
            + _table(["shape", "method", "strategy", "pred fwd", "fwd", "pred f+b", "f+b", "f+b / pred"], rows))


def _num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _problems(data) -> str:
    """Skipped and failed methods, one line per (method, reason) with the shapes."""
    groups = OrderedDict()
    for r in data["rows"]:
        if r["status"] != "ok":
            groups.setdefault((r["method"], r["status"], r["reason"]), []).append(r["shape"])
    lines = [f"- {m} {status} on {', '.join(shapes)}: {reason}" for (m, status, reason), shapes in groups.items()]
    lines += [f"- {n}" for n in data.get("notes", [])]
    return ("\nskipped / failed:\n" + "\n".join(lines)) if lines else ""


def _rounds(row: dict, key: str) -> str:
    """A time cell: the value, then each interleaved round's in brackets (``--rounds``)."""
    each = row.get(f"{key}_rounds")
    text = _f(row.get(key), ".3f")
    return text + (f" ({' / '.join(_f(v, '.2f') for v in each)})" if each else "")


def _full_table(data) -> str:
    info = data["shapes"]
    if data["suite"] in ("lce", "precision"):
        header = ["shape", "method", "fwd ms", "fwd/1 GEMM", "fwd+bwd ms", "f+b/3 GEMMs", "peak extra MiB",
                  "loss", "\\|loss-ref\\|", "dx err", "dW err", "status",
                  "predicted fwd / f+b ms (planner's strategy)"]
        rows = [[r["shape"], r["method"], _rounds(r, "fwd_ms"), _f(r.get("fwd_per_gemm"), ".2f", "x"),
                 _rounds(r, "fwdbwd_ms"), _f(r.get("fwdbwd_per_3gemm"), ".2f", "x"),
                 _mib(r.get("peak_extra_mib")),
                 _f(r.get("loss"), ".6f"), _f(r.get("loss_abs_err"), ".1e"), _f(r.get("dx_rel_err"), ".1e"),
                 _f(r.get("dw_rel_err"), ".1e"), r["status"],
                 (f"{_f(r.get('pred_fwd_ms'), '.2f')} / {_f(r.get('pred_ms'), '.2f')} ({r['pred_strategy']})"
                  if r.get("pred_strategy") else "")] for r in data["rows"]]
        units = [f"- {unit_text(data, s)}; float64 reference loss {_f(i.get('ref_loss'), '.6f')}"
                 for s, i in info.items()]
    else:
        header = ["case", "method", "fwd ms", "fwd GB/s", "fwd % copy", "fwd+bwd ms", "f+b GB/s", "f+b % copy",
                  "peak extra MiB", "loss", "\\|loss-ref\\|", "grad err", "status"]
        rows = [[r["shape"], r["method"], _f(r.get("fwd_ms"), ".3f"), _f(r.get("fwd_GBps"), ".0f"),
                 _f(_pct(r.get("fwd_frac_copy")), ".0f", "%"), _f(r.get("fwdbwd_ms"), ".3f"),
                 _f(r.get("fwdbwd_GBps"), ".0f"), _f(_pct(r.get("fwdbwd_frac_copy")), ".0f", "%"),
                 _mib(r.get("peak_extra_mib")), _f(r.get("loss"), ".6f"), _f(r.get("loss_abs_err"), ".1e"),
                 _f(r.get("grad_rel_err"), ".1e"), r["status"]] for r in data["rows"]]
        units = [f"- copy bandwidth: {unit_text(data, None)}"]
    return "\n".join(units) + "\n\n" + _table(header, rows)


def markdown(data) -> str:
    meta = data["meta"]
    peers = ", ".join(f"{k} {v or 'not installed'}" for k, v in meta.get("peers", {}).items())
    git = meta.get("git") or {}
    lines = [f"# logitless bench: {data['suite']} ({data['title']})", ""]
    if not meta.get("gpu"):
        lines += ["```", CPU_BANNER, "```", ""]
    if not data.get("complete"):
        lines += ["**Partial results: the run had not finished when this file was written.**", ""]
    lines += [
        f"- device: {meta['device']} ({meta['device_tag']})",
        f"- torch {meta['torch']}, cuda {meta.get('cuda')}, triton {meta.get('triton')}, python {meta['python']}, "
        f"logitless {meta.get('logitless')}" + (f" (git {git['commit'][:10]}{', dirty' if git.get('dirty') else ''})"
                                                if git.get("commit") else ""),
        f"- peers: {peers}",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- settings: {', '.join(f'{k}={v}' for k, v in data.get('settings', {}).items())}",
    ]
    for prev in data.get("previous_runs", []):
        lines.append(f"- merged (--append) with an earlier run, {prev['date']}, `{prev['command']}`: "
                     f"{len(prev['kept'])} row(s) kept")
    lines += [
        "",
        "## Summary",
        "",
        summary(data),
        "",
        "## All metrics",
        "",
        _full_table(data),
        "",
        "## Methods",
        "",
    ]
    lines += [f"- **{k}**: {v}" for k, v in data.get("methods", {}).items()]
    lines += ["", "## Definitions", "", METRICS[data["suite"]], ""]
    return "\n".join(lines)
