"""Test set-up: without CUDA, Triton kernels run on the CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here,
before any test module imports logitless' Triton backends. Where helion is installed,
the CPU kernels its ref mode needs are registered for this process
(``register_cpu_mm_dtype``).
"""

import atexit
import importlib.util
import os
import shutil
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# torch.compile's on-disk caches key a graph by the custom ops' names, not by their fake
# implementations: a graph compiled before a change of an op's outputs (e.g. one more
# TritonPlan field) would be replayed with the old shapes ("expected size 14==13"). The
# suite compiles into a fresh folder of its own unless one is given, and removes it when the
# process that made it exits (each run left ~40 MB behind; CI machines fill up).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="logitless-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

#: Device the tests run on: the GPU when there is one, else the CPU (interpreter).
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

#: The torch.library registrations of ``register_cpu_mm_dtype`` (dropping one unregisters it).
_LIBS: list = []


def register_cpu_mm_dtype() -> None:
    """CPU kernels for ``aten::mm.dtype`` / ``aten::bmm.dtype`` (``torch.mm(a, b,
    out_dtype=...)``), only where torch has none: Helion's ref mode (HELION_INTERPRET=1, the
    Helion tests on the CPU) calls them for its matmuls. fp32 accumulation (fp64 for fp64
    operands), rounded once to ``out_dtype``. Test-side: the library raises instead
    (``helion_lib.runtime.launch``). Registered once, at the start of the session, so that
    no test's outcome depends on which ran first."""
    lib = torch.library.Library("aten", "IMPL")

    def mm_dtype(a, b, out_dtype):
        acc = torch.float64 if torch.float64 in (a.dtype, b.dtype, out_dtype) else torch.float32
        return torch.mm(a.to(acc), b.to(acc)).to(out_dtype)

    def bmm_dtype(a, b, out_dtype):
        acc = torch.float64 if torch.float64 in (a.dtype, b.dtype, out_dtype) else torch.float32
        return torch.bmm(a.to(acc), b.to(acc)).to(out_dtype)

    for name, fn, probe in (("mm.dtype", mm_dtype, lambda: torch.mm(torch.ones(1, 1), torch.ones(1, 1),
                                                                     out_dtype=torch.float32)),
                            ("bmm.dtype", bmm_dtype, lambda: torch.bmm(torch.ones(1, 1, 1), torch.ones(1, 1, 1),
                                                                       out_dtype=torch.float32))):
        try:
            probe()
            continue  # torch has it
        except (NotImplementedError, RuntimeError):
            pass
        lib.impl(name, fn, "CPU")
    _LIBS.append(lib)


if importlib.util.find_spec("helion") is not None:
    register_cpu_mm_dtype()


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Tests draw their data from seeded generators; what still comes from torch's global
    RNG (shapes of bad inputs, a few helpers) is the same in every run and every order."""
    torch.manual_seed(0)


def exact_for_interpreter(*ts):
    """On the Triton interpreter (no GPU), ``ts`` rounded to multiples of 2**-6, else as
    they are. The interpreter's ``tl.dot`` is numpy's matmul, and a CPU BLAS may give one
    row or column different bits at another place in the tile (seen on an AMD EPYC with
    AVX2: equal W rows gave unequal logits, a row's log-prob changed with its position).
    The GPU's tile MMA does not; with these values every product, and every sum under 4096
    in magnitude, is exact in fp32 (2**-12 steps, 24 bits), so tests of ties and of bitwise
    batch invariance test our kernels' logic, not the CPU's BLAS. Softmax sums still round."""
    if HAS_CUDA:
        return ts
    return tuple(t if t is None else (t * 64).round() / 64 for t in ts)
