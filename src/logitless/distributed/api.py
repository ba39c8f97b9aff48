"""The public functions' side of vocab parallelism: ``process_group=``, DTensor heads
(``dtensor``) and ``vocab_size=`` (a padded vocabulary) -> local tensors and the
``VocabParallelOptions`` that the custom ops take. Plain Python that torch.compile traces:
no collective, no host sync here (the ops exchange the layout, once)."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from logitless.options import VocabParallelOptions, check_vocab_size

from . import dtensor as _dtensor
from .dtensor import dtensor_type
from .layout import group_name


def _check_group(op: str, process_group) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{op}: process_group must be a torch.distributed.ProcessGroup (e.g. the tensor-parallel "
                        f"group, or mesh.get_group() of a 1-D DeviceMesh), got {type(process_group).__name__}")


def prepare(op: str, names: tuple[str, str, str], x: Tensor, weight: Tensor, bias: Optional[Tensor], *,
            process_group, vocab_size: Optional[int], partial_dx: bool):
    """(x, weight, bias, VocabParallelOptions) for one LM head.

    DTensor inputs (``dtensor.local_head``) or ``process_group``: the local tensors and
    the group's name; the ops merge statistics over the group. Neither: today's
    single-GPU op (a DTensor among them raises the FSDP error); ``vocab_size`` then
    slices the weight's (and bias') first rows (autograd gives the padding rows zero
    gradient) and ``partial_dx`` raises. ``vocab_size`` is checked here; that it is at
    most the full weight's rows, in the op (only the ranks together know them).
    """
    vsize = check_vocab_size(vocab_size)
    if not isinstance(partial_dx, bool):
        raise TypeError(f"{op}: partial_dx must be a bool, got {type(partial_dx).__name__}")
    dtensor = dtensor_type()  # (None until torch.distributed.tensor is imported)
    if dtensor is not None and (isinstance(x, dtensor) or isinstance(weight, dtensor) or isinstance(bias, dtensor)):
        if process_group is not None:
            raise ValueError(f"{op}: pass either DTensor inputs or process_group=, not both (the DTensors' mesh "
                             "is the group)")
        x, weight, bias, pg, partial_dx = _dtensor.local_head(op, names, x, weight, bias, partial_dx)
        return x, weight, bias, VocabParallelOptions(group_name(pg), vsize, partial_dx)
    if process_group is not None:
        _check_group(op, process_group)
        return x, weight, bias, VocabParallelOptions(group_name(process_group), vsize, partial_dx)
    if partial_dx:
        raise ValueError(f"{op}: partial_dx=True needs a vocab-parallel head (process_group= or DTensor inputs)")
    if vsize > 0 and isinstance(weight, Tensor) and weight.dim() == 2:
        if vsize > weight.shape[0]:
            raise ValueError(f"{op}: vocab_size={vsize} exceeds the {weight.shape[0]} rows of {names[1]}")
        if vsize < weight.shape[0]:
            weight = weight[:vsize]
            if isinstance(bias, Tensor) and bias.dim() == 1 and bias.shape[0] > vsize:
                bias = bias[:vsize]
    return x, weight, bias, VocabParallelOptions()


plain = _dtensor.plain
