"""When the forward statistics run on the CuTe DSL Hopper kernel (``cute_lib``), and how.

``forward_plan(device, dtype, n, v, h, layout_ok, ...)`` returns a ``CutePlan`` (vocabulary
splits, pipeline) or None (the Triton kernel runs); the backends call it from their memoised
plans, so a steady-state call does not come here. It says "CuTe" only when all of these hold:

  * not turned off: ``override(cute=False)``, or the environment variable
    ``LOGITLESS_CUTE=0`` (read per call; ``override(cute=True)`` ignores it), or an
    override aimed at the Triton plan (tiles, strategy);
  * a CUDA device of compute capability 9.x (sm_90a: wgmma, TMA, setmaxnreg), by its
    ``device.DeviceFacts`` (``capability``: None under ROCm);
  * the DSL is usable (``dsl_problem``): the optional ``nvidia-cutlass-dsl`` (``pip install
    'logitless[hopper]'``) installed at a supported version (``DSL_MIN`` <= version <
    ``DSL_BELOW`` by its package metadata) and ``cutlass.cute`` importable, checked lazily
    once per process and only when a plan would take the kernel, never at ``import
    logitless``; a ``DeviceFacts.cute_available`` of True / False replaces the check
    (tests describing a device). Then the
    kernel must compile and launch (``cute_lib.launch.ready``, once per compiled
    configuration). Any of these failing means the Triton forward, with one
    ``CuteFallbackWarning`` per process and cause (``warn_fallback``): an optional
    accelerator never breaks a call;
  * x and W of one dtype, bfloat16 or float16, row-major with unit last stride and
    16-byte aligned, H % 8 == 0 (TMA's 16-byte stride rule), N >= 1, V >= 1;
  * options the kernel computes: no bias, no soft-cap, no argmax, no class weights
    inside the kernel (the weighted smoothing sum); kept columns (the plan's ``keep_cols``
    > 0: a gradient to come and a budget holding some logits) in blocks of ``keep_block``
    columns (the Triton plan's block_v) that divide the kernel's 256-column tile: the
    kernel then stores exp(a - m) and m where the Triton forward would.

CTA order and splits (``plan_for``): one CTA per (128-row block, split), one CTA per SM,
each re-reading its x block once per 256-column vocabulary tile. Splits: about ``WAVES``
full waves, floor(2 * SMs / row blocks), at least 1, at most the vocabulary's tiles. When
the x blocks in flight (min(row blocks, SMs) x 128 x H x 2 bytes) exceed L2, Triton's
grouped order (``GROUP`` row blocks at a time, ``triton_lib.gemm.grouped_tile``) with at
least ``GROUP_SPLITS`` splits.

Where the Triton forward is faster (``triton_faster``; the automatic choice only,
``override(cute=True)`` forces CuTe): fewer than ``MIN_SLABS_PER_CTA`` 64-wide steps of H
per CTA (pipeline fill and epilogue not amortised); the entropy term where the grouped
order is needed; x in flight above ``TRITON_X_OVER_L2`` times L2; and more than
``KEEP_SHARE`` of the columns kept (the kernel stores kept values element by element,
Triton by TMA tiles; at 512-1024 tokens too, where the default budget keeps them all).
The measurements behind these thresholds are in docs/design.md ("CuTe forward").
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import warnings
from typing import Optional

from logitless.planning import device as _device
from logitless.planning.overrides import current as _overrides
from logitless.planning.tiles import CutePlan  # noqa: F401  (re-exported: the plan lives there)

ENV = "LOGITLESS_CUTE"
TILE_M, TILE_N, TILE_K = 128, 256, 64
WAVES = 2
#: L2 bytes assumed when the device does not say (the H100's and H200's 50 MiB).
L2_DEFAULT = 50 * 2**20
#: Fewer k slabs per CTA than this: Triton (module docstring).
MIN_SLABS_PER_CTA = 128
#: Kept columns above this share of V: Triton (module docstring).
KEEP_SHARE = 0.25
#: The grouped CTA order where x in flight exceeds L2: row blocks per group, least splits.
GROUP, GROUP_SPLITS = 16, 16
#: x in flight above this many times L2: Triton (module docstring).
TRITON_X_OVER_L2 = 2.0


#: The nvidia-cutlass-dsl releases the kernel is used with: DSL_MIN <= version < DSL_BELOW.
#: Verified: 4.2.1 and 4.8.1 (4.7.1 and 4.8.1 are what quack >= 0.6, Liger's and
#: FlashAttention's CuTe kernels require); the releases between compile the same code (the
#: renamed DSL functions are looked up by either name: ``cute_lib.forward_stats``), and a
#: compile or launch failure of any release falls back (``cute_lib.launch.ready``).
#: 5.x: not yet released; its API may change, so it is refused until verified.
DSL_MIN, DSL_BELOW = (4, 2, 1), (5,)
DSL_DIST = "nvidia-cutlass-dsl"
#: What to install for the kernel (the ``hopper`` extra of pyproject.toml).
DSL_INSTALL = "pip install 'logitless[hopper]' (nvidia-cutlass-dsl>=4.7,<5; Python >= 3.12)"


class CuteFallbackWarning(UserWarning):
    """The CuTe DSL forward was planned but cannot run (``dsl_problem``, a failed compile or
    launch): the Triton forward runs instead. Issued once per process and cause."""


_WARNED: set = set()


def warn_fallback(cause: str) -> None:
    """Warn once per process per ``cause`` that the Triton forward runs instead of CuTe's."""
    if cause in _WARNED:
        return
    _WARNED.add(cause)
    warnings.warn(f"logitless: the CuTe DSL Hopper forward is off ({cause}); the Triton forward runs "
                  f"instead (same results to fp32 rounding). For the CuTe kernel: {DSL_INSTALL}; "
                  f"to silence this: LOGITLESS_CUTE=0.", CuteFallbackWarning, stacklevel=3)


