"""What both suites share: the run configuration, failure capture, progress output."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import timing


@dataclass
class Config:
    device: torch.device
    warmup: int = 3
    reps: int = 10
    errors: bool = True  # compute the float64 reference and the error columns
    seed: int = 0
    deadline: Optional[float] = None  # time.monotonic() after which methods are skipped
    budgets: list = field(default_factory=lambda: ["default", "logits", "64MiB"])
    rounds: int = 1  # interleaved rounds of every method on a case; each time the median of the rounds'

    @property
    def cpu(self) -> bool:
        return self.device.type != "cuda"

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


def describe(exc: BaseException) -> str:
    """One line for the report: OOM spelled out, else the exception's type and first line."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    if timing.is_oom(exc):
        return f"out of memory ({type(exc).__name__}: {first})"
    return f"{type(exc).__name__}: {first}"


def phase(row: dict, name: str, device, fn: Callable):
    """Runs one measurement of a method; a failure is written into ``row`` (and the
    memory it held released) instead of stopping the run. Returns fn()'s value or None."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - any failure of a method is a result
        row["errors"].append(f"{name}: {describe(exc)}")
        timing.release_memory(device)
        return None


def grad_leaves(*tensors) -> tuple:
    """The tensors as leaves that require grad (same storage), then a function that sets
    their gradients to None (the untimed set-up before each forward+backward, so every
    call allocates the gradients afresh, as a training step does)."""
    leaves = [t.detach().requires_grad_(True) for t in tensors]

    def clear_grads():
        for leaf in leaves:
            leaf.grad = None

    return (*leaves, clear_grads)


def memory_and_loss(row: dict, step: Callable, setup: Callable, device, exclude_bytes: int) -> bool:
    """One more call of ``step`` (after ``setup``): its peak memory beyond what it held
    before and ``exclude_bytes`` (``row["peak_extra_mib"]``) and its loss (``row["loss"]``).
    False when the call failed (the error is in the row)."""
    measured = phase(row, "memory", device,
                     lambda: timing.peak_extra_bytes(step, device=device, setup=setup, exclude_bytes=exclude_bytes))
    if measured is None:
        return False
    loss, extra = measured
    row["peak_extra_mib"] = None if extra is None else extra / 2**20
    row["loss"] = float(loss.detach().float().item())
    return True


def run_methods(suite: str, case, methods, cfg: Config, results, progress: Progress, measure: Callable,
                *, skip_reason: Optional[str] = None, extra: Optional[dict] = None) -> None:
    """Measures every method on one case; each gives one row, whatever happens to it.

    ``measure(fn, method, row)`` fills the row with the metrics of the loss function
    ``method.make`` returned. A method that cannot run here is "skipped" with the reason;
    one whose set-up or measurement raises is "failed" with the error.
    """
    from .report import format_row

    rounds: dict = {method.name: [] for method in methods}
    for index in range(max(cfg.rounds, 1)):  # A B A B ...: a clock or power episode hits every method alike
        if index and cfg.out_of_time():
            break
        for method in methods:
            row = {"suite": suite, "shape": case.name, "method": method.name, "peer": method.peer,
                   "status": "ok", "reason": "", "errors": [], **(extra or {})}
            fill_row(row, lambda: method.make(case, cfg.device), lambda fn: measure(fn, method, row),
                     skip_reason=skip_reason, out_of_time=cfg.out_of_time())
            rounds[method.name].append(row)
            timing.release_memory(cfg.device)
    for method in methods:
        row = median_round(rounds[method.name])
        results.add(row)
        progress.step(format_row(row))


#: Per time metric, the metrics derived from it and their power of it (ratios to a unit
#: are proportional to the time, bandwidths inverse to it).
DERIVED = {"fwd_ms": (("fwd_per_gemm", 1), ("fwd_GBps", -1), ("fwd_frac_copy", -1)),
           "fwdbwd_ms": (("fwdbwd_per_3gemm", 1), ("fwdbwd_GBps", -1), ("fwdbwd_frac_copy", -1))}


def median_round(rows: list) -> dict:
    """One method's row of ``--rounds`` interleaved rounds: the first round's row with each
    time (forward, forward+backward) the median of the rounds' and the metrics derived
    from it rescaled; each round's times beside it (``fwd_ms_rounds``, ...). One round:
    that row. A round that failed makes the method's row that failure."""
    if len(rows) == 1:
        return rows[0]
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        return failed[0]
    row = dict(rows[0])
    for key, derived in DERIVED.items():
        values = [r.get(key) for r in rows]
        if any(v is None for v in values):
            continue
        mid = sorted(values)[(len(values) - 1) // 2]
        for name, power in derived:
            if row.get(name) is not None and row[key]:
                row[name] = row[name] * (mid / row[key]) ** power
        row[key], row[f"{key}_rounds"] = mid, values
    return row


def fill_row(row: dict, make: Callable, measure: Callable, *, skip_reason: Optional[str] = None,
             out_of_time: bool = False) -> None:
    """One method's row: "skipped" with ``skip_reason``, when out of time, or when its
    set-up ``make()`` raises ``Skip``; "failed" when the set-up raises anything else or
    ``measure(fn)`` (the loss function ``make`` returned) left errors in ``row["errors"]``."""
    from .peers import Skip

    if skip_reason is not None:
        row.update(status="skipped", reason=skip_reason)
    elif out_of_time:
        row.update(status="skipped", reason="time limit (--max-minutes) reached")
    else:
        try:
            fn = make()
        except Skip as exc:
            row.update(status="skipped", reason=str(exc))
        except Exception as exc:  # noqa: BLE001
            row.update(status="failed", reason=f"set-up: {describe(exc)}")
        else:
            measure(fn)
            del fn
    if row["status"] == "ok" and row["errors"]:
        row.update(status="failed", reason="; ".join(row["errors"]))


def select(args, cpu: bool, shapes, cpu_shapes, methods, suite: str) -> tuple:
    """A suite's selection from its options (distill, rl): (device, shapes, method names,
    (warmup, reps, deadline)). --shapes picks from both tables (default: the CPU's or the
    GPU's), --quick keeps the first; --methods (default all), --no-peers keeps the
    logitless ones. On a CPU it prints the banner that says so."""
    from . import report
    from .common import chosen, repetitions

    pool = shapes + cpu_shapes
    wanted = chosen(args.shapes, [s.name for s in pool], f"{suite} shape")
    picked = [s for s in pool if s.name in wanted] if wanted else (cpu_shapes if cpu else shapes)
    names = [m for m in chosen(args.methods, list(methods), f"{suite} method") or list(methods)
             if not args.no_peers or m.startswith("logitless")]
    if cpu:
        print(report.CPU_BANNER, flush=True)
    return timing.bench_device(cpu), picked[:1] if args.quick else picked, names, repetitions(args)


def run_shapes(data: dict, shapes, run_shape: Callable, save: Callable, out_dir, device) -> list:
    """``run_shape(shape)`` for each shape, the memory released and ``save(data, out_dir)``
    after each (a killed run leaves what it measured); a KeyboardInterrupt (also a time
    limit's SIGTERM) ends the run with a note. ``data["complete"]`` says whether every
    shape ran. Returns the files of the last save."""
    try:
        for shape in shapes:
            run_shape(shape)
            timing.release_memory(device)
            save(data, out_dir)
        data["complete"] = True
    except KeyboardInterrupt as exc:
        data["notes"].append(f"interrupted ({exc or 'KeyboardInterrupt'}): partial results")
    return save(data, out_dir)


class Progress:
    """A tqdm bar on a terminal (plain numbered lines otherwise); every finished row is
    printed at once, flushed, so a log of a killed run still shows what was measured."""

    def __init__(self, total: int, desc: str):
        self.total, self.done = total, 0
        self.bar = None
        try:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, disable=None, leave=False)
        except ImportError:
            pass

    def write(self, text: str) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)
        sys.stdout.flush()

    def step(self, text: str) -> None:
        self.done += 1
        self.write(f"[{self.done}/{self.total}] {text}")
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
