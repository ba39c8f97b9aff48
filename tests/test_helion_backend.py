"""backend="helion" of linear_cross_entropy, linear_log_probs and linear_jsd (docs/helion.md),
on the CPU under HELION_INTERPRET=1 (Helion's eager ref mode, every ``hl.tile`` loop split
into tiles of 8: several vocabulary, row and hidden tiles, the last one partial), and with
the compiled kernels on CUDA (blocks of 16: tests/_helion_tiles.py).

The public functions against the float64 references through the contract suite's checks
(tests/test_op_contract.py, tests/op_specs.py): values and gradients for every option of
the three ops, fp32 and bf16, odd sizes (V prime, H not a multiple of 16, one token, 3-D,
tiny), empty and all-ignored inputs, ``torch.library.opcheck`` (the fakes agree with what
the Helion backend returns); vocabulary parallelism (two gloo ranks); the Helion kernels
really run (launches counted); torch.compile(fullgraph=True); without a usable Helion, one warning naming the cause and
the torch backend's numbers; bad input. Skipped with a reason when helion >= 1.5 is not
importable (the fallback tests run without it).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("HELION_INTERPRET", "1")  # read when the kernels are decorated

import logitless  # noqa: E402
from logitless.helion_lib import runtime  # noqa: E402
from logitless.ops.common import helion_choice  # noqa: E402
from logitless.ops.common import validate as dispatch  # noqa: E402
from tests._helion_tiles import interpret_block_size  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402
from tests.op_specs import SPECS  # noqa: E402
from tests.test_op_contract import check_against_reference  # noqa: E402

HELION = runtime.available()
needs_helion = pytest.mark.skipif(not HELION, reason="helion >= 1.5 is not importable "
                                  "(pip install 'logitless[helion]')")

LINEAR_OPS = ("linear_cross_entropy", "linear_log_probs", "linear_jsd")
BACKEND = "helion"


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Tiles of 8 in the ref mode, blocks of 16 on CUDA (tests/_helion_tiles.py)."""
    if not HELION:
        yield
        return
    from tests._helion_tiles import small_tiles

    with small_tiles(monkeypatch, 8):
        yield


@pytest.fixture()
def launches(monkeypatch):
    """Counts of the Helion kernel launches by kernel name (the launch functions' ``launch``)."""
    from logitless.helion_lib import grad_kernels, linear_cross_entropy, linear_jsd, linear_log_probs

    counts: dict = {}
    for module in (linear_cross_entropy, linear_jsd, linear_log_probs, grad_kernels):
        original = module.launch

        def counted(kernel, args, config, _original=original):
            name = getattr(kernel, "name", None) or kernel.fn.__name__
            counts[name] = counts.get(name, 0) + 1
            return _original(kernel, args, config)

        monkeypatch.setattr(module, "launch", counted)
    return counts


def _params(per_spec):
    return [pytest.param(name, *rest, id="-".join([name, *map(str, rest)]))
            for name in LINEAR_OPS for rest in per_spec(SPECS[name])]


def _reduction(spec, option: str) -> str:
    """One reduction per option, in turn (the interpreter is slow): every one is covered."""
    return spec.reductions[list(spec.options).index(option) % len(spec.reductions)]


# ------------------------------------------------------------------ values and gradients


@needs_helion
@pytest.mark.parametrize("op,option", _params(lambda spec: [(o,) for o in spec.options]))
def test_each_option_fp32(op, option):
    spec = SPECS[op]
    check_against_reference(spec, BACKEND, torch.float32, spec.base_size, option, _reduction(spec, option), seed=23)


@needs_helion
@pytest.mark.parametrize("op", LINEAR_OPS)
def test_all_options_every_reduction(op):
    spec = SPECS[op]
    for reduction in spec.reductions:
        check_against_reference(spec, BACKEND, torch.float32, spec.base_size, "all", reduction, seed=29)


@needs_helion
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", LINEAR_OPS)
def test_16bit_all_options(op, dtype):
    spec = SPECS[op]
    check_against_reference(spec, BACKEND, dtype, spec.base_size, "all", spec.reductions[0], seed=31)