def parse_version(text: str) -> tuple:
    """(major, minor, patch, ...) of a version string's leading numbers ("4.8.1.dev0" ->
    (4, 8, 1)); () when it starts with none."""
    m = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def version_problem(version: Optional[str]) -> Optional[str]:
    """Why DSL release ``version`` is not used (too old, too new), or None. Pure (tests);
    an unknown version (None) passes: the compile and launch checks decide."""
    if version is None:
        return None
    v = parse_version(version)
    lo = ".".join(map(str, DSL_MIN))
    hi = ".".join(map(str, DSL_BELOW))
    if not v:
        return f"{DSL_DIST} version {version!r} not understood (supported: >={lo},<{hi})"
    if v < DSL_MIN:
        return f"{DSL_DIST} {version} is too old (supported: >={lo},<{hi})"
    if v >= DSL_BELOW:
        return f"{DSL_DIST} {version} is newer than the verified releases (supported: >={lo},<{hi})"
    return None


def dsl_version() -> Optional[str]:
    """The installed nvidia-cutlass-dsl's version from its package metadata (no import of
    cutlass), else ``cutlass.__version__`` (a source tree on the path), else None."""
    try:
        return importlib.metadata.version(DSL_DIST)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return getattr(importlib.import_module("cutlass"), "__version__", None)
    except Exception:  # noqa: BLE001  (dsl_problem reports the import failure)
        return None


def _present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a module in sys.modules without a spec: present
        return name in sys.modules


@functools.cache
def dsl_problem() -> Optional[str]:
    """Why the CuTe DSL cannot be used in this process (absent, too old, too new, fails to
    import), or None; decided once per process (cached), without importing torch."""
    if not _present("cutlass"):
        return f"{DSL_DIST} is not installed"
    problem = version_problem(dsl_version())
    if problem is not None:
        return problem
    for module in ("cutlass.cute", "cuda.bindings.driver"):
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001  (a broken or partial install means: not available)
            return f"import {module} failed: {type(e).__name__}: {str(e)[:200]}"
    return None


def dsl_importable() -> bool:
    """Whether the DSL is usable in this process (``dsl_problem`` is None; once per process)."""
    return dsl_problem() is None


