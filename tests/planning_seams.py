"""The tests' handles on the planner: plans for a described device, plans reshaped by hand,
the CuTe kernel launches an op made. Test-side code: the library reads no switch for them.

    described(**fields)   a ``DeviceFacts``: the CPU interpreter's with ``fields`` replaced
    H100                  the facts of an H100 (its cost model, 132 SMs, sm_90, 50 MiB L2)
    on_device(facts)      while inside, every torch device plans with ``facts`` (the ops'
                          own calls on CPU tensors too): ``planning.device.facts`` replaced
    reshaped(reshape)     while inside, every ``plans.triton_plan`` (linear_cross_entropy's
                          and linear_log_probs' plans) passes through ``reshape``, and the
                          CuTe forward is off (the Triton plan is what is under test)
    cute_launches()       while inside, a list that gets one dict (op, n, v, h, splits,
                          dtype, smooth, entropy, scale, group, keep_cols) per CuTe kernel
                          launch of an op (``cute_lib.launch._launch`` wrapped)

A planner called directly takes the facts as its device argument instead
(``plans.triton_plan(..., H100)``). Each context clears the planners' memo on entry and on
exit (a plan memoised by device would outlive the replacement). The replacements are
process-wide, not per thread: a backward on autograd's device thread sees them too.
"""

from __future__ import annotations

import contextlib
import dataclasses

from logitless.planning import cost_model, memo, plans
from logitless.planning import device as _device
from logitless.planning.device import DeviceFacts
from logitless.planning.overrides import override

#: An H100 as the planners see one (no tuned-tile cache of this machine: set LOGITLESS_TUNED=0
#: where the shipped tables must apply).
H100 = DeviceFacts(model=cost_model.H100, sms=132, name="NVIDIA H100 80GB HBM3", capability=(9, 0),
                   l2_bytes=50 * 2**20)


def described(**fields) -> DeviceFacts:
    """The CPU interpreter's facts with ``fields`` replaced, e.g. ``described(sms=132)``."""
    return dataclasses.replace(_device.INTERPRETER, **fields)


@contextlib.contextmanager
def _replaced(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    memo.clear()
    try:
        yield
    finally:
        setattr(module, name, original)
        memo.clear()


@contextlib.contextmanager
def on_device(facts: DeviceFacts):
    """Every torch device plans with ``facts`` while inside (facts passed as such stay)."""
    with _replaced(_device, "facts", lambda device: device if type(device) is DeviceFacts else facts):
        yield facts


@contextlib.contextmanager
def reshaped(reshape):
    """Every ``plans.triton_plan`` result passes through ``reshape`` (a function TritonPlan
    -> TritonPlan) while inside; the CuTe forward is off."""
    original = plans.triton_plan

    def triton_plan(*args, **kwargs):
        return reshape(original(*args, **kwargs))

    with _replaced(plans, "triton_plan", triton_plan), override(cute=False):
        yield


class Launches(list):
    """``cute_launches``' list: one dict per CuTe kernel launch of an op."""

    def ops(self) -> list:
        return [d["op"] for d in self]


@contextlib.contextmanager
def cute_launches():
    """A ``Launches`` list of the CuTe kernel launches of ops made while inside (module
    docstring)."""
    from logitless.cute_lib import launch as cute_launch

    seen = Launches()
    original = cute_launch._launch

    def launch(fs, key, x, weight, tgt, parts, splits, *, scale, smooth, entropy, keep, op=None):
        if op is not None:
            seen.append(dict(op=op, n=x.shape[0], v=weight.shape[0], h=x.shape[1], splits=splits, dtype=key[1],
                             smooth=smooth is not None, entropy=entropy is not None, scale=scale, group=key[6],
                             keep_cols=keep[0].shape[1] if keep is not None else 0))
        return original(fs, key, x, weight, tgt, parts, splits, scale=scale, smooth=smooth, entropy=entropy,
                        keep=keep, op=op)

    cute_launch._launch = launch
    try:
        yield seen
    finally:
        cute_launch._launch = original
