"""The command line: ``python -m logitless_bench [options]`` or ``logitless bench [options]``.

On a machine without a GPU it runs one small case on the CPU and says so loudly: that
checks the harness, it is not the benchmark.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

import torch

from . import peers, precision, report, shapes, timing
from .common import line_buffered_stdout, split
from .runner import Config

EXAMPLES = """\
examples:
  python -m logitless_bench                          # both suites, every anchor shape and method
  python -m logitless_bench --suite lce --quick      # smoke run: first shape, 1+3 reps
  python -m logitless_bench --suite lce --shapes llama3.1-8b,deepseek-v3 --methods logitless,torch-compile
  python -m logitless_bench --suite ce --shapes '*-bf16' --max-minutes 9
  python -m logitless_bench --suite ce --shapes '*-fp32' --max-minutes 9 --append   # same files, both halves
  python -m logitless_bench --suite precision --max-minutes 4   # fp32 (highest / high) and autocast bf16
  python -m logitless_bench --suite models --no-peers --budgets default,logits   # 26 model shapes
  python -m logitless_bench --suite distill --max-minutes 6   # fused linear JSD vs liger, TRL, torch
  python -m logitless_bench --suite rl --max-minutes 5       # token log-probs + entropy (RL) vs torch, verl
  python -m logitless_bench --suite topk --max-minutes 5     # top-k distillation vs the logits way
  python -m logitless_bench --suite grpo             # one GRPO step of a 1B HF model per LM-head method (-h)
  python -m logitless_bench --suite tp --max-minutes 4   # vocab-parallel CE, one process per GPU
  python -m logitless_bench --suite train            # end-to-end HF training (its options: --suite train -h)
  python -m logitless_bench --list                   # shapes and methods
  python -m logitless_bench --from-json benchmarks/results/latest-lce-H100.json   # redraw .md/.png
  python -m logitless_bench compare OLD.json NEW.json   # regression report (markdown beside NEW.json)