def dsl_usable_or_warn() -> bool:
    """``dsl_importable()``, warning once (``warn_fallback``) with the cause when not."""
    problem = dsl_problem()
    if problem is not None:
        warn_fallback(problem)
        return False
    return True


def splits_for(n: int, v: int, num_sms: int) -> int:
    """Vocabulary splits for N rows and V columns on ``num_sms`` SMs: about WAVES full
    waves of CTAs (module docstring), at least 1, at most ceil(V / 256)."""
    row_blocks = -(-n // TILE_M)
    v_tiles = -(-v // TILE_N)
    return max(1, min(v_tiles, (WAVES * num_sms) // row_blocks))


def x_in_flight(n: int, h: int, num_sms: int, itemsize: int = 2) -> int:
    """Bytes of x the CTAs in flight read (one 128-row block each, one CTA per SM)."""
    return min(-(-n // TILE_M), num_sms) * TILE_M * h * itemsize


def plan_for(n: int, v: int, h: int, num_sms: int, l2_bytes: Optional[int] = None) -> CutePlan:
    """Splits and CTA order for N x H x V (module docstring): the plain grid with
    ``splits_for``'s splits, or, when x in flight exceeds L2, the grouped order with at
    least ``GROUP_SPLITS`` splits (at most the vocabulary's tiles)."""
    splits = splits_for(n, v, num_sms)
    if x_in_flight(n, h, num_sms) > (l2_bytes or L2_DEFAULT):
        return CutePlan(splits=min(-(-v // TILE_N), max(splits, GROUP_SPLITS)), group=GROUP)
    return CutePlan(splits=splits)


def triton_faster(*, n: int, v: int, h: int, num_sms: int, l2_bytes: Optional[int] = None,
                  entropy: bool = False, keep_cols: int = 0) -> Optional[str]:
    """Why the Triton forward is expected to be faster than the CuTe kernel at this shape
    (module docstring: measured), or None. Pure (tests)."""
    if keep_cols > v * KEEP_SHARE:
        return "most columns kept: the CuTe kernel's element-wise keep stores measured slower"
    plan = plan_for(n, v, h, num_sms, l2_bytes)
    if entropy and plan.group:
        return "the entropy term where the grouped order is needed: Triton measured faster"
    if plan.group and x_in_flight(n, h, num_sms) > TRITON_X_OVER_L2 * (l2_bytes or L2_DEFAULT):
        return f"x in flight over {TRITON_X_OVER_L2:g} times L2: Triton measured faster"
    v_tiles = -(-v // TILE_N)
    slabs = -(-v_tiles // plan.splits) * -(-h // TILE_K)
    if slabs < MIN_SLABS_PER_CTA:
        return f"{slabs} k slabs per CTA (< {MIN_SLABS_PER_CTA}): Triton measured faster"
    return None


def unsupported(*, capability: tuple, available: bool, dtype: str, n: int, v: int, h: int,
                layout_ok: bool, bias: bool = False, softcap: bool = False, argmax: bool = False,
                weighted_smooth: bool = False, keep_cols: int = 0, keep_block: int = 0) -> Optional[str]:
    """Why the CuTe kernel cannot run this call (a short reason), or None when it can.
    Pure: every fact is an argument (tests call it without a GPU or the DSL)."""
    if capability is None or capability[0] != 9:
        return f"needs compute capability 9.x, got {capability}"
    if not available:
        return "nvidia-cutlass-dsl (cutlass.cute) not importable"
    if dtype not in ("bfloat16", "float16"):
        return f"dtype {dtype} (bfloat16 or float16 only)"
    if n < 1 or v < 1:
        return "empty input"
    if h < 8 or h % 8:
        return f"hidden size {h} not a multiple of 8"
    if not layout_ok:
        return "x or weight not row-major contiguous and 16-byte aligned"
    for flag, what in ((bias, "bias"), (softcap, "softcap"), (argmax, "argmax"),
                       (weighted_smooth, "class-weighted label smoothing")):
        if flag:
            return f"{what} not in the CuTe kernel"
    if keep_cols and (keep_block < 8 or keep_block % 8 or TILE_N % keep_block):
        return f"kept columns in blocks of {keep_block} (must divide {TILE_N})"
    return None


def env_off() -> bool:
    """``LOGITLESS_CUTE=0`` (or false/off/no) in the environment."""
    return os.environ.get(ENV, "").strip().lower() in ("0", "false", "off", "no")


def enabled(ov, env_is_off: bool) -> bool:
    """The switch alone: ``override(cute=...)`` first; unset, the environment variable, and
    an override that shapes the Triton plan (tiles, strategy: a test or probe aimed at
    the Triton kernel) keeps the Triton kernel."""
    if ov.cute is not None:
        return bool(ov.cute)
    if env_is_off:
        return False
    return ov.tiles is None and ov.strategy is None


def choose(*, capability, available: bool, num_sms: int, dtype: str, n: int, v: int, h: int, layout_ok: bool,
           ov=None, env_is_off: bool = False, l2_bytes: Optional[int] = None, entropy: bool = False,
           **options) -> Optional[CutePlan]:
    """The decision from explicit facts (``unsupported``'s, the SM count, the L2 size, the
    overrides ``ov`` and the environment switch): a ``CutePlan`` or None. Without
    ``override(cute=True)``, shapes where ``triton_faster`` says so keep Triton. Pure (tests)."""
    ov = ov if ov is not None else _overrides()
    if not enabled(ov, env_is_off):
        return None
    if unsupported(capability=capability, available=available, dtype=dtype, n=n, v=v, h=h, layout_ok=layout_ok,
                   **options) is not None:
        return None
    if ov.cute is None and triton_faster(n=n, v=v, h=h, num_sms=num_sms, l2_bytes=l2_bytes, entropy=entropy,
                                         keep_cols=options.get("keep_cols", 0)) is not None:
        return None
    return plan_for(n, v, h, num_sms, l2_bytes)


def layout_fits(layout: tuple, h: int, dtype, row0: int = 0) -> bool:
    """Whether rows ``row0:`` of x and W suit the kernel's TMA loads: ``layout`` is (x and W of
    one dtype, x.stride(), W.stride(), x.data_ptr() % 16, W.data_ptr() % 16) as a backend reads
    it; both row-major with unit last stride and 16-byte aligned."""
    same_dtype, x_stride, w_stride, x_ptr, w_ptr = layout
    return (same_dtype and x_stride == (h, 1) and w_stride == (h, 1)
            and (x_ptr + row0 * h * dtype.itemsize) % 16 == 0 and w_ptr == 0)


def forward_plan(device, dtype, n: int, v: int, h: int, layout_ok: bool, *, keep_cols: int = 0, keep_block: int = 0,
                 bias: bool = False, softcap: bool = False, need_argmax: bool = False, weighted_smooth: bool = False,
                 entropy: bool = False) -> Optional[CutePlan]:
    """The CuTe plan of one forward of x (n, h) and W (v, h) on ``device`` (module docstring), or
    None: the Triton kernel runs. ``layout_ok``: ``layout_fits`` of the tensors; ``bias``,
    ``softcap``: present. The backends call it from their memoised plans."""
    facts = _device.facts(device)  # first: on a CPU or off Hopper, the only question asked here
    capability = facts.capability
    if capability is None or capability[0] != 9 or not enabled(_overrides(), env_off()):  # no DSL import
        return None
    # The DSL's own check (and its one warning) only where the plan would take the kernel.
    assumed = facts.cute_available
    plan = choose(capability=capability, available=assumed is not False, num_sms=facts.sms,
                  l2_bytes=facts.l2_bytes or None, dtype=str(dtype).removeprefix("torch."), n=n, v=v, h=h,
                  layout_ok=layout_ok, bias=bias, softcap=softcap, argmax=need_argmax, weighted_smooth=weighted_smooth,
                  keep_cols=keep_cols, keep_block=keep_block, entropy=entropy)
    if plan is None or assumed is not None:
        return plan
    return plan if dsl_usable_or_warn() else None