@needs_helion
@pytest.mark.parametrize("op,size", _params(lambda spec: [(s,) for s in spec.sizes]))
def test_odd_sizes(op, size):
    """V prime, H not a multiple of 16, one token, 3-D, tiny vocabularies (tiles of 32:
    V = 1009 is 32 vocabulary tiles, the last of 17 columns)."""
    spec = SPECS[op]
    shape, options, reduction = spec.sizes[size]
    with interpret_block_size(32):
        for option in options:
            check_against_reference(spec, BACKEND, torch.float32, shape, option, reduction, seed=3)


@needs_helion
@pytest.mark.parametrize("op", LINEAR_OPS)
def test_empty_and_all_ignored(op):
    spec = SPECS[op]
    reduction = spec.reductions[0]
    for lead, ignore in (((0,), 0.0), ((0, 3), 0.0), ((5,), 1.0)):
        case = spec.make(dict(spec.base_size, lead=lead), torch.float32, {"_ignore": ignore}, seed=9)
        loss = spec.fn(*case.args, reduction=reduction, backend=BACKEND, **case.kwargs)
        if reduction == "mean":
            assert loss.shape == () and torch.isnan(loss)
        else:
            assert loss.shape == lead and not loss.any()
        grads = torch.autograd.grad(loss, case.grads, torch.ones_like(loss))
        for g, t in zip(grads, case.grads):
            assert g.shape == t.shape and not g.any()


@needs_helion
@pytest.mark.parametrize("op", LINEAR_OPS)
def test_opcheck(op):
    """Schema, fakes and autograd registration of the custom ops with backend="helion"."""
    calls = 0
    with interpret_block_size(32):
        for custom_op, args, utils in SPECS[op].opcheck(BACKEND):
            torch.library.opcheck(custom_op, args, **({} if utils is None else {"test_utils": utils}))
            calls += 1
    assert calls >= 2


# ------------------------------------------------------------------ the kernels run


def _small_calls():
    g = torch.Generator().manual_seed(41)
    x = torch.randn(2, 5, 20, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(37, 20, generator=g) * 0.3).to(DEVICE).requires_grad_()
    b = torch.randn(37, generator=g).to(DEVICE).requires_grad_()
    t = torch.randint(0, 37, (2, 5), generator=g).to(DEVICE)
    xt = torch.randn(2, 5, 23, generator=g).to(DEVICE)
    wt = (torch.randn(37, 23, generator=g) * 0.3).to(DEVICE)
    return {
        "linear_cross_entropy": lambda backend: logitless.linear_cross_entropy(
            x, w, t, b, label_smoothing=0.1, softcap=3.0, z_loss=1e-3, return_stats=True, backend=backend)[0],
        "linear_log_probs": lambda backend: sum(o.sum() for o in logitless.linear_log_probs(
            x, w, t, b, entropy=True, temperature=0.8, backend=backend)),
        "linear_jsd": lambda backend: logitless.linear_jsd(
            x, w, xt, wt, t, student_bias=b, beta=0.3, hard_label_weight=0.2, backend=backend),
    }, (x, w, b)


@needs_helion
@pytest.mark.parametrize("op,kernels", [("linear_cross_entropy", ("ce_forward", "linear_dlogits")),
                                        ("linear_log_probs", ("logp_forward", "linear_dlogits")),
                                        ("linear_jsd", ("jsd_row_stats", "jsd_dlogits"))])
def test_helion_kernels_run(op, kernels, launches):
    """Forward and backward launch the op's two Helion kernels once each (no fallback; the
    backward's d(logits) in one vocabulary chunk at these sizes), and the results match
    the torch backend's."""
    calls, leaves = _small_calls()
    with warnings.catch_warnings():
        warnings.simplefilter("error", helion_choice.HelionFallbackWarning)
        loss = calls[op](BACKEND)
        grads = torch.autograd.grad(loss, leaves)
    assert {k: launches.get(k, 0) for k in kernels} == dict.fromkeys(kernels, 1), launches
    want = calls[op]("torch")
    want_grads = torch.autograd.grad(want, leaves)
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-5)
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)


