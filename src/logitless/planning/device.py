"""What the planners read about a device: ``facts(device) -> DeviceFacts``, the one seam.

Every plan that depends on the device depends on these facts only, never on a torch
device's own state: the planning model (``model``, a ``cost_model.DeviceModel``: the CPU
interpreter's ``INTERPRETER`` or a GPU class), the multiprocessors the launch plans
assume, the name the tuned-tile tables are keyed by, the AMD architecture, the compute
capability and L2 size the CuTe choice reads, and whether the CuTe DSL is usable.

``facts(device)`` reads them of a torch device once per device (``(type, index)``; an
index-less CUDA device is the current one) and keeps them until ``memo.clear()``; given
a ``DeviceFacts`` it returns it unchanged. The planners take either: the library passes
torch devices, tests and probes describe a device they do not have by building a
``DeviceFacts`` and passing it (``plans.triton_plan(..., DeviceFacts(model=H100,
sms=132))``), or replace this function from the test side for the ops' own calls
(``tests/planning_seams.py``). Every library site calls it as ``device.facts``, so
there is one place to replace.

Each device runs one planning rule, the one its model names: ``INTERPRETER`` (the CPU,
and any device that is not CUDA) takes the interpreter's tiles and the greedy kept
columns and chunks, the GPU classes the tile tables, tuned tiles and the cost model's
columns (``plans.triton_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from logitless.planning import cost_model as _cost_model
from logitless.planning.memo import cache, device_key

#: Multiprocessors the plans assume on the CPU interpreter: few programs keep it quick.
INTERPRETER_SMS = 4


@dataclass(frozen=True)
class DeviceFacts:
    """The facts the planners read about one device (module docstring).

    model: the planning model: ``cost_model.INTERPRETER`` (the interpreter's rule) or a GPU
        class (``cost_model.H100``, ...: the GPU rule, its constants price the plans).
    sms: multiprocessors the launch plans assume (splits, program order, persistent
        programs); ``model.sms`` is the cost model's own.
    name: the GPU's name (tuned-tile tables, the tuner's cache file); "cpu" elsewhere.
    arch: the AMD architecture under ROCm ("gfx942", ...), else None (``planning.rocm``).
    capability: the NVIDIA compute capability, e.g. (9, 0); None on ROCm and off GPUs.
    l2_bytes: L2 bytes (0: unknown, the CuTe planner assumes ``cute.L2_DEFAULT``).
    cute_available: None: the CuTe DSL's own check (``cute.dsl_problem``, once per
        process, only where a plan would take the kernel); True / False: assume it.
    """

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


#: The CPU interpreter's facts (every device that is not CUDA).
INTERPRETER = DeviceFacts(model=_cost_model.INTERPRETER, sms=INTERPRETER_SMS)

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
