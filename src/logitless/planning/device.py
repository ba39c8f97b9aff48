"""What the planners read about a device: ``facts(device) -> DeviceFacts``, the one seam.

Plans depend on a device through its facts alone: read of a torch device once (per
``(type, index)``, kept until ``memo.clear()``), or given as a ``DeviceFacts`` (returned
as is): the planners take either. Tests and probes describe a device they do not have by
building the facts (``plans.triton_plan(..., DeviceFacts(model=H100, sms=132))``) or by
replacing this function from their side (``tests/planning_seams.py``); library code calls
it as ``device.facts`` so that there is one place to replace. Each device runs the one
planning rule its model names (``DeviceFacts.gpu``, ``plans.triton_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from logitless.planning import cost_model as _cost_model
from logitless.planning.memo import cache, device_key


@dataclass(frozen=True)
class DeviceFacts:
    """model: the planning model, ``cost_model.INTERPRETER`` (the interpreter's rule) or a GPU
    class (the GPU rule; its constants price the plans). sms: multiprocessors the launch
    plans assume (``model.sms`` is the cost model's). name: the GPU's (tuned tiles, the
    tuner's cache), "cpu" elsewhere. arch: the AMD architecture under ROCm, else None.
    capability: the NVIDIA compute capability, None on ROCm and off GPUs. l2_bytes: 0 when
    unknown. cute_available: None, the CuTe DSL's own check (``cute.dsl_problem``: once, and
    only where a plan would take the kernel); True / False: assumed."""

    model: _cost_model.DeviceModel
    sms: int
    name: str = "cpu"
    arch: Optional[str] = None
    capability: Optional[tuple] = None
    l2_bytes: int = 0
    cute_available: Optional[bool] = None

    @property
    def gpu(self) -> bool:
        """The GPU planning rule (tile tables, tuned tiles, the cost model's columns)."""
        return not self.model.interpreter


#: Any device that is not CUDA: the interpreter's rule, 4 SMs (few programs keep it quick).
INTERPRETER = DeviceFacts(model=_cost_model.INTERPRETER, sms=4)
_FACTS: dict = cache()


def facts(device) -> DeviceFacts:
    """The facts of ``device`` (a torch device, read once; a ``DeviceFacts``, as is)."""
    if type(device) is DeviceFacts:
        return device
    key = (device.type, device.index) if device.index is not None or device.type != "cuda" else device_key(device)
    found = _FACTS.get(key)
    if found is None:
        found = _FACTS[key] = _read(*key)
    return found


def _read(kind: str, index) -> DeviceFacts:
    if kind != "cuda":
        return INTERPRETER
    import torch

    from logitless.planning import rocm

    device = torch.device("cuda", index)
    props = torch.cuda.get_device_properties(device)
    hip = rocm.is_hip()  # ROCm reports gfx942 as capability (9, 4): not a Hopper
    return DeviceFacts(model=_cost_model.device_model(device), sms=props.multi_processor_count,
                       name=torch.cuda.get_device_name(device), arch=rocm.arch(device),
                       capability=None if hip else tuple(torch.cuda.get_device_capability(device)),
                       l2_bytes=int(getattr(props, "L2_cache_size", 0) or 0))
