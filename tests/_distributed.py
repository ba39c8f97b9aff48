"""Multi-process test helpers: spawn ranks, set up the process group, tear it down.

``spawn(fn, world, *args)`` runs ``fn(rank, world, device, *args)`` in ``world``
processes: NCCL with one GPU per rank when CUDA has enough GPUs (NVLink multicast off),
else gloo on the CPU (``backend="gloo"`` forces gloo). A failing rank re-raises (the
spawn then fails the test) without a barrier, and every rank times out of a collective
after 90 s instead of hanging; a rank that passes waits at a barrier, destroys the group
and leaves with ``os._exit(0)``. Plus small checks the vocab-parallel tests share:
``blocks`` (a rank's rows), ``same_on_every_rank`` (bitwise), ``head_inputs`` (float64
draws of a split LM head and its inputs, cast afterwards).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import socket
import sys
import tempfile
import traceback
from typing import Optional

import pytest
import torch
import torch.distributed as dist

#: Marks of a multi-process test module: ``pytestmark = DIST_MARKS``.
DIST_MARKS = [
    pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed"),
    pytest.mark.skipif(sys.platform == "win32", reason="gloo on Windows is not set up here"),
]

#: Whether NCCL with one GPU per rank is possible at all (``spawn`` checks the count).
NCCL = torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()

#: The mark of a test whose ranks run the Triton backend: NCCL ranks on GPUs, or gloo
#: ranks with Triton's interpreter on the CPU (tests/conftest.py sets it without CUDA).
TRITON_RANKS = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or (not NCCL and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="the Triton backend needs triton, and CUDA or TRITON_INTERPRET=1")

#: A failing rank leaves the others waiting in a collective: they time out, not hang.
TIMEOUT = datetime.timedelta(seconds=90)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for MASTER_PORT). Racy: another process may
    take it before the caller binds it (pytest-xdist workers do); ``spawn`` uses a file."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world: int, *args, backend: Optional[str] = None):
    """Runs ``fn(rank, world, device, *args)`` in ``world`` processes: NCCL with one GPU
    each when there are enough GPUs, else gloo on the CPU; ``backend="gloo"``: gloo on
    the CPU always. Skips when neither is available."""
    nccl = backend != "gloo" and NCCL and torch.cuda.device_count() >= world
    if not nccl and not dist.is_gloo_available():
        pytest.skip("needs gloo (CPU) or enough CUDA GPUs with NCCL")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    # The ranks meet through a file of a fresh directory, not a TCP port: a port found free can
    # be taken by another test process before rank 0 listens on it (EADDRINUSE under xdist).
    with tempfile.TemporaryDirectory(prefix="logitless-dist-") as tmp:
        store = os.path.join(tmp, "store")
        torch.multiprocessing.spawn(_run, args=(world, store, fn, args, nccl), nprocs=world, join=True)


def _run(rank: int, world: int, store_path: str, fn, args, nccl: bool):
    store = dist.FileStore(store_path, world)
    if nccl:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank), timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        fn(rank, world, torch.device("cuda", rank) if nccl else torch.device("cpu"), *args)
    except BaseException:
        traceback.print_exc()
        raise  # no barrier: the other ranks may be inside a collective
    # Every rank reaches here before any tears the group down.
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: a C++ thread still joinable at exit
    # (gloo's, the interpreter's) aborted one CI run ("terminate called without an active
    # exception") after every check had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def blocks(rows: list[int], rank: int) -> slice:
    """The slice of ``rank``'s contiguous block when the ranks hold ``rows`` rows each."""
    start = sum(rows[:rank])
    return slice(start, start + rows[rank])


def cases_worker(rank, world, device, check, rows_list, cases, subset=None):
    """``check(rank, device, rows, case)`` for every case on the first split of the rows
    (``rows_list[0]``), and on the other splits for the cases named in ``subset`` (all
    when None): the body of a vocab-parallel test module's ``spawn``."""
    for i, rows in enumerate(rows_list):
        for case in cases:
            if i == 0 or subset is None or case["name"] in subset:
                check(rank, device, rows, case)


def same_on_every_rank(name: str, t: torch.Tensor):
    """Asserts that ``t`` is bitwise the same on every rank (an all_gather)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    for p in parts:
        assert torch.equal(p.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), \
            f"{name} differs between ranks"


def head_inputs(seed, shape, h, v_rows, v_real, dtype, device, *, bias=False, cw=False, ignore=-100):
    """x (*shape, h), the full head's weight (v_rows, h) and bias (or None), targets in
    [0, v_real) (the second one ``ignore`` when there are more than 2) and class weights
    (v_real,) in [0.5, 1.5) (or None; fp32 unless dtype is float64): drawn in float64
    from ``seed`` (the same on every rank), then cast to dtype on device."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, h, generator=g, dtype=torch.float64)
    w = torch.randn(v_rows, h, generator=g, dtype=torch.float64) * h ** -0.5 * 2
    b = torch.randn(v_rows, generator=g, dtype=torch.float64) * 0.5 if bias else None
    t = torch.randint(0, v_real, shape, generator=g)
    if t.numel() > 2:
        t.view(-1)[1] = ignore
    c = torch.rand(v_real, generator=g, dtype=torch.float64) + 0.5 if cw else None
    to = dict(dtype=dtype, device=device)
    return (x.to(**to), w.to(**to), None if b is None else b.to(**to), t.to(device),
            None if c is None else c.to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype))


def check_vocab_parallel_errors(op, x, w, t, pg, device):
    """The errors every vocab-parallel op (``op(x, w, t, **kw)``, ``w`` this rank's rows)
    must raise alike: a too-small ``vocab_size``, out-of-range or padding targets (CPU:
    the check reads values), a non-group ``process_group``, ``partial_dx`` without a
    group, ``vocab_size=0``."""
    with pytest.raises(ValueError, match="vocab_size=12 exceeds"):
        op(x, w, t, process_group=pg, vocab_size=12)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="outside"):
            op(x, w, torch.tensor([0, 11, 1, 2]), process_group=pg)
        with pytest.raises(ValueError, match="outside"):  # a padding class is no target
            op(x, w, t, process_group=pg, vocab_size=10)
    with pytest.raises(TypeError, match="process_group"):
        op(x, w, t, process_group="tp")
    with pytest.raises(ValueError, match="partial_dx"):
        op(x, w, t, partial_dx=True)
    with pytest.raises(ValueError, match="vocab_size"):
        op(x, w, t, process_group=pg, vocab_size=0)
