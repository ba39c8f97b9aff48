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
- the gradient-in-forward strategy (``forward_grads``: outputs holding the gradients for
  a unit upstream gradient, present when ``forward_grads_if(args)``): the backward scales
  them (``ops.common.grad_in_forward.scale_grads``) and runs the backward op only for
  the other incoming gradients;
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

from logitless.ops.common.autograd import EagerOp, below_autograd, custom_op, guard_double_backward, \
    under_forward_overrides
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
        """One value per group (options rebuilt from their fields)."""
        return [flat[i] if cls is None else cls(*flat[i:j]) for _, i, j, cls in self.parts]

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
    incoming gradient is."""

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
    forward_grads_if: Optional[Callable] = None
    materialize_grads: bool = False
    zero_if_none: dict = field(default_factory=dict)
    skip_if_no_grads: bool = False


class BuiltOp:
    """What ``build`` makes: ``forward_op``/``backward_op`` (torch.library custom ops),
    ``eager`` (the forward op with the eager fast path), ``forward_impl`` (the flat
    implementation), ``layout`` (the forward's flat arguments)."""

    def __init__(self, spec: OpSpec):
        self.spec = s = spec
        self.layout = fl = Layout(s.forward)
        k = len(s.outputs)
        self.forward_impl = fl.wrap(s.forward_impl, f"{s.name}_impl", k)
        self.forward_op = custom_op(s.name, self.forward_impl)
        self.forward_op.register_fake(fl.wrap(s.forward_fake, f"{s.name}_fake", k))
        self.backward_op = self.backward_eager = None
        if s.backward_name is not None:
            bl = self.backward_layout = Layout(s.backward)
            nb = len(s.grad_inputs)
            impl = bl.wrap(s.backward_impl, f"{s.backward_name}_impl", nb)
            self.backward_op = custom_op(s.backward_name, impl, mutates_args=s.mutates)
            self.backward_op.register_fake(bl.wrap(s.backward_fake, f"{s.backward_name}_fake", nb))
            self.backward_eager = below_autograd(impl)
        self._plan()
        setup, backward = under_forward_overrides(self._setup_context, self._backward)
        self.forward_op.register_autograd(backward, setup_context=setup)
        self.eager = EagerOp(self.forward_op, self.forward_impl, setup, backward)

    def _plan(self):
        """Which forward groups and outputs the backward reads (done once)."""
        s, fl = self.spec, self.layout
        wanted = set(self.backward_layout.group_names) if s.backward_name else set()
        self.flat_pos = {p[0]: p[1] for p in fl.parts}  # a group's first flat argument (needs_input_grad)
        self.saved_inputs = tuple(n for n in fl.group_names if n in wanted and n in fl.tensor_groups)
        self.kept_inputs = tuple(n for n in fl.group_names if n in wanted and n not in fl.tensor_groups)
        out_names = [n for n in s.outputs if n in wanted and n not in s.consumed]
        self.saved_outputs = tuple((s.outputs.index(n), n) for n in out_names)
        self.consumed_pos = tuple(s.outputs.index(n) for n in s.consumed)
        self.forward_grads_pos = tuple(s.outputs.index(n) for n in s.forward_grads)
        self.non_diff = tuple(i for i, g in enumerate(s.grads) if g is None)

    def _setup_context(self, ctx, inputs, output):
        s, fl = self.spec, self.layout
        if len(inputs) != len(fl.params):
            inputs = fl.complete(tuple(inputs), {})
        values = dict(zip(fl.group_names, fl.group(inputs)))
        ctx.save_for_backward(*[values[n] for n in self.saved_inputs], *[output[i] for i, _ in self.saved_outputs])
        ctx.values = {n: values[n] for n in self.kept_inputs}
        ctx.num_inputs = len(inputs)
        ctx.consumed = tuple(output[i] for i in self.consumed_pos) if self.consumed_pos else None
        ctx.forward_grads = None
        if s.forward_grads and s.forward_grads_if(values):
            ctx.forward_grads = tuple(output[i] for i in self.forward_grads_pos)
            ctx.dtypes = (values[s.grad_inputs[0]].dtype, values[s.grad_inputs[1]].dtype)
        nd = [output[i] for i in self.non_diff]
        if nd:
            ctx.mark_non_differentiable(*nd)
        if not s.materialize_grads:
            ctx.set_materialize_grads(False)

    def _backward(self, ctx, *grads):
        s = self.spec
        nones = (None,) * ctx.num_inputs
        consumed, ctx.consumed = ctx.consumed, None
        forward_grads, ctx.forward_grads = ctx.forward_grads, None
        needs = ctx.needs_input_grad
        grad_needs = [needs[self.flat_pos[n]] for n in s.grad_inputs]
        if not any(grad_needs):
            return nones
        if s.skip_if_no_grads and all(grads[i] is None for i, g in enumerate(s.grads) if g is not None):
            return nones
        saved = ctx.saved_tensors
        values = dict(ctx.values)
        k = len(self.saved_inputs)
        values.update(zip(self.saved_inputs, saved[:k]))
        values.update((n, t) for (_, n), t in zip(self.saved_outputs, saved[k:]))
        for i, g in enumerate(s.grads):
            if g is not None:
                values[g] = grads[i]
        for g, zeros in s.zero_if_none.items():
            if values[g] is None:
                values[g] = zeros(values)
        for arg, inp in s.need.items():
            values[arg] = needs[self.flat_pos[inp]]
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
            if any(values[g] is not None for g in s.grads[1:] if g is not None):
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
        out = tuple(g if need else None for g, need in zip(out, grad_needs))
        guard = [values[g] for g in s.grads if g is not None] + [values.get(n) for n in s.grad_inputs]
        out = guard_double_backward(s.op, out, *guard)
        result = list(nones)
        for name, g in zip(s.grad_inputs, out):
            result[self.flat_pos[name]] = g
        return tuple(result)


def build(spec: OpSpec) -> BuiltOp:
    """The custom ops and autograd of one declaration (module docstring)."""
    return BuiltOp(spec)
