"""How time, memory and the two units (1 GEMM, copy bandwidth) are measured.

The units are warmed up, timed repeatedly and checked (``measure_unit``): a unit whose
timings spread, or whose rate is outside what the device's class can do, carries a
warning that the report prints next to its table.

Everything the report calls "ms" comes from ``time_ms`` and everything it calls
"peak extra MiB" from ``peak_extra_bytes``; nothing else in the package measures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

#: Bytes zeroed before each timed GPU call so that no input is still in L2
#: (50 MiB on an H100), as triton.testing.do_bench does.
L2_FLUSH_BYTES = 256 * 2**20

_flush_buffers: dict = {}


def bench_device(cpu: bool) -> torch.device:
    """The device a suite runs on: the CPU, or the current CUDA device."""
    return torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())


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


def step_times_ms(step: Callable[[int], object], n: int, *, device, first: int = 0) -> list:
    """Runs ``step(i)`` for i in ``first .. first + n - 1`` back to back; returns each call's
    milliseconds: a whole training step (forward, backward, optimizer) as the loop runs it.

    On CUDA one event is recorded between consecutive steps (no synchronisation inside
    the loop, so the GPU stays queued as in training; one ``synchronize`` at the end); on
    the CPU ``time.perf_counter`` around each call. No L2 flush: a step is far larger
    than the cache. Used by the end-to-end suites (grpo, the TRL rows of train).
    """
    if n <= 0:
        return []
    if is_cuda(device):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        marks[0].record()
        for i in range(n):
            step(first + i)
            marks[i + 1].record()
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        step(first + i)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


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
    On the CPU, where torch's allocator keeps no statistics, peak and before are the
    process's resident memory (Linux: VmHWM of /proc/self/status, reset through
    /proc/self/clear_refs, and VmRSS): what the call touched, allocator caches included;
    ``None`` where that is not available.
    """
    if setup is not None:
        setup()
    if not is_cuda(device):
        import gc

        gc.collect()
        before = cpu_rss_reset_peak()
        out = fn()
        peak = cpu_rss_peak()
        if before is None or peak is None:
            return out, None
        return out, peak - before - exclude_bytes
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return out, peak - before - exclude_bytes


