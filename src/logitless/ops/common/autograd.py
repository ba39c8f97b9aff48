"""The autograd glue of the torch.library custom ops, shared by every op.

Each op is a forward and a backward custom op whose arguments are tensors, then the
fields of its options dataclass (``logitless.options``, under their own names), then
execution arguments (backend, budget, flags), their schemas written out in the op's
``custom_op.py``. ``EagerOp`` runs an op's implementation without the dispatcher in eager
mode (``contract.register_autograd`` makes it), with no frame of its own between the public
function and the implementation; ``guard_double_backward`` makes a second-order
gradient raise one clear error; ``under_forward_overrides`` runs a backward under the
planner overrides of its forward; ``EAGER`` maps each custom op to its Python
implementation (tests run them under dispatch modes, which otherwise see a custom op
as one opaque call).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

#: "logitless::<name>" -> the Python implementation behind the custom op (one registry,
#: ``glue.EAGER``).
from logitless.ops.common.glue import EAGER  # noqa: E402, F401
from logitless.planning import overrides as _overrides


def custom_op(name: str, fn: Callable, *, mutates_args=(), schema: Optional[str] = None):
    """``torch.library.custom_op("logitless::<name>", fn)`` (``schema``: written out, else
    inferred from ``fn``'s annotations), registered in ``EAGER``."""
    EAGER[f"logitless::{name}"] = fn
    return torch.library.custom_op(f"logitless::{name}", fn, mutates_args=mutates_args, schema=schema)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_INFRA_MODES = tuple(getattr(torch._C._TorchDispatchModeKey, k) for k in ("FAKE", "PROXY", "FUNCTIONAL")
                     if hasattr(torch._C._TorchDispatchModeKey, k))


def eager_fast_path_ok(inputs: tuple) -> bool:
    """Whether a plain autograd.Function may stand in for a custom op: an eager call on
    plain tensors, outside torch.compile, dispatch modes (FakeTensor, tracing, the tests'
    recorders), functorch transforms and tensor subclasses (DTensor...)."""
    # (compiling first: dynamo stops there)
    if torch.compiler.is_compiling():
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active():
        return False
    for k in _INFRA_MODES:
        if torch._C._get_dispatch_mode(k) is not None:
            return False
    for a in inputs:  # (a loop, not all(<generator>): this runs per call, ~20 inputs)
        if isinstance(a, torch.Tensor) and type(a) not in _PLAIN:
            return False
    return True


def below_autograd():
    """The context in which the eager fast path's backward calls the backward op's
    implementation, as the dispatcher runs a custom op's: recording no autograd history (a
    backward with create_graph=True runs with grad mode on, and the inputs require grad).
    A context, not a wrapper: no frame between the backward and its launches."""
    return torch.no_grad() if torch.is_grad_enabled() else _NO_CONTEXT


_NO_CONTEXT = contextlib.nullcontext()  # (reusable: it holds no state)


class EagerOp:
    """A forward custom op (``op``) with its autograd (``register_autograd``'s
    ``setup_context`` and ``backward``) and its eager fast path ``eager``: a plain
    autograd.Function (``Function.apply``, public) whose ``forward`` runs ``impl`` (the op's
    Python implementation, ``EAGER``) and the op's ``setup_context`` on the op's own
    arguments, and whose ``backward`` is the op's: the same computation, so the same results
    bitwise, without the torch.library layer's per-call work (schema default filling,
    aliasing checks, redispatch: ~0.2 ms per call of an op with ~20 arguments on the CPU,
    ``benchmarks/probe_host.py``). ``forward`` takes ``ctx`` (no ``setup_context`` on the
    Function): ``Function.apply`` then does not bind the ~20 arguments to a signature per
    call. ``backward`` runs with ``ctx.eager`` set on the fast path: it then calls the
    backward op's implementation, not the op.

    The public function calls ``eager_op.runner(inputs)(*inputs)``: ``runner`` picks
    (``eager`` for eager calls, ``eager_fast_path_ok``; the custom op for anything else:
    torch.compile, fake tensors, dispatch modes, subclasses) and returns, so no frame of
    this glue but ``forward`` stands between the public function and the op's implementation."""

    def __init__(self, op, impl: Callable, setup_context: Callable, backward: Callable):
        def forward(ctx, *inputs):
            out = impl(*inputs)
            ctx.eager = True  # the backward calls the backward op's implementation directly
            setup_context(ctx, inputs, out)
            return out

        name = getattr(op, "_name", getattr(impl, "__name__", "op")).split("::")[-1]
        function = type(f"Eager_{name}", (torch.autograd.Function,), {
            "forward": staticmethod(forward), "backward": staticmethod(backward), "__module__": __name__,
        })
        self.op, self.eager = op, function.apply

    def runner(self, inputs: tuple) -> Callable:
        """What runs the op on ``inputs``: ``eager`` where ``eager_fast_path_ok``, else the
        custom op."""
        return self.eager if eager_fast_path_ok(inputs) else self.op


def under_forward_overrides(setup_context: Callable, backward: Callable) -> tuple[Callable, Callable]:
    """(setup_context, backward) of ``register_autograd`` such that the backward runs under
    the planner overrides (``logitless.planning.overrides``) in effect at the forward.
    Autograd runs the backward of CUDA tensors on a device thread of its own, where the
    caller's ``override(...)`` context is not in effect (it is on CPU, in the caller's
    thread): without this a backward that re-plans (no kept columns) or reads an
    override (``tf32_preround``, tiles) would follow the defaults on GPUs only."""

    @functools.wraps(setup_context)
    def setup(ctx, inputs, output):
        ctx.overrides = _overrides.current()  # (overrides.saved(), inline)
        return setup_context(ctx, inputs, output)

    @functools.wraps(backward)
    def run(ctx, *grads):
        if _overrides.current() is ctx.overrides:
            # the forward's thread or no override at all
            return backward(ctx, *grads)
        with _overrides.restored(ctx.overrides):
            return backward(ctx, *grads)

    return setup, run


class NoDoubleBackward(torch.autograd.Function):
    """Identity on first-order gradients computed with create_graph=True; differentiating
    them again raises one clear error."""

    @staticmethod
    def forward(ctx, op: str, *tensors):
        ctx.op = op
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"logitless.{ctx.op}: double backward (differentiating its gradients, e.g. after "
            "torch.autograd.grad(..., create_graph=True)) is not supported"
        )


def guard_double_backward(op: str, grads: tuple, *inputs: Optional[Tensor]) -> tuple:
    """``grads`` unchanged, unless the backward runs with create_graph=True: then wrapped
    so that their own backward raises (``inputs`` make the wrapper part of the graph)."""
    if not torch.is_grad_enabled():
        return grads
    present = [i for i, g in enumerate(grads) if g is not None]
    extra = [t for t in inputs if t is not None and t.requires_grad]
    wrapped = NoDoubleBackward.apply(op, *[grads[i] for i in present], *extra)
    out = list(grads)
    for k, i in enumerate(present):
        out[i] = wrapped[k]
    return tuple(out)


from logitless.ops.common.glue import fake_grad_outputs, grad_outputs, zero_grads  # noqa: E402, F401
