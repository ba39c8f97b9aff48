"""Torch side of the CuTe DSL kernels: launch ``forward_stats`` on torch tensors.

Imported only when ``planning.cute.forward_plan`` chose the CuTe kernel (it imports
cutlass). The kernel runs on torch's current CUDA stream (CUDA-graph capture and
torch.compile'd steps see an ordinary kernel launch; the first call per configuration
compiles, ~1 s: warm up before capturing a graph). No host sync.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from logitless.planning.overrides import current as _overrides


def forward_partials(op: str, x: Tensor, weight: Tensor, target: Tensor, parts, splits: int, *,
                     scale: float = 1.0, smooth: Optional[Tensor] = None, entropy: Optional[Tensor] = None,
                     stages: int = 4, specialised: bool = True, group: int = 0,
                     keep: Optional[tuple] = None) -> None:
    """Fill ``parts`` = (max, sum, target) (each (splits, N) fp32, ``triton_lib.launch.
    partials``) and the optional ``smooth`` (sum of a) and ``entropy`` (sum e (a - m))
    partials of a = scale * x W^T over ``splits`` vocabulary splits (``forward_stats``).
    x (N, H), weight (V, H): bf16/fp16, contiguous, 16-byte aligned (the planner checked).
    ``keep`` = (keep, keep_max, keep_block): the forward also keeps exp(a - m) for the
    first keep.shape[1] columns into ``keep`` ((N, keep_cols) view, unit column stride,
    x's dtype) and the maxima m into ``keep_max`` ((ceil(keep_cols / keep_block), N) fp32),
    as ``triton_lib.launch.keep_buffers`` lays them out (the Triton backward reads them)."""
    from . import forward_stats as fs

    n, h = x.shape
    v = weight.shape[0]
    dtype = str(x.dtype).removeprefix("torch.")
    keep_block = keep[2] if keep is not None else 0
    compiled = fs.compile_forward(h, dtype, smooth is not None, entropy is not None, stages, specialised,
                                  group, keep_block)
    tgt = target if target.dtype == torch.int32 and target.is_contiguous() else target.to(torch.int32).contiguous()
    part_max, part_sum, part_tgt = parts
    addrs = [p.data_ptr() for p in (part_max, part_sum, part_tgt,
                                    smooth if smooth is not None else part_max,
                                    entropy if entropy is not None else part_max)]
    probe = _overrides().cute_probe
    if probe is not None:
        probe(dict(op=op, n=n, v=v, h=h, splits=splits, dtype=dtype, smooth=smooth is not None,
                   entropy=entropy is not None, scale=scale, group=group,
                   keep_cols=keep[0].shape[1] if keep is not None else 0))
    stream = torch.cuda.current_stream(x.device).cuda_stream
    with torch.cuda.device(x.device):
        kept = (0, 0, 0, 0)
        if keep is not None:
            kbuf, kmax, _ = keep
            kept = (kbuf.data_ptr(), kmax.data_ptr(), kbuf.shape[1], kbuf.stride(0))
        fs.launch(compiled, x.data_ptr(), weight.data_ptr(), tgt.data_ptr(), addrs, float(scale), n, v, splits,
                  stream, dtype, kept)
