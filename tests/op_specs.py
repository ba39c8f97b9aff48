"""One "op spec" per public loss: everything the contract suite (test_op_contract.py)
needs to hold the op to the same rules as every other op.

A spec says how to make random inputs of a given size and options, how to call the op
and its float64 reference, which inputs get gradients, which calls must raise (type and
message), which custom ops ``torch.library.opcheck`` checks with which arguments, and
which (tokens x vocab) allocations are allowed. A new op joins the contract by adding
one spec to ``SPECS``.

Custom ops are reached by name (``custom_op("lce_forward")``, i.e.
``torch.ops.logitless.lce_forward.default``), never through the modules that define
them: ``CUSTOM_OPS`` lists every name the specs use, in one place.

Sizes are tiny: the Triton backend runs on the CPU interpreter when there is no GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Optional

import torch

import logitless
from logitless.ops.common.reference import cross_entropy_reference, jsd_reference
from logitless.ops.linear_cross_entropy.api import BACKENDS as LCE_BACKENDS
from logitless.ops.linear_cross_entropy.reference import linear_cross_entropy_reference
from logitless.ops.linear_jsd.reference import linear_jsd_reference
from logitless.ops.linear_log_probs.reference import linear_log_probs_reference
from logitless.ops.log_probs.reference import log_probs_reference
from tests.conftest import DEVICE

#: The custom ops (namespace ``logitless``) that the specs' opcheck calls use, by name.
CUSTOM_OPS = ("ce_forward", "ce_backward", "lce_forward", "lce_backward", "jsd_forward", "jsd_backward",
              "linear_jsd_forward", "linear_jsd_backward", "lp_forward", "lp_backward", "llp_forward",
              "llp_backward", "topk_kl_forward", "topk_kl_backward")


def custom_op(name: str):
    """The overload ``torch.ops.logitless.<name>.default`` (registered by ``import logitless``)."""
    assert name in CUSTOM_OPS, f"add {name} to CUSTOM_OPS"
    return getattr(torch.ops.logitless, name).default

#: Keys of an option dict that start with "_" describe the inputs, not the op's keyword
#: arguments: "_ignore" (fraction of ignored targets), "_bias", "_class_weight", "_no_target".


@dataclass
class Case:
    """Inputs of one call: the op is ``spec.fn(*args, **kwargs)``; ``grads`` are the
    tensors whose gradients are checked (they require grad); ``num_tokens`` is the
    count of non-ignored tokens that ``return_stats`` must report."""

    args: tuple
    kwargs: dict
    grads: tuple
    num_tokens: Optional[int] = None


@dataclass
class OpSpec:
    name: str
    fn: Callable
    #: (case, reduction, dtype) -> (loss, lse or None, correct or None), differentiable
    #: with respect to case.grads; float64 for the reference, ``dtype`` for "torch in
    #: the same dtype" (the yardstick of assert_close_to_ref).
    reference: Callable
    #: (size, dtype, opts, seed, device) -> Case; ``size`` is one entry of ``sizes``' values.
    make: Callable
    options: dict
    #: The size used by the option tests.
    base_size: dict
    #: Odd sizes: name -> (size, option names, reduction).
    sizes: dict
    #: () -> {name: (call, exception type, message regex)}.
    bad_calls: Callable
    #: backend -> iterator of (custom op, args, opcheck test_utils or None for all).
    opcheck: Callable
    #: The size of the allocation check (tokens x vocab must not be allocated).
    alloc_size: dict
    #: Ops allowed to create an (N x V) tensor in the backward: the gradient of logits.
    grad_allocs: tuple = ()
    #: memory_budget of the option tests (None: the default; small values chunk).
    budget: Optional[int] = None
    #: return_stats: the op returns (loss, LossStats) to check against the reference.
    stats: bool = False
    #: lse in fp32 exactly (the logits are given), else within the input dtype's error.
    lse_exact: bool = False
    #: The reductions the op takes; ("none",): per-token outputs, no ``reduction`` argument.
    reductions: tuple = ("mean", "sum", "none")
    #: The backends the allocation check holds to "no (N x V) tensor" at ``alloc_size``.
    alloc_backends: tuple = ("torch", "triton")

    def __post_init__(self):
        # Read-only: the op files reuse these dicts; a test that changed one would change
        # every later test's inputs.
        self.options = MappingProxyType({k: MappingProxyType(dict(v)) for k, v in self.options.items()})


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _targets(lead, vocab, opts, g, ignore_index=-100):
    target = torch.randint(0, max(vocab, 1), lead, generator=g)
    if opts.get("_ignore"):
        target[torch.rand(lead, generator=g) < opts["_ignore"]] = ignore_index
    return target


def _kw(opts):
    return {k: v for k, v in opts.items() if not k.startswith("_")}


def _valid(target, ignore_index=-100):
    return int((target != ignore_index).sum())


# ----------------------------------------------------------------------- linear_cross_entropy


def _lce_make(size, dtype, opts, seed, device=DEVICE):
    lead, hidden, vocab = size["lead"], size["hidden"], size["vocab"]
    g = _gen(seed)
    x = torch.randn(*lead, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5 * 2).to(dtype)
    target = _targets(lead, vocab, opts, g)
    bias = (torch.randn(vocab, generator=g) * 0.5).to(dtype) if opts.get("_bias") else None
    kw = _kw(opts)
    if opts.get("_class_weight"):
        kw["class_weight"] = (torch.rand(vocab, generator=g) + 0.5).to(device)
    x = x.to(device).requires_grad_()
    w = w.to(device).requires_grad_()
    if bias is not None:
        bias = bias.to(device).requires_grad_()
    counted = target[..., 1:] if kw.get("shift") else target
    return Case((x, w, target.to(device), bias), kw, tuple(t for t in (x, w, bias) if t is not None),
                _valid(counted))


def _lce_reference(case, reduction, dtype=torch.float64):
    return linear_cross_entropy_reference(*case.args, reduction=reduction, dtype=dtype, **case.kwargs)


def _lce_bad_calls():
    x, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    f = logitless.linear_cross_entropy
    return {
        "reduction": (lambda: f(x, w, t, reduction="avg"), ValueError, "reduction"),
        "label_smoothing": (lambda: f(x, w, t, label_smoothing=-0.1), ValueError, "label_smoothing"),
        "softcap": (lambda: f(x, w, t, softcap=0.0), ValueError, "softcap"),
        "z_loss": (lambda: f(x, w, t, z_loss=-1.0), ValueError, "z_loss"),
        "hidden": (lambda: f(x, torch.randn(10, 7), t), ValueError, "hidden size"),
        # An (H, V) head (a flax kernel, weight.T) and torch's weight= for class weights.
        "transposed-head": (lambda: f(x, w.T, t), ValueError, r"looks transposed.*pass weight\.T"),
        "torch-weight-name": (lambda: f(x, w, t, weight=torch.rand(10)), TypeError, "class_weight="),
        "weight-rank": (lambda: f(x, torch.randn(10, 8, 1), t), ValueError, "2-D"),
        "target-shape": (lambda: f(x, w, t[:3]), ValueError, "target has shape"),
        "target-dtype": (lambda: f(x, w, t.short()), TypeError, "int64 or int32"),
        "target-probabilities": (lambda: f(x, w, torch.rand(4, 10)), TypeError, r"logitless\.cross_entropy"),
        "x-dtype": (lambda: f(x.int(), w, t), TypeError, "x must be"),
        "dtype-mismatch": (lambda: f(x, w.double(), t), TypeError, "must match"),
        "bias-shape": (lambda: f(x, w, t, torch.randn(9)), ValueError, "bias must have shape"),
        "bias-dtype": (lambda: f(x, w, t, torch.randn(10).half()), TypeError, "bias is"),
        "class-weight": (lambda: f(x, w, t, class_weight=torch.rand(11)), ValueError, "class_weight"),
        "empty-vocab": (lambda: f(x, torch.randn(0, 8), t), ValueError, "vocabulary is empty"),
        "backend": (lambda: f(x, w, t, backend="cuda"), ValueError, "backend"),
        "budget": (lambda: f(x, w, t, memory_budget=0), ValueError, "memory_budget"),
        "shift-1d": (lambda: f(x[0], w, t[0], shift=True), ValueError, "shift"),
        "device": (lambda: f(x, w.to("meta"), t), ValueError, "device"),
        "out-of-range-target": (lambda: f(x, w, t + 10), ValueError, "outside"),
        "negative-target": (lambda: f(x, w, t - 1), ValueError, "outside"),
    }


def _lce_opcheck(backend):
    # V = 104: a multiple of 8, so that the GPU plan may keep columns (ODD_V_ALIGN).
    opts = {"_ignore": 0.2, "_bias": True, "_class_weight": True}
    case = _lce_make({"lead": (13,), "hidden": 24, "vocab": 104}, torch.float32, opts, seed=5)
    x, w, t, b = case.args
    cw = case.kwargs["class_weight"]
    from logitless.ops.common.contract import Needs
    from logitless.ops.linear_cross_entropy.api import OPS
    from logitless.ops.linear_cross_entropy.contract import LceBackwardCall, LceCall
    from logitless.ops.linear_cross_entropy.custom_op import planned, replan
    from logitless.options import CrossEntropyOptions, VocabParallelOptions

    opts = CrossEntropyOptions(label_smoothing=0.1, softcap=4.0, z_loss=1e-3)
    need, tp = Needs(True, True, True), VocabParallelOptions()
    # Not test_aot_dispatch_dynamic: it compares every output with eager's, and the kept
    # columns' dummies (``NOTHING_KEPT``, when none are kept) are left uninitialised. The
    # public function never returns them; the compile tests of test_training_loops.py
    # cover that path (fullgraph, dynamic, kept columns).
    forward_utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    for need_grad in (True, False):
        call = LceCall(x, w, b, t, cw, opts, backend, 12_000, need_argmax=True, need_grad=need_grad,
                       grad_in_forward=False, need=need, batch_invariant=False, tp=tp)
        yield custom_op("lce_forward"), OPS.args(call), forward_utils
        out = OPS.outputs_of(custom_op("lce_forward")(*OPS.args(call)))
        assert out.config is None  # (no Config output: the backward op plans it again)
        grad_loss = torch.rand((), device=DEVICE) + 0.5
        grad_lse = torch.randn(out.lse.shape, device=DEVICE)  # the per-token lse is differentiable
        bcall = LceBackwardCall(grad_loss, grad_lse, x.detach(), w.detach(), b.detach(), t, cw, out.lse.detach(),
                                out.w_t, out.keep, out.keep_max, None, opts, backend, False, need, tp, planned(call))
        config = replan(bcall, LCE_BACKENDS[backend])  # (the backward op's Config: the forward's)
        if backend == "triton" and need_grad:
            assert 1 < out.keep.shape[1] < 104 + 8 and config.keeps  # the budget keeps some columns
        else:
            assert out.keep.shape == (1, 1) and not getattr(config, "keeps", False)  # nothing kept
        yield custom_op("lce_backward"), OPS.backward_args(bcall), None


LINEAR_CROSS_ENTROPY = OpSpec(
    name="linear_cross_entropy",
    fn=logitless.linear_cross_entropy,
    reference=_lce_reference,
    make=_lce_make,
    options={
        "plain": {},
        "ignore": {"_ignore": 0.3},
        "bias": {"_bias": True},
        "label_smoothing": {"label_smoothing": 0.1},
        "class_weight": {"_class_weight": True},
        "softcap": {"softcap": 4.0},
        "z_loss": {"z_loss": 1e-2},
        "shift": {"shift": True},
        "all": {"_ignore": 0.3, "_bias": True, "label_smoothing": 0.2, "_class_weight": True,
                "softcap": 6.0, "z_loss": 1e-3, "shift": True},
    },
    base_size={"lead": (3, 13), "hidden": 24, "vocab": 101},
    sizes={
        "one-token": ({"lead": (1,), "hidden": 24, "vocab": 101}, ("ignore",), "mean"),
        "prime-V-odd-H-3d": ({"lead": (2, 5), "hidden": 20, "vocab": 1009}, ("ignore",), "mean"),
        "H17": ({"lead": (33,), "hidden": 17, "vocab": 67}, ("ignore",), "mean"),
        "tiny": ({"lead": (1, 1), "hidden": 8, "vocab": 3}, ("ignore",), "mean"),
    },
    bad_calls=_lce_bad_calls,
    opcheck=_lce_opcheck,
    alloc_size={"lead": (48,), "hidden": 16, "vocab": 160},
    budget=None,
    stats=True,
)


# ----------------------------------------------------------------------- cross_entropy


def _ce_make(size, dtype, opts, seed, device=DEVICE):
    lead, vocab = size["lead"], size["vocab"]
    g = _gen(seed)
    kw = _kw(opts)
    if kw.get("ignore_index", -100) >= vocab:  # (a class of tiny vocabularies)
        kw["ignore_index"] = -100
    logits = (torch.randn(*lead, vocab, generator=g) * 3.0).to(dtype)
    target = _targets(lead, vocab, opts, g, kw.get("ignore_index", -100))
    if opts.get("_class_weight"):
        kw["class_weight"] = (torch.rand(vocab, generator=g) + 0.5).to(device)
    logits = logits.to(device).requires_grad_()
    return Case((logits, target.to(device)), kw, (logits,), _valid(target, kw.get("ignore_index", -100)))


def _ce_reference(case, reduction, dtype=torch.float64):
    return cross_entropy_reference(*case.args, reduction=reduction, dtype=dtype, **case.kwargs)


def _ce_bad_calls():
    z, t = torch.randn(4, 10), torch.zeros(4, dtype=torch.long)
    f = logitless.cross_entropy
    return {
        "reduction": (lambda: f(z, t, reduction="avg"), ValueError, "reduction"),
        "label_smoothing": (lambda: f(z, t, label_smoothing=-0.1), ValueError, "label_smoothing"),
        "softcap": (lambda: f(z, t, softcap=0.0), ValueError, "softcap"),
        "z_loss": (lambda: f(z, t, z_loss=-1.0), ValueError, "z_loss"),
        "ignore_index": (lambda: f(z, t, ignore_index=1.5), TypeError, "ignore_index"),
        "target-shape": (lambda: f(z, t[:3]), ValueError, "target has shape"),
        "target-rank": (lambda: f(z, t[:, None]), ValueError, "target has shape"),
        "target-dtype": (lambda: f(z, t.short()), TypeError, "int64 or int32"),
        "soft-target-shape": (lambda: f(z, t.float()), ValueError, "class probabilities"),
        "soft-target-3d": (lambda: f(z[None], z[None].softmax(-1)), ValueError, "class_dim"),
        "soft-target-stats": (lambda: f(z, z.softmax(-1), return_stats=True), ValueError, "return_stats"),
        "logits-dtype": (lambda: f(z.int(), t), TypeError, "logits must be"),
        "logits-type": (lambda: f(z.tolist(), t), TypeError, "logits must be a torch.Tensor"),
        "logits-0d": (lambda: f(z[0, 0], t[0]), ValueError, "at least one dimension"),
        "empty-vocab": (lambda: f(z[:, :0], t), ValueError, "vocabulary is empty"),
        "class-weight": (lambda: f(z, t, class_weight=torch.rand(11)), ValueError, "class_weight"),
        "backend": (lambda: f(z, t, backend="cuda"), ValueError, "backend"),
        "budget": (lambda: f(z, t, memory_budget=0), ValueError, "memory_budget"),
        "triton-fp64": (lambda: f(z.double(), t, backend="triton"), TypeError, "float64"),
        "device": (lambda: f(z, t.to("meta")), ValueError, "device"),
        "out-of-range-target": (lambda: f(z, t + 10), ValueError, "outside"),
        "negative-target": (lambda: f(z, t - 1), ValueError, "outside"),
    }


def _ce_opcheck(backend):
    from logitless.ops.cross_entropy.api import OPS
    from logitless.ops.cross_entropy.contract import CeBackwardCall, CeCall
    from logitless.options import CrossEntropyOptions

    g = _gen(6)
    logits = torch.randn(11, 37, generator=g).to(DEVICE).requires_grad_()
    t = torch.randint(0, 37, (11,), generator=g).to(DEVICE)
    cw = (torch.rand(37, generator=g) + 0.5).to(DEVICE)
    for reduction in ("mean", "none"):
        opts = CrossEntropyOptions(-100, reduction, 0.1, 5.0, 1e-3)
        call = CeCall(logits, t, cw, opts, backend, 4096, need_argmax=True)
        yield custom_op("ce_forward"), OPS.args(call), None
        strided = CeCall(logits.detach().T.contiguous().T, t, None, opts, backend, 4096, need_argmax=False)
        yield custom_op("ce_forward"), OPS.args(strided), None
        no_argmax = CeCall(logits, t, cw, opts, backend, 4096, need_argmax=False)
        out = OPS.outputs_of(custom_op("ce_forward")(*OPS.args(no_argmax)))
        grad_loss = torch.rand(11 if reduction == "none" else (), device=DEVICE) + 0.5
        for grad_lse in (None, torch.randn(out.lse.shape, device=DEVICE)):  # the per-token lse is differentiable
            bcall = CeBackwardCall(grad_loss, grad_lse, logits.detach(), t, cw, out.lse.detach(), out.w_t, None,
                                   opts, backend, 4096)
            yield custom_op("ce_backward"), OPS.backward_args(bcall), None


CROSS_ENTROPY = OpSpec(
    name="cross_entropy",
    fn=logitless.cross_entropy,
    reference=_ce_reference,
    make=_ce_make,
    options={
        "plain": {},
        "ignore": {"_ignore": 0.3},
        "label_smoothing": {"label_smoothing": 0.1},
        "class_weight": {"_class_weight": True},
        "softcap": {"softcap": 4.0},
        "z_loss": {"z_loss": 1e-2},
        "all": {"_ignore": 0.3, "ignore_index": 5, "label_smoothing": 0.2, "_class_weight": True,
                "softcap": 6.0, "z_loss": 1e-3},
    },
    base_size={"lead": (3, 11), "vocab": 97},
    sizes={
        "one-token": ({"lead": (1,), "vocab": 101}, ("ignore", "all"), "mean"),
        "prime-V-3d": ({"lead": (2, 3), "vocab": 1009}, ("ignore", "all"), "mean"),
        "1d-logits": ({"lead": (), "vocab": 37}, ("ignore", "all"), "mean"),
        "one-class": ({"lead": (6,), "vocab": 1}, ("ignore", "all"), "mean"),
        "two-classes": ({"lead": (5,), "vocab": 2}, ("ignore", "all"), "mean"),
        "N40-V300": ({"lead": (40,), "vocab": 300}, ("ignore", "all"), "mean"),
    },
    bad_calls=_ce_bad_calls,
    opcheck=_ce_opcheck,
    alloc_size={"lead": (40,), "vocab": 160},
    grad_allocs=("aten.empty_like.default",),
    budget=4096,
    stats=True,
    lse_exact=True,
)


# ----------------------------------------------------------------------- jsd


def _jsd_make(size, dtype, opts, seed, device=DEVICE):
    lead, vocab = size["lead"], size["vocab"]
    g = _gen(seed)
    zs = (torch.randn(*lead, vocab, generator=g) * 2).to(dtype).to(device).requires_grad_()
    zt = (torch.randn(*lead, vocab, generator=g) * 2).to(dtype).to(device)
    target = _targets(lead, vocab, opts, g)
    target = None if opts.get("_no_target") else target.to(device)
    return Case((zs, zt, target), _kw(opts), (zs,))


def _jsd_reference(case, reduction, dtype=torch.float64):
    return jsd_reference(*case.args, reduction=reduction, dtype=dtype, **case.kwargs), None, None


def _jsd_bad_calls():
    zs, zt, t = torch.randn(4, 10), torch.randn(4, 10), torch.zeros(4, dtype=torch.long)
    f = logitless.jsd
    return {
        "beta": (lambda: f(zs, zt, beta=-0.1), ValueError, "beta"),
        "temperature": (lambda: f(zs, zt, temperature=float("inf")), ValueError, "temperature"),
        "reduction": (lambda: f(zs, zt, reduction="batchmean"), ValueError, "reduction"),
        "vocab": (lambda: f(zs, zt[:, :9]), ValueError, "vocabularies"),
        "target-shape": (lambda: f(zs, zt, t[:2]), ValueError, "target has shape"),
        "hard-no-target": (lambda: f(zs, zt, hard_label_weight=1.0), ValueError, "needs a target"),
        "dtype": (lambda: f(zs.int(), zt), TypeError, "student_logits must be"),
        "teacher-grad": (lambda: f(zs, zt.requires_grad_()), ValueError, "teacher_logits requires grad"),
        "scalar": (lambda: f(torch.tensor(1.0), torch.tensor(1.0)), ValueError, "shape"),
        "backend": (lambda: f(zs, zt, backend="jax"), ValueError, "backend"),
        "out-of-range": (lambda: f(zs, zt, t + 10, hard_label_weight=1.0), ValueError, "outside"),
    }


_JSD_ALL = {"_ignore": 0.3, "student_softcap": 4.0, "teacher_softcap": 3.0, "hard_label_weight": 0.3,
            "beta": 0.3, "temperature": 1.5}


def _jsd_opcheck(backend):
    from logitless.ops.jsd.api import OPS
    from logitless.ops.jsd.contract import JsdBackwardCall, JsdCall
    from logitless.options import JSDOptions

    case = _jsd_make({"lead": (6,), "vocab": 19}, torch.float32, _JSD_ALL, seed=10)
    zs, zt, target = case.args
    opts = JSDOptions(beta=0.3, temperature=1.5, ignore_index=-100, student_softcap=4.0, teacher_softcap=3.0,
                      hard_label_weight=0.3)
    call = JsdCall(zs, zt, target, opts, 1 << 20, backend)
    yield custom_op("jsd_forward"), OPS.args(call), None
    out = OPS.outputs_of(custom_op("jsd_forward")(*OPS.args(call)))
    bcall = JsdBackwardCall(torch.randn(6, device=DEVICE), zs.detach(), zt, target, out.stats.detach(), None,
                            opts, backend, 1 << 20)
    yield custom_op("jsd_backward"), OPS.backward_args(bcall), None


JSD = OpSpec(
    name="jsd",
    fn=logitless.jsd,
    reference=_jsd_reference,
    make=_jsd_make,
    options={
        "plain": {},
        "ignore": {"_ignore": 0.3},
        "softcaps": {"student_softcap": 3.0, "teacher_softcap": 5.0},
        "hard": {"hard_label_weight": 0.5},
        "no-target": {"_no_target": True},
        "all": _JSD_ALL,
    },
    base_size={"lead": (3, 7), "vocab": 101},
    sizes={
        "one-token": ({"lead": (1,), "vocab": 101}, ("hard",), "sum"),
        "prime-V-3d": ({"lead": (2, 5), "vocab": 1009}, ("hard",), "sum"),
        "tiny": ({"lead": (1, 1), "vocab": 3}, ("hard",), "sum"),
        "empty": ({"lead": (0,), "vocab": 7}, ("hard",), "sum"),
    },
    bad_calls=_jsd_bad_calls,
    opcheck=_jsd_opcheck,
    alloc_size={"lead": (40,), "vocab": 160},
    grad_allocs=("aten.empty_like.default",),
    budget=4096,
)


# ----------------------------------------------------------------------- linear_jsd


def _ljsd_make(size, dtype, opts, seed, device=DEVICE):
    lead, hs, ht, vocab = size["lead"], size["hidden"], size["teacher_hidden"], size["vocab"]
    g = _gen(seed)
    xs = torch.randn(*lead, hs, generator=g)
    ws = torch.randn(vocab, hs, generator=g) * hs**-0.5 * 2
    xt = torch.randn(*lead, ht, generator=g)
    wt = torch.randn(vocab, ht, generator=g) * ht**-0.5 * 2
    target = _targets(lead, vocab, opts, g)
    kw = _kw(opts)
    grads = []
    if opts.get("_bias"):
        kw["student_bias"] = (torch.randn(vocab, generator=g) * 0.5).to(dtype).to(device).requires_grad_()
        kw["teacher_bias"] = (torch.randn(vocab, generator=g) * 0.5).to(dtype).to(device)
        grads = [kw["student_bias"]]
    xs = xs.to(dtype).to(device).requires_grad_()
    ws = ws.to(dtype).to(device).requires_grad_()
    target = None if opts.get("_no_target") else target.to(device)
    return Case((xs, ws, xt.to(dtype).to(device), wt.to(dtype).to(device), target), kw, (xs, ws, *grads))


def _ljsd_reference(case, reduction, dtype=torch.float64):
    return linear_jsd_reference(*case.args, reduction=reduction, dtype=dtype, **case.kwargs), None, None


def _ljsd_bad_calls():
    xs, ws = torch.randn(4, 8), torch.randn(10, 8)
    xt, wt = torch.randn(4, 6), torch.randn(10, 6)
    t = torch.zeros(4, dtype=torch.long)
    f = logitless.linear_jsd
    return {
        "beta": (lambda: f(xs, ws, xt, wt, beta=1.5), ValueError, "beta"),
        "temperature": (lambda: f(xs, ws, xt, wt, temperature=0.0), ValueError, "temperature"),
        "reduction": (lambda: f(xs, ws, xt, wt, reduction="batchmean"), ValueError, "reduction"),
        "softcap": (lambda: f(xs, ws, xt, wt, student_softcap=-1.0), ValueError, "student_softcap"),
        "hard-weight": (lambda: f(xs, ws, xt, wt, t, hard_label_weight=-1.0), ValueError, "hard_label_weight"),
        "hard-no-target": (lambda: f(xs, ws, xt, wt, hard_label_weight=0.5), ValueError, "needs a target"),
        "vocab": (lambda: f(xs, ws, xt, torch.randn(11, 6)), ValueError, "vocabularies differ"),
        "hidden": (lambda: f(xs, ws, xt, torch.randn(10, 7)), ValueError, "hidden size"),
        "transposed-head": (lambda: f(xs, ws, xt, wt.T), ValueError, r"looks transposed.*teacher_weight\.T"),
        "tokens": (lambda: f(xs, ws, xt[:3], wt), ValueError, "tokens must match"),
        "weight-rank": (lambda: f(xs, ws[None], xt, wt), ValueError, "2-D"),
        "target-shape": (lambda: f(xs, ws, xt, wt, t[:3]), ValueError, "target has shape"),
        "target-dtype": (lambda: f(xs, ws, xt, wt, t.float()), TypeError, "int64 or int32"),
        "x-dtype": (lambda: f(xs.int(), ws, xt, wt), TypeError, "student_x must be"),
        "dtype-mismatch": (lambda: f(xs, ws, xt.double(), wt.double()), TypeError, "one dtype"),
        "bias-shape": (lambda: f(xs, ws, xt, wt, student_bias=torch.randn(9)), ValueError, "student_bias"),
        "empty-vocab": (lambda: f(xs, ws[:0], xt, wt[:0]), ValueError, "vocabulary is empty"),
        "backend": (lambda: f(xs, ws, xt, wt, backend="cuda"), ValueError, "backend"),
        "budget": (lambda: f(xs, ws, xt, wt, memory_budget=0), ValueError, "memory_budget"),
        "shift-1d": (lambda: f(xs[0], ws, xt[0], wt, shift=True), ValueError, "shift"),
        "device": (lambda: f(xs, ws, xt, wt.to("meta")), ValueError, "device"),
        "teacher-grad": (lambda: f(xs, ws, xt.clone().requires_grad_(), wt, teacher_grad=True),
                         NotImplementedError, "teacher_x requires grad"),
        "teacher-weight-grad": (lambda: f(xs, ws, xt, wt.clone().requires_grad_(), t, teacher_grad=True),
                                NotImplementedError, "teacher_weight requires grad"),
        "teacher-grad-type": (lambda: f(xs, ws, xt, wt, teacher_grad="yes"), TypeError, "teacher_grad"),
        "out-of-range-hard-labels": (lambda: f(xs, ws, xt, wt, t + 10, hard_label_weight=0.5), ValueError,
                                     "outside"),
    }


_LJSD_ALL = {"_ignore": 0.3, "_bias": True, "student_softcap": 4.0, "teacher_softcap": 3.0,
             "hard_label_weight": 0.3, "shift": True, "beta": 0.3, "temperature": 1.5}


def _ljsd_opcheck(backend):
    opts = dict(_LJSD_ALL, shift=False)
    case = _ljsd_make({"lead": (5,), "hidden": 8, "teacher_hidden": 6, "vocab": 13}, torch.float32, opts, seed=10)
    xs, ws, xt, wt, target = case.args
    bs, bt = case.kwargs["student_bias"], case.kwargs["teacher_bias"]
    from logitless.ops.common.contract import Needs
    from logitless.ops.linear_jsd.api import OPS
    from logitless.ops.linear_jsd.contract import LjsdBackwardCall, LjsdCall
    from logitless.ops.linear_jsd.custom_op import planned
    from logitless.options import JSDOptions, VocabParallelOptions

    opts = JSDOptions(beta=0.3, temperature=1.5, student_softcap=4.0, teacher_softcap=3.0, hard_label_weight=0.3)
    need, tp = Needs(True, True, True), VocabParallelOptions()
    call = LjsdCall(xs, ws, bs, xt, wt, bt, target, opts, "none", 1 << 20, backend, grad_in_forward=False,
                    need=need, tp=tp)
    yield custom_op("linear_jsd_forward"), OPS.args(call), None
    out = OPS.outputs_of(custom_op("linear_jsd_forward")(*OPS.args(call)))  # (no config: the backward plans it)
    bcall = LjsdBackwardCall(torch.randn(5, device=DEVICE), xs.detach(), ws.detach(), bs.detach(), xt, wt, bt,
                             target, out.stats.detach(), None, opts, "none", backend, need, tp, out.keep,
                             planned(call))
    yield custom_op("linear_jsd_backward"), OPS.backward_args(bcall), None


LINEAR_JSD = OpSpec(
    name="linear_jsd",
    fn=logitless.linear_jsd,
    reference=_ljsd_reference,
    make=_ljsd_make,
    options={
        "plain": {},
        "ignore": {"_ignore": 0.3},
        "bias": {"_bias": True},
        "softcaps": {"student_softcap": 3.0, "teacher_softcap": 5.0},
        "hard": {"hard_label_weight": 0.5},
        "shift": {"shift": True, "_ignore": 0.2},
        "no-target": {"_no_target": True},
        "all": _LJSD_ALL,
    },
    base_size={"lead": (3, 7), "hidden": 24, "teacher_hidden": 40, "vocab": 101},
    sizes={
        "one-token": ({"lead": (1,), "hidden": 24, "teacher_hidden": 24, "vocab": 101}, ("hard",), "mean"),
        "prime-V-3d": ({"lead": (2, 5), "hidden": 20, "teacher_hidden": 12, "vocab": 1009}, ("ignore",), "mean"),
        "H17-H23": ({"lead": (33,), "hidden": 17, "teacher_hidden": 23, "vocab": 67}, ("ignore",), "mean"),
        "tiny": ({"lead": (1, 1), "hidden": 8, "teacher_hidden": 8, "vocab": 3}, ("hard",), "mean"),
    },
    bad_calls=_ljsd_bad_calls,
    opcheck=_ljsd_opcheck,
    alloc_size={"lead": (64,), "hidden": 16, "teacher_hidden": 24, "vocab": 160},
    budget=None,
)


# ----------------------------------------------------------------------- log_probs
# Per-token outputs, no reduction: the spec's ``fn`` returns logp, or with entropy=True
# logp and entropy stacked on a last axis of 2 (so that one random upstream gradient
# reaches both outputs); its reference does the same.


def _lp_outputs(logp, ent, **kw):
    return torch.stack((logp, ent), -1) if kw.get("entropy") else logp


def _lp_fn(logits, tokens, *, reduction="none", memory_budget=None, **kw):
    """log_probs as the contract calls it (reduction "none" only; it takes no budget)."""
    assert reduction == "none", reduction
    out = logitless.log_probs(logits, tokens, **kw)
    return torch.stack(out, -1) if kw.get("entropy") else out


def _lp_make(size, dtype, opts, seed, device=DEVICE):
    lead, vocab = size["lead"], size["vocab"]
    g = _gen(seed)
    kw = _kw(opts)
    if kw.get("ignore_index", -100) >= vocab:  # (a class of tiny vocabularies)
        kw["ignore_index"] = -100
    logits = (torch.randn(*lead, vocab, generator=g) * 3.0).to(dtype)
    tokens = _targets(lead, vocab, opts, g, kw.get("ignore_index", -100))
    logits = logits.to(device).requires_grad_()
    return Case((logits, tokens.to(device)), kw, (logits,))


def _lp_reference(case, reduction, dtype=torch.float64):
    assert reduction == "none", reduction
    kw = {k: v for k, v in case.kwargs.items() if k != "entropy"}
    return _lp_outputs(*log_probs_reference(*case.args, dtype=dtype, **kw), **case.kwargs), None, None


def _lp_bad_calls():
    z, t = torch.randn(4, 10), torch.zeros(4, dtype=torch.long)
    f = logitless.log_probs
    return {
        "temperature": (lambda: f(z, t, temperature=0.0), ValueError, "temperature must be a positive finite"),
        "temperature-inf": (lambda: f(z, t, temperature=float("inf")), ValueError, "temperature"),
        "temperature-type": (lambda: f(z, t, temperature="1"), TypeError, "temperature must be a float"),
        "entropy": (lambda: f(z, t, entropy=1), TypeError, "entropy must be a bool"),
        "ignore_index": (lambda: f(z, t, ignore_index=1.5), TypeError, "ignore_index must be an int"),
        "logits-dtype": (lambda: f(z.int(), t), TypeError, "logits must be float16"),
        "logits-type": (lambda: f(z.tolist(), t), TypeError, "logits must be a torch.Tensor"),
        "logits-0d": (lambda: f(z[0, 0], t[0]), ValueError, r"logits must have shape \(..., V\)"),
        "empty-vocab": (lambda: f(z[:, :0], t), ValueError, "V >= 1"),
        "tokens-type": (lambda: f(z, t.tolist()), TypeError, "tokens must be a torch.Tensor"),
        "tokens-dtype": (lambda: f(z, t.float()), TypeError, "int64 or int32"),
        "tokens-shape": (lambda: f(z, t[:3]), ValueError, "tokens has shape"),
        "tokens-rank": (lambda: f(z, t[:, None]), ValueError, "tokens has shape"),
        "device": (lambda: f(z, t.to("meta")), ValueError, "one device"),
        "backend": (lambda: f(z, t, backend="cuda"), ValueError, "backend must be one of"),
        "triton-fp64": (lambda: f(z.double(), t, backend="triton"), TypeError, "float64"),
        "out-of-range-token": (lambda: f(z, t + 10), ValueError, r"tokens contains 10, outside \[0, 10\)"),
        "negative-token": (lambda: f(z, t - 1), ValueError, "outside"),
    }


def _lp_opcheck(backend):
    case = _lp_make({"lead": (6,), "vocab": 37}, torch.float32, {"_ignore": 0.3}, seed=5)
    z, t = case.args
    from logitless.ops.log_probs.api import OPS
    from logitless.ops.log_probs.contract import LpBackwardCall, LpCall, LpPlanned
    from logitless.options import LogProbOptions

    for entropy in (True, False):
        opts = LogProbOptions(temperature=0.7, entropy=entropy)
        call = LpCall(z, t, opts, backend, 1 << 20, top_k=None, top_p=None, min_p=None, checked=True, k_max=-1,
                      batch_invariant=False)
        yield custom_op("lp_forward"), OPS.args(call), None
        out = OPS.outputs_of(custom_op("lp_forward")(*OPS.args(call)))
        grad_ent = torch.randn(out.entropy.shape, device=DEVICE) if entropy else None
        for grad_logp in (torch.randn(out.logp.shape, device=DEVICE), None if entropy else out.logp.detach()):
            bcall = LpBackwardCall(grad_logp, grad_ent, z.detach(), t, None, out.entropy.detach(), out.lse, out.tau,
                                   None, opts, backend, LpPlanned(1 << 20, False, False))
            yield custom_op("lp_backward"), OPS.backward_args(bcall), None


_LP_ALL = {"_ignore": 0.3, "temperature": 0.7, "entropy": True, "ignore_index": 5}

LOG_PROBS = OpSpec(
    name="log_probs",
    fn=_lp_fn,
    reference=_lp_reference,
    make=_lp_make,
    options={
        "plain": {},
        "ignore": {"_ignore": 0.3},
        "temperature": {"temperature": 1.7},
        "entropy": {"entropy": True},
        "ignore_index": {"_ignore": 0.3, "ignore_index": 3},
        "all": _LP_ALL,
    },
    base_size={"lead": (3, 11), "vocab": 97},
    sizes={
        "one-token": ({"lead": (1,), "vocab": 101}, ("ignore", "all"), "none"),
        "prime-V-3d": ({"lead": (2, 3), "vocab": 1009}, ("ignore", "all"), "none"),
        "1d-logits": ({"lead": (), "vocab": 37}, ("ignore", "all"), "none"),
        "one-class": ({"lead": (6,), "vocab": 1}, ("ignore", "all"), "none"),
        "two-classes": ({"lead": (5,), "vocab": 2}, ("ignore", "all"), "none"),
        "N40-V300": ({"lead": (40,), "vocab": 300}, ("ignore", "all"), "none"),
    },
    bad_calls=_lp_bad_calls,
    opcheck=_lp_opcheck,
    alloc_size={"lead": (40,), "vocab": 160},
    grad_allocs=("aten.empty_like.default",),
    # The torch backend upcasts rows in chunks of the default budget (256 MiB; log_probs
    # takes no memory_budget): at test sizes one chunk holds every row.
    alloc_backends=("triton",),
    reductions=("none",),
)


# ----------------------------------------------------------------------- linear_log_probs


def _llp_fn(x, weight, tokens, bias=None, *, reduction="none", **kw):
    """linear_log_probs as the contract calls it (reduction "none" only)."""
    assert reduction == "none", reduction
    out = logitless.linear_log_probs(x, weight, tokens, bias, **kw)
    return torch.stack(out, -1) if kw.get("entropy") else out


def _llp_make(size, dtype, opts, seed, device=DEVICE):
    case = _lce_make(size, dtype, {k: v for k, v in opts.items() if k != "_class_weight"}, seed, device)
    x, w, t, b = case.args
    kw = _kw(opts)
    if kw.get("ignore_index", -100) != -100:  # (the targets above use -100)
        t = torch.where(t == -100, kw["ignore_index"], t)
    return Case((x, w, t, b), kw, case.grads)


def _llp_reference(case, reduction, dtype=torch.float64):
    assert reduction == "none", reduction
    kw = {k: v for k, v in case.kwargs.items() if k not in ("entropy", "memory_budget")}
    return _lp_outputs(*linear_log_probs_reference(*case.args, dtype=dtype, **kw), **case.kwargs), None, None


def _llp_bad_calls():
    x, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    f = logitless.linear_log_probs
    return {
        "temperature": (lambda: f(x, w, t, temperature=0.0), ValueError, "temperature must be a positive finite"),
        "temperature-type": (lambda: f(x, w, t, temperature="1"), TypeError, "temperature must be a float"),
        "entropy": (lambda: f(x, w, t, entropy="yes"), TypeError, "entropy must be a bool"),
        "softcap": (lambda: f(x, w, t, softcap=0.0), ValueError, "softcap must be a positive finite"),
        "softcap-negative": (lambda: f(x, w, t, softcap=-1.0), ValueError, "softcap"),
        "ignore_index": (lambda: f(x, w, t, ignore_index=1.5), TypeError, "ignore_index must be an int"),
        "hidden": (lambda: f(x, torch.randn(10, 7), t), ValueError, "hidden size 8"),
        "transposed-head": (lambda: f(x, w.T, t), ValueError, r"looks transposed.*pass weight\.T"),
        "top_k-range": (lambda: f(x, w, t, top_k=-1), ValueError, r"top_k must be in \[0, 2\*\*62\]"),
        "weight-rank": (lambda: f(x, torch.randn(10, 8, 1), t), ValueError, "weight must be 2-D"),
        "x-0d": (lambda: f(x[0, 0], w, t[0]), ValueError, "x must have at least one dimension"),
        "tokens-shape": (lambda: f(x, w, t[:3]), ValueError, "tokens has shape"),
        "tokens-dtype": (lambda: f(x, w, t.float()), TypeError, "int64 or int32"),
        "tokens-type": (lambda: f(x, w, t.tolist()), TypeError, "tokens must be a torch.Tensor"),
        "x-dtype": (lambda: f(x.int(), w, t), TypeError, "x must be float16"),
        "weight-dtype": (lambda: f(x, w.int(), t), TypeError, "weight must be float16"),
        "dtype-mismatch": (lambda: f(x, w.double(), t), TypeError, "must match"),
        "bias-shape": (lambda: f(x, w, t, torch.randn(9)), ValueError, "bias must have shape"),
        "bias-dtype": (lambda: f(x, w, t, torch.randn(10).half()), TypeError, "bias is"),
        "empty-vocab": (lambda: f(x, torch.randn(0, 8), t), ValueError, "vocabulary is empty"),
        "backend": (lambda: f(x, w, t, backend="cuda"), ValueError, "backend must be one of"),
        "triton-fp64": (lambda: f(x.double(), w.double(), t, backend="triton"), TypeError, "float64"),
        "budget": (lambda: f(x, w, t, memory_budget=0), ValueError, "memory_budget"),
        "device": (lambda: f(x, w.to("meta"), t), ValueError, "one device"),
        "vocab_size": (lambda: f(x, w, t, vocab_size=11), ValueError, "vocab_size=11 exceeds"),
        "out-of-range-token": (lambda: f(x, w, t + 10), ValueError, r"tokens contains 10, outside \[0, 10\)"),
        "negative-token": (lambda: f(x, w, t - 1), ValueError, "outside"),
    }


def _llp_opcheck(backend):
    # V = 104: a multiple of 8, so that the GPU plan may keep columns (ODD_V_ALIGN).
    case = _llp_make({"lead": (13,), "hidden": 24, "vocab": 104}, torch.float32, {"_ignore": 0.2, "_bias": True},
                     seed=5)
    x, w, t, b = case.args
    from logitless.ops.common.contract import Needs
    from logitless.ops.linear_log_probs.api import BACKENDS as _LLP
    from logitless.ops.linear_log_probs.api import OPS
    from logitless.ops.linear_log_probs.contract import LlpBackwardCall, LlpCall
    from logitless.ops.linear_log_probs.custom_op import planned, replan
    from logitless.options import LogProbOptions, VocabParallelOptions

    forward_utils = ("test_schema", "test_autograd_registration", "test_faketensor")  # (see _lce_opcheck)
    tp = VocabParallelOptions()
    for need_grad, entropy in ((True, True), (True, False), (False, True)):
        opts = LogProbOptions(temperature=0.7, entropy=entropy, softcap=4.0)
        call = LlpCall(x, w, b, t, opts, backend, 12_000, need_grad=need_grad, need_dw=True, top_k=None, top_p=None,
                       min_p=None, checked=True, k_max=-1, block=0, tp=tp)
        yield custom_op("llp_forward"), OPS.args(call), forward_utils
        out = OPS.outputs_of(custom_op("llp_forward")(*OPS.args(call)))
        grad_ent = torch.randn(out.entropy.shape, device=DEVICE) if entropy else None
        bcall = LlpBackwardCall(torch.randn(out.logp.shape, device=DEVICE), grad_ent, x.detach(), w.detach(),
                                b.detach(), t, out.lse, out.entropy.detach(), out.keep, out.keep_max, None,
                                opts, backend, Needs(True, True, True), None, None, None, None, tp, planned(call))
        decoded = getattr(replan(bcall, _LLP[backend]), "main", None)  # (the backward op's Config)
        if backend == "triton" and need_grad:
            assert 1 < out.keep.shape[1] < 104 + 8 and decoded.keeps  # the budget keeps some columns
        else:
            assert out.keep.shape == (1, 1) and (decoded is None or not decoded.keeps)  # nothing kept
        yield custom_op("llp_backward"), OPS.backward_args(bcall), None


_LLP_ALL = {"_ignore": 0.3, "_bias": True, "temperature": 0.7, "entropy": True, "softcap": 4.0,
            "ignore_index": 7}

LINEAR_LOG_PROBS = OpSpec(
    name="linear_log_probs",
    fn=_llp_fn,
    reference=_llp_reference,
    make=_llp_make,
    options={
        "plain": {},
        "ignore": {"_ignore": 0.3},
        "bias": {"_bias": True},
        "temperature": {"temperature": 1.7},
        "entropy": {"entropy": True},
        "softcap": {"softcap": 4.0},
        "ignore_index": {"_ignore": 0.3, "ignore_index": 3},
        # a budget that keeps some columns of exp(a - m) (Triton) and chunks the vocabulary
        "budget": {"_ignore": 0.2, "entropy": True, "memory_budget": 6_000},
        "all": _LLP_ALL,
    },
    base_size={"lead": (3, 13), "hidden": 24, "vocab": 101},
    sizes={
        "one-token": ({"lead": (1,), "hidden": 24, "vocab": 101}, ("ignore", "all"), "none"),
        "prime-V-odd-H-3d": ({"lead": (2, 5), "hidden": 20, "vocab": 1009}, ("ignore", "all"), "none"),
        "H17": ({"lead": (33,), "hidden": 17, "vocab": 67}, ("ignore", "all"), "none"),
        "tiny": ({"lead": (1, 1), "hidden": 8, "vocab": 3}, ("ignore",), "none"),
    },
    bad_calls=_llp_bad_calls,
    opcheck=_llp_opcheck,
    alloc_size={"lead": (48,), "hidden": 16, "vocab": 160},
    reductions=("none",),
)


# ----------------------------------------------------------------------- linear_topk_kl
# The teacher: the top-k of a random distribution (its log-probs under the full one), the
# ids in a random order per token; hidden, weight, target as linear_cross_entropy's.


def _topk_teacher(lead, vocab, k, g, device):
    logits = torch.randn(*lead, vocab, generator=g, dtype=torch.float64) * 2.5
    lp, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)
    order = torch.rand(*lead, k, generator=g).argsort(-1)
    return ids.gather(-1, order).to(device), lp.gather(-1, order).float().to(device)


def _topk_make(size, dtype, opts, seed, device=DEVICE):
    case = _lce_make(size, dtype, {k: v for k, v in opts.items() if k != "_class_weight"}, seed, device)
    x, w, t, b = case.args
    g = _gen(seed + 100)
    ids, lp = _topk_teacher(size["lead"], size["vocab"], size.get("k", 7), g, device)
    if opts.get("_no_target"):
        t = None
    return Case((x, w, ids, lp, t, b), _kw(opts), case.grads)


def _topk_fn(x, weight, ids, lp, target=None, bias=None, **kw):
    return logitless.linear_topk_kl(x, weight, ids, lp, target, bias=bias, **kw)


def _topk_reference(case, reduction, dtype=torch.float64):
    from logitless.ops.linear_topk_kl.reference import linear_topk_kl_reference

    x, w, ids, lp, t, b = case.args
    kw = {k: v for k, v in case.kwargs.items() if k != "memory_budget"}
    return linear_topk_kl_reference(x, w, ids, lp, t, b, reduction=reduction, dtype=dtype, **kw), None, None


def _topk_bad_calls():
    x, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    ids = torch.tensor([[0, 1, 2]] * 4)
    lp = torch.full((4, 3), -2.0)
    f = logitless.linear_topk_kl
    return {
        "direction": (lambda: f(x, w, ids, lp, direction="backward"), ValueError,
                      r"direction must be one of \('forward', 'reverse'\)"),
        "tail": (lambda: f(x, w, ids, lp, tail="clamp"), ValueError,
                 r"tail must be one of \('bucket', 'renormalize', 'none'\)"),
        "reduction": (lambda: f(x, w, ids, lp, reduction="batchmean"), ValueError, "reduction"),
        "temperature": (lambda: f(x, w, ids, lp, temperature=0.0), ValueError, "temperature"),
        "hard_label_weight": (lambda: f(x, w, ids, lp, t, hard_label_weight=-1.0), ValueError, "hard_label_weight"),
        "softcap": (lambda: f(x, w, ids, lp, softcap=0.0), ValueError, "softcap"),
        "shapes-differ": (lambda: f(x, w, ids, lp[:, :2]), ValueError, "teacher_log_probs has shape"),
        "ids-lead": (lambda: f(x, w, ids[:3], lp[:3]), ValueError, "teacher_ids has shape"),
        "ids-dtype": (lambda: f(x, w, ids.float(), lp), TypeError, "teacher_ids must be int64 or int32"),
        "lp-dtype": (lambda: f(x, w, ids, ids), TypeError, "teacher_log_probs must be a float"),
        "id-out-of-range": (lambda: f(x, w, ids + 8, lp), ValueError, r"teacher_ids contains 10, outside \[0, 10\)"),
        "negative-id": (lambda: f(x, w, ids - 1, lp), ValueError, "teacher_ids contains -1"),
        "repeated-id": (lambda: f(x, w, ids.clamp(max=1), lp), ValueError, "repeats an id"),
        "positive-log-prob": (lambda: f(x, w, ids, lp + 3.0), ValueError, r"> 0 .*logits passed by mistake"),
        "too-many-ids": (lambda: f(x, torch.randn(2, 8), ids, lp), ValueError, "3 ids per token"),
        "hard-no-target": (lambda: f(x, w, ids, lp, hard_label_weight=0.5), ValueError, "needs target"),
        "target-out-of-range": (lambda: f(x, w, ids, lp, t + 10, hard_label_weight=0.5), ValueError, "outside"),
        "target-shape": (lambda: f(x, w, ids, lp, t[:3]), ValueError, "target has shape"),
        "teacher-grad": (lambda: f(x, w, ids, lp.clone().requires_grad_()), ValueError, "requires grad"),
        "hidden": (lambda: f(x, torch.randn(10, 7), ids, lp), ValueError, "hidden size"),
        "transposed-head": (lambda: f(x, w.T, ids, lp), ValueError, r"looks transposed"),
        "backend": (lambda: f(x, w, ids, lp, backend="cuda"), ValueError, "backend"),
        "budget": (lambda: f(x, w, ids, lp, memory_budget=0), ValueError, "memory_budget"),
        "shift-1d": (lambda: f(x[0], w, ids[0], lp[0], shift=True), ValueError, "shift"),
        "device": (lambda: f(x, w.to("meta"), ids, lp), ValueError, "device"),
    }


_TOPK_ALL = {"_ignore": 0.3, "_bias": True, "direction": "reverse", "tail": "bucket", "temperature": 1.5,
             "softcap": 4.0, "hard_label_weight": 0.3, "shift": True}


def _topk_opcheck(backend):
    # V = 104: a multiple of 8, so that the GPU plan may keep columns (ODD_V_ALIGN).
    case = _topk_make({"lead": (13,), "hidden": 24, "vocab": 104, "k": 6}, torch.float32,
                      {"_ignore": 0.2, "_bias": True}, seed=5)
    x, w, ids, lp, t, b = case.args
    from logitless.ops.common.contract import Needs
    from logitless.ops.linear_topk_kl.api import BACKENDS, OPS
    from logitless.ops.linear_topk_kl.contract import TopKBackwardCall, TopKCall
    from logitless.ops.linear_topk_kl.custom_op import replan
    from logitless.options import TopKKLOptions, VocabParallelOptions

    ids, order = ids.sort(dim=1)
    lp = lp.gather(1, order)
    need, tp = Needs(True, True, True), VocabParallelOptions()
    forward_utils = ("test_schema", "test_autograd_registration", "test_faketensor")  # (see _lce_opcheck)
    for need_grad, opts in ((True, TopKKLOptions(hard_label_weight=0.3, temperature=0.7, softcap=4.0)),
                            (True, TopKKLOptions(direction="reverse", tail="none", reduction="none")),
                            (False, TopKKLOptions(tail="renormalize"))):
        call = TopKCall(x, w, b, ids, lp, t, opts, backend, 12_000, need_grad, need, tp)
        yield custom_op("topk_kl_forward"), OPS.args(call), forward_utils
        out = OPS.outputs_of(custom_op("topk_kl_forward")(*OPS.args(call)))
        bcall = TopKBackwardCall(torch.rand(out.loss.shape, device=DEVICE) + 0.5, x.detach(), w.detach(), b.detach(),
                                 ids, t, out.w, out.rows, out.coef, out.sparse, out.keep, out.keep_max, None, opts,
                                 backend, need, tp, 12_000, need_grad)
        decoded = getattr(replan(bcall, BACKENDS[backend]), "linear", None)  # (the backward op's Config)
        if backend == "triton" and need_grad:
            assert 1 < out.keep.shape[1] < 104 + 8 and decoded.keeps  # the budget keeps some columns
        else:
            assert out.keep.shape == (1, 1) and not getattr(decoded, "keeps", False)  # nothing kept
        if not need_grad:
            continue
        yield custom_op("topk_kl_backward"), OPS.backward_args(bcall), None


LINEAR_TOPK_KL = OpSpec(
    name="linear_topk_kl",
    fn=_topk_fn,
    reference=_topk_reference,
    make=_topk_make,
    options={
        "plain": {},
        "reverse": {"direction": "reverse"},
        "renormalize": {"tail": "renormalize", "_ignore": 0.2},
        "reverse-renormalize": {"direction": "reverse", "tail": "renormalize"},
        "none": {"tail": "none"},
        "reverse-none": {"direction": "reverse", "tail": "none", "_bias": True},
        "temperature-softcap": {"temperature": 0.7, "softcap": 4.0},
        "hard": {"hard_label_weight": 0.5, "_ignore": 0.3},
        "no-target": {"_no_target": True, "temperature": 1.3},
        # a budget that keeps some columns of exp(a - m) (Triton) and chunks the vocabulary
        "budget": {"_ignore": 0.2, "hard_label_weight": 0.2, "memory_budget": 6_000},
        "all": _TOPK_ALL,
    },
    base_size={"lead": (3, 13), "hidden": 24, "vocab": 101, "k": 7},
    sizes={
        "one-token": ({"lead": (1,), "hidden": 24, "vocab": 101, "k": 5}, ("hard",), "mean"),
        "prime-V-odd-H-3d": ({"lead": (2, 5), "hidden": 20, "vocab": 1009, "k": 20}, ("plain", "all"), "sum"),
        "H17-k1": ({"lead": (33,), "hidden": 17, "vocab": 67, "k": 1}, ("reverse", "hard"), "none"),
        "tiny": ({"lead": (1, 1), "hidden": 8, "vocab": 3, "k": 2}, ("plain", "reverse-none"), "mean"),
    },
    bad_calls=_topk_bad_calls,
    opcheck=_topk_opcheck,
    alloc_size={"lead": (48,), "hidden": 16, "vocab": 160, "k": 5},
)


#: Every op of the contract. A new op joins by adding its spec here.
SPECS: dict[str, OpSpec] = {s.name: s for s in (LINEAR_CROSS_ENTROPY, CROSS_ENTROPY, JSD, LINEAR_JSD,
                                                        LOG_PROBS, LINEAR_LOG_PROBS, LINEAR_TOPK_KL)}