@needs_helion
@pytest.mark.parametrize("beta", [0.3, 1.0])
def test_jsd_forward_row_chunks_by_budget(beta, launches):
    """linear_jsd under a memory budget of 3 tokens' fp32 logits of both heads (10 tokens
    of a 3-D input: four row chunks, the last of one token, each one ``jsd_row_stats``
    launch), every option on: the torch backend's loss and gradients."""
    g = torch.Generator().manual_seed(47)
    v = 37
    x = torch.randn(2, 5, 20, generator=g).to(DEVICE).requires_grad_()
    w = (torch.randn(v, 20, generator=g) * 0.3).to(DEVICE).requires_grad_()
    b = torch.randn(v, generator=g).to(DEVICE).requires_grad_()
    xt, wt = torch.randn(2, 5, 23, generator=g).to(DEVICE), (torch.randn(v, 23, generator=g) * 0.3).to(DEVICE)
    t = torch.randint(0, v, (2, 5), generator=g).to(DEVICE)
    t[0, 1] = -100

    def run(backend):
        loss = logitless.linear_jsd(x, w, xt, wt, t, student_bias=b, teacher_bias=torch.zeros(v, device=DEVICE),
                                    beta=beta, temperature=1.5, student_softcap=2.5, teacher_softcap=4.0,
                                    hard_label_weight=0.3, reduction="none", memory_budget=3 * 8 * v,
                                    backend=backend)
        return loss, torch.autograd.grad(loss.sum(), (x, w, b))

    with warnings.catch_warnings():
        warnings.simplefilter("error", helion_choice.HelionFallbackWarning)
        got, got_grads = run(BACKEND)
    assert launches.get("jsd_row_stats") == 4, launches
    want, want_grads = run("torch")
    assert got.shape == (2, 5) and got[0, 1] == 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, e in zip(got_grads, want_grads):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


@needs_helion
def test_modules_take_helion():
    g = torch.Generator().manual_seed(43)
    x, w = torch.randn(6, 12, generator=g).to(DEVICE), torch.randn(19, 12, generator=g).to(DEVICE)
    t = torch.randint(0, 19, (6,), generator=g).to(DEVICE)
    for module, args in ((logitless.LinearCrossEntropyLoss(backend=BACKEND), (x, w, t)),
                         (logitless.LinearLogProbs(backend=BACKEND), (x, w, t)),
                         (logitless.LinearJSDLoss(backend=BACKEND), (x, w, x * 0.5, w, t))):
        got = module(*args)
        module.kwargs["backend"] = "torch"
        torch.testing.assert_close(got, module(*args), rtol=1e-4, atol=1e-5)


@needs_helion
def test_compile_fullgraph(launches):
    """torch.compile(fullgraph=True): Helion is chosen inside the custom ops (never traced),
    so the graph has no break; eager's numbers and gradients."""
    calls, leaves = _small_calls()

    def f(backend):
        return sum(calls[op](backend) for op in LINEAR_OPS)

    compiled = torch.compile(lambda: f(BACKEND), fullgraph=True, backend="aot_eager")
    loss = compiled()
    grads = torch.autograd.grad(loss, leaves)
    assert launches.get("ce_forward") == launches.get("jsd_dlogits") == 1, launches
    eager = f(BACKEND)
    assert torch.equal(loss, eager)
    for got, want in zip(grads, torch.autograd.grad(eager, leaves)):  # (the three ops' sums in another order)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ without a usable Helion


@pytest.fixture()
def no_helion(monkeypatch):
    """Helion unusable: ``runtime.available()`` False, a fresh warning state."""
    monkeypatch.setattr(runtime, "available", lambda: False)
    monkeypatch.setattr(helion_choice, "_WARNED", set())
    monkeypatch.setattr(helion_choice, "_REASON", [])


