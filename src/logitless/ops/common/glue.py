"""The glue between an op's public function, autograd and torch.library, written once.

An op declares its custom ops as typed classes (in its ``contract.py``) and writes its
bodies against their names (in its ``custom_op.py``); ``CustomOp`` derives everything
positional from the declarations:

- a **call** (``Call`` subclass, a frozen dataclass): the forward op's inputs by name.
  Fields are tensors (``Tensor``, ``Optional[Tensor]``), scalars (``bool``, ``int``,
  ``float``, ``str``, ``Optional[float]``, ``Optional[int]``) or option dataclasses of
  scalars (``logitless.options``: ``CrossEntropyOptions``, ``VocabParallelOptions``...). Each
  tensor is a schema argument; the scalars, the options' fields flattened in order, travel
  packed in at most three (``Fields``: ints, floats, the rest as a string). ``differentiable``
  names the inputs that get gradients (in the order the backward returns them). No op
  writes its inputs (a declared write to a backward graph's input, e.g. the kept columns,
  makes inductor copy it whole before the op): a backward call's field of type ``Owned``
  tells the body whether it owns buffers it may overwrite instead. The backward call's
  field of type ``Replanned`` is the backend's Config: the object on the eager path; it
  never crosses the custom ops: the backward op re-derives it from its call (the op's
  ``replan``: the same memoised plan the forward made), so the forward op has no Config
  output and both ops may run inside a CUDA graph (``torch.compile(mode="reduce-overhead")``).
- its **outputs** (a ``typing.NamedTuple`` of tensors and ``config``: the backend's Config,
  not an output of the forward op). An
  ``Optional[Tensor]`` output may be None (absent): so on the eager path, a size-0 tensor of
  the call's first tensor's dtype and device through the custom ops (forward and fake); its
  gradient: None, or size 0 through the custom ops (the call says which outputs exist).
- a **backward call** (another ``Call``): what the backward op reads, and nothing else.

``CustomOp(name, Call, Outputs, BackwardCall, table=..., forward=..., fake=..., save=...,
backward=..., backward_impl=..., backward_fake=..., replan=...)`` defines ``logitless::<name>_forward``
and ``logitless::<name>_backward`` (schemas from the field lists), registers the autograd,
and runs a call: ``op(call)`` on plain tensors in eager mode runs ``forward(call)`` under
a plain ``autograd.Function`` that carries the call object intact (no torch.library layer,
no flattening: the host path of small batches); anywhere else (torch.compile, fake tensors,
dispatch modes, tensor subclasses) it flattens the call into the custom op, whose
implementation rebuilds it. Both run the same bodies: bitwise the same results.

The op's bodies: ``forward(call) -> Outputs`` (``config`` the object), ``fake(call) ->
Outputs`` (shapes; ``config`` None),
``save(ctx, call, out)`` (what the backward needs, on ``ctx`` and ``save_for_backward``),
``backward(ctx, grads, need, run) -> grads`` (``ctx.eager``: whether the forward ran
eagerly, see ``Owned``; ``grads``: the outputs' gradients by name, None
where absent; ``need``: a NamedTuple of bools named after ``differentiable``; it returns
one gradient per differentiable input, computing them with ``run(bcall)``
or by itself), ``backward_impl(bcall) -> (gradients)`` and ``backward_fake(bcall)`` (a
tuple, one per differentiable input; the backward custom op of a single one returns it
as one Tensor, its schema's one return), ``replan(bcall) -> Config`` (the forward's
Config, planned again from the backward call's fields).
Each backward runs under its forward's planner overrides (autograd runs CUDA backwards on
a thread of its own). Double backward raises one clear error.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Generic, NamedTuple, NewType, Optional, TypeVar

import torch
from torch import Tensor

from logitless.ops.common.contract import Backend, BackendTable
from logitless.planning import overrides as _overrides

#: A backend's Config as a field of a backward call (``CustomOp``'s ``replan`` plans it
#: again): the object on the eager path; no argument of the custom ops (None there until
#: ``replan`` fills it in the backward op).
Replanned = NewType("Replanned", object)

#: A field of a backward call: whether its body owns the buffers the forward saved for it
#: (the op's ``backward`` passes ``ctx.eager``: after an eager forward the buffers on ctx
#: serve this one backward, which may overwrite them, e.g. kept columns turned into dz in
#: place). No argument of the custom ops: False there (built so), where those buffers are
#: inputs of the backward graph that the body must leave as they are. A forward call's
#: (True when made, the eager path's) says the same of its backward to its planner.
Owned = NewType("Owned", bool)


@torch.compiler.assume_constant_result
def _overrides_text() -> str:
    """The planner overrides in effect as the text an op hands both its custom ops (their
    last argument; "" for none): both plan under the same overrides, the
    backward op on whichever thread runs it. torch.compile takes the text at trace time
    (a constant of the graph: a compiled call keeps the overrides it was traced under)."""
    return _text_of(_overrides.current())


def _text_of(state: _overrides.Overrides) -> str:
    """``state`` as ``_overrides_of`` reads it back ("" for the defaults)."""
    return "" if state is _overrides.DEFAULT else repr(dataclasses.astuple(state))


@functools.lru_cache(maxsize=64)
def _overrides_of(text: str) -> _overrides.Overrides:
    """The overrides ``_overrides_text`` wrote."""
    return _overrides.DEFAULT if not text else _overrides.Overrides(*ast.literal_eval(text))

#: "logitless::<name>" -> the Python implementation behind the custom op (flat arguments):
#: tests run it under dispatch modes, which otherwise see a custom op as one opaque call.
EAGER: dict[str, Callable] = {}

#: The scalar types of a call's fields (packed into its ``scalars`` argument: ``Fields``).
_SCALARS = (bool, int, float, str)

#: The tags of an op pair whose calls sync with the host to choose their route (``CustomOp``'s
#: ``tags``: the truncated log-prob ops). ``cudagraph_unsafe``: under
#: ``torch.compile(mode="reduce-overhead")`` inductor runs the op between its CUDA-graph
#: partitions, eagerly, on the faster route its syncs choose, with eager's bits; inside a
#: graph it would take the capture-safe route (slower, other rounding). A graph the caller
#: captures (``torch.cuda.graph``) still holds it, on that route.
HOST_SYNCS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


class Call:
    """Base of the declared calls (module docstring): a frozen dataclass subclass. Each
    declares a field ``backend``: the name of the backend that runs it."""

    differentiable: ClassVar[tuple[str, ...]] = ()
    backend: str  # (a field of each declaration; annotated here only, for the type checker)


#: ``CustomOp``'s type parameters: an op's forward call, its outputs, its backward call and
#: its backend Protocol.
CallT = TypeVar("CallT", bound=Call)
OutT = TypeVar("OutT", bound=NamedTuple)
BwdT = TypeVar("BwdT", bound=Call)
ImplT = TypeVar("ImplT", bound=Backend)


def _unwrap_optional(t) -> tuple[Any, bool]:
    members = [a for a in typing.get_args(t) if a is not type(None)]
    if typing.get_origin(t) in (typing.Union, types.UnionType) and len(members) == 1:
        return members[0], True
    return t, False


class Fields:
    """A declared class's flat argument list: the schema, ``flatten`` and ``build``.

    The tensors are schema arguments of their own, in declaration order. The scalars, with
    the options dataclasses' fields flattened in order, travel in at most three last
    arguments: ``SymInt[] ints`` (the int fields' values), ``float[] floats`` (the float
    fields') and ``str scalars``: the repr of a tuple with one
    entry per scalar, the value of a str or bool field, and for an int or float field None
    when absent, else 0 (its value is in its list). Ints and floats stay in typed lists so
    that torch.compile may trace them as symbols (``dynamic=True``); the rest is a constant
    string. Few arguments, not one per scalar: torch.library's autograd and mutation
    wrappers re-read the schema's argument list per argument
    (``torch._library.utils.fill_defaults``, quadratic in their count: 131 us per call at 25
    arguments, 50 us at 15 on a CPU; docs/design.md "The glue").

    ``entries``: (name, kind, nested Fields or None) per field, kind "tensor",
    "replanned" (no argument: None when built), "owned" (no argument: False when built),
    "scalar" or "options" (a dataclass flattened into its own fields)."""

    def __init__(self, cls: type, *, top: bool = True):
        self.cls = cls
        hints = typing.get_type_hints(cls)
        self.entries: list[tuple[str, str, Optional[Fields]]] = []
        self.schema_args: list[str] = []
        #: The flattened scalars: (name, type, optional), in declaration order.
        self.scalars: list[tuple[str, type, bool]] = []
        for f in dataclasses.fields(cls):
            t, optional = _unwrap_optional(hints[f.name])
            q = "?" if optional else ""
            if t is Tensor:
                if not top:
                    raise TypeError(f"{cls.__name__}.{f.name}: tensors are fields of the call, not of its options")
                self.entries.append((f.name, "tensor", None))
                self.schema_args.append(f"Tensor{q} {f.name}")
            elif t is Replanned:  # (not an argument: the backward op re-plans it)
                self.entries.append((f.name, "replanned", None))
            elif t is Owned:  # (not an argument: False through the custom ops)
                self.entries.append((f.name, "owned", None))
            elif t in _SCALARS:
                self.entries.append((f.name, "scalar", None))
                self.scalars.append((f.name, t, optional))
            elif isinstance(t, type) and dataclasses.is_dataclass(t) and not optional:
                sub = Fields(t, top=False)
                self.entries.append((f.name, "options", sub))
                self.scalars.extend(sub.scalars)
            else:
                raise TypeError(f"{cls.__name__}.{f.name}: a call field must be a tensor, a scalar or an "
                                f"options dataclass, got {hints[f.name]}")
        self.scalar_names = tuple(name for name, _, _ in self.scalars)
        self._lists = tuple(kind for kind, t in (("ints", int), ("floats", float))
                            if any(st is t for _, st, _ in self.scalars))
        packed = [f"{'SymInt' if k == 'ints' else 'float'}[] {k}" for k in self._lists]
        if self.scalars:
            packed.append("str scalars")
        names = [a.rsplit(" ", 1)[1] for a in self.schema_args] + list(self.scalar_names)
        if len(set(names)) != len(names):
            raise TypeError(f"{cls.__name__}: flattened field names repeat: {names}")
        if top:
            clash = {"ints", "floats", "scalars"} & set(names)
            if clash and self.scalars:
                raise TypeError(f"{cls.__name__}: {sorted(clash)} name the packed scalars' arguments; rename")
            self.schema_args.extend(packed)
        self.names = tuple(a.rsplit(" ", 1)[1] for a in self.schema_args)
        self._tensor_fields = tuple(name for name, kind, _ in self.entries if kind == "tensor")
        self.replanned = tuple(name for name, kind, _ in self.entries if kind == "replanned")
        self.owned = tuple(name for name, kind, _ in self.entries if kind == "owned")
        self._layout = functools.lru_cache(maxsize=256)(self._read)

    def schema(self, outputs: int, extra: tuple[str, ...] = ()) -> str:
        """The custom op's schema: these arguments (then ``extra``), ``outputs`` Tensors."""
        return f"({', '.join([*self.schema_args, *extra])}) -> ({', '.join(['Tensor'] * outputs)})"

    def _values(self, obj) -> list:
        """The flattened scalar values of ``obj``, in ``scalars``' order."""
        out = []
        for name, kind, sub in self.entries:
            if kind == "scalar":
                out.append(getattr(obj, name))
            elif sub is not None:
                out.extend(sub._values(getattr(obj, name)))
        return out

    def flatten(self, obj) -> list:
        """The op's flat arguments of ``obj`` (plain Python: torch.compile traces it)."""
        out = [getattr(obj, name) for name in self._tensor_fields]
        if not self.scalars:
            return out
        values = self._values(obj)
        ints: list[Any] = []
        floats: list[Any] = []
        rest: list[Any] = []
        for (_, t, _), value in zip(self.scalars, values):
            if t is int or t is float:
                if value is not None:
                    (ints if t is int else floats).append(value)
                rest.append(None if value is None else 0)
            else:
                rest.append(value)
        for kind in self._lists:
            out.append(ints if kind == "ints" else floats)
        out.append(repr(tuple(rest)))
        return out

    def _read(self, packed: str) -> tuple:
        """``scalars`` read back and checked against the declared types (memoised per
        string): per scalar (list, value): list "ints" / "floats" (the value is that list's
        next), or None (the value is ``value``)."""
        try:
            values = ast.literal_eval(packed)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"{self.cls.__name__}: scalars {packed!r} do not read back ({exc})") from None
        if not isinstance(values, tuple) or len(values) != len(self.scalars):
            raise ValueError(f"{self.cls.__name__}: expected {len(self.scalars)} scalars, got {packed!r}")
        out: list[Any] = []
        for (name, t, optional), value in zip(self.scalars, values):
            if value is None and optional:
                out.append((None, None))
            elif t is int or t is float:
                if value != 0 or isinstance(value, bool):
                    raise ValueError(f"{self.cls.__name__}.{name}: expected 0 or None, got {value!r}")
                out.append(("ints" if t is int else "floats", None))
            elif isinstance(value, t):
                out.append((None, value))
            else:
                raise ValueError(f"{self.cls.__name__}.{name}: expected {t.__name__}, got {value!r}")
        return tuple(out)

    def _fields_of(self, values) -> dict:
        out: dict[str, Any] = {}
        for name, kind, sub in self.entries:
            if sub is not None:
                out[name] = sub.cls(**sub._fields_of(values))
            elif kind == "scalar":
                out[name] = next(values)
        return out

    def build(self, args):
        """The object ``flatten`` flattened into ``args``."""
        kwargs = dict(zip(self._tensor_fields, args))
        for name in self.replanned:
            kwargs[name] = None
        for name in self.owned:
            kwargs[name] = Owned(False)
        if self.scalars:
            lists = {k: iter(a) for k, a in zip(self._lists, args[len(self._tensor_fields):])}
            values = (next(lists[src]) if src else value for src, value in self._layout(args[-1]))
            kwargs.update(self._fields_of(values))
        return self.cls(**kwargs)

    def tensors(self) -> tuple[str, ...]:
        return tuple(name for name, kind, _ in self.entries if kind == "tensor")


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_INFRA_MODES = tuple(getattr(torch._C._TorchDispatchModeKey, k) for k in ("FAKE", "PROXY", "FUNCTIONAL")
                     if hasattr(torch._C._TorchDispatchModeKey, k))


