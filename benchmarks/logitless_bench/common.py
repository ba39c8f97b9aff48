"""What the suites' command lines and result files share, without torch (the JAX suites
use it too): line-buffered output, comma-separated selections, the run settings, the
result files under a dated and a ``latest-`` name, markdown tables."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional


def add_run_options(p, max_minutes_help: str) -> None:
    """The options that end a training-loop suite's parser (grpo, train): --max-minutes,
    --seed, --cpu, --out."""
    p.add_argument("--max-minutes", type=float, default=None, help=max_minutes_help)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="the small CPU run even if there is a GPU")
    p.add_argument("--out", metavar="DIR", help="directory of the result files (default: benchmarks/results)")


def line_buffered_stdout() -> None:
    """Every printed line reaches a log at once (a killed run's log shows what it did)."""
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except (AttributeError, ValueError):
        pass


def split(text: Optional[str]) -> list:
    """The non-empty, stripped items of a comma-separated option ([] for None or "")."""
    return [s.strip() for s in text.split(",") if s.strip()] if text else []


def chosen(text: Optional[str], known, what: str) -> list:
    """The names of a comma-separated option, in its order; ``SystemExit`` naming the
    unknown ones (``what``: e.g. "distill shape")."""
    names = split(text)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what}(s) {unknown}; known: {list(known)}")
    return names


def repetitions(args, warmup: int = 3, reps: int = 10) -> tuple:
    """(warmup, reps, deadline) of a suite's options: --warmup / --reps or the defaults
    (1 and 3 with --quick), and the time.monotonic() after which no method starts
    (None without --max-minutes)."""
    quick = args.quick
    return (args.warmup if args.warmup is not None else (1 if quick else warmup),
            args.reps if args.reps is not None else (3 if quick else reps),
            time.monotonic() + 60 * args.max_minutes if args.max_minutes else None)


def write_results(out_dir, stems, data, markdown: str, *, default: Optional[Callable] = None) -> list:
    """``<stem>.json`` (``data``) and ``<stem>.md`` (``markdown``) in ``out_dir`` (made if
    missing) for each stem (a dated name and a ``latest-`` one); the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for stem in stems:
        (out / f"{stem}.json").write_text(json.dumps(data, indent=1, default=default))
        (out / f"{stem}.md").write_text(markdown)
        written += [out / f"{stem}.json", out / f"{stem}.md"]
    return written


def table_report(head, columns, rows, fmt: Callable, notes=()) -> str:
    """Markdown: the ``head`` lines, a table of ``rows`` (dicts) under ``columns`` (each cell
    ``fmt(row.get(column))``), then the ``notes`` as items."""
    lines = list(head) + ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines + [f"\n- {n}" for n in notes]) + "\n"
