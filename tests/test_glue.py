"""The custom-op glue derived from declared calls (``ops.common.glue``): schemas, flattening,
an option that reaches a backend without a line of glue, optional outputs and a backward of
one gradient.

A new field of an options dataclass (here: a subclass of ``CrossEntropyOptions`` with a
``dummy`` field, in a call class that declares it) must arrive at the backend's ``plan`` and
``forward`` on the eager path (the call object carried intact) and through the custom ops
(flattened into the torch.library schema and rebuilt), with no edit to ``custom_op.py``:
the op pair here is made from linear_cross_entropy's own bodies.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, NamedTuple, Optional

import pytest
import torch
from torch import Tensor

import logitless
from logitless.ops.common.contract import BackendTable, Needs
from logitless.ops.common.glue import Call, CustomOp, Fields, Owned, Replanned
from logitless.ops.linear_cross_entropy import custom_op
from logitless.ops.linear_cross_entropy.contract import LceBackwardCall, LceCall, LceOutputs, LcePlanned
from logitless.ops.linear_cross_entropy.torch_backend import TorchBackend
from logitless.options import CrossEntropyOptions, VocabParallelOptions
from tests.conftest import DEVICE
from tests.helpers import PassThrough


@dataclasses.dataclass(frozen=True)
class DummyOptions(CrossEntropyOptions):
    """CrossEntropyOptions with one more field, as a new option would add it."""

    dummy: float = 0.0


@dataclasses.dataclass(frozen=True)
class DummyCall(LceCall):
    opts: DummyOptions


@dataclasses.dataclass(frozen=True)
class DummyBackwardCall(LceBackwardCall):
    opts: DummyOptions


class RecordingBackend(TorchBackend):
    """The torch backend, recording the options its plan and forward receive."""

    seen: list = []

    def plan(self, x, weight, bias, class_weight, opts, **kwargs):
        self.seen.append(("plan", opts))
        return super().plan(x, weight, bias, class_weight, opts, **kwargs)

    def forward(self, x, weight, bias, target, class_weight, opts, config, **kwargs):
        self.seen.append(("forward", opts))
        return super().forward(x, weight, bias, target, class_weight, opts, config, **kwargs)


@pytest.fixture(scope="module")
def dummy_op():
    table = BackendTable(torch=RecordingBackend)
    return custom_op.define(table, name="lce_dummy_test", call=DummyCall, backward_call=DummyBackwardCall)


def _call(x, w, t, opts) -> DummyCall:
    return DummyCall(x, w, None, t, None, opts, "torch", 1 << 20, need_argmax=False, need_grad=True,
                     grad_in_forward=False, need=Needs(True, True, False), batch_invariant=False,
                     tp=VocabParallelOptions())


@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_a_new_option_field_reaches_the_backend_without_glue_edits(dummy_op, path):
    assert "dummy" in dummy_op.fields.scalar_names  # the packed scalars are derived from the declaration
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 8, generator=g, requires_grad=True)
    w = torch.randn(11, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 11, (7,), generator=g)
    opts = DummyOptions(label_smoothing=0.1, dummy=0.5)
    RecordingBackend.seen.clear()
    mode = PassThrough() if path == "custom_op" else None
    if mode is not None:
        with mode:
            out = dummy_op(_call(x, w, t, opts))
    else:
        out = dummy_op(_call(x, w, t, opts))
    assert isinstance(out, LceOutputs)
    kinds = [k for k, _ in RecordingBackend.seen]
    assert kinds == ["plan", "forward"], kinds
    for _, seen in RecordingBackend.seen:
        assert isinstance(seen, DummyOptions) and seen.dummy == 0.5 and seen.label_smoothing == 0.1
    # and the op is the real one: its loss and gradients are linear_cross_entropy's
    out.loss.backward()
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    ref = logitless.linear_cross_entropy(x2, w2, t, backend="torch", label_smoothing=0.1)
    ref.backward()
    assert torch.equal(out.loss, ref) and torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def test_fields_flatten_and_rebuild_by_name():
    fields = Fields(LceCall)
    assert fields.names == ("x", "weight", "bias", "target", "class_weight", "ints", "floats", "scalars")
    assert {"ignore_index", "tp_group", "need_dw", "budget"} <= set(fields.scalar_names)
    x, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 4])
    call = LceCall(x, w, None, t, None, CrossEntropyOptions(z_loss=0.25), "torch", 7, need_argmax=True,
                   need_grad=False, grad_in_forward=False, need=Needs(), batch_invariant=True,
                   tp=VocabParallelOptions("g", 5, True))
    flat = fields.flatten(call)
    assert len(flat) == len(fields.names)
    assert call.owned and fields.owned == ("owned",)  # (eager: True; through the custom ops False)
    call = dataclasses.replace(call, owned=Owned(False))
    assert fields.build(flat) == call  # the same object back, field by field
    assert fields.build(list(flat)) == call  # (again: from the memoised scalars)
    assert fields.schema(2) == ("(Tensor x, Tensor weight, Tensor? bias, Tensor target, Tensor? class_weight, "
                                "SymInt[] ints, float[] floats, str scalars) -> (Tensor, Tensor)")
    ints, floats, rest = flat[-3:]
    assert 7 in ints and 5 in ints and 0.25 in floats  # budget, vocab_size; z_loss
    assert isinstance(rest, str) and "'g'" in rest and "'torch'" in rest
    back = Fields(LceBackwardCall)
    assert "Tensor keep" in back.schema(3) and "!" not in back.schema(3)  # no op writes its inputs
    assert "owned" not in back.names and back.owned == ("owned",)  # (False through the custom ops)
    # The Config does not cross (the backward op plans it again from the forward's scalars)
    assert "config" not in back.names and back.replanned == ("config",) and "budget" in back.scalar_names
    built = back.build(back.flatten(LceBackwardCall(
        None, None, x, w, None, t, None, t.float(), t.float(), t.float(), t.float(), "an object", call.opts, "torch",
        False, Needs(), call.tp, LcePlanned(7, True, False, False, True), owned=Owned(True))))
    assert fields.build(flat).budget == 7 and built.config is None and built.owned is False


def test_packed_scalars_are_checked():
    """A scalars string that does not read back as the declared types is an error that says
    what is wrong, never a call built from it."""
    fields = Fields(LceCall)
    x, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 4])
    call = LceCall(x, w, None, t, None, CrossEntropyOptions(), "torch", 7, need_argmax=True, need_grad=False,
                   grad_in_forward=False, need=Needs(), batch_invariant=False, tp=VocabParallelOptions(),
                   owned=Owned(False))  # (as built: the custom ops' calls own nothing)
    *tensors, ints, floats, packed = fields.flatten(call)
    assert fields.build([*tensors, ints, floats, packed]) == call
    with pytest.raises(ValueError, match="do not read back"):
        fields.build([*tensors, ints, floats, packed[:-3] + ")"])
    bad = packed.replace("'torch'", "3", 1)  # the backend's name as an int
    with pytest.raises(ValueError, match="backend: expected str"):
        fields.build([*tensors, ints, floats, bad])
    with pytest.raises(ValueError, match="expected 0 or None"):  # an int field's slot holds its value
        fields.build([*tensors, ints, floats, packed.replace("(0,", "(-100,", 1)])


def test_declarations_are_checked():
    @dataclasses.dataclass(frozen=True)
    class Listy(Call):
        x: Tensor
        sizes: list

    with pytest.raises(TypeError, match="sizes"):
        Fields(Listy)

    @dataclasses.dataclass(frozen=True)
    class Clash(Call):
        ignore_index: int
        opts: CrossEntropyOptions

    with pytest.raises(TypeError, match="repeat"):
        Fields(Clash)

    @dataclasses.dataclass(frozen=True)
    class Fine(Call):
        x: Tensor
        y: Optional[Tensor]
        config: Replanned
        k: Optional[int]

    assert Fields(Fine).schema(1) == "(Tensor x, Tensor? y, SymInt[] ints, str scalars) -> (Tensor)"
    assert Fields(Fine).scalar_names == ("k",)


def test_one_differentiable_input_has_one_tensor_returned():
    """A backward op of one gradient (cross_entropy's d logits) has one Tensor return, not a
    tuple; the glue hands autograd that gradient on both paths, the same bits."""
    from logitless.ops.cross_entropy.api import OPS
    from logitless.ops.cross_entropy.contract import CeBackwardCall, CeCall

    assert len(torch.ops.logitless.ce_backward.default._schema.returns) == 1
    g = torch.Generator().manual_seed(1)
    z0, t = torch.randn(6, 13, generator=g), torch.randint(0, 13, (6,), generator=g)
    opts = CrossEntropyOptions(label_smoothing=0.1)
    out = OPS.outputs_of(OPS.forward_op(*OPS.args(CeCall(z0, t, None, opts, "torch", 1 << 20, True))))
    b = CeBackwardCall(torch.tensor(1.0), None, z0, t, None, out.lse, out.w_t, None, opts, "torch", 1 << 20)
    assert isinstance(OPS.backward_op(*OPS.backward_args(b)), Tensor)
    grads = []
    for mode in (None, PassThrough()):
        z = z0.clone().requires_grad_()
        with mode if mode is not None else contextlib.nullcontext():
            loss = OPS(CeCall(z, t, None, opts, "torch", 1 << 20, False)).loss
        assert ("Eager" in type(loss.grad_fn).__name__) == (mode is None)
        loss.backward()
        grads.append(z.grad)
    assert grads[0].shape == z0.shape and torch.equal(grads[0], grads[1])


# --------------------------------------------------------------------------- optional outputs, one gradient


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    scale: int = 1


class ToyBackend:
    name = "toy"

    def plan(self, x: Tensor) -> ToyConfig:
        return ToyConfig(2)


@dataclasses.dataclass(frozen=True)
class ToyCall(Call):
    differentiable = ("x",)

    x: Tensor
    backend: str
    square: bool


class ToyOutputs(NamedTuple):
    y: Tensor
    y2: Optional[Tensor]  # (absent unless ``square``)
    config: Any


@dataclasses.dataclass(frozen=True)
class ToyBackwardCall(Call):
    grad_y: Optional[Tensor]
    grad_y2: Optional[Tensor]
    x: Tensor
    config: Replanned
    backend: str


def _toy_forward(call, impl):
    config = impl.plan(call.x)
    return ToyOutputs(call.x * config.scale, call.x * call.x if call.square else None, config)


def _toy_fake(call, impl):
    return ToyOutputs(torch.empty_like(call.x), torch.empty_like(call.x) if call.square else None, None)


def _toy_save(ctx, call, out):
    ctx.save_for_backward(call.x)
    ctx.backend, ctx.config, ctx.square = call.backend, out.config, call.square


def _toy_backward(ctx, grads, need, run):
    (x,) = ctx.saved_tensors  # (an absent output's gradient: None, or size 0 through the custom ops)
    return run(ToyBackwardCall(grads.y, grads.y2 if ctx.square else None, x, ctx.config, ctx.backend))


def _toy_backward_impl(b, impl):
    scale = b.config.scale
    g = b.grad_y * scale if b.grad_y is not None else torch.zeros_like(b.x)
    return (g + 2 * b.x * b.grad_y2 if b.grad_y2 is not None else g,)


@pytest.fixture(scope="module")
def toy_op():
    return CustomOp("glue_toy_test", ToyCall, ToyOutputs, ToyBackwardCall, table=BackendTable(toy=ToyBackend),
                    forward=_toy_forward, fake=_toy_fake, save=_toy_save, backward=_toy_backward,
                    backward_impl=_toy_backward_impl, backward_fake=lambda b, impl: (torch.empty_like(b.x),),
                    replan=lambda b, impl: impl.plan(b.x))


@pytest.mark.parametrize("path", ["eager", "custom_op"])
@pytest.mark.parametrize("square", [False, True])
def test_optional_outputs_and_a_single_gradient(toy_op, path, square):
    """An ``Optional[Tensor]`` output is None on the eager path and a size-0 tensor of the
    call's first tensor through the custom ops (forward and fake alike: opcheck); a backward
    op with one gradient returns it bare (a schema of one output) and the glue takes it."""
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    call = ToyCall(x, "toy", square)
    assert toy_op.optional_outputs == ("y2",)
    with PassThrough() if path == "custom_op" else contextlib.nullcontext():
        out = toy_op(call)
    if square:
        assert torch.equal(out.y2, x * x)
    elif path == "eager":
        assert out.y2 is None
    else:
        assert out.y2.shape == (0,) and out.y2.dtype == x.dtype
    loss = out.y.sum() + (out.y2.sum() if square else 0)
    (gx,) = torch.autograd.grad(loss, (x,))
    assert torch.equal(gx, torch.full_like(x, 2.0) + (2 * x.detach() if square else 0))
    torch.library.opcheck(toy_op.forward_op, toy_op.args(call))
    bcall = ToyBackwardCall(torch.ones(5, dtype=torch.float64), None, x.detach(), None, "toy")
    torch.library.opcheck(toy_op.backward_op, toy_op.backward_args(bcall))
    assert isinstance(toy_op.backward_op(*toy_op.backward_args(bcall)), Tensor)


def test_compiled_backward_plans_under_the_forward_overrides():
    """An op whose backward op plans the Config again (``replan``) hands both its custom ops
    the planner overrides the call was made under: a compiled call made inside
    ``override(tiles=...)`` whose backward runs outside it (as autograd's device thread
    always does) keeps the forward's kept-column layout. Before, the backward planned
    with the default tiles and read the kept tile maxima wrongly: NaN gradients."""
    from logitless.planning.overrides import override

    g = torch.Generator().manual_seed(3)
    x0, w0 = torch.randn(40, 32, generator=g), torch.randn(1001, 32, generator=g) * 32 ** -0.5
    t = torch.randint(0, 1001, (40,), generator=g)
    x0, w0, t = x0.to(DEVICE), w0.to(DEVICE), t.to(DEVICE)  # (Triton runs CPU tensors only interpreted)

    def loss(x, w):
        return logitless.linear_cross_entropy(x, w, t, backend="triton")

    results = []
    for fn in (loss, torch.compile(loss, dynamic=False, fullgraph=True)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with override(tiles=(32, 64, 16, 4, 1)):  # (the default interpreter tiles are 16 x 32)
            out = fn(x, w)
        results.append((out.detach(), *torch.autograd.grad(out, (x, w))))
    torch._dynamo.reset()
    for eager, compiled in zip(*results):
        assert torch.isfinite(compiled).all()
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-7)


def _kept_chunks_budget(n: int, v: int, h: int, chunks: bool) -> int:
    """A budget at which the device's fp32 plan for a backward that does not own the kept
    columns (``kept_owned=False``, the custom ops') keeps every column and writes their dz in
    several chunks (``chunks``) or at once (not)."""
    from logitless.planning import plans

    keep = n * v * 5
    for budget in range(keep, 8 * keep, keep // 32):
        plan = plans.triton_plan(n, v, h, 4, budget, DEVICE, keep_allowed=True, kept_owned=False)
        if plan.keep_cols == v and (plan.kept_dz_chunk > 0) == chunks:
            return budget
    raise AssertionError(f"no budget keeps every column with dz in {'chunks' if chunks else 'one chunk'}")


def test_the_custom_ops_keep_what_their_budget_holds_beside_the_kept_dz():
    """Where the budget holds every kept column but not one chunk of their dz beside them,
    an eager call keeps them all (its backward turns them into dz in place) and a call
    through the custom ops plans fewer (``kept_owned=False``: the forward op's call is built
    with ``Owned(False)``): its forward keeps fewer columns, the backward recomputes the rest,
    and the gradients agree with the eager call's to rounding."""
    from logitless.ops.linear_cross_entropy.api import OPS
    from logitless.planning import plans

    g = torch.Generator().manual_seed(4)
    n, h, v = 40, 24, 1000
    for budget in range(n * v * 4, 2 * n * v * 4, n * v // 8):
        if plans.triton_plan(n, v, h, 4, budget, DEVICE, keep_allowed=True).keep_cols == v:
            break
    custom = plans.triton_plan(n, v, h, 4, budget, DEVICE, keep_allowed=True, kept_owned=False)
    assert custom.keep_cols < v, custom  # (the interpreter: some; a GPU's cost model: none)
    x = torch.randn(n, h, generator=g).to(DEVICE)
    w = (torch.randn(v, h, generator=g) * 0.3).to(DEVICE)
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    grads, widths = [], []
    for through_ops in (False, True):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        call = LceCall(xg, wg, None, t, None, CrossEntropyOptions(), "triton", budget, need_argmax=False,
                       need_grad=True, grad_in_forward=False, need=Needs(True, True, False), batch_invariant=False,
                       tp=VocabParallelOptions())
        out = OPS.outputs_of(OPS.forward_op(*OPS.args(call))) if through_ops else OPS(call)
        widths.append(out.keep.shape[1])
        out.loss.backward()
        grads.append((out.loss.detach(), xg.grad, wg.grad))
    assert widths[0] >= v > widths[1] >= custom.keep_cols, widths
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunks", [False, True], ids=["one", "chunks"])
def test_the_backward_op_leaves_the_kept_columns_as_they_are(chunks):
    """Through the custom ops (``glue.Owned`` False) the backward writes the kept columns'
    dz into its dz chunk buffer: the forward op's kept output is unchanged after the
    backward (its schema declares no write; a declared one made inductor copy the columns
    whole first). Where the budget's rest holds dz of every kept column the gradients are
    bitwise the eager path's, which turns the columns into dz in place; where it does not
    (``plan.kept_dz_chunk`` columns at a time, dx summed over the chunks in fp32) they
    agree to rounding."""
    from logitless.ops.linear_cross_entropy.api import OPS

    g = torch.Generator().manual_seed(3)
    n, h, v = 40, 24, 1000  # (V a multiple of 8: the plan may keep every column)
    budget = _kept_chunks_budget(n, v, h, chunks)
    x = torch.randn(n, h, generator=g).to(DEVICE)
    w = (torch.randn(v, h, generator=g) * 0.3).to(DEVICE)
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    opts = CrossEntropyOptions()
    grads = []
    for custom in (False, True):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        call = LceCall(xg, wg, None, t, None, opts, "triton", budget, need_argmax=False, need_grad=True,
                       grad_in_forward=False, need=Needs(True, True, False), batch_invariant=False,
                       tp=VocabParallelOptions())
        out = OPS.outputs_of(OPS.forward_op(*OPS.args(call))) if custom else OPS(call)
        kept = out.keep.clone()
        if custom:
            assert v <= kept.shape[1] and kept.isfinite().all()  # the plan kept every column
        out.loss.backward()
        if custom:
            assert torch.equal(out.keep, kept)
        grads.append((xg.grad, wg.grad))
    if not chunks:
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["lce_softcap", "log_probs_entropy", "topk_kl"])
def test_compiled_kept_columns_in_chunks_match_eager(op, monkeypatch):
    """Each op that keeps columns, compiled (the custom ops: the backward cannot write dz
    over the kept columns) at a budget that holds them but not a second buffer of their
    size: dz goes through ``plan.kept_dz_chunk``-wide chunks (asserted on the launch's
    column chunks), and the loss and gradients are the eager call's (in place, one chunk)."""
    from logitless.triton_lib import launch

    g = torch.Generator().manual_seed(5)
    n, h, v = 40, 24, 1000
    budget = _kept_chunks_budget(n, v, h, True)
    x0 = torch.randn(n, h, generator=g).to(DEVICE)
    w0 = (torch.randn(v, h, generator=g) * 0.3).to(DEVICE)
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    ids = torch.rand(n, v, generator=g).topk(5, dim=-1).indices.to(DEVICE)  # (distinct per token)
    teacher = torch.log_softmax(torch.randn(n, 5, generator=g), -1).to(DEVICE)

    def loss(x, w):
        if op == "lce_softcap":
            return logitless.linear_cross_entropy(x, w, t, softcap=4.0, memory_budget=budget, backend="triton")
        if op == "log_probs_entropy":
            lp, ent = logitless.linear_log_probs(x, w, t, entropy=True, memory_budget=budget, backend="triton")
            return lp.sum() + 0.3 * ent.sum()
        return logitless.linear_topk_kl(x, w, ids, teacher, t, hard_label_weight=0.5, memory_budget=budget,
                                        backend="triton")

    seen = []
    chunks_of = launch.backward_chunks

    def spy(plan, v_, keep_cols, kept_step=0):
        out = chunks_of(plan, v_, keep_cols, kept_step)
        seen.append(sum(1 for _, v1 in out if v1 <= keep_cols))
        return out

    monkeypatch.setattr(launch, "backward_chunks", spy)
    results = []
    torch._dynamo.reset()
    for fn in (loss, torch.compile(loss, dynamic=False, fullgraph=True)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = fn(x, w)
        results.append((out.detach(), *torch.autograd.grad(out, (x, w))))
    torch._dynamo.reset()
    assert seen[0] == 1 and seen[-1] > 1, seen  # eager: one kept chunk in place; compiled: several
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
