"""DTensor inputs of the fused linear ops: torchtitan-style vocab-parallel heads.

A ``weight`` DTensor ``Shard(0)`` on a 1-D mesh (the head's rows split over the mesh, as
``ColwiseParallel`` shards ``nn.Linear.weight``) with an ``x`` DTensor on the same mesh:

    x Replicate()   every rank holds all tokens (torchtitan's head input after its
                    input hook): the op runs on the local tensors; x's gradient comes
                    back Replicate() (all-reduced by the op), or Partial() with
                    ``partial_dx=True`` (DTensor reduces it where it is used).
    x Shard(d)      sequence parallel (d < x.dim() - 1, e.g. a norm's output under
                    ``SequenceParallel``): x is all-gathered to Replicate() first, and its
                    gradient leaves the op Partial(), which DTensor's backward of that
                    all-gather reduce-scatters back to Shard(d).

weight's and bias's gradients come back as DTensors ``Shard(0)`` like the parameters.
A ``Shard(0)`` weight with a plain ``x`` is FSDP2's layout (each rank a different x,
outside the module's forward), refused with the FSDP error. ``dtensor_type`` (DTensor's
class, once loaded) also serves ``ops.common.validate``'s DTensor check.
"""

from __future__ import annotations

import sys
from typing import Optional, overload

import torch
from torch import Tensor

_DTENSOR: list = []  # DTensor's class, once found (it does not change while the process lives)


def dtensor_type():
    """DTensor's class if torch.distributed.tensor is loaded (no DTensor exists otherwise).
    Cached for eager calls only: a compiled graph that read the cache would be guarded on
    it and recompiled once it fills (the first compiled step of a process did that)."""
    compiling = torch.compiler.is_compiling()
    if _DTENSOR and not compiling:
        return _DTENSOR[0]
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "DTensor"):
            if not compiling:
                _DTENSOR.append(module.DTensor)
            return module.DTensor
    return None


def is_dtensor(t) -> bool:
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def _placements(t) -> str:
    return ", ".join(str(p) for p in t.placements)


def _fsdp_error(op: str, name: str, t) -> TypeError:
    return TypeError(
        f"{op}: {name} is a DTensor (placements {tuple(t.placements)}) but the hidden states are a plain "
        "tensor: e.g. a parameter sharded by FSDP2's fully_shard, used outside the module's forward. Call "
        f"{op} inside the forward of the module that owns it (FSDP2 unshards its parameters there into "
        "plain tensors), or register the method that calls it with "
        "torch.distributed.fsdp.register_fsdp_forward_method(module, 'method'). For a vocab-parallel head "
        "(tensor parallelism), pass the hidden states as a DTensor on the weight's mesh (Replicate() or "
        "sharded over the tokens), or plain local tensors with process_group=."
    )


def local_head(op: str, names: tuple[str, str, str], x: Tensor, weight: Tensor, bias: Optional[Tensor],
               partial_dx: bool):
    """(x, weight, bias as local tensors, the mesh's ProcessGroup, partial_dx for the op)
    for DTensor inputs (module docstring), or a TypeError naming what is wrong."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    x_name, w_name, b_name = names
    if not is_dtensor(weight):
        bad = x_name if is_dtensor(x) else b_name
        raise TypeError(f"{op}: {bad} is a DTensor but {w_name} is not; a vocab-parallel head needs {w_name} "
                        "as a DTensor Shard(0) on a 1-D mesh (or plain local tensors with process_group=)")
    if not is_dtensor(x):
        raise _fsdp_error(op, w_name, weight)
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise TypeError(f"{op}: {w_name} is a DTensor on a {mesh.ndim}-D mesh; a vocab-parallel head needs a "
                        "1-D mesh (call the op inside the FSDP module's forward, where FSDP leaves the "
                        "tensor-parallel mesh only)")
    if tuple(weight.placements) != (Shard(0),):
        raise TypeError(f"{op}: {w_name} has placements ({_placements(weight)}); a vocab-parallel head needs "
                        "Shard(0) (rows split over the mesh, as ColwiseParallel)")
    if x.device_mesh != mesh:
        raise TypeError(f"{op}: {x_name} and {w_name} are DTensors on different meshes")
    if bias is not None:
        if not is_dtensor(bias) or bias.device_mesh != mesh or tuple(bias.placements) != (Shard(0),):
            raise TypeError(f"{op}: {b_name} must be a DTensor Shard(0) on {w_name}'s mesh, like {w_name}")
        bias = bias.to_local()
    (placement,) = x.placements
    if isinstance(placement, Replicate):
        x = x.to_local(grad_placements=[Partial() if partial_dx else Replicate()])
    elif isinstance(placement, Shard) and placement.dim % x.dim() < x.dim() - 1:
        # Sequence parallel: all-gather the tokens; the gradient leaves the op partial and
        # the all-gather's backward reduce-scatters it.
        x = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        partial_dx = True
    else:
        raise TypeError(f"{op}: {x_name} has placements ({_placements(x)}); expected Replicate() or Shard(d) "
                        "over a token dimension (sequence parallel), never the hidden dimension")
    return x, weight.to_local(), bias, mesh.get_group(), partial_dx


@overload
def plain(t: Tensor) -> Tensor: ...
@overload
def plain(t: None) -> None: ...
@overload
def plain(t: Optional[Tensor]) -> Optional[Tensor]: ...


def plain(t: Optional[Tensor]) -> Optional[Tensor]:
    """A DTensor's full value as a plain tensor (targets, class weights); others unchanged."""
    if t is None or type(t) is Tensor:  # (the common case, without the DTensor lookup)
        return t
    if is_dtensor(t):
        return t.full_tensor()
    return t
