"""Shared test tools: the accuracy criterion and an allocation recorder."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Extra allowance over torch's own error, relative to the largest reference value.
TOL = {torch.float32: 2e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.detach().double().cpu() - ref.detach().double().cpu()).abs().max().item() if ref.numel() else 0.0


def assert_close_to_ref(name, ours, torch_same_dtype, ref, dtype):
    """|ours - ref| <= |torch in the same dtype - ref| + tol * max(max|ref|, 0.01); NaN never passes."""
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    assert not torch.isnan(ours).any(), f"{name}: NaN"
    e_ours = max_err(ours, ref)
    e_torch = max_err(torch_same_dtype, ref) if torch_same_dtype is not None else 0.0
    if e_torch != e_torch:  # torch itself gave NaN: hold ours to the tolerance alone
        e_torch = 0.0
    scale = ref.detach().double().abs().max().item()
    bound = e_torch + TOL[dtype] * max(scale, 1e-2)
    assert e_ours <= bound, f"{name}: error {e_ours:.3g} > bound {bound:.3g} (torch {e_torch:.3g})"


def run_custom_op(mode, func, args, kwargs):
    """For a dispatch mode: the result of ``func``, running a logitless custom op's Python
    implementation with ``mode`` active (so that the mode sees the aten ops inside it;
    otherwise each custom op is one opaque call), any other op as it is."""
    from logitless.ops.common.glue import EAGER

    impl = EAGER.get(func.name())
    if impl is None:
        return func(*args, **(kwargs or {}))
    with mode:
        return impl(*args, **(kwargs or {}))


class AllocationRecorder(TorchDispatchMode):
    """Records the largest tensor that any op creates while active (``largest`` elements,
    by ``largest_op``) and, with ``threshold``, the names of the ops that create a tensor
    of at least ``threshold`` elements (``big``). Looks inside logitless' custom ops.
    Views, out= and in-place ops allocate nothing and are not recorded."""

    def __init__(self, threshold=None):
        super().__init__()
        self.largest = 0
        self.largest_op = None
        self.threshold = threshold
        self.big = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "logitless":
            return run_custom_op(self, func, args, kwargs)
        out = func(*args, **(kwargs or {}))
        # Views, out= and in-place ops (copy_, set_: Triton's interpreter uses them on
        # kernel arguments) write into existing storage: they allocate nothing.
        if func.is_view or func.overloadpacket.__name__.endswith("_") or "out" in (kwargs or {}):
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            if t.numel() > self.largest:
                self.largest, self.largest_op = t.numel(), str(func)
            if self.threshold is not None and t.numel() >= self.threshold:
                self.big.append(str(func))
        return out


def load_benchmark(name: str):
    """The module benchmarks/<name>.py (the probes are scripts, not a package)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_gpu(args):
    """A transformers TrainingArguments using one GPU, as ``CUDA_VISIBLE_DEVICES=0`` would, on a
    machine where the process sees several: TRL's trainers refuse the ``nn.DataParallel`` that
    Trainer otherwise wraps the model in (their users launch one process per GPU)."""
    if args.n_gpu > 1:
        args._n_gpu = 1
    return args


def fake_triton_launches(monkeypatch, kernel, stream: int = 77):
    """Triton's ``JITFunction.run`` and the CUDA stream faked, so ``fast_launch.run_kernel``'s two
    paths run on a CPU: returns (a JITFunction of ``kernel``, the launches through the cached
    compiled kernel (each its launcher's arguments), the grids launched through
    ``kernel[grid]``). The fake compiled kernel's launch metadata is ("meta", grid, stream)."""
    from triton.runtime.jit import JITFunction

    from logitless.triton_lib import fast_launch

    jit = JITFunction(getattr(kernel, "fn", kernel))
    launched, slow = [], []

    class Compiled:
        packed_metadata, function = "packed", "function"

        def launch_metadata(self, grid, stream, *args):
            return ("meta", grid, stream)

        def run(self, *args):
            launched.append(args)

    compiled = Compiled()

    def jit_run(self, *args, grid, warmup, **kwargs):
        slow.append(grid)
        return compiled

    monkeypatch.setattr(JITFunction, "run", jit_run)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: stream, raising=False)
    monkeypatch.setattr(fast_launch, "ENABLED", True)
    monkeypatch.setattr(fast_launch, "_FAST", {})
    return jit, launched, slow


def eager_fast_path(on: bool):
    """A context in which the public ops' eager fast path is as shipped (``on``) or off
    (every call through the torch.library custom ops, as under torch.compile): a test-only
    patch of ``ops.common.glue.eager_fast_path_ok``."""
    import contextlib
    from unittest import mock

    from logitless.ops.common import glue

    if on:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(glue, "eager_fast_path_ok", lambda tensors: False))
    return stack


class PassThrough(TorchDispatchMode):
    """Any dispatch mode turns the eager fast path off: the custom ops run."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


#: A forward and two backwards (retain_graph): the plan counts after each, per path. The eager
#: path carries the forward's Config to its backward; on the custom-op path the backward op
#: of an op with ``glue.CustomOp(replan=)`` plans it again from the same inputs, one call per
#: backward op run, each the forward's decision (``same_decision``).
ONE_PLAN = {"eager": (1, 1, 1), "custom_op": (1, 2, 3)}


def same_decision(calls: dict, key) -> bool:
    """Whether every Config ``calls[key]``'s backend planned is the first one (``count_plans``)."""
    decided = calls["decided"][key]
    return bool(decided) and all(c == decided[0] for c in decided)


def count_plans(monkeypatch, backends: dict, planners, *, record=None, outermost: bool = False) -> dict:
    """Counts plan decisions (the one-plan tests). ``backends``: key -> a backend object
    whose ``plan`` is wrapped: ``calls[key]`` gets one entry per call (``kwargs[record]``, or
    the Config when ``record`` is None; with ``outermost``, only calls not made inside another
    backend's ``plan``), ``calls["configs"]`` every Config. ``planners``: (dotted module,
    dotted attribute) of the planners a ``plan`` consults; ``calls["outside"]`` names those
    run outside any ``plan`` (must stay empty)."""
    import importlib

    calls: dict = {"outside": [], "configs": [], "decided": {}}
    depth = [0]
    for key, backend in backends.items():
        entries = calls[key] = []
        decided = calls["decided"][key] = []

        def plan(*args, _real=backend.plan, _entries=entries, _decided=decided, **kwargs):
            nested = depth[0] > 0
            depth[0] += 1
            try:
                config = _real(*args, **kwargs)
            finally:
                depth[0] -= 1
            if not (outermost and nested):
                _entries.append(config if record is None else kwargs.get(record))
                _decided.append(config)
            calls["configs"].append(config)
            return config

        monkeypatch.setattr(backend, "plan", plan)
    for module, attr in planners:
        owner = importlib.import_module(module)
        *path, leaf = attr.split(".")
        for part in path:
            owner = getattr(owner, part)

        real = getattr(owner, leaf)

        def planner(*args, _real=real, _name=f"{module}.{attr}", **kwargs):
            if not depth[0]:
                calls["outside"].append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, leaf, planner)
    return calls
