"""AMD GPUs under ROCm (HIP): which target the planner sees, its tiles and kernel options.

PyTorch on ROCm reports AMD GPUs as ``device.type == "cuda"`` with ``torch.version.hip``
set; the architecture is ``torch.cuda.get_device_properties(d).gcnArchName``
("gfx942:sramecc+:xnack-" on an MI300X/MI325X, "gfx950:..." on an MI350X/MI355X). This
module reads it (``arch``: the planners get it through ``device.DeviceFacts.arch``) and
gives what differs from the NVIDIA path:

    tiles          Triton tiles (block_n, block_v, block_h, num_warps, num_stages) of the
                   fused GEMM kernels, by input itemsize (``ROCM_TILES``, ``JSD_ROCM_TILES``)
    adapt_plan     a plan without Hopper-only features: no TMA descriptors (``tma``,
                   ``dz_tma`` off: the kernels take the pointer path), and no other change
    dot_precision  tl.dot's ``input_precision`` on HIP: Triton's AMD backend accepts
                   "ieee" everywhere and "tf32" on gfx942 only (CDNA3's xf32 MFMA);
                   "tf32x3" is NVIDIA-only

The device models (``cost_model.MI300X``, ``cost_model.MI355X``) are chosen by
``cost_model.device_model`` through ``arch`` too. Nothing here has run on AMD hardware:
the kernels are compiled ahead of time on the CPU for gfx942 and gfx950
(``benchmarks/check_gpu_compile.py``, ``tests/test_gpu_compile.py``; docs/rocm.md).

Hardware facts the tiles follow (AMD CDNA3 / CDNA4 ISA guides): wavefronts of 64 lanes
(a Triton "warp" is a wavefront: num_warps=8 is 512 threads), 512 VGPRs per lane per SIMD
(256 architectural + 256 accumulation registers) shared by the waves resident on it, LDS
(shared memory) 64 KiB per CU on gfx942 and 160 KiB on gfx950, MFMA matrix instructions
(no wgmma, no TMA). Triton's AMD stream pipeliner is tuned for num_stages=2.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

#: LDS bytes per CU (what one program's shared memory must fit), by architecture.
LDS_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}
#: Architectures with tiles of their own; any other AMD GPU takes gfx942's (the smaller LDS).
KNOWN_ARCHS = ("gfx942", "gfx950")
#: Wavefront width of the CDNA GPUs (GPUTarget's warp size for an AOT compile).
WAVEFRONT = 64

#: Tiles of the fused linear kernels (linear_cross_entropy, linear_log_probs) by input
#: itemsize, per architecture. Chosen from AOT compiles on the CPU, not from timings (no
#: AMD GPU has run them): the largest candidates with no VGPR spill in any kernel the ops
#: launch with them, every flag on (``benchmarks/check_gpu_compile.py``; the registers of
#: each candidate in ``benchmarks/results/rocm-tiles-cpu-*``). 8 wavefronts (512 threads)
#: leave each lane 256 VGPRs, 4 wavefronts 512 (AGPRs too): at 128 x 128 x 64 and 8
#: wavefronts the 16-bit forward spilled 2-35 VGPRs with every flag on and the kept-columns
#: dz kernel (an elementwise pass over the forward's tile) 98-118; at 128 x 64 x 64 and 4
#: wavefronts nothing spills (forward 298-393 VGPRs), LDS 16-25 KiB (gfx942 has 64). fp32:
#: 128 x 64 x 32, 4 wavefronts (128 x 128 x 32 at 8 spilled 28 in the forward).
ROCM_TILES = {
    "gfx942": {2: (128, 64, 64, 4, 2), 4: (128, 64, 32, 4, 2)},
    "gfx950": {2: (128, 64, 64, 4, 2), 4: (128, 64, 32, 4, 2)},
}
#: linear_jsd's backward and KL-limit forward kernels (a student and a teacher tile at
#: once: two fp32 accumulators), by itemsize. gfx950's 16-bit KL forward at 128 x 64 x 64
#: spilled 116 VGPRs with 8 wavefronts and 197 with 4 (gfx942: 162 VGPRs, none), at
#: 128 x 64 x 32 and 8 wavefronts 6 (reverse KL with hard labels); at 64 x 64 x 32 and 4
#: wavefronts it takes 268-320, none.
JSD_ROCM_TILES = {
    "gfx942": {2: (128, 64, 64, 8, 2), 4: (64, 64, 32, 4, 2)},
    "gfx950": {2: (64, 64, 32, 4, 2), 4: (64, 64, 32, 4, 2)},
}


def is_hip() -> bool:
    """PyTorch built for ROCm (``torch.version.hip`` set)."""
    import torch

    return getattr(torch.version, "hip", None) is not None


@functools.lru_cache(maxsize=64)
def _arch_of(index: int) -> str:
    import torch

    name = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "") or ""
    return name.split(":")[0]


def arch(device) -> Optional[str]:
    """"gfx942", "gfx950", ... for an AMD GPU under ROCm; None on NVIDIA GPUs, the CPU
    or a ROCm device that reports no architecture."""
    if getattr(device, "type", None) != "cuda" or not is_hip():
        return None
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return _arch_of(index) or None


def _table_arch(a: str) -> str:
    return a if a in KNOWN_ARCHS else "gfx942"


def tiles(arch_name: Optional[str], itemsize: int, jsd: bool = False) -> Optional[tuple]:
    """The tile table's entry for an AMD GPU of architecture ``arch_name`` (the device's
    ``device.DeviceFacts.arch``); None elsewhere (``arch_name`` None: the CUDA tables apply)."""
    if arch_name is None:
        return None
    table = JSD_ROCM_TILES if jsd else ROCM_TILES
    return table[_table_arch(arch_name)][4 if itemsize >= 4 else 2]


def adapt_plan(plan, arch_name: Optional[str]):
    """``plan`` for a device of architecture ``arch_name``: on an AMD GPU without TMA (x and
    W tiles, kept tiles and dz through pointers: the kernels' non-TMA path); unchanged
    elsewhere (None)."""
    if arch_name is None or not (plan.tma or plan.dz_tma):
        return plan
    return dataclasses.replace(plan, tma=False, dz_tma=False)


def dot_precision(dtype_is_fp32: bool, tf32_allowed: bool, device=None,
                  arch_name: Optional[str] = None) -> str:
    """tl.dot's ``input_precision`` on an AMD GPU. 16-bit inputs: "ieee" (ignored by the
    bf16/fp16 MFMAs; Triton's gfx950 backend rejects "tf32" even there). fp32 at matmul
    precision "highest": "ieee" (fp32 MFMA: fp32 products, at least 3xTF32's accuracy).
    fp32 at "high"/"medium": "tf32-round" on gfx942 (operands rounded to TF32, xf32 MFMA:
    the products cuBLAS and the NVIDIA path give); "ieee" on gfx950 and other AMD GPUs (no xf32).
    ``arch_name``: the architecture (default: ``device``'s, or the current device's)."""
    if not dtype_is_fp32 or not tf32_allowed:
        return "ieee"
    if arch_name is None:
        import torch

        arch_name = arch(device if device is not None else torch.device("cuda", torch.cuda.current_device()))
    if arch_name != "gfx942":
        return "ieee"
    return "tf32-round"
