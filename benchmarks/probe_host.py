"""Host overhead of one eager forward+backward, measured on the CPU (issue 23 item 3).

The Triton kernels are replaced by no-ops (a monkeypatch of the interpreter's launch,
here in the probe only), so what is timed is the Python and dispatch path of the
library and torch: argument checks, planning, the custom-op machinery, the torch
epilogue ops (on CPU tensors of the call's size) and the torch GEMMs of the backward
(tiny shapes by default, so they cost little). Counts the device work per step: ATen
ops (a TorchDispatchMode that looks inside logitless' custom ops) and Triton launches.
On a GPU each ATen compute op is (about) one CUDA kernel.

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/probe_host.py [--tokens 512,1024,2048] [--json OUT]

Also counts, per forward+backward, the allocations (ATen ``empty*`` ops) and the Python
function calls (``sys.setprofile`` "call" events with no-op kernels: a deterministic
measure of the Python work, which the timings on a shared machine are not), and with
``--tiny`` runs a second table at hidden 16, vocab 128, where the CPU's own GEMMs and
epilogue arithmetic cost nothing, so that host ms is the host path alone.

Also importable: ``count_ops(fn)``, ``count_host(fn)`` and ``no_op_kernels()``
(tests/test_host_overhead.py).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import platform
import sys
import time

if __name__ == "__main__":  # run as a script: the interpreter (imported by a test: the suite decides)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import logitless  # noqa: E402

#: ATen ops that allocate uninitialised memory (no kernel).
ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
#: ATen ops that launch no kernel (views, metadata, allocation of uninitialised memory).
NOT_KERNELS = ALLOCATIONS | {"detach", "alias", "lift_fresh", "_to_copy_noop", "is_same_size", "sym_size",
                             "sym_stride", "sym_numel", "set_", "_local_scalar_dense"}


class OpCounter(TorchDispatchMode):
    """Counts ATen ops by name (inside logitless' custom ops too); views are not counted."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.allocs = collections.Counter()  # ALLOCATIONS by name
        self.paused = False  # inside a kernel launch (the interpreter's own copies)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from logitless.ops.common.glue import EAGER

        impl = EAGER.get(func.name()) if func.namespace == "logitless" else None
        if impl is not None:
            with self:
                return impl(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NOT_KERNELS and not self.paused:
            self.ops[name] += 1
        if name in ALLOCATIONS and not self.paused:
            self.allocs[name] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_op_kernels(launches: collections.Counter | None = None):
    """Triton launches do nothing (counted by kernel name into ``launches``)."""
    from triton.runtime.interpreter import InterpretedFunction

    real = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if launches is not None:
            launches[self.fn.__name__] += 1

    InterpretedFunction.run = run
    try:
        yield launches
    finally:
        InterpretedFunction.run = real


@contextlib.contextmanager
def counted_kernels(launches: collections.Counter, counter: OpCounter | None = None):
    """Triton launches run (compiled or interpreted), counted by kernel name; ``counter``
    pauses during each (the interpreter copies arguments with torch ops)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    reals = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}

    def wrap(real):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup"):
                launches[self.fn.__name__] += 1
            if counter is not None:
                counter.paused = True
            try:
                return real(self, *args, **kwargs)
            finally:
                if counter is not None:
                    counter.paused = False
        return run

    from logitless.triton_lib import fast_launch as F
    from logitless.triton_lib import launch as L

    real_run_kernel = L.run_kernel

    def run_kernel(kernel, grid, *args, **kwargs):  # launches of cached compiled kernels (GPU)
        fast = F.LAUNCHES["fast"]
        out = real_run_kernel(kernel, grid, *args, **kwargs)
        if F.LAUNCHES["fast"] != fast:
            launches[kernel.fn.__name__] += 1
        return out

    for cls, real in reals.items():
        cls.run = wrap(real)
    L.run_kernel = run_kernel
    try:
        yield launches
    finally:
        for cls, real in reals.items():
            cls.run = real
        L.run_kernel = real_run_kernel


def count_ops(step, run_kernels: bool = False) -> tuple[collections.Counter, collections.Counter]:
    """(ATen ops, Triton launches) of one call of ``step``: kernels as no-ops, or run
    (``run_kernels``: on a GPU, or where the results matter)."""
    launches = collections.Counter()
    counter = OpCounter()
    kernels = counted_kernels(launches, counter) if run_kernels else no_op_kernels(launches)
    with kernels, counter:
        step()
    return counter.ops, launches


#: Frames that only the CPU run has: numpy's ``errstate`` (``_ufunc_config.py``), which
#: ``triton_lib.fast_launch.run_kernel`` enters around each interpreted launch (a GPU
#: launch has none). Not counted, so that the count is the GPU path's.
INTERPRETER_ONLY = "_ufunc_config.py"


def python_calls(step) -> int:
    """Python function calls ("call" profile events) in one call of ``step``, kernels as
    no-ops (deterministic: the same code path gives the same count), numpy's errstate
    frames of interpreted launches left out (``INTERPRETER_ONLY``)."""
    calls = [0]

    def prof(frame, event, arg):
        if event == "call" and not frame.f_code.co_filename.endswith(INTERPRETER_ONLY):
            calls[0] += 1

    with no_op_kernels():
        sys.setprofile(prof)
        try:
            step()
        finally:
            sys.setprofile(None)
    return calls[0] - 1  # (the profiler sees step() itself)


def count_host(step, run_kernels: bool = False) -> dict:
    """Per call of ``step``: ATen compute ops, allocations, Triton launches (each a count
    and by name) and Python function calls (``python_calls``)."""
    launches = collections.Counter()
    counter = OpCounter()
    kernels = counted_kernels(launches, counter) if run_kernels else no_op_kernels(launches)
    with kernels, counter:
        step()
    return dict(aten_ops=sum(counter.ops.values()), allocations=sum(counter.allocs.values()),
                triton_launches=sum(launches.values()), python_calls=python_calls(step),
                ops=dict(counter.ops.most_common()), allocs=dict(counter.allocs), launches=dict(launches))


def make_steps(n: int, h: int = 64, v: int = 1024, dtype=torch.bfloat16):
    """name -> a forward+backward step of each op at n tokens (CPU tensors, Triton backend)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(v, h, generator=g) * h**-0.5).to(dtype).requires_grad_(True)
    xt = torch.randn(n, h, generator=g).to(dtype)
    wt = (torch.randn(v, h, generator=g) * h**-0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)

    def lce():
        x.grad = w.grad = None
        logitless.linear_cross_entropy(x, w, t, backend="triton").backward()

    def lce_smooth():
        x.grad = w.grad = None
        logitless.linear_cross_entropy(x, w, t, backend="triton", label_smoothing=0.1, z_loss=1e-4).backward()

    def log_probs():
        x.grad = w.grad = None
        logitless.linear_log_probs(x, w, t, backend="triton").sum().backward()

    def linear_jsd():
        x.grad = w.grad = None
        logitless.linear_jsd(x, w, xt, wt, t, backend="triton").backward()

    z = torch.randn(n, v, generator=g).to(dtype).requires_grad_(True)  # logits (the ops on given logits)
    zt = torch.randn(n, v, generator=g).to(dtype)

    def cross_entropy():
        z.grad = None
        logitless.cross_entropy(z, t, backend="triton").backward()

    def jsd():
        z.grad = None
        logitless.jsd(z, zt, t, backend="triton").backward()

    return dict(linear_cross_entropy=lce, lce_smoothing_zloss=lce_smooth, linear_log_probs=log_probs,
                linear_jsd=linear_jsd, cross_entropy=cross_entropy, jsd=jsd)


def host_ms(step, reps: int, stat: str = "median") -> float:
    """Median (or "min") CPU milliseconds (this thread's CPU time: robust to a shared,
    busy machine) per call of ``step`` with no-op kernels."""
    with no_op_kernels():
        for _ in range(10):
            step()
        times = []
        gc.collect()
        gc.disable()
        try:
            for _ in range(reps):
                t0 = time.thread_time()
                step()
                times.append((time.thread_time() - t0) * 1e3)
        finally:
            gc.enable()
    return min(times) if stat == "min" else sorted(times)[len(times) // 2]


def custom_op_cost(reps: int = 2000) -> dict:
    """Microseconds per forward+backward of a trivial torch.library custom op (with
    register_autograd, as the library's) against a plain autograd.Function with the same
    signature: the fixed cost of the custom-op layer in eager mode."""
    lib_name = "logitless_probe_host"

    @torch.library.custom_op(f"{lib_name}::fwd", mutates_args=())
    def fwd(x: torch.Tensor, w: torch.Tensor, a: int, b: float, c: str, d: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return x.clone(), x.new_empty(0)

    @fwd.register_fake
    def _(x, w, a, b, c, d):
        return torch.empty_like(x), x.new_empty(0)

    @torch.library.custom_op(f"{lib_name}::bwd", mutates_args=())
    def bwd(g: torch.Tensor, x: torch.Tensor, a: int, b: float, c: str, d: bool) -> torch.Tensor:
        return g.clone()

    @bwd.register_fake
    def _(g, x, a, b, c, d):
        return torch.empty_like(g)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.args = inputs[2:]

    def backward(ctx, g, _):
        (x,) = ctx.saved_tensors
        return bwd(g, x, *ctx.args), None, None, None, None, None

    fwd.register_autograd(backward, setup_context=setup)

    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, a, b, c, d):
            ctx.save_for_backward(x)
            return x.clone(), x.new_empty(0)

        @staticmethod
        def backward(ctx, g, _):
            return g.clone(), None, None, None, None, None

    x = torch.randn(4, requires_grad=True)
    w = torch.randn(4)

    def time_it(f):
        for _ in range(50):
            f(x, w, 1, 0.5, "s", True)[0].sum().backward()
        t0 = time.thread_time()
        for _ in range(reps):
            f(x, w, 1, 0.5, "s", True)[0].sum().backward()
        return (time.thread_time() - t0) / reps * 1e6

    def base(x, w, a, b, c, d):  # the rest of the step: sum, backward of sum
        return x * 1.0, None

    out = {"custom_op_us": time_it(fwd), "autograd_function_us": time_it(Plain.apply), "baseline_us": time_it(base)}
    return {k: round(v, 1) for k, v in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,1024,2048")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="also hidden 16, vocab 128: the host path alone")
    ap.add_argument("--ops", default="", help="comma-separated subset of make_steps' names: linear_cross_entropy, "
                    "lce_smoothing_zloss, linear_log_probs, linear_jsd, cross_entropy, jsd (default: all)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # host work is single-threaded; the machine may be shared
    meta = dict(device="cpu (kernels as no-ops)", torch=torch.__version__, python=platform.python_version(),
                date=time.strftime("%Y-%m-%dT%H:%M:%S"), command=" ".join(sys.argv))
    print(meta, flush=True)
    rows = []
    sizes = [(args.hidden, args.vocab)] + ([(16, 128)] if args.tiny else [])
    wanted = set(filter(None, args.ops.split(",")))
    for hidden, vocab in sizes:
        for n in (int(t) for t in args.tokens.split(",")):
            for name, step in make_steps(n, hidden, vocab).items():
                if wanted and name not in wanted:
                    continue
                counts = count_host(step)
                ms = host_ms(step, args.reps)
                ms_min = host_ms(step, args.reps, "min")
                rows.append(dict(op=name, tokens=n, hidden=hidden, vocab=vocab, host_ms=round(ms, 3),
                                 host_ms_min=round(ms_min, 3), **counts))
    cost = custom_op_cost()
    print(f"\n{'op':<22} {'N x H x V':>14} {'host ms (med/min)':>18} {'aten ops':>9} {'allocs':>7} {'triton':>7}"
          f" {'py calls':>9}")
    for r in rows:
        print(f"{r['op']:<22} {r['tokens']:>5} x{r['hidden']:>3} x{r['vocab']:>5} {r['host_ms']:>8.3f} /"
              f"{r['host_ms_min']:>7.3f} {r['aten_ops']:>9} {r['allocations']:>7} {r['triton_launches']:>7}"
              f" {r['python_calls']:>9}")
    print(f"\ncustom-op layer (trivial op, f+b): {cost}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows, custom_op_layer=cost), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