@pytest.mark.parametrize("op", LINEAR_OPS)
def test_fallback_one_warning_torch_numbers(op, no_helion, monkeypatch):
    """The torch backend runs (on the CPU; Triton on CUDA), bitwise its numbers, with one
    HelionFallbackWarning for two calls naming the cause and the install command; the cause
    is probed once."""
    if DEVICE.type == "cuda":
        pytest.skip("the CPU fallback (torch backend); on CUDA it is the Triton backend")
    probes = []
    monkeypatch.setattr(helion_choice, "unavailable_reason",
                        lambda: probes.append(1) or "helion failed to import (ImportError: x)")
    calls, leaves = _small_calls()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = calls[op](BACKEND)
        grads = torch.autograd.grad(loss, leaves)
        calls[op](BACKEND)
    mine = [w for w in seen if issubclass(w.category, helion_choice.HelionFallbackWarning)]
    assert len(mine) == 1, [str(w.message) for w in seen]
    text = str(mine[0].message)
    assert "ImportError: x" in text and "pip install 'logitless[helion]'" in text and "torch backend" in text
    assert len(probes) == 1
    want = calls[op]("torch")
    assert torch.equal(loss, want)
    for got, exp in zip(grads, torch.autograd.grad(want, leaves)):
        assert torch.equal(got, exp)


def test_unavailable_reason_keeps_the_import_error(no_helion, monkeypatch):
    """A helion that fails to import (as helion 1.5.1 on torch 2.11 without runtime's shim): the reason quotes
    the error; too old, or not installed: says so."""
    import builtins
    import importlib.util

    message = "cannot import name 'IntelGPUError' from 'torch._inductor.runtime.triton_compat'"
    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name == "helion" or name.startswith("helion."):
            raise ImportError(message)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())  # "installed"
    monkeypatch.setattr(builtins, "__import__", failing_import)
    reason = helion_choice.unavailable_reason()
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert reason == f"helion failed to import (ImportError: {message})"
    if HELION:  # imports, but older than 1.5
        import importlib.metadata

        monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.4.2")
        assert helion_choice.unavailable_reason() == "helion 1.4.2 is older than 1.5"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert helion_choice.unavailable_reason() == "helion is not installed"


@needs_helion
def test_gpu_kernel_failure_falls_back(monkeypatch):
    """On a GPU (compiled kernels) a Helion kernel that fails to compile or launch: one
    warning quoting the error, the other backend for this and later calls; out of memory
    propagates. (``guarded`` and ``fallback_name_of_call``, as every Helion backend's forward
    and plan call them, on a CUDA device object: nothing runs on a GPU here.)"""
    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    monkeypatch.setattr(helion_choice, "_FAILED", [])
    monkeypatch.setattr(helion_choice, "_WARNED", set())
    cuda = torch.device("cuda", 0)

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        helion_choice.guarded(cuda, oom, lambda: pytest.fail("fell back on OOM"))
    assert helion_choice.fallback_name_of_call(cuda) is None  # (OOM is not Helion's failure)

    def broken():
        raise RuntimeError("PassManager::run failed\nmore")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = helion_choice.guarded(cuda, broken, lambda: helion_choice.fallback_name_of_call(cuda))
        again = helion_choice.fallback_name_of_call(cuda)  # a later call's plan: the other backend at once
    assert got == again == helion_choice.fallback_name(cuda)
    mine = [str(w.message) for w in seen if issubclass(w.category, helion_choice.HelionFallbackWarning)]
    assert len(mine) == 1 and "RuntimeError: PassManager::run failed)" in mine[0], mine


_SHIM_PROBE = """
import sys
import warnings
import torch
import torch._inductor.runtime.triton_compat as tc
if hasattr(tc, "IntelGPUError"):
    del tc.IntelGPUError  # as torch 2.11, which lacks it
torch.__version__ = sys.argv[1]  # the release the shim's gate reads
try:
    import helion  # noqa: F401
    print("plain import: ok")
except ImportError as e:
    print("plain import:", e)
from logitless.helion_lib import runtime
from logitless.ops.common import helion_choice
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    ok = runtime.available() and runtime.available() and helion_choice.cause() is None
mine = [str(w.message) for w in seen if issubclass(w.category, runtime.HelionTorchShimWarning)]
if not ok:
    print("available:", ok, "| warnings:", len(mine), "| planted:", hasattr(tc, "IntelGPUError"),
          "| cause:", helion_choice.cause())
    sys.exit(0)
print("available:", ok, "| warnings:", len(mine), "| stand-in:", issubclass(tc.IntelGPUError, Exception),
      "| helion sees it:", __import__("helion.autotuner.logger").autotuner.logger.IntelGPUError is tc.IntelGPUError)
print("message:", mine[0] if mine else "")
"""


