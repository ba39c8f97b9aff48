"""Probe of the planner: each strategy measured beside the cost model's prediction.

    PYTHONPATH=src python3 benchmarks/probe_strategies.py [--out DIR] [--quick]

For a few shapes and budgets, times forward+backward (bf16, mean reduction) under
    model   the cost model's choice (what the library does),
    greedy  the previous rule (keep as many columns as fit; override(model_plans=False)),
    keep/partial  the model restricted to keep/partial plans,
    gif     gradient-in-forward forced with the model's best token chunk at that budget,
and prints predicted vs measured ms, so that the model's constants can be refitted
and "never slower when the budget grows" checked on the measured column. JSON to
--out (probe-strategies-<device>.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import logitless  # noqa: E402
from logitless.planning import cost_model as M
from logitless.planning import plans as _plans
from logitless.planning.overrides import override
from logitless_bench import timing  # noqa: E402

SHAPES = [  # name, tokens, hidden, vocab, budgets (MiB; "L" = the bf16 logits)
    ("llama3.1-8b", 4096, 4096, 128256, [256, 512, 1024, "L"]),
    ("llama3.2-1b-32k", 32768, 2048, 128256, [256, 1024, 2048, 4096, "L"]),
    ("gpt2", 8192, 768, 50257, [256, 512, "L"]),
    ("llama3.1-8b-512", 512, 4096, 128256, [64, "L"]),
]


SMOKE = [("tiny", 64, 32, 1000, [0.0625, "L"])]  # --smoke: the CPU interpreter (TRITON_INTERPRET=1)


def run(quick: bool, smoke: bool = False):
    dev = torch.device("cpu" if smoke else "cuda")
    cuda = dev.type == "cuda"
    model = M.device_model(dev)
    out = []
    shapes = SMOKE if smoke else (SHAPES[:1] if quick else SHAPES)
    for name, n, h, v, budgets in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, h, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
        w = (torch.randn(v, h, device=dev, dtype=torch.bfloat16, generator=g) * h**-0.5).requires_grad_()
        t = torch.randint(0, v, (n,), device=dev, generator=g)
        gemm = timing.gemm_ms(x.detach(), w.detach())
        print(f"== {name} ({n}, {h}, {v}): 1 GEMM {gemm:.3f} ms (model {M.gemm_s(model, n, v, h, 2) * 1e3:.3f})",
              flush=True)
        for spec in budgets:
            budget = n * v * 2 if spec == "L" else int(spec * 2**20)
            preds = M.predict_all(n, h, v, 2, budget, device_model=model)
            choice = _plans.lce_strategy(n, v, h, 2, budget, dev)
            modes = [("model", None, True), ("greedy", "partial", False), ("keep/partial", "partial", True)]
            if preds.get("grad_in_forward") is not None:
                modes.append(("gif", ("grad_in_forward", preds["grad_in_forward"].token_chunk), True))
            for mode, force, model_plans in modes:
                strategy = ("partial", 0) if force == "partial" else force

                def step():
                    x.grad = w.grad = None  # noqa: F821 (deleted below, after use)
                    with override(model_plans=model_plans, strategy=strategy):
                        loss = logitless.linear_cross_entropy(x, w, t, memory_budget=budget, backend="triton")  # noqa: F821 (deleted below, after use)
                        loss.backward()

                try:
                    ms, spread = timing.time_ms_spread(step, device=dev, warmup=2 if cuda else 0,
                                                       reps=(5 if quick else 8) if cuda else 1)
                    _, extra = timing.peak_extra_bytes(step, device=dev, exclude_bytes=2 * (x.numel() + w.numel()))
                    peak = extra / 2**20 if extra is not None else 0.0
                    err = None
                except Exception as exc:  # noqa: BLE001
                    ms = spread = peak = None
                    err = f"{type(exc).__name__}: {str(exc)[:200]}"
                finally:
                    x.grad = w.grad = None
                pred = {"model": choice, "gif": preds.get("grad_in_forward")}.get(mode)
                if mode == "keep/partial":
                    pred = min((c for c in (preds.get("keep"), preds.get("partial")) if c), key=lambda c: c.time_s,
                               default=None)
                row = {"shape": name, "tokens": n, "hidden": h, "vocab": v, "budget_mib": budget / 2**20,
                       "mode": mode, "ms": ms, "spread": spread, "per_3gemm": ms / (3 * gemm) if ms else None,
                       "peak_extra_mib": peak, "gemm_ms": gemm, "error": err,
                       "pred_ms": pred.ms if pred else None, "pred_plan": pred.label if pred else None}
                out.append(row)
                print(f"  budget {budget / 2**20:8.0f} MiB {mode:13} "
                      + (f"{ms:8.3f} ms ({ms / (3 * gemm):.2f}x 3 GEMMs, +{peak:.0f} MiB)" if ms else f"FAILED {err}")
                      + (f"  predicted {pred.ms:8.3f} ms {pred.label}" if pred else ""), flush=True)
        del x, w, t
        timing.release_memory(dev)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU interpreter (checks the script)")
    args = p.parse_args()
    if args.smoke:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    t0 = time.time()
    rows = run(args.quick, args.smoke)
    tag = "cpu" if args.smoke else M.device_class(torch.cuda.get_device_name())
    path = Path(args.out) / f"probe-strategies-{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": "cpu" if args.smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "seconds": time.time() - t0}
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {path} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