def _proc_status_bytes(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024  # "VmHWM:  123456 kB"
    except (OSError, ValueError, IndexError):
        pass
    return None


def cpu_rss_reset_peak() -> Optional[int]:
    """Resets the process's resident-memory high-water mark (VmHWM) to its current
    resident memory (Linux >= 4.0: "5" into /proc/self/clear_refs); returns that resident
    memory in bytes, or None where the mark cannot be reset (not Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _proc_status_bytes("VmRSS")


def cpu_rss_peak() -> Optional[int]:
    """The process's resident-memory high-water mark (VmHWM) in bytes, or None."""
    return _proc_status_bytes("VmHWM")


#: A unit is timed this many times at least (its spread is checked on them).
UNIT_REPS = 21
#: Untimed calls before a unit is timed: at least UNIT_WARMUP_S seconds, then until the
#: median of the last 10 calls is within UNIT_STEADY x the fastest call (at most
#: UNIT_WARMUP_MAX_S). On a shared 2-core CPU a fresh process ran its first ~50 small
#: GEMMs at 8-16 ms each, then 0.13 ms: a fixed warm-up measured the slow phase.
UNIT_WARMUP_S = {"cpu": 0.3, "cuda": 0.05}
UNIT_WARMUP_MAX_S = {"cpu": 5.0, "cuda": 2.0}
UNIT_STEADY = 1.5
#: Relative spread (inter-quartile range / median) above which a unit is re-timed, and
#: reported as noisy if it stays there after UNIT_TRIES tries.
UNIT_SPREAD_LIMIT = 0.15
UNIT_TRIES = 3
#: A CPU unit whose calls take longer than UNIT_LONG_S each (the CPU-sized lce case: ~1 s)
#: is timed UNIT_REPS_LONG times, once: 21 calls times 3 tries would be most of the run.
UNIT_LONG_S, UNIT_REPS_LONG = 0.1, 5
#: What a device class can plausibly do, per CPU core (FLOP/s of an fp32 / 16-bit GEMM,
#: copy bytes/s read + write) and, for GPUs, as fractions of the cost model's rates.
CPU_GEMM_FLOPS_PER_CORE = {4: (2e9, 2.5e11), 2: (2e8, 1.5e12)}
CPU_COPY_BPS = (1e9, 1e12)
GPU_LOW_FRACTION, GPU_HIGH_FRACTION = 0.05, 1.3


@dataclass
class Unit:
    """A unit of the report, measured with warm-up and a spread check.

    ms: median time of one call; spread: its inter-quartile range / median; rate:
    FLOP/s (GEMM) or bytes/s (copy) that the median means; warning: why the unit looks
    wrong (too noisy, or outside what the device's class can do), else None: the
    report prints it next to the table, since every ratio is relative to it.
    """

    name: str
    ms: float
    spread: float
    reps: int
    rate: float
    warning: Optional[str] = None
    warmup_s: float = 0.0


def _cores() -> int:
    return max(1, torch.get_num_threads())


def measure_unit(name: str, fn: Callable[[], object], work: float, *, device, warmup: int = 3,
                 reps: int = 10, expected: Optional[tuple] = None, rate_unit: str = "FLOP/s") -> Unit:
    """Times ``fn`` (which does ``work`` FLOPs or bytes) as a unit: untimed calls until
    steady (see UNIT_WARMUP_S; at least ``warmup`` calls), then at least UNIT_REPS timed calls,
    re-timed up to UNIT_TRIES times while the spread is above UNIT_SPREAD_LIMIT (the
    quietest try is kept). ``expected`` = (low, high) plausible rate of the device."""
    kind = "cuda" if is_cuda(device) else "cpu"
    warm = []
    t0 = time.perf_counter()
    while True:  # until steady: the last calls' median near the fastest call seen
        start = time.perf_counter()
        fn()
        synchronize(device)
        warm.append(time.perf_counter() - start)
        elapsed = time.perf_counter() - t0
        if len(warm) >= warmup and elapsed >= UNIT_WARMUP_S[kind] and (
                statistics.median(warm[-10:]) <= UNIT_STEADY * min(warm) or elapsed >= UNIT_WARMUP_MAX_S[kind]):
            break
    long_calls = kind == "cpu" and statistics.median(warm) > UNIT_LONG_S
    reps = max(reps, UNIT_REPS_LONG if long_calls else UNIT_REPS)
    best = None
    for _ in range(1 if long_calls else UNIT_TRIES):
        ms, spread = time_ms_spread(fn, device=device, warmup=1, reps=reps)
        if best is None or spread < best[1]:
            best = (ms, spread)
        if spread <= UNIT_SPREAD_LIMIT:
            break
    ms, spread = best
    rate = work / (ms * 1e-3)
    unit = Unit(name, ms, spread, reps, rate, warmup_s=elapsed)
    problems = []
    if spread > UNIT_SPREAD_LIMIT:
        problems.append(f"its timings spread by {spread:.0%} (inter-quartile range / median, limit "
                        f"{UNIT_SPREAD_LIMIT:.0%}): the machine is busy or throttling")
    if expected is not None:
        low, high = expected
        if not low <= rate <= high:
            problems.append(f"{_rate_text(rate, rate_unit)} is outside what this device class does "
                            f"({_rate_text(low, rate_unit)} to {_rate_text(high, rate_unit)})")
    if problems:
        unit.warning = (f"UNIT LOOKS WRONG: {name} = {ms:.3g} ms: " + "; ".join(problems)
                        + ". Every ratio of the table is relative to it: re-run on a quiet machine.")
    return unit


def _rate_text(rate: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if rate >= scale:
            return f"{rate / scale:.3g} {prefix}{unit}"
    return f"{rate:.3g} {unit}"


def expected_gemm_flops(device, itemsize: int, flops: float) -> Optional[tuple]:
    """(low, high) FLOP/s that a GEMM of ``flops`` may plausibly reach on ``device``;
    None where a small GEMM on a GPU may be launch-bound (no low bound is meaningful)."""
    if not is_cuda(device):
        low, high = CPU_GEMM_FLOPS_PER_CORE[4 if itemsize >= 4 else 2]
        return low * _cores(), high * _cores()
    from logitless.planning.cost_model import device_model

    dev = device_model(torch.device(device))
    peak = dev.gemm_flops_32 if itemsize >= 4 else dev.gemm_flops_16
    # fp32 at "highest" runs without TF32: far below the tensor-core rate, never above it.
    low = GPU_LOW_FRACTION * peak if flops >= 1e11 and itemsize < 4 else 0.0
    return low, GPU_HIGH_FRACTION * peak


def expected_copy_bps(device, nbytes: int) -> tuple:
    if not is_cuda(device):
        return CPU_COPY_BPS
    from logitless.planning.cost_model import device_model

    bw = device_model(torch.device(device)).hbm_bw
    return (GPU_LOW_FRACTION * bw if nbytes >= 2**28 else 0.0), GPU_HIGH_FRACTION * bw


def gemm_unit(x: torch.Tensor, weight: torch.Tensor, *, warmup: int = 3, reps: int = 10) -> Unit:
    """The unit of the lce suite: one (B,H)x(H,V) product ``x @ weight.T`` (cuBLAS on a GPU)."""
    flops = 2.0 * x.shape[0] * x.shape[1] * weight.shape[0]
    with torch.no_grad():
        return measure_unit("1 GEMM", lambda: x @ weight.T, flops, device=x.device, warmup=warmup, reps=reps,
                            expected=expected_gemm_flops(x.device, x.element_size(), flops))


def gemm_ms(x: torch.Tensor, weight: torch.Tensor, *, warmup: int = 3, reps: int = 10) -> float:
    """Median ms of the GEMM unit (``gemm_unit``)."""
    return gemm_unit(x, weight, warmup=warmup, reps=reps).ms


def copy_unit(device, *, nbytes: Optional[int] = None, warmup: int = 3, reps: int = 10) -> Unit:
    """The unit of the ce suite: a large device-to-device copy; its rate counts bytes
    read plus bytes written (2 * nbytes per copy)."""
    if nbytes is None:
        nbytes = 2**30 if is_cuda(device) else 64 * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return measure_unit("copy", lambda: dst.copy_(src), 2.0 * nbytes, device=device, warmup=warmup, reps=reps,
                        expected=expected_copy_bps(device, nbytes), rate_unit="B/s")


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
