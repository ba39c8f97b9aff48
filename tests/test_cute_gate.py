"""The CuTe DSL gate on the CPU: an optional accelerator never breaks a call.

A FAKE ``cutlass`` package (and ``cuda.bindings.driver``, and package metadata naming its
version) is written to a temporary folder put first on sys.path, in each way a real
install goes wrong: absent, importable but lacking what the kernel uses (an API that
moved, as 4.8.1 did under the 4.2.1 code), raising on import, too old or too new by its
metadata; and a kernel module whose compile or first launch raises. In every case
``forward_plan`` / ``cute_lib.launch.ready`` give the Triton path, the calls of
linear_cross_entropy and linear_log_probs equal the Triton path's bitwise, and exactly
one ``CuteFallbackWarning`` names the cause. The planner sees an H100 through
its device facts (``tests.planning_seams.on_device``: compute capability 9.0, 132 SMs,
50 MiB of L2, the rest this machine's own); the Triton kernels run on the CPU
interpreter (tests/conftest.py), or on the GPU where there is one (the fake kernel module
then gets CUDA addresses; it never launches anything)."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
import warnings

import pytest
import torch

import logitless
from logitless.cute_lib import launch as cute_launch
from logitless.planning import cute, device
from logitless.planning.overrides import override
from tests.conftest import DEVICE
from tests.planning_seams import on_device

BACKEND = "triton"  # (the Triton interpreter on a CPU: tests/conftest.py)
ROOTS = ("cutlass", "cuda")


def _write(root, rel, text=""):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def fake_dsl(tmp_path, monkeypatch):
    """Returns make(version=..., cute_init=...): writes a fake DSL into tmp_path (first on
    sys.path). Real cutlass/cuda modules are hidden for the test and restored after; the
    gate's per-process caches start empty."""
    saved = {k: m for k, m in sys.modules.items() if k.split(".")[0] in ROOTS}
    for k in saved:
        del sys.modules[k]
    # the real kernel module (a GPU machine with the DSL imported it) must not serve the fakes
    monkeypatch.delitem(sys.modules, "logitless.cute_lib.forward_stats", raising=False)
    monkeypatch.delattr(logitless.cute_lib, "forward_stats", raising=False)
    hopper = dataclasses.replace(device.facts(DEVICE), capability=(9, 0), sms=132, l2_bytes=50 * 2**20)
    monkeypatch.setattr(cute, "_WARNED", set())
    monkeypatch.setattr(cute_launch, "_STATE", {})
    monkeypatch.delenv(cute.ENV, raising=False)
    cute.dsl_problem.cache_clear()

    def make(version="4.8.1", cute_init=""):
        _write(tmp_path, "cutlass/__init__.py", f"__version__ = {version!r}\n")
        _write(tmp_path, "cutlass/cute/__init__.py", cute_init)
        for sub in ("pipeline/__init__.py", "utils/__init__.py", "utils/hopper_helpers.py"):
            _write(tmp_path, f"cutlass/{sub}")
        _write(tmp_path, "cuda/__init__.py")
        _write(tmp_path, "cuda/bindings/__init__.py")
        _write(tmp_path, "cuda/bindings/driver.py", "class CUstream:\n    pass\n")
        if version is not None:
            _write(tmp_path, f"nvidia_cutlass_dsl-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: nvidia-cutlass-dsl\nVersion: {version}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()

    with on_device(hopper):
        yield make
    for k in [k for k in sys.modules if k.split(".")[0] in ROOTS]:
        del sys.modules[k]
    sys.modules.update(saved)
    cute.dsl_problem.cache_clear()


def inputs(n=5, h=24, v=77):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, h, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, h, generator=g) / h ** 0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=g)
    t[1] = -100
    return x.to(DEVICE), w.to(DEVICE), t.to(DEVICE)


def calls(x, w, t):
    """linear_cross_entropy (with smoothing) and linear_log_probs (with entropy) outputs."""
    loss = logitless.linear_cross_entropy(x, w, t, label_smoothing=0.1, backend=BACKEND)
    logp = logitless.linear_log_probs(x, w, t.clamp(min=0), entropy=True, backend=BACKEND)
    return [loss, *(logp if isinstance(logp, tuple) else (logp,))]


def fallback_warnings(record):
    return [r for r in record if issubclass(r.category, cute.CuteFallbackWarning)]


