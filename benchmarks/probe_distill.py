"""Probe for linear_jsd's Triton backend on a GPU: forward, forward+backward and the
GEMM floor at one shape, for a few tiles of the fused backward kernel.

    PYTHONPATH=src python benchmarks/probe_distill.py [--tokens 4096 --hs 4096 --ht 8192 --vocab 128256]

Prints one line per tile configuration (block_n, block_v, block_h, num_warps, num_stages)
of ``_plans.JSD_CUDA_TILES[2]``: forward ms, forward+backward ms, their ratio to the
floor (four cuBLAS GEMMs) and the backward share; the first line is the default.
``--schedule``: the backward kernel's plain against its grouped program order instead.
"""

from __future__ import annotations

import argparse

import torch

import logitless
from logitless.ops.linear_jsd.bench_shapes import DistillShape
from logitless.planning.overrides import override
from logitless.planning.plans import JSD_CUDA_TILES
from logitless_bench import timing
from logitless_bench.distill import gemm_floor_ms, make_inputs

CONFIGS = [None, (128, 64, 64, 8, 3), (64, 128, 64, 4, 3), (128, 128, 64, 8, 2), (128, 128, 32, 8, 4)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hs", type=int, default=4096)
    p.add_argument("--ht", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--schedule", action="store_true",
                   help="instead of tiles: the plain against the grouped program order, 3 interleaved rounds")
    a = p.parse_args()
    dev = torch.device("cuda")
    shape = DistillShape("probe", a.tokens, a.hs, a.ht, a.vocab)
    xs, ws, xt, wt, t = make_inputs(shape, dev, 0)
    floor = gemm_floor_ms(xs, ws, xt, wt, warmup=2, reps=a.reps)
    print(f"shape {shape.label}: floor {floor['floor']:.2f} ms "
          + ", ".join(f"{k} {v:.2f}" for k, v in floor.items() if k != "floor"), flush=True)
    default = JSD_CUDA_TILES[2]
    xg, wg = xs.detach().requires_grad_(), ws.detach().requires_grad_()

    def setup():
        xg.grad = wg.grad = None

    def step():
        logitless.linear_jsd(xg, wg, xt, wt, t).backward()

    if a.schedule:
        times = {False: [], True: []}
        for _ in range(3):
            for group in (False, True):
                with override(kernel_options=dict(group=group)):
                    times[group].append(timing.time_ms(step, device=dev, setup=setup, warmup=2, reps=a.reps))
        for group, ts in times.items():
            ts = sorted(ts)
            order = "grouped" if group else "plain"
            print(f"{order} order: fwd+bwd {ts[1]:.2f} ms ({ts[1] / floor['floor']:.2f}x floor; "
                  f"rounds {', '.join(f'{x:.2f}' for x in ts)})", flush=True)
        return
    for cfg in CONFIGS:
        try:
            with override(tiles=cfg or default):
                with torch.no_grad():
                    fwd = timing.time_ms(lambda: logitless.linear_jsd(xs, ws, xt, wt, t), device=dev, warmup=2,
                                         reps=a.reps)
                fb = timing.time_ms(step, device=dev, setup=setup, warmup=2, reps=a.reps)
            print(f"tiles {cfg or default}{' (default)' if cfg is None else ''}: fwd {fwd:.2f} ms "
                  f"({fwd / floor['floor']:.2f}x floor), fwd+bwd {fb:.2f} ms ({fb / floor['floor']:.2f}x floor), "
                  f"bwd ~{fb - fwd:.2f} ms", flush=True)
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile is a result
            print(f"tiles {cfg}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
        timing.release_memory(dev)


if __name__ == "__main__":
    main()