def _shim_probe(version: str) -> str:
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", _SHIM_PROBE, version], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@needs_helion
def test_torch_shim_makes_helion_import():
    """helion 1.5.1 imports IntelGPUError from torch._inductor.runtime.triton_compat, which
    torch 2.11 lacks: in a fresh process without that name (as on torch 2.11) a plain
    ``import helion`` fails, and ``runtime.available()`` defines a stand-in first, imports
    helion and says so in one HelionTorchShimWarning (two calls)."""
    out = _shim_probe("2.11.0+cu130")
    assert "plain import: cannot import name 'IntelGPUError'" in out, out
    assert "available: True | warnings: 1 | stand-in: True | helion sees it: True" in out, out
    assert "torch._inductor.runtime.triton_compat.IntelGPUError" in out and "helion 1.5" in out, out


@needs_helion
def test_torch_shim_only_on_the_releases_it_was_written_for():
    """Outside ``runtime.SHIM_TORCH`` (a torch that lacks the name but is not 2.9-2.11)
    nothing is planted in torch: helion fails to import, so it counts as absent (the
    fallback backend, with the import error as the cause) and no shim warning is given."""
    assert runtime.shim_applies("2.11.0+cu130") and runtime.shim_applies("2.9.1")
    assert not runtime.shim_applies("2.12.0") and not runtime.shim_applies("2.8.0") and not runtime.shim_applies("x")
    out = _shim_probe("2.16.0")
    assert "available: False | warnings: 0 | planted: False | cause: helion failed to import" in out, out


def test_torch_shim_noop_where_torch_has_the_names(monkeypatch):
    """Where torch defines every name of TORCH_SHIMS (torch >= 2.12) the shim adds nothing;
    a name it lacks is added once, as an Exception subclass."""
    import importlib
    import types

    module = types.ModuleType("fake_triton_compat")
    monkeypatch.setattr(runtime, "TORCH_SHIMS", (("fake_triton_compat", "IntelGPUError"),
                                                 ("no.such.module", "X")))
    monkeypatch.setitem(__import__("sys").modules, "fake_triton_compat", module)
    assert not runtime.shimmed()
    assert runtime.shim_torch() == ["fake_triton_compat.IntelGPUError"]
    assert issubclass(module.IntelGPUError, Exception)
    assert runtime.shim_torch() == []
    # shimmed: Helion's spawned benchmark workers would lack the name, so its autotuner
    # benchmarks in-process (measured: every config failed in the workers on torch 2.11)
    assert runtime.shimmed()
    if runtime.available():
        assert runtime.kernel_settings()["autotune_benchmark_subprocess"] is False
    real = importlib.import_module("torch._inductor.runtime.triton_compat")
    if hasattr(real, "IntelGPUError"):  # torch >= 2.12 (or already shimmed): nothing to do
        monkeypatch.setattr(runtime, "TORCH_SHIMS", (("torch._inductor.runtime.triton_compat", "IntelGPUError"),))
        assert runtime.shim_torch() == []


def test_fallback_backend_by_device():
    assert helion_choice.fallback_name(torch.device("cpu")) == "torch"
    assert helion_choice.fallback_name(torch.device("cuda", 0)) == ("triton" if dispatch.HAS_TRITON else "torch")


# ------------------------------------------------------------------ choice and bad input


def test_auto_never_picks_helion():
    from logitless.ops.linear_cross_entropy.api import BACKENDS as LCE
    from logitless.ops.linear_jsd.api import BACKENDS as LJSD
    from logitless.ops.linear_log_probs.api import BACKENDS as LLP

    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        for dtype in (torch.float32, torch.bfloat16):
            for table in (LCE, LJSD, LLP):
                assert dispatch.resolve_backend("auto", device, dtype, table) != "helion"