"""


#: Budgets of the logitless lce rows without --budgets.
GPU_BUDGETS, CPU_BUDGETS = "default,logits,64MiB", "default"
#: Methods of a run without a GPU and without --methods: a CPU call of the default case
#: takes seconds, so the run compares the op with the logits way (the rest: --methods).
CPU_METHODS = ("logitless", "torch-eager", "logitless-inplace")

#: Suites of --suite; "all" runs lce and ce, the others run only when named.
SUITES = ("lce", "ce", "all", "precision", "models", "distill", "train", "jax", "jax-sharded", "rl", "tp", "grpo",
          "topk")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m logitless_bench",
        description="Benchmark logitless against torch eager, torch.compile, liger-kernel and "
        "cut-cross-entropy: time, peak memory and float64 errors, in one run.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--suite", choices=SUITES, default="all",
                   help="lce: fused linear cross-entropy; ce: cross-entropy on logits; all: both; "
                   "precision: lce on fp32 inputs at matmul precision highest/high and under autocast bf16; "
                   "models: the lce suite on 26 real LM-head shapes (files models-<device>-*); "
                   "distill: fused linear JSD; tp: vocab-parallel cross-entropy, one process per GPU; "
                   "train: end-to-end HF training of a 1B model, its own "
                   "options (--suite train -h); jax: the JAX op, its own options (--suite jax -h); "
                   "jax-sharded: the JAX op on all local devices, data/tensor parallel (--suite jax-sharded -h); "
                   "grpo: one GRPO training step of a 1B HF model per LM-head method, its own options "
                   "(--suite grpo -h) "
                   "(default: all)")
    p.add_argument("--shapes", metavar="NAME[,NAME]",
                   help="cases to run: names or shell patterns of lce shapes and/or ce cases, e.g. "
                   "llama3.1-8b,'*-fp32' (see --list)")
    p.add_argument("--methods", metavar="NAME[,NAME]", help="methods to run (see --list)")
    p.add_argument("--budgets", metavar="B[,B]",
                   help="memory budgets of the logitless lce rows: default, logits (= B*V*itemsize) or a size "
                   f"like 64MiB (default: {GPU_BUDGETS}; without a GPU: {CPU_BUDGETS})")
    p.add_argument("--no-peers", action="store_true", help="logitless only (no torch, liger, cce)")
    p.add_argument("--quick", action="store_true", help="smoke run: first case of each suite, 1 warm-up, 3 reps")
    p.add_argument("--warmup", type=int, help="untimed calls before timing (default 3; --quick or no GPU: 1)")
    p.add_argument("--reps", type=int, help="timed calls, the median is reported (default 10; --quick 3; no GPU: 2)")
    p.add_argument("--rounds", type=int, default=1, metavar="R",
                   help="interleaved rounds: every method of a case runs R times, A B A B ...; each time is "
                   "the median of the rounds', each round's beside it (default 1)")
    p.add_argument("--no-errors", action="store_true", help="skip the float64 reference and the error columns")
    p.add_argument("--max-minutes", type=float, metavar="M",
                   help="after M minutes skip the remaining methods and write the files (for time-limited sessions)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="run the small CPU case even if there is a GPU")
    p.add_argument("--append", action="store_true",
                   help="merge into the existing latest-<suite>-<device>.json of --out: keep its rows of the "
                   "(shape, method) pairs this run does not measure (to split a long benchmark over commands)")
    p.add_argument("--out", metavar="DIR", help="directory of the result files (default: benchmarks/results)")
    p.add_argument("--list", action="store_true", help="list shapes and methods, then exit")
    p.add_argument("--from-json", nargs="+", metavar="FILE", help="rewrite the .md and .png of saved JSON results")
    return p


def _method_lists(budgets, cpu, with_peers):
    return {
        "lce": peers.lce_methods(budgets, cpu=cpu, peers=with_peers),
        "ce": peers.ce_methods(cpu=cpu, peers=with_peers),
        "precision": precision.methods(),
    }


def _list(cpu, budgets) -> int:
    defaults = shapes.default_names(cpu)
    print("lce shapes (B tokens, H hidden, V vocab):")
    for s in shapes.lce_shapes(cpu):
        only = "" if s.name in defaults else "  (only with --shapes)"
        print(f"  {s.name:<18} {s.tokens:>6} {s.hidden:>6} {s.vocab:>7}  {s.dtype}{only}")
    print("ce cases (N tokens x V vocab - dtype):")
    for c in shapes.ce_cases(cpu):
        print(f"  {c.name}{'' if c.name in defaults else '  (only with --shapes)'}")
    for suite, methods in _method_lists(budgets, False, True).items():
        print(f"{suite} methods:")
        for m in methods:
            print(f"  {m.name:<20} {m.description}{'  (GPU only)' if m.gpu_only else ''}")
    return 0


def _from_json(files, out) -> int:
    for f in files:
        res = report.Results.from_json(f, out)
        written = res.save(complete=res.data.get("complete", False))
        print(report.summary(res.data))
        print("wrote:\n" + "\n".join(f"  {p}" for p in written))
    return 0


def _on_sigterm(signum, frame):  # a time limit's kill: unwind so partial results are saved
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    threads = torch.get_num_threads()
    try:
        return _main(argv)
    finally:  # a CPU run sets one thread; an in-process caller (a test) gets its count back
        torch.set_num_threads(threads)


def _main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # the console script: `logitless bench ...`
        argv = argv[1:]
    if argv[:1] == ["compare"]:  # regression report between two JSON files (compare.py)
        from .compare import main as compare_main

        return compare_main(argv[1:])
    if "--suite=train" in argv or any(a == "--suite" and b == "train" for a, b in zip(argv, argv[1:])):
        from . import train  # its own options

        return train.main(argv)
    if "--suite=grpo" in argv or any(a == "--suite" and b == "grpo" for a, b in zip(argv, argv[1:])):
        from . import grpo  # its own options

        return grpo.main(argv)
    from .jax_suite import wants_jax

    if wants_jax(argv):
        from .jax_suite import main as jax_main

        return jax_main(argv)
    args = build_parser().parse_args(argv)
    line_buffered_stdout()
    out_dir = args.out or "benchmarks/results"
    if args.from_json:
        return _from_json(args.from_json, args.out)

    if args.rounds < 1 or (args.rounds > 1 and args.suite in ("distill", "rl", "topk", "tp")):
        raise SystemExit(f"--rounds {args.rounds}: a count >= 1, and more than one only for the suites "
                         "lce, ce, all, models and precision (the others time each method once)")
    cpu = args.cpu or not torch.cuda.is_available()
    if cpu:
        # One thread: on a shared machine torch's worker threads wait for each other at
        # every op (a descheduled thread stalls the op for a time slice: 0.13 ms GEMMs
        # measured 8 ms); one thread gives steady, comparable times.
        torch.set_num_threads(1)
    if args.suite == "distill":  # its own runner and shapes: bench/distill.py
        from . import distill

        signal.signal(signal.SIGTERM, _on_sigterm)
        return distill.run_cli(args, cpu)
    if args.suite == "rl":  # token log-probs + entropy: its own runner and shapes (bench/rl.py)
        from . import rl

        signal.signal(signal.SIGTERM, _on_sigterm)
        return rl.run_cli(args, cpu)
    if args.suite == "topk":  # top-k distillation: its own runner and shapes (bench/topk.py)
        from . import topk

        signal.signal(signal.SIGTERM, _on_sigterm)
        return topk.run_cli(args, cpu)
    if args.suite == "tp":  # vocab-parallel over one process per GPU: bench/tp.py
        from . import tp

        return tp.run_cli(args, cpu)
    cpu_defaults = cpu and not args.shapes  # the CPU-sized case: fewer calls of seconds each
    budgets = split(args.budgets if args.budgets is not None else (CPU_BUDGETS if cpu else GPU_BUDGETS)) or ["default"]
    for b in budgets:
        peers.budget_bytes(b, 1, 1, 2)  # fail early on a malformed budget
    if args.list:
        return _list(cpu, budgets)

    device = timing.bench_device(cpu)
    quick = args.quick
    cfg = Config(
        device=device,
        warmup=args.warmup if args.warmup is not None else (1 if quick or cpu_defaults else 3),
        reps=args.reps if args.reps is not None else (2 if cpu_defaults else 3 if quick else 10),
        errors=not args.no_errors,
        seed=args.seed,
        deadline=time.monotonic() + 60 * args.max_minutes if args.max_minutes else None,
        budgets=budgets,
        rounds=args.rounds,
    )

    shape_names = split(args.shapes)
    unknown = shapes.unmatched(shape_names, cpu) if args.suite != "precision" else []
    if unknown:
        raise SystemExit(f"unknown shape(s) {unknown}; known: {', '.join(shapes.known_names(cpu))}")
    method_lists = _method_lists(budgets, cpu, not args.no_peers)
    method_names = split(args.methods) or (list(CPU_METHODS) if cpu_defaults and args.suite in ("lce", "all") else [])
    all_names = {m.name for ms in _method_lists(budgets, False, True).values() for m in ms}
    unknown = [n for n in method_names if n not in all_names]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {', '.join(sorted(all_names))}")

    if cpu:
        print(report.CPU_BANNER, flush=True)
    meta = report.environment(device)
    print(f"device: {meta['device']} | torch {meta['torch']} | cuda {meta['cuda']} | triton {meta['triton']} | "
          f"python {meta['python']} | peers: {meta['peers']}", flush=True)
    settings = {"warmup": cfg.warmup, "reps": cfg.reps, "budgets": ",".join(budgets), "errors": cfg.errors,
                "seed": cfg.seed, "quick": quick, "peers": not args.no_peers,
                "rounds": cfg.rounds}
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()), flush=True)

    signal.signal(signal.SIGTERM, _on_sigterm)
    done = []
    suites = ("lce", "ce") if args.suite == "all" else (args.suite,)
    interrupted = False
    for suite in suites:
        if interrupted:
            break
        if suite == "precision":
            runner = precision
            cases = precision.cases(cpu, shape_names, quick=quick)
        elif suite in ("lce", "models"):
            from . import lce as runner
            pool = shapes.model_shapes(cpu) if suite == "models" else shapes.lce_shapes(cpu)
            cases = shapes.select(pool, shape_names, cpu=cpu, quick=quick, every=suite == "models")
        else:
            from . import ce as runner
            cases = shapes.select(shapes.ce_cases(cpu), shape_names, cpu=cpu, quick=quick)
            try:
                peers.logitless_cross_entropy()
            except peers.Skip as exc:
                print(f"\n[ce] suite skipped: {exc}", flush=True)
                continue
        methods = [m for m in method_lists["lce" if suite == "models" else suite]
                   if not method_names or m.name in method_names]
        if not cases or not methods:
            print(f"\n[{suite}] suite skipped: no {'case' if not cases else 'method'} selected for it", flush=True)
            continue
        print(f"\n[{suite}] {report.TITLES.get(suite, report.TITLES['lce'])}: {len(cases)} case(s) x "
              f"{len(methods)} method(s): {', '.join(m.name for m in methods)}", flush=True)
        results = report.Results("lce" if suite == "models" else suite, meta, out_dir, methods, settings=settings)
        if suite == "models":
            results.data["name"] = "models"  # files models-<device>-<date>.*, rows of suite lce
        if args.append:
            print(results.merge_previous([c.name for c in cases], [m.name for m in methods]), flush=True)
        complete = False
        try:
            runner.run(cases, methods, cfg, results)
            complete = True
        except KeyboardInterrupt as exc:
            interrupted = True
            results.note(f"interrupted ({exc or 'KeyboardInterrupt'}): partial results")
            print(f"\n[{suite}] interrupted: saving partial results", flush=True)
        done.append((results, results.save(complete=complete)))

    if cpu and done:  # before the numbers it introduces
        print("\n" + report.CPU_BANNER)
    for results, written in done:
        d = results.data
        print("\n" + "=" * 100)
        print(f"{d['suite']}: {d['title']} | {meta['device']} | {meta['date']}")
        print(report.summary(d))
        print("files: " + " ".join(str(p) for p in written if "latest-" not in p.name))
    sys.stdout.flush()
    return 130 if interrupted else 0
