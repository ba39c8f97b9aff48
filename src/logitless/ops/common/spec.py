"""Custom-op scaffolding from one declaration per op (``OpSpec``).

An op declares its forward and backward as lists of arguments: tensors (``tensor``),
scalars (``scalar``) and options dataclasses (``options``: one group, the dataclass of
``logitless.options``, flattened here into one schema argument per field, under the
field's own name and type: torch.library cannot take dataclasses). From that ``build``
makes:

- the ``logitless::<name>`` forward and backward custom ops (schemas inferred from the
  generated signatures), whose implementations and fakes the op writes once each, with
  the GROUPED arguments (``impl(x, weight, ..., opts, backend, budget, ..., tp)``: one
  argument per group, the options rebuilt from their fields);
- ``setup_context`` and the autograd backward: the backward op's arguments are found by
  name among the forward's arguments, its outputs, the incoming gradients (``grads``:
  one name per output, None for a non-differentiable one) and ``need_<input>`` flags
  (``needs_input_grad`` of that forward input); tensors among them are saved for the
  backward, the rest is kept on ctx; outputs named in ``consumed`` are handed to the
  first backward only (``nothing``: what a later one gets);
- the call's plan (``plan_cls``: the output named ``plan`` holds the frozen dataclass
  the forward decided, or None): on the eager fast path the object itself reaches the
  backward on the autograd context; the custom ops carry it as a CPU int64 tensor
  (``plan_codec``: encoded after the forward's implementation, a fixed-size fake, decoded
  before the backward's implementation sees it), so the op's own code only ever sees
  the object;
- the gradient-in-forward strategy (``forward_grads``: outputs holding the gradients for
  a unit upstream gradient; the bool forward argument ``forward_grads_when`` allows the
  strategy, and the forward used it when one of those outputs is not empty; without
  that argument, always): the backward scales them
  (``ops.common.grad_in_forward.scale_grads``) and runs the backward op only for the
  other incoming gradients;
- the double-backward guard, the planner overrides in the backward
  (``autograd.under_forward_overrides``) and the eager fast path (``autograd.EagerOp``:
  the backward calls the backward op's implementation directly).

The op's module keeps only its math: the implementation and the fake of each custom op.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from logitless.ops.common import plan_codec
from logitless.ops.common.autograd import (
    EagerOp,
    below_autograd,
    custom_op,
    guard_double_backward,
    under_forward_overrides,
)
from logitless.ops.common.grad_in_forward import scale_grads

_EMPTY = inspect.Parameter.empty


@dataclass(frozen=True)
class Arg:
    """One schema argument: a tensor or a scalar."""

    name: str
    annotation: Any
    default: Any = _EMPTY

    @property
    def is_tensor(self) -> bool:
        return self.annotation in (Tensor, Optional[Tensor])


@dataclass(frozen=True)
class Options:
    """An options dataclass as one group of arguments (``name``: the group's name in the
    grouped implementation and among the backward's sources). ``defaulted``: its fields
    take the dataclass defaults in the schema (trailing arguments only)."""

    name: str
    cls: type
    defaulted: bool = False


def tensor(name: str, optional: bool = False) -> Arg:
    return Arg(name, Optional[Tensor] if optional else Tensor)


def scalar(name: str, annotation, default=_EMPTY) -> Arg:
    return Arg(name, annotation, default)


def options(name: str, cls: type, defaulted: bool = False) -> Options:
    return Options(name, cls, defaulted)


class Layout:
    """The flat schema arguments of a list of groups, and the way back to the groups."""

    def __init__(self, groups):
        params, parts = [], []
        for g in groups:
            if isinstance(g, Arg):
                parts.append((g.name, len(params), None, None))
                params.append(inspect.Parameter(g.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                default=g.default, annotation=g.annotation))
            else:
                hints = typing.get_type_hints(g.cls)
                start = len(params)
                for f in dataclasses.fields(g.cls):
                    params.append(inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                    default=f.default if g.defaulted else _EMPTY,
                                                    annotation=hints[f.name]))
                parts.append((g.name, start, len(params), g.cls))
        self.params = tuple(params)
        self.parts = tuple(parts)
        self.names = tuple(p.name for p in params)
        self.group_names = tuple(p[0] for p in parts)
        self.tensor_groups = frozenset(g.name for g in groups if isinstance(g, Arg) and g.is_tensor)

    def signature(self, outputs: int) -> inspect.Signature:
        ret = Tensor if outputs == 1 else tuple[(Tensor,) * outputs]
        return inspect.Signature(self.params, return_annotation=ret)

    def complete(self, args: tuple, kwargs: dict) -> tuple:
        """The flat arguments with the ones left out (keywords, defaults) filled in."""
        out = list(args)
        for p in self.params[len(args):]:
            if p.name in kwargs:
                out.append(kwargs[p.name])
            elif p.default is not _EMPTY:
                out.append(p.default)
            else:
                raise TypeError(f"argument {p.name!r} missing")
        return tuple(out)

    def group(self, flat: tuple) -> list:
        """One value per group (options rebuilt from their fields). (A loop: per call.)"""
        out = []
        for _, i, j, cls in self.parts:
            out.append(flat[i] if cls is None else cls(*flat[i:j]))
        return out

    def flatten(self, values: dict) -> list:
        """The flat arguments from one value per group name."""
        out = []
        for name, _, _, cls in self.parts:
            if cls is None:
                out.append(values[name])
            else:
                out.extend(values[name].args())
        return out

    def wrap(self, body: Callable, name: str, outputs: int) -> Callable:
        """``body`` (grouped arguments) as a function of the flat arguments."""
        n = len(self.params)
        group = self.group

        def flat(*args, **kwargs):
            if kwargs or len(args) != n:
                args = self.complete(args, kwargs)
            return body(*group(args))

        flat.__name__ = flat.__qualname__ = name
        flat.__doc__ = body.__doc__
        flat.__signature__ = self.signature(outputs)
        return flat


@dataclass
class OpSpec:
    """One op's custom ops and autograd (module docstring).

    forward/backward: argument groups; outputs: the forward's output names;
    grads: per output, the name of its incoming gradient among the backward's
    arguments (None: not differentiable); grad_inputs: the forward inputs whose
    gradients the backward op returns, in order; need: backward argument -> forward input
    whose ``needs_input_grad`` it is; materialize_grads: autograd zero-fills gradients of
    unused outputs (else None); zero_if_none: incoming gradient name -> (values -> the
    zeros it stands for when None); skip_if_no_grads: the gradients are None when every
    incoming gradient is; plan_cls: the class of the call's plan, held by the output
    named "plan" (module docstring)."""

    op: str
    name: str
    forward: tuple
    outputs: tuple
    forward_impl: Callable
    forward_fake: Callable
    backward_name: Optional[str] = None
    backward: tuple = ()
    backward_impl: Optional[Callable] = None
    backward_fake: Optional[Callable] = None
    grads: tuple = ()
    grad_inputs: tuple = ()
    need: dict = field(default_factory=dict)
    mutates: tuple = ()
    consumed: tuple = ()
    nothing: Optional[Callable] = None
    forward_grads: tuple = ()
    forward_grads_when: Optional[str] = None
    materialize_grads: bool = False
    zero_if_none: dict = field(default_factory=dict)
    skip_if_no_grads: bool = False
    plan_cls: Optional[type] = None


#: The output (and backward argument) that holds the call's plan (``OpSpec.plan_cls``).
PLAN = "plan"


class BuiltOp:
    """What ``build`` makes: ``forward_op``/``backward_op`` (torch.library custom ops),
    ``eager`` (the forward op with the eager fast path), ``forward_impl`` (the flat
    implementation), ``layout`` (the forward's flat arguments)."""

    def __init__(self, spec: OpSpec):
        self.spec = s = spec
        self.layout = fl = Layout(s.forward)
        k = len(s.outputs)
        self.forward_impl = fl.wrap(s.forward_impl, f"{s.name}_impl", k)  # (the plan as an object)
        impl, fake = s.forward_impl, s.forward_fake
        if s.plan_cls is not None:
            impl = self._encoding(impl, plan_codec.encode)
            fake = self._encoding(fake, lambda _, cls: plan_codec.fake(cls))
        self.forward_op = custom_op(s.name, fl.wrap(impl, f"{s.name}_impl", k))
        self.forward_op.register_fake(fl.wrap(fake, f"{s.name}_fake", k))
        self.backward_op = self.backward_eager = None
        if s.backward_name is not None:
            bl = self.backward_layout = Layout(s.backward)
            nb = len(s.grad_inputs)
            body = s.backward_impl if s.plan_cls is None else self._decoding(s.backward_impl, bl)
            impl = bl.wrap(body, f"{s.backward_name}_impl", nb)
            self.backward_op = custom_op(s.backward_name, impl, mutates_args=s.mutates)
            self.backward_op.register_fake(bl.wrap(s.backward_fake, f"{s.backward_name}_fake", nb))
            self.backward_eager = below_autograd(impl)
        self._plan()
        setup, backward = under_forward_overrides(self._setup_context, self._backward)
        self.forward_op.register_autograd(backward, setup_context=setup)
        self.eager = EagerOp(self.forward_op, self.forward_impl, setup, backward)

    def _encoding(self, body: Callable, encode: Callable) -> Callable:
        """``body`` (a forward implementation or fake) with its plan output encoded."""
        pos, cls = self.spec.outputs.index(PLAN), self.spec.plan_cls

        def run(*groups):
            out = list(body(*groups))
            out[pos] = encode(out[pos], cls)
            return tuple(out)

        run.__doc__ = body.__doc__
        return run

    def _decoding(self, body: Callable, layout: Layout) -> Callable:
        """``body`` (the backward implementation) with its plan argument decoded when it
        comes as a tensor (the custom op; the eager fast path passes the object)."""
        pos, cls = layout.group_names.index(PLAN), self.spec.plan_cls

        def run(*groups):
            if isinstance(groups[pos], Tensor):
                groups = list(groups)
                groups[pos] = plan_codec.decode(groups[pos], cls)
            return body(*groups)

        run.__doc__ = body.__doc__
        return run

    def _plan(self):
        """Which forward arguments and outputs the backward reads, as positions (done once:
        the per-call code below is plain loops, no comprehensions: it runs on the hot path)."""
        s, fl = self.spec, self.layout
        wanted = set(self.backward_layout.group_names) if s.backward_name else set()
        self.flat_pos = {p[0]: p[1] for p in fl.parts}  # a group's first flat argument (needs_input_grad)
        self.saved_inputs = tuple(p[0] for p in fl.parts if p[0] in wanted and p[0] in fl.tensor_groups)
        self.saved_in_pos = tuple(self.flat_pos[n] for n in self.saved_inputs)
        self.kept_inputs = tuple(p for p in fl.parts if p[0] in wanted and p[0] not in fl.tensor_groups)
        out_names = [n for n in s.outputs if n in wanted and n not in s.consumed and n != PLAN]
        self.saved_outputs = tuple(out_names)
        self.saved_out_pos = tuple(s.outputs.index(n) for n in out_names)
        self.consumed_pos = tuple(s.outputs.index(n) for n in s.consumed)
        self.forward_grads_pos = tuple(s.outputs.index(n) for n in s.forward_grads)
        self.non_diff = tuple(i for i, g in enumerate(s.grads) if g is None)
        self.diff = tuple((i, g) for i, g in enumerate(s.grads) if g is not None)
        self.grad_flat = tuple(self.flat_pos[n] for n in s.grad_inputs)
        self.need_flat = tuple((arg, self.flat_pos[inp]) for arg, inp in s.need.items())
        self.when_pos = self.flat_pos[s.forward_grads_when] if s.forward_grads_when else None
        self.plan_pos = s.outputs.index(PLAN) if s.plan_cls is not None else None
        self.dtype_pos = self.grad_flat[:2]

    def _setup_context(self, ctx, inputs, output):
        s = self.spec
        if len(inputs) != len(self.layout.params):
            inputs = self.layout.complete(tuple(inputs), {})
        saved = []
        for i in self.saved_in_pos:
            saved.append(inputs[i])
        for i in self.saved_out_pos:
            saved.append(output[i])
        ctx.save_for_backward(*saved)
        values = {}
        for name, i, j, cls in self.kept_inputs:
            values[name] = inputs[i] if cls is None else cls(*inputs[i:j])
        ctx.values = values
        ctx.num_inputs = len(inputs)
        ctx.consumed = ctx.forward_grads = None
        if self.plan_pos is not None:  # (not a saved tensor: the object, or its CPU encoding)
            ctx.plan = output[self.plan_pos]
        if self.consumed_pos:
            ctx.consumed = tuple([output[i] for i in self.consumed_pos])
        if self.forward_grads_pos and (self.when_pos is None or (
                inputs[self.when_pos] and self._forward_grads_used(output))):
            ctx.forward_grads = tuple([output[i] for i in self.forward_grads_pos])
            ctx.dtypes = (inputs[self.dtype_pos[0]].dtype, inputs[self.dtype_pos[1]].dtype)
        if self.non_diff:
            nd = []
            for i in self.non_diff:
                if isinstance(output[i], Tensor):  # (the eager fast path's plan is an object)
                    nd.append(output[i])
            ctx.mark_non_differentiable(*nd)
        if not s.materialize_grads:
            ctx.set_materialize_grads(False)

    def _forward_grads_used(self, output) -> bool:
        """The forward used the gradient-in-forward strategy: one of its gradient outputs
        is not empty (the strategy allowed, eager only)."""
        for i in self.forward_grads_pos:
            if output[i].numel():
                return True
        return False

    def _backward(self, ctx, *grads):
        s = self.spec
        nones = (None,) * ctx.num_inputs
        consumed, ctx.consumed = ctx.consumed, None
        forward_grads, ctx.forward_grads = ctx.forward_grads, None
        needs = ctx.needs_input_grad
        grad_needs = []
        for i in self.grad_flat:
            grad_needs.append(needs[i])
        if not any(grad_needs):
            return nones
        values = dict(ctx.values)
        some = False
        for i, g in self.diff:
            values[g] = grads[i]
            some = some or grads[i] is not None
        if s.skip_if_no_grads and not some:
            return nones
        saved = ctx.saved_tensors
        k = len(self.saved_inputs)
        values.update(zip(self.saved_inputs, saved[:k]))
        values.update(zip(self.saved_outputs, saved[k:]))
        if s.zero_if_none:
            for g, zeros in s.zero_if_none.items():
                if values[g] is None:
                    values[g] = zeros(values)
        for arg, i in self.need_flat:
            values[arg] = needs[i]
        if self.plan_pos is not None:
            values[PLAN] = ctx.plan
        nothing = None
        if consumed is None and s.consumed:  # a second backward: the buffers are spent
            consumed = nothing = s.nothing(values[s.grad_inputs[0]])
        if consumed is not None:
            values.update(zip(s.consumed, consumed))
        op = self.backward_eager if getattr(ctx, "eager", False) else self.backward_op  # (EagerOp: the same)
        first = s.grads[0]
        if forward_grads is not None:
            # Gradient-in-forward: scale the forward's gradients by the upstream gradient,
            # in place; the other incoming gradients (rare) come on top through the backward op.
            present = [g if g.numel() else None for g in forward_grads]
            out = scale_grads(present, values[first], *ctx.dtypes)
            if any(values[g] is not None for _, g in self.diff[1:]):
                values[first] = torch.zeros_like(values[first])
                if s.consumed:
                    values.update(zip(s.consumed, nothing or s.nothing(values[s.grad_inputs[0]])))
                extra = op(*self.backward_layout.flatten(values))
                out = tuple(g + e if g is not None else None for g, e in zip(out, extra))
        elif op is None:
            return nones
        else:
            out = op(*self.backward_layout.flatten(values))
            if len(s.grad_inputs) == 1:
                out = (out,)
        guard = []
        for _, g in self.diff:
            guard.append(values[g])
        for n in s.grad_inputs:
            guard.append(values.get(n))
        kept_out = []
        for g, need in zip(out, grad_needs):
            kept_out.append(g if need else None)
        out = guard_double_backward(s.op, tuple(kept_out), *guard)
        result = list(nones)
        for i, g in zip(self.grad_flat, out):
            result[i] = g
        return tuple(result)


def build(spec: OpSpec) -> BuiltOp:
    """The custom ops and autograd of one declaration (module docstring)."""
    return BuiltOp(spec)
