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


def run_methods(suite: str, case, methods, cfg: Config, results, progress: Progress, measure: Callable,
                *, skip_reason: Optional[str] = None, extra: Optional[dict] = None) -> None:
    """Measures every method on one case; each gives one row, whatever happens to it.

    ``measure(fn, method, row)`` fills the row with the metrics of the loss function
    ``method.make`` returned. A method that cannot run here is "skipped" with the reason;
    one whose set-up or measurement raises is "failed" with the error.
    """
    from .peers import Skip
    from .report import format_row

    for method in methods:
        row = {"suite": suite, "shape": case.name, "method": method.name, "peer": method.peer,
               "status": "ok", "reason": "", "errors": [], **(extra or {})}
        if skip_reason is not None:
            row.update(status="skipped", reason=skip_reason)
        elif cfg.out_of_time():
            row.update(status="skipped", reason="time limit (--max-minutes) reached")
        else:
            try:
                fn = method.make(case, cfg.device)
            except Skip as exc:
                row.update(status="skipped", reason=str(exc))
            except Exception as exc:  # noqa: BLE001
                row.update(status="failed", reason=f"set-up: {describe(exc)}")
            else:
                measure(fn, method, row)
                del fn
        if row["status"] == "ok" and row["errors"]:
            row.update(status="failed", reason="; ".join(row["errors"]))
        results.add(row)
        progress.step(format_row(row))
        timing.release_memory(cfg.device)


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