def run_twice_and_compare(x, w, t):
    """Calls twice through the gate (CuTe asked for, no availability override), then with
    CuTe off; returns the fallback warnings of the gated calls."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with override(cute=True):
            first = calls(x, w, t)
            second = calls(x, w, t)
    with override(cute=False):
        triton = calls(x, w, t)
    for a, b, c in zip(first, second, triton):
        assert torch.equal(a, c) and torch.equal(b, c)
    return fallback_warnings(record)


BROKEN = {
    "lacks attributes": dict(cute_init="", version="4.8.1"),  # cutlass.cute imports, has nothing
    "raises on import": dict(cute_init="raise ImportError('libcute_dsl_runtime.so: cannot open shared object')"),
    "too old": dict(version="4.1.0"),
    "too new": dict(version="5.0.0"),
    "version not understood": dict(version="dev"),
}
CAUSE = {
    "lacks attributes": "failed to import with nvidia-cutlass-dsl 4.8.1: AttributeError",  # cutlass.BFloat16
    "raises on import": "import cutlass.cute failed: ImportError: libcute_dsl_runtime.so",
    "too old": "nvidia-cutlass-dsl 4.1.0 is too old",
    "too new": "nvidia-cutlass-dsl 5.0.0 is newer than the verified releases",
    "version not understood": "version 'dev' not understood",
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_dsl_means_triton_and_one_warning(fake_dsl, case):
    fake_dsl(**BROKEN[case])
    x, w, t = inputs()
    got = run_twice_and_compare(x, w, t)
    assert len(got) == 1, [str(r.message) for r in got]
    msg = str(got[0].message)
    assert CAUSE[case] in msg and "pip install 'logitless[hopper]'" in msg and "Triton" in msg, msg


def test_an_absent_dsl_means_triton_and_one_warning(fake_dsl, monkeypatch):
    monkeypatch.setattr(cute, "_present", lambda name: False)
    x, w, t = inputs()
    got = run_twice_and_compare(x, w, t)
    assert len(got) == 1 and "nvidia-cutlass-dsl is not installed" in str(got[0].message)


def _forward_plan(x, w, **options):
    """``cute.forward_plan`` of x and W, their layout read as a backend reads it."""
    layout = (x.dtype == w.dtype, x.stride(), w.stride(), x.data_ptr() % 16, w.data_ptr() % 16)
    (n, h), v = x.shape, w.shape[0]
    return cute.forward_plan(x.device, x.dtype, n, v, h, cute.layout_fits(layout, h, x.dtype), **options)


def test_the_planner_checks_the_dsl_only_where_it_would_take_the_kernel(fake_dsl):
    fake_dsl(version="4.1.0")
    x, w, t = inputs()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert _forward_plan(x, w) is None  # triton_faster at this size: no DSL check
        assert _forward_plan(x, w, bias=True) is None  # unsupported option
        with override(cute=True), on_device(dataclasses.replace(device.facts(x.device), cute_available=True)):
            assert _forward_plan(x, w) is not None  # a device described as having the DSL: no check
            shifted = x.new_empty(x.numel() + 1)[1:].view(x.shape)  # 2 bytes past an aligned address
            shifted.copy_(x)
            assert _forward_plan(shifted, w) is None  # x not 16-byte aligned
        with override(cute=True), on_device(dataclasses.replace(device.facts(x.device), cute_available=False)):
            assert _forward_plan(x, w) is None  # described as lacking it: no check, no warning
        with override(cute=True):
            assert _forward_plan(x, w) is None
    assert len(fallback_warnings(record)) == 1


class _KernelModule(types.ModuleType):
    """A stand-in for ``cute_lib.forward_stats``: compile or launch raises."""

    def __init__(self, fail):
        super().__init__("logitless.cute_lib.forward_stats")
        self.fail, self.compiled, self.launched = fail, [], []

    def compile_forward(self, *key):
        self.compiled.append(key)
        if self.fail == "compile":
            raise RuntimeError("DSLRuntimeError: cute.compile lowering failed")
        return object()

    def launch(self, *args):
        self.launched.append(args)
        if self.fail == "launch":
            raise RuntimeError("CUDA_ERROR_UNSUPPORTED_PTX_VERSION")


@pytest.mark.parametrize("fail", ["compile", "launch"])
def test_a_failing_compile_or_first_launch_means_triton_and_one_warning(fake_dsl, monkeypatch, fail):
    fake_dsl()  # a supported, importable DSL: the plan reaches cute_lib.launch.ready
    kernel = _KernelModule(fail)
    monkeypatch.setitem(sys.modules, "logitless.cute_lib.forward_stats", kernel)
    monkeypatch.setattr(logitless.cute_lib, "forward_stats", kernel, raising=False)
    x, w, t = inputs()
    got = run_twice_and_compare(x, w, t)
    assert len(got) == 1, [str(r.message) for r in got]
    msg = str(got[0].message)
    want = "CUDA_ERROR_UNSUPPORTED_PTX_VERSION" if fail == "launch" else "cute.compile lowering failed"
    assert f"failed to {fail} with nvidia-cutlass-dsl 4.8.1" in msg and want in msg, msg
    # decided once per configuration: the second calls did not try again
    keys = set(kernel.compiled)
    assert {k[2:4] for k in keys} == {(True, False), (False, True)}  # lce with smoothing, log_probs with entropy
    assert len(kernel.launched) == (2 if fail == "launch" else 0)


def test_ready_passes_a_working_configuration_once(fake_dsl, monkeypatch):
    fake_dsl()
    kernel = _KernelModule(None)
    monkeypatch.setitem(sys.modules, "logitless.cute_lib.forward_stats", kernel)
    monkeypatch.setattr(logitless.cute_lib, "forward_stats", kernel, raising=False)
    x, w, _ = inputs()
    plan = cute.CutePlan(splits=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert cute_launch.ready(plan, x, w, keep_block=128) is plan
        assert cute_launch.ready(plan, x, w, keep_block=128) is plan
    assert fallback_warnings(record) == []
    assert len(kernel.launched) == 1  # the first launch: one row, one vocabulary row
    args = kernel.launched[0]
    assert args[6:9] == (1, 1, 1)  # n, v, splits
    assert args[10] == "bfloat16" and args[11][2:] == (8, 8)  # 8 kept columns, row stride 8


@pytest.mark.parametrize("version, problem", [
    ("4.2.1", None), ("4.7.1", None), ("4.8.1", None), ("4.9.0.dev1", None), (None, None),
    ("4.2.0", "too old"), ("3.9", "too old"), ("5.0.0", "newer"), ("5.0.0rc1", "newer"), ("x", "not understood"),
])
def test_version_range(version, problem):
    got = cute.version_problem(version)
    assert (got is None) if problem is None else (problem in got)
