"""Opt-in tuner of the Triton tiles: ``python -m logitless.tune`` or ``logitless.tune.tune()``.

Measures a small candidate space of tiles (block_n, block_v, block_h, num_warps,
num_stages) once on this GPU, for the shape classes of the shapes given, by timing
the public op's forward + backward at the default budget, and writes the fastest per
(dtype class, shape class) to this machine's cache (``tuned.cache_path``: keyed by GPU
name, torch and triton versions). Later plans read it (``tuned.tiles_for``). Nothing
is ever tuned implicitly: the library only reads files.

A candidate that fails (e.g. out of shared memory) is skipped. The cache is merged:
classes not measured keep their previous entries.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from logitless.planning import tuned as _tuned
from logitless.planning.overrides import override

#: Candidates by itemsize. 16-bit: the sweep of docs/design.md "Forward kernel" around the
#: shipped 128x256x64/8/3; 32-bit: TF32 tiles with a 32-wide K step.
CANDIDATES = {
    2: [(128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3),
        (64, 256, 64, 4, 3), (128, 256, 32, 8, 4)],
    4: [(128, 128, 32, 8, 3), (128, 128, 32, 8, 2), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3)],
}
#: fp32 at matmul precision "high" on operands rounded to TF32 beforehand (TMA, 4 stages
#: of 32-wide steps: ``tiles.CUDA_TILES_TF32``); tuned under their own key
#: (``tuned.PREROUNDED_CLASS``), the in-kernel path under "32-bit".
CANDIDATES_PREROUNDED = [(128, 128, 32, 8, 4), (128, 128, 32, 8, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4)]


def fp32_paths() -> list[tuple[bool, dict]]:
    """(prerounded, overrides) of the fp32 paths to tune at torch's current matmul
    precision: at "high"/"medium" both the pre-rounded and the in-kernel rounding path,
    each forced (``override(tf32_preround=...)``) so that the tiles timed are the path's
    and land under its own key; at "highest" (3xTF32) the one path."""
    if torch.get_float32_matmul_precision() == "highest":
        return [(False, {})]
    return [(True, dict(tf32_preround=True)), (False, dict(tf32_preround=False))]
#: One representative shape per class when none are given: (tokens, hidden, vocab).
DEFAULT_SHAPES = [(4096, 4096, 128256), (8192, 1152, 131072), (512, 4096, 128256), (16384, 4096, 128256)]


def _time_ms(fn, reps: int, device) -> float:
    """Median ms of ``fn()`` over ``reps`` calls after one warm-up (CUDA events)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(shape, tiles, dtype=torch.bfloat16, device=None, reps: int = 5, budget=None, **overrides) -> float:
    """Median ms of loss + backward with ``tiles`` (and ``overrides``, e.g. an fp32
    path: ``tf32_preround=True``) forced (raises if they do not run)."""
    import logitless

    device = torch.device(device or "cuda")
    n, h, v = shape
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, h, device=device, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h, device=device, generator=g) * h**-0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=device, generator=g)
    backend = "triton"

    def step():
        x.grad = w.grad = None
        with override(tiles=tiles, **overrides):
            loss = logitless.linear_cross_entropy(x, w, t, memory_budget=budget, backend=backend)
        loss.backward()

    return _time_ms(step, reps, device)


def tune(shapes=None, dtypes=(torch.bfloat16,), candidates=None, device=None, reps: int = 5,
         write: bool = True, verbose: bool = True) -> dict:
    """Times every candidate on each shape; returns {key: {"tiles", "ms", "shape", "all"}}
    and (``write``) merges it into this machine's cache file."""
    device = torch.device(device or "cuda")
    shapes = list(shapes or DEFAULT_SHAPES)
    results: dict = {}
    for dtype in dtypes:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        paths = fp32_paths() if itemsize == 4 else [(False, {})]
        for shape, (prerounded, forced) in ((s, p) for s in shapes for p in paths):
            key = _tuned.config_key(itemsize, *shape, prerounded=prerounded)
            if key in results:
                continue  # one shape per class
            timings = {}
            for tiles in (candidates or (CANDIDATES_PREROUNDED if prerounded else CANDIDATES[itemsize])):
                try:
                    timings[tiles] = measure(shape, tiles, dtype, device, reps, **forced)
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: skip it
                    if verbose:
                        print(f"  {key} {shape} {tiles}: skipped ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
                    continue
                if verbose:
                    print(f"  {key} {shape} {tiles}: {timings[tiles]:.3f} ms", flush=True)
            if not timings:
                continue
            best = min(timings, key=timings.get)
            results[key] = {"tiles": list(best), "ms": timings[best], "shape": list(shape),
                            "all": {"x".join(map(str, k)): ms for k, ms in timings.items()}}
            if verbose:
                print(f"{key}: best {best} ({timings[best]:.3f} ms)", flush=True)
    if write and results:
        path = _tuned.cache_path(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            old = json.loads(path.read_text()).get("configs", {})
        except (OSError, ValueError):
            old = {}
        data = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "configs": {**old, **results}}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
        _tuned.clear()
        if verbose:
            print(f"wrote {path}", flush=True)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m logitless.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help="TOKENS:HIDDEN:VOCAB[,...] (default: one per shape class)")
    p.add_argument("--dtypes", default="bfloat16", help="bfloat16,float16,float32 (default %(default)s)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")] if args.shapes else None
    dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("python -m logitless.tune needs a CUDA GPU")
    tune(shapes, dtypes, reps=args.reps, write=not args.dry_run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