def test_bad_input():
    x, w, t = torch.randn(3, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64), torch.tensor([0, 1, 2])
    with pytest.raises(TypeError, match="backend='helion' supports float16, bfloat16 and float32"):
        logitless.linear_cross_entropy(x, w, t, backend=BACKEND)
    with pytest.raises(TypeError, match="backend='helion' supports"):
        logitless.linear_log_probs(x, w, t, backend=BACKEND)
    with pytest.raises(TypeError, match="backend='helion' supports"):
        logitless.linear_jsd(x, w, x, w, t, backend=BACKEND)
    # ops without a Helion backend refuse the name
    with pytest.raises(ValueError, match="backend must be one of"):
        logitless.cross_entropy(torch.randn(3, 5), t, backend=BACKEND)
    with pytest.raises(ValueError, match="backend must be one of"):
        logitless.log_probs(torch.randn(3, 5), t, backend=BACKEND)


@needs_helion
def test_cpu_without_interpret_raises(monkeypatch):
    monkeypatch.delenv("HELION_INTERPRET", raising=False)
    x, w, t = torch.randn(3, 8), torch.randn(5, 8), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="HELION_INTERPRET=1"):
        logitless.linear_cross_entropy(x, w, t, backend=BACKEND)


# ------------------------------------------------------------------ vocabulary parallelism


def _tp_worker(rank, world, device):
    from tests import test_tensor_parallel as tp_ce
    from tests import test_tensor_parallel_jsd as tp_jsd
    from tests import test_tensor_parallel_log_probs as tp_lp

    rows = [17, 16]
    for case in (dict(name="helion-every-option", dtype=torch.float32, backend=BACKEND, reduction="sum",
                      bias=True, cw=True, label_smoothing=0.1, z_loss=1e-3, softcap=3.0, stats=True),
                 dict(name="helion-bf16-padded", dtype=torch.bfloat16, backend=BACKEND, h=16, bias=True,
                      vocab_size=30)):
        tp_ce._check_case(rank, device, rows, case)
    for case in (dict(name="helion-entropy", dtype=torch.float32, backend=BACKEND, bias=True, entropy=True,
                      temperature=0.7, softcap=3.0),
                 dict(name="helion-bf16-partial", dtype=torch.bfloat16, backend=BACKEND, h=16, entropy=True,
                      partial_dx=True)):
        tp_lp._check_case(rank, device, rows, case)
    for case in (dict(name="helion-mixture", dtype=torch.float32, backend=BACKEND, beta=0.3, bias=True,
                      hard_label_weight=0.4, student_softcap=3.0),
                 dict(name="helion-kl-bf16", dtype=torch.bfloat16, backend=BACKEND, beta=0.0)):
        tp_jsd._case(rank, device, rows, case)


@needs_helion
def test_vocab_parallel(monkeypatch):
    """Two ranks (NCCL with two GPUs, else gloo on the CPU): each op against the one-process
    op and the reference. The CPU ranks run the kernels in Helion's ref mode, also when this
    process has one GPU (its kernels are compiled, the ranks' are decorated afresh)."""
    from tests._distributed import NCCL, spawn

    if not (NCCL and torch.cuda.device_count() >= 2):
        monkeypatch.setenv("HELION_INTERPRET", "1")
    spawn(_tp_worker, 2)


# ------------------------------------------------------------------ tuned configs