def eager_fast_path_ok(tensors) -> bool:
    """Whether a plain autograd.Function may stand in for a custom op: an eager call on
    plain tensors (``tensors``: the call's, None allowed), outside torch.compile, dispatch
    modes (FakeTensor, tracing, the tests' recorders), functorch transforms and tensor
    subclasses (DTensor...)."""
    if torch.compiler.is_compiling():  # (first: dynamo stops there)
        return False
    if torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active():
        return False
    for k in _INFRA_MODES:
        if torch._C._get_dispatch_mode(k) is not None:
            return False
    for a in tensors:  # (a loop, not all(<generator>): this runs per call)
        if a is not None and type(a) not in _PLAIN:
            return False
    return True


def below_autograd():
    """The context in which the eager path's backward runs the backward body, as the
    dispatcher runs a custom op's: recording no autograd history (a backward with
    create_graph=True runs with grad mode on)."""
    return torch.no_grad() if torch.is_grad_enabled() else _NO_CONTEXT


_NO_CONTEXT = contextlib.nullcontext()  # (reusable: it holds no state)


class NoDoubleBackward(torch.autograd.Function):
    """Identity on first-order gradients computed with create_graph=True; differentiating
    them again raises one clear error."""

    @staticmethod
    def forward(ctx, op: str, *tensors):
        ctx.op = op
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"logitless.{ctx.op}: double backward (differentiating its gradients, e.g. after "
                           "torch.autograd.grad(..., create_graph=True)) is not supported")


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


