"""How time, memory and the two units (1 GEMM, copy bandwidth) are measured.

Everything the report calls "ms" comes from ``time_ms`` and everything it calls
"peak extra MiB" from ``peak_extra_bytes``; nothing else in the package measures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Optional

import torch

#: Bytes zeroed before each timed GPU call so that no input is still in L2
#: (50 MiB on an H100), as triton.testing.do_bench does.
L2_FLUSH_BYTES = 256 * 2**20

_flush_buffers: dict = {}


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def synchronize(device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def _flush_l2(device) -> None:
    key = str(device)
    if key not in _flush_buffers:
        _flush_buffers[key] = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    _flush_buffers[key].zero_()


def time_ms(fn: Callable[[], object], **kw) -> float:
    """Median milliseconds of ``fn()`` (see ``time_ms_spread``)."""
    return time_ms_spread(fn, **kw)[0]


def relative_spread(times) -> float:
    """Inter-quartile range / median of a list of times (0 for fewer than 4)."""
    if len(times) < 4:
        return 0.0
    q = statistics.quantiles(times, n=4)
    med = statistics.median(times)
    return (q[2] - q[0]) / med if med > 0 else 0.0


def time_ms_spread(
    fn: Callable[[], object],
    *,
    device,
    setup: Optional[Callable[[], None]] = None,
    warmup: int = 3,
    reps: int = 10,
) -> float:
    """(median milliseconds of ``fn()`` over ``reps`` calls after ``warmup`` untimed calls,
    their relative spread: inter-quartile range / median; ``compare`` reads it as noise).

    ``setup()`` runs before every call and is not timed (it sets gradients to None or
    restores inputs that a method overwrites). On CUDA each call is bracketed by a
    pair of CUDA events (GPU time from the first to the last kernel of the call,
    including launch gaps) after an L2 flush; on the CPU by ``time.perf_counter``.
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    if is_cuda(device):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for start, end in zip(starts, ends):
            if setup is not None:
                setup()
            _flush_l2(device)
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        times = []
        for _ in range(reps):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), relative_spread(times)


def peak_extra_bytes(
    fn: Callable[[], object],
    *,
    device,
    setup: Optional[Callable[[], None]] = None,
    exclude_bytes: int = 0,
):
    """Runs ``fn()`` once; returns ``(its result, peak extra bytes)``.

    Peak extra = (peak of torch.cuda.max_memory_allocated during the call) - (memory
    allocated just before the call) - ``exclude_bytes`` (the sizes of the gradients
    the call must produce). So it is the temporary memory of the method (plus what it
    keeps alive after the call, e.g. its saved tensors if the backward did not run).
    ``None`` on the CPU, where torch keeps no such statistics.
    """
    if setup is not None:
        setup()
    if not is_cuda(device):
        return fn(), None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return out, peak - before - exclude_bytes


def gemm_ms(x: torch.Tensor, weight: torch.Tensor, *, warmup: int = 3, reps: int = 10) -> float:
    """The unit of the lce suite: one cuBLAS (B,H)x(H,V) product ``x @ weight.T``."""
    with torch.no_grad():
        return time_ms(lambda: x @ weight.T, device=x.device, warmup=warmup, reps=reps)


def copy_bandwidth(device, *, nbytes: Optional[int] = None, warmup: int = 3, reps: int = 10) -> float:
    """The unit of the ce suite: bytes/s of a large device-to-device copy, counting
    bytes read plus bytes written (2 * nbytes per copy)."""
    if nbytes is None:
        nbytes = 2**30 if is_cuda(device) else 64 * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device=device, warmup=warmup, reps=reps)
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def release_memory(device) -> None:
    """Frees what a finished method left in torch's caching allocator."""
    import gc

    gc.collect()
    if is_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()