def test_tuned_configs_lookup(tmp_path, monkeypatch):
    """What ``benchmarks/helion_gpu.py merge`` writes (``config_file``) is what
    ``configs.pick`` reads: per device class (an H100 here, faked), the user folder
    (LOGITLESS_HELION_CONFIGS) before the package's, the log-probs kernels sharing the
    cross-entropy ones' tuning, token and dtype bounds, and the heuristic where nothing matches."""
    import json

    from benchmarks.helion_gpu import config_file
    from logitless.helion_lib import configs

    fwd = {"block_sizes": [128, 256, 64], "num_warps": 8, "num_stages": 3, "indexing": "tensor_descriptor"}
    dz = {"block_sizes": [64, 256, 64], "num_warps": 8, "num_stages": 4, "pid_type": "persistent_blocked"}
    shape = dict(tokens=8192, hidden=4096, vocab=128256, dtype="bfloat16", autotuner="PatternSearch",
                 device_class="nvidia-h100")
    user, package = tmp_path / "user", tmp_path / "package"
    user.mkdir(), package.mkdir()
    (user / "nvidia-h100.json").write_text(json.dumps(config_file([dict(shape, kernel="ce_forward", config=fwd),
                                                                   dict(shape, kernel="ce_dz", config=dz)])))
    shipped = {"block_sizes": [32, 64, 32], "num_warps": 4, "num_stages": 2}
    (package / "nvidia-h100.json").write_text(json.dumps({
        "ce_forward": [{"min_tokens": 1024, "config": shipped}],
        "logp_forward": [{"max_tokens": 64, "config": shipped}]}))
    monkeypatch.setattr(configs, "_DIR", package)
    monkeypatch.setattr(configs, "device_class", lambda d: "nvidia-h100" if d.type == "cuda" else d.type)
    configs._load.cache_clear()
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    big = {"n": 8192, "v": 128256, "h": 4096, "dtype": "bfloat16"}
    small = {"n": 20, "v": 1009, "h": 20, "dtype": "bfloat16"}
    big32 = dict(big, dtype="float32")
    try:
        monkeypatch.delenv(configs.USER_DIR_ENV, raising=False)
        assert configs.pick("ce_forward", big, cuda) == shipped  # the package's file
        assert configs.pick("ce_forward", small, cuda) == configs.default_config("ce_forward", small)  # min_tokens
        assert configs.pick("logp_forward", small, cuda) == shipped
        assert configs.pick("logp_forward", big, cuda) == configs.default_config("logp_forward", big)  # max_tokens
        monkeypatch.setenv(configs.USER_DIR_ENV, str(user))
        # the user's tuning wins, its portable fields only (an indexing list fits one variant)
        kept = {k: v for k, v in fwd.items() if k != "indexing"}
        assert configs.pick("ce_forward", big, cuda) == kept
        assert configs.pick("ce_forward", small, cuda) == kept  # tuned entries hold for every shape
        assert configs.pick("ce_dz", big, cuda) == configs.pick("logp_dz", big, cuda) == dz
        assert configs.pick("logp_forward", big, cuda) == kept  # shares ce_forward's tuning
        # tuned at bf16: fp16 (same itemsize) takes it, fp32 (the shared memory) does not
        assert configs.pick("ce_forward", dict(big, dtype="float16"), cuda) == kept
        assert configs.pick("ce_forward", big32, cuda) == shipped  # the package's entry has no dtype bound
        assert configs.pick("ce_dz", big32, cuda) == configs.default_config("ce_dz", big32)
        assert configs.pick("jsd_dz", big, cuda) == configs.default_config("jsd_dz", big)
        assert configs.pick("ce_forward", big, cpu) == configs.default_config("ce_forward", big)  # other class
    finally:
        configs._load.cache_clear()