def grad_outputs(x: Tensor, dx: Optional[Tensor], dw: Optional[Tensor], db: Optional[Tensor], need_dx: bool,
                 need_dw: bool, need_db: bool) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """The (dx, dw, db) outputs of a fused linear op's backward custom op: each gradient
    where needed, else a size-0 tensor of x's dtype and device (distinct ones: a custom
    op's outputs may not alias each other)."""
    return (dx if need_dx else x.new_empty(0), dw if need_dw else x.new_empty(0), db if need_db else x.new_empty(0))


def fake_grad_outputs(x: Tensor, weight: Tensor, bias: Optional[Tensor], need_dx: bool, need_dw: bool,
                      need_db: bool) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``grad_outputs`` of a backward custom op's fake: gradients shaped like x, weight
    and bias where needed."""
    return grad_outputs(x, torch.empty_like(x) if need_dx else None, torch.empty_like(weight) if need_dw else None,
                        torch.empty_like(bias) if need_db and bias is not None else None, need_dx, need_dw, need_db)


def zero_grads(x: Tensor, weight: Tensor, bias: Optional[Tensor]):
    """(dx, dw, db) of an op on no tokens: zeros (db None without a bias)."""
    return torch.zeros_like(x), torch.zeros_like(weight), torch.zeros_like(bias) if bias is not None else None


def _returned(grads: tuple):
    """A backward custom op's return: its gradients, or the one Tensor of an op with one
    differentiable input (a schema of one return is that Tensor, not a tuple)."""
    if len(grads) != 1:
        return grads
    (grad,) = grads
    return grad


def _named_tuple(name: str, fields: tuple[str, ...]) -> type[tuple[Any, ...]]:
    """A namedtuple class made at run time (its fields: values read by name)."""
    return collections.namedtuple(name, fields)


class CustomOp(Generic[CallT, OutT, BwdT, ImplT]):
    """An op's forward/backward custom-op pair, its autograd and its eager path (module
    docstring). ``table``: the op's backends by name (``api.BACKENDS``); ``call.backend``
    names the one that runs. ``replan(bcall, impl) -> Config`` fills the backward call's
    ``Replanned`` field in the backward op: the forward op has no Config output. ``tags``:
    torch.library's tags of both ops (``HOST_SYNCS``). Generic
    over the op's declarations (its call, outputs, backward call) and its backend Protocol:
    a type checker checks the bodies against them."""

    def __init__(self, name: str, call: type[CallT], outputs: type[OutT], backward_call: type[BwdT], *,
                 table: BackendTable[ImplT], forward: Callable[[CallT, ImplT], OutT],
                 fake: Callable[[CallT, ImplT], OutT], save: Callable[[Any, CallT, OutT], None],
                 backward: Callable[[Any, OutT, Any, Callable[[BwdT], tuple]], tuple],
                 backward_impl: Callable[[BwdT, ImplT], tuple], backward_fake: Callable[[BwdT, ImplT], tuple],
                 replan: Callable[[BwdT, ImplT], Any], title: Optional[str] = None, tags: tuple = ()):
        self.name, self.title, self.table, self.outputs = name, title or name, table, outputs
        self.fields, self.backward_fields = Fields(call), Fields(backward_call)
        self._replan = replan
        if len(self.backward_fields.replanned) != 1 or "config" not in outputs._fields:
            raise TypeError(f"{name}: the outputs need a field config and the backward call one Replanned field")
        #: The forward op's outputs: every field of ``outputs`` but ``config``.
        self.op_outputs = tuple(n for n in outputs._fields if n != "config")
        self.tensor_names = self.fields.tensors()
        self.differentiable = call.differentiable
        hints = typing.get_type_hints(outputs)
        self.optional_outputs = tuple(n for n in outputs._fields if _unwrap_optional(hints[n]) == (Tensor, True))
        self.need_type = _named_tuple(f"{call.__name__}Need", call.differentiable)
        flat = self.fields.names
        self.grad_positions = tuple(flat.index(n) for n in call.differentiable)
        self.num_inputs = len(flat) + 1  # (the overrides argument last)
        self._forward, self._fake, self._save = forward, fake, save
        self._backward, self._backward_impl, self._backward_fake = backward, backward_impl, backward_fake

        # Both ops take the planner overrides as a last argument.
        extra = ("str overrides",)
        self.forward_op = self._define(f"{name}_forward", self._forward_op_impl,
                                       self.fields.schema(len(self.op_outputs), extra), tags)
        self.forward_op.register_fake(self._forward_op_fake)
        self.backward_op = self._define(f"{name}_backward", self._backward_op_impl,
                                        self.backward_fields.schema(len(call.differentiable), extra), tags)
        self.backward_op.register_fake(self._backward_op_fake)
        self.forward_op.register_autograd(self._custom_backward, setup_context=self._custom_setup)

        def eager_forward(ctx, call: CallT, *_differentiable) -> tuple:
            out = forward(call, table[call.backend])
            ctx.eager = True
            self._setup(ctx, call, out)
            return tuple(out)

        function: type[torch.autograd.Function] = type(f"Eager_{name}", (torch.autograd.Function,), {
            "forward": staticmethod(eager_forward), "backward": staticmethod(self._eager_backward),
            "__module__": __name__,
        })
        self.apply = function.apply

    @staticmethod
    def _define(name: str, fn: Callable, schema: str, tags: tuple):
        EAGER[f"logitless::{name}"] = fn
        return torch.library.custom_op(f"logitless::{name}", fn, mutates_args=(), schema=schema, tags=tags)

    # ---------------------------------------------------------------- running a call

    def __call__(self, call: CallT) -> OutT:
        """The forward's outputs (``Outputs``) of ``call``, with autograd."""
        get = call.__getattribute__  # (map, not comprehensions: no frames per call)
        if eager_fast_path_ok(map(get, self.tensor_names)):
            return self.outputs._make(self.apply(call, *map(get, self.differentiable)))
        return self.outputs_of(self.forward_op(*self.args(call)))

    def outputs_of(self, flat) -> OutT:
        """The ``Outputs`` of the forward op's flat outputs (``config`` None)."""
        out = list(flat)
        out.insert(self.outputs._fields.index("config"), None)
        return self.outputs._make(out)

    def args(self, call: CallT) -> tuple:
        """The forward custom op's flat arguments for ``call`` (tests: ``opcheck``), the
        overrides in effect last."""
        return (*self.fields.flatten(call), _overrides_text())

    def backward_args(self, bcall: BwdT, overrides: Optional[_overrides.Overrides] = None) -> tuple:
        """The backward custom op's flat arguments for ``bcall``, last the forward's
        ``overrides`` (default: those in effect)."""
        state = _overrides.current() if overrides is None else overrides
        return (*self.backward_fields.flatten(bcall), _text_of(state))

    def _runner(self, ctx) -> Callable[[BwdT], tuple]:
        """What runs a backward call (``backward``'s ``run``): the backward body, directly
        after an eager forward (recording no history), else the backward custom op."""
        if getattr(ctx, "eager", False):
            def run(b: BwdT) -> tuple:
                with below_autograd():
                    return tuple(self._backward_impl(b, self.table[b.backend]))
        else:
            def run(b: BwdT) -> tuple:
                out = self.backward_op(*self.backward_args(b, ctx.overrides))
                return (out,) if isinstance(out, Tensor) else tuple(out)  # (one gradient: a Tensor)
        return run

    # ---------------------------------------------------------------- custom-op bodies

    def _forward_op_impl(self, *args):
        with _overrides.restored(_overrides_of(args[-1])):  # (under the overrides the call was made with)
            call = self.fields.build(args[:-1])
            return self._op_outputs(self._present(call, self._forward(call, self.table[call.backend])))

    def _op_outputs(self, out) -> tuple:
        """``out`` without its ``config``."""
        return tuple(getattr(out, n) for n in self.op_outputs)

    def _forward_op_fake(self, *args):
        with _overrides.restored(_overrides_of(args[-1])):  # (the kept shapes: planned as the forward plans)
            call = self.fields.build(args[:-1])
            return self._op_outputs(self._present(call, self._fake(call, self.table[call.backend])))

    def _present(self, call, out):
        """``out`` with each absent optional output a size-0 tensor (distinct: no aliasing)."""
        for name in self.optional_outputs:
            if getattr(out, name) is None:
                out = out._replace(**{name: getattr(call, self.tensor_names[0]).new_empty(0)})
        return out

    def _backward_op_impl(self, *args):
        # The Config: the forward's plan, under the forward's overrides (from the memo).
        with _overrides.restored(_overrides_of(args[-1])):
            b = self.backward_fields.build(args[:-1])
            impl = self.table[b.backend]
            b = dataclasses.replace(b, **{name: self._replan(b, impl) for name in self.backward_fields.replanned})
            return _returned(tuple(self._backward_impl(b, impl)))

    def _backward_op_fake(self, *args):
        b = self.backward_fields.build(args[:-1])
        return _returned(tuple(self._backward_fake(b, self.table[b.backend])))

    # ---------------------------------------------------------------- autograd

    def _setup(self, ctx, call: CallT, out: OutT) -> None:
        ctx.overrides = _overrides.current()  # (the C-level getter: no frame)
        self._save(ctx, call, out)

    def _custom_setup(self, ctx, inputs, output) -> None:
        ctx.eager = False  # (the backward runs the backward op: it owns nothing, ``Owned``)
        self._save(ctx, self.fields.build(inputs[:-1]), self.outputs_of(output))
        ctx.overrides = _overrides_of(inputs[-1])  # (the forward op's: the backward op's too)

    def _gradients(self, ctx, grads: OutT, needs: tuple) -> tuple:
        need = self.need_type(*needs)
        if not any(need):
            return (None,) * len(need)
        state = ctx.overrides
        if _overrides.current() is state:  # the forward's thread
            out = self._backward(ctx, grads, need, self._runner(ctx))
        else:
            with _overrides.restored(state):
                out = self._backward(ctx, grads, need, self._runner(ctx))
        if not all(need):
            out = tuple(g if n else None for g, n in zip(out, need))
        if not torch.is_grad_enabled():  # (first-order: nothing to guard; saved tensors not unpacked again)
            return out
        return guard_double_backward(self.title, out, *grads, *ctx.saved_tensors)

    def _eager_backward(self, ctx, *grads):
        needs = ctx.needs_input_grad[1:]
        return (None, *self._gradients(ctx, self.outputs._make(grads), needs))

    def _custom_backward(self, ctx, *grads):
        needs = tuple(ctx.needs_input_grad[i] for i in self.grad_positions)
        out = [None] * self.num_inputs
        for i, g in zip(self.grad_positions, self._gradients(ctx, self.outputs_of(grads), needs)):
            out[i] = g
        return tuple(out)