def test_shipped_configs(monkeypatch):
    """The package's tuned files: every entry names a kernel, one block size per ``hl.tile``
    loop of it, a dtype bound; on a (faked) H100 the 16-bit calls at the anchors' tokens
    get them, fp32 and small calls the heuristic; the memory-bound ``jsd_stats`` (it reads
    fp32 logit chunks whatever the inputs) its entry for every call, on every device class."""
    import json

    from logitless.helion_lib import configs

    files = sorted(configs._DIR.glob("*.json"))
    assert any(f.name == "nvidia-h100.json" for f in files)
    for f in files:
        for kernel, entries in json.loads(f.read_text()).items():
            assert kernel in configs.KERNEL_DIMS, (f.name, kernel)
            for e in entries:
                assert len(e["config"]["block_sizes"]) == len(configs.KERNEL_DIMS[kernel]), (f.name, kernel)
                assert set(e["dtypes"]) <= {"bfloat16", "float16", "float32"}, (f.name, kernel)
    monkeypatch.delenv(configs.USER_DIR_ENV, raising=False)
    monkeypatch.setattr(configs, "device_class", lambda d: "nvidia-h100" if d.type == "cuda" else d.type)
    configs._load.cache_clear()
    cuda = torch.device("cuda", 0)
    shipped = json.loads((configs._DIR / "nvidia-h100.json").read_text())
    try:
        for size in ({"n": 8192, "v": 128256, "h": 4096, "dtype": "float32"},
                     {"n": 5, "v": 9, "h": 3, "dtype": "bfloat16"}):
            assert configs.pick("jsd_stats", size, cuda) == shipped["jsd_stats"][0]["config"]
            assert configs.pick("jsd_stats", size, torch.device("cpu"))["block_sizes"] == [1, 1024]
        for kernel in ("ce_forward", "logp_forward", "ce_dz", "logp_dz", "jsd_dz"):
            for dtype in ("bfloat16", "float16"):
                anchor = {"n": 8192, "v": 128256, "h": 4096, "dtype": dtype}
                assert configs.pick(kernel, anchor, cuda) == shipped[kernel][0]["config"], kernel
            for other in ({"n": 8192, "v": 128256, "h": 4096, "dtype": "float32"},
                          {"n": 20, "v": 1009, "h": 20, "dtype": "bfloat16"}):
                assert configs.pick(kernel, other, cuda) == configs.default_config(kernel, other), (kernel, other)
    finally:
        configs._load.cache_clear()


@needs_helion
def test_tuned_config_from_a_stopped_search(tmp_path):
    """A tuning process stopped before its end: ``best_of_log`` takes the fastest "ok" row
    of Helion's search log (its CSV columns, its ``Config`` repr) as the kernel's config."""
    import csv

    import helion

    from benchmarks.helion_gpu import best_of_log

    rows = [("error", "", helion.Config(block_sizes=[16, 16, 16], num_warps=4)),
            ("ok", "3.5", helion.Config(block_sizes=[64, 128, 64], num_warps=4, num_stages=2)),
            ("ok", "2.25", helion.Config(block_sizes=[128, 256, 64], num_warps=8, num_stages=3,
                                         indexing="tensor_descriptor", l2_groupings=[4])),
            ("accuracy_error", "1.0", helion.Config(block_sizes=[256, 256, 64], num_warps=8))]
    path = tmp_path / "autotune-ce_forward.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("run_id", "timestamp_s", "config_id", "generation", "status", "perf_ms", "compile_time_s",
                    "config"))
        for i, (status, perf, cfg) in enumerate(rows):
            w.writerow(("r", "1.0", f"c{i}", 0, status, perf, "2.0", str(cfg)))
    found = best_of_log("ce_forward", path)
    assert found["perf_ms"] == 2.25
    assert helion.Config(**found["config"]) == rows[2][2]


@needs_helion
def test_small_tiles_on_cuda(monkeypatch):
    """On CUDA the tests' launches get blocks of 16 in every loop (tests/_helion_tiles.py),
    whatever config the lookup gave; the rest of the config is kept."""
    from logitless.helion_lib import grad_kernels, linear_cross_entropy
    from tests._helion_tiles import small_tiles

    seen = []
    for module in (linear_cross_entropy, grad_kernels):
        monkeypatch.setattr(module, "launch", lambda kernel, args, config: seen.append(config))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with small_tiles(monkeypatch):
        linear_cross_entropy.launch("k", (), {"block_sizes": [64, 128, 64], "num_warps": 8})
        grad_kernels.launch("k", (), {"block_sizes": [64, 128, 64, 64], "num_warps": 4, "indexing": "pointer"})
    assert seen == [{"block_sizes": [16, 16, 16], "num_warps": 8},
                    {"block_sizes": [16, 16, 16, 16], "num_warps": 4, "indexing": "pointer"}]
