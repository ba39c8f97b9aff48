"""torchtitan's trainer on logitless: ``LogitlessLoss``, a torchtitan loss that computes
``CrossEntropyLoss`` of ``lm_head(hidden)`` without the (tokens x vocab) logits
(docs/torchtitan.md). Importing this module imports torchtitan (``import logitless`` never does).

Select it the way torchtitan selects any component, with no change to torchtitan:

- on the command line, torchtitan's override mechanism (``torchtitan.config.override``)::

      --override.imports logitless.integrations.torchtitan.logitless_loss

  replaces the trainer's ``loss`` config (``CrossEntropyLoss.Config``, or a
  ``ChunkedLossWrapper.Config`` around one) by ``LogitlessLoss.Config``, keeping its
  ``global_vocab_size``; options as JSON:
  ``'logitless.integrations.torchtitan.logitless_loss={"memory_budget": 536870912}'``;
- in a ``config_registry`` function: ``loss=LogitlessLoss.Config(...)``.

``LogitlessLoss`` is a ``ChunkedLossWrapper``, so torchtitan's ``Trainer`` wires it as it
wires the chunked loss: it hands it the model's ``lm_head`` (``set_lm_head``) and sets
``model._skip_lm_head``, so the model returns the final norm's output. Per call the head
runs once, through logitless (one fused op per hidden-state tensor; memory bounded by
``memory_budget``, not by a chunk count): the sum of the per-token losses over the local
tokens divided by ``global_valid_tokens``, ``IGNORE_INDEX`` (-100) ignored, the
cross-entropy of torchtitan's ``CrossEntropyLoss`` on the same head. As the chunked loss
does, the head's backward runs inside the call; the returned loss carries the hidden
states' gradient into the decoder's backward.

Parallelism: FSDP2 (the head's weight is all-gathered at most once per call and its
gradient reduce-scattered by FSDP's own hooks, through ``register_fsdp_forward_method``, in
each layout: the head its own FSDP root, in a group with the final norm as torchtitan shards
it, or in the root's group; ``_unsharded``), TP with
a vocabulary-parallel head (torchtitan's ``loss_parallel``: a ``Shard(0)`` DTensor weight, or
under ``spmd_backend="spmd_types"`` this rank's rows with the TP group of the current mesh;
logitless exchanges O(tokens) statistics, never logits), CP (the local sequence chunk; the
loss stays a local sum over ``global_valid_tokens``), and MTP lists of hidden states
(``[main, depth 1, ...]``: the main loss plus ``mtp_scale`` times the mean of the depths'
losses, labels rolled per depth as torchtitan's ``MTPLoss`` rolls them). Under FSDP2 a head
that the norm's forward left unsharded stays so through the head's backward into the norm's
(no gather in the call, none again in the backward); a sharded one is gathered once for the
call and resharded at its end; under ``spmd_types`` TP the hidden states are typed Replicate (their
backward all-reduces the gradient), so each rank returns its partial gradient
(``partial_dx=True``), as the colwise head would.

Refused, each with a ``ValueError``/``TypeError`` that says why: a loss other than
``CrossEntropyLoss`` (``logitless_loss`` on ``MSELoss``, or on a ``ChunkedLossWrapper`` around
another loss); ``MTPLoss`` through the trainer (torchtitan 0.3.0's ``MTPDecoder.forward`` raises
on ``_skip_lm_head``, which the trainer sets for every ``ChunkedLossWrapper``: MTP lists work
when the loss is called directly); a head weight sharded other than over the vocabulary, or over
it on two mesh dimensions; a head weight that is FSDP2's shard (the head in a parent's FSDP
group that resharded it after its forward); ``Partial`` or hidden-dimension-sharded hidden
states; labels that are not (batch, seq) integers; a ``global_vocab_size`` that disagrees with the head; bad options.
Not tested: pipeline parallelism (wired by the trainer as for the chunked loss, last stage),
``full_dtensor`` (handled as ``partial_dtensor``) and CP (nothing specific to do).
``compile.components=["loss"]`` compiles nothing: the op is already fused. ``set_lm_head``
logs once per process, at INFO, that logitless is active.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torchtitan.components.loss import (
    IGNORE_INDEX,
    BaseLoss,
    ChunkedLossWrapper,
    CrossEntropyLoss,
)
from torchtitan.config import CompileConfig, override
from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size
from torchtitan.distributed.utils import get_spmd_backend

from logitless.ops.linear_cross_entropy import linear_cross_entropy

from ._announce import announce

__all__ = ["LogitlessLoss", "logitless_loss"]

#: The name of the head method that runs the fused loss, registered with FSDP2 as a
#: forward method when the head is an ``FSDPModule``.
_HEAD_METHOD = "_logitless_cross_entropy_sum"


class LogitlessLoss(ChunkedLossWrapper):
    """torchtitan's ``CrossEntropyLoss`` of ``lm_head(hidden)``, computed by logitless
    without the logits (module docstring: selection, wiring, parallelism).

    ``__call__(pred, labels, global_valid_tokens=None, positions=None)`` ->
    ``(loss, {})``: ``pred`` the final norm's output (B, L, H) (plain or DTensor), or a
    list/tuple ``[main, depth 1, ...]`` of them for multi-token prediction; ``labels``
    (B, L) integer token ids, -100 ignored; the loss is fp32, the sum over the local
    tokens divided by ``global_valid_tokens`` (when given).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        global_vocab_size: int | None = None
        """Full vocabulary size (optional): checked against the head's rows."""

        mtp_scale: float = 0.3
        """Weight of the mean MTP depth loss (as torchtitan's ``MTPLoss``)."""

        memory_budget: int | None = None
        """logitless' temporary-memory budget in bytes (None: its default, 256 MiB)."""

        backend: str = "auto"
        """logitless backend: "auto", "triton" or "torch"."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        if config.global_vocab_size is not None and (
                not isinstance(config.global_vocab_size, int) or config.global_vocab_size <= 0):
            raise ValueError(f"LogitlessLoss: global_vocab_size must be a positive int or None, "
                             f"got {config.global_vocab_size!r}")
        if not isinstance(config.mtp_scale, (int, float)) or config.mtp_scale < 0:
            raise ValueError(f"LogitlessLoss: mtp_scale must be a number >= 0, got {config.mtp_scale!r}")
        if config.memory_budget is not None and (
                not isinstance(config.memory_budget, int) or config.memory_budget <= 0):
            raise ValueError(f"LogitlessLoss: memory_budget must be a positive int (bytes) or None, "
                             f"got {config.memory_budget!r}")
        if config.backend not in ("auto", "triton", "torch"):
            raise ValueError(f"LogitlessLoss: backend must be 'auto', 'triton' or 'torch', "
                             f"got {config.backend!r}")
        # ChunkedLossWrapper's own constructor, for one chunk of its cross-entropy (what this
        # loss computes; its inner loss is never called). compile.components=["loss"] compiles
        # nothing here: the op is already fused.
        del compile_config
        super().__init__(ChunkedLossWrapper.Config(
            num_chunks=1, loss_fn=CrossEntropyLoss.Config(global_vocab_size=config.global_vocab_size)))
        self.config = config
        self.global_vocab_size = config.global_vocab_size
        self.mtp_scale = float(config.mtp_scale)

    def set_lm_head(self, lm_head: nn.Module) -> None:
        """Called by torchtitan's trainer with the model's head (an ``nn.Linear``, maybe
        FSDP-wrapped and/or with a vocabulary-sharded weight)."""
        weight = getattr(lm_head, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise TypeError(f"LogitlessLoss.set_lm_head: the head must be a linear layer with a 2-D "
                            f"(vocab, hidden) weight, got {type(lm_head).__name__}")
        if getattr(lm_head, _HEAD_METHOD, None) is None:
            setattr(lm_head, _HEAD_METHOD, types.MethodType(_head_cross_entropy_sum, lm_head))
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(lm_head, _HEAD_METHOD)   # a no-op without FSDP
        self.lm_head = lm_head
        announce("torchtitan", "LogitlessLoss computes the trainer's cross-entropy from lm_head's weight, no logits")

    def __call__(
        self,
        pred: Tensor | list[Tensor] | tuple[Tensor, ...],
        labels: Tensor,
        global_valid_tokens: Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        positions = kwargs.pop("positions", None)
        del kwargs   # as CrossEntropyLoss: other per-token inputs do not change the loss
        head = self.lm_head
        if head is None:
            raise RuntimeError("LogitlessLoss: no lm_head; torchtitan's trainer calls set_lm_head(model.lm_head) "
                               "(and sets model._skip_lm_head); outside the trainer call it yourself")
        if isinstance(pred, (list, tuple)):
            hiddens, label_list, scales = self._mtp_terms(list(pred), labels, positions)
        else:
            hiddens, label_list, scales = [pred], [labels], [1.0]
        for i, (h, t) in enumerate(zip(hiddens, label_list)):
            _check_pair(h, t, "pred" if len(hiddens) == 1 else f"pred[{i}]")

        grad = torch.is_grad_enabled() and any(h.requires_grad for h in hiddens)
        with _no_spmd_typecheck():
            sources, xs, ts = [], [], []
            for h, t in zip(hiddens, label_list):
                source, x = _local_hidden(h, head.weight)
                sources.append(source)
                xs.append(x.detach().requires_grad_(grad))
                ts.append(t.to_local() if isinstance(t, DTensor) else t)
            if not grad:
                with torch.no_grad(), _unsharded(head, backward=False):
                    _check_not_fsdp_sharded(head.weight, hiddens)
                    loss = getattr(head, _HEAD_METHOD)(xs, ts, scales, self)
                return _scaled(loss, global_valid_tokens), {}
            with _unsharded(head, backward=True):
                _check_not_fsdp_sharded(head.weight, hiddens)
                loss = _scaled(getattr(head, _HEAD_METHOD)(xs, ts, scales, self), global_valid_tokens)
                loss.backward()
            grads = [x.grad for x in xs]
            return _HiddenGrad.apply(loss.detach(), len(sources), *sources, *grads), {}

    def _mtp_terms(self, pred: list, labels: Tensor, positions: Tensor | None):
        """The hidden states, labels and weights of torchtitan's ``MTPLoss``."""
        from torchtitan.models.deepseek_v3.mtp import roll_mtp_sequence

        if len(pred) < 2:
            raise ValueError(f"LogitlessLoss: a list pred is multi-token prediction and needs the main "
                             f"hidden states plus at least one MTP depth, got {len(pred)} tensor(s)")
        if positions is None:
            raise ValueError("LogitlessLoss: MTP predictions need positions= (as torchtitan's MTPLoss)")
        if not isinstance(labels, Tensor) or labels.dim() != 2:
            raise ValueError("LogitlessLoss: labels must be a (batch, seq) tensor")
        hiddens = [pred[0]]
        label_list = [labels[:, : pred[0].shape[1]]]
        depths = len(pred) - 1
        for depth, h in enumerate(pred[1:], 1):
            if not isinstance(h, Tensor) or h.dim() != 3:
                raise ValueError(f"LogitlessLoss: pred[{depth}] must be (batch, seq, hidden) hidden states")
            seq = h.shape[1]
            if labels.shape[1] < seq or positions.shape[1] < seq:
                raise ValueError(f"LogitlessLoss: MTP depth {depth} needs labels and positions of at least "
                                 f"{seq} tokens, got {labels.shape[1]} and {positions.shape[1]}")
            hiddens.append(h)
            label_list.append(roll_mtp_sequence(labels[:, :seq], shift=depth, fill_value=IGNORE_INDEX,
                                                positions=positions[:, :seq]))
        return hiddens, label_list, [1.0] + [self.mtp_scale / depths] * depths


def _head_cross_entropy_sum(head: nn.Module, xs: list[Tensor], targets: list[Tensor],
                            scales: list[float], loss: LogitlessLoss) -> Tensor:
    """Bound to the head as ``_HEAD_METHOD`` (and registered with FSDP2): sum over ``xs`` of
    ``scale * sum-reduced cross-entropy(x @ W.T + b, target)``. Under FSDP2 the pre-forward
    hook has unsharded the weight (and cast ``xs`` to the parameters' dtype) before this runs."""
    weight, group, rows = _local_weight(head.weight, "lm_head.weight")
    bias = getattr(head, "bias", None)
    if bias is not None:
        bias, _, _ = _local_weight(bias, "lm_head.bias")
    _check_vocab(loss.global_vocab_size, rows)
    # spmd_types: the hidden states are typed Replicate over TP (torchtitan's pre-head norm), whose
    # backward all-reduces their gradient, so each rank returns its partial one (as the colwise head
    # would); a DTensor Replicate() hidden state gets the full gradient
    partial_dx = group is not None and rows is None
    total = None
    for x, t, scale in zip(xs, targets, scales):
        term = linear_cross_entropy(x, weight, t, bias, ignore_index=IGNORE_INDEX, reduction="sum",
                                    process_group=group, partial_dx=partial_dx,
                                    memory_budget=loss.config.memory_budget,
                                    backend=loss.config.backend)
        if scale != 1.0:
            term = term * scale
        total = term if total is None else total + term
    return total


def _local_weight(w: Tensor, name: str):
    """(this rank's rows, the vocabulary-parallel group or None, the full row count or None)."""
    if isinstance(w, DTensor):
        group, mesh = None, w.device_mesh
        for dim, p in enumerate(w.placements):
            if p.is_shard(0):
                if group is not None:
                    raise ValueError(f"LogitlessLoss: {name} is sharded over the vocabulary on two mesh "
                                     f"dimensions ({w.placements}); one tensor-parallel dimension is supported")
                group = mesh.get_group(dim)
            elif not p.is_replicate():
                raise ValueError(f"LogitlessLoss: {name} has placement {p} on mesh dimension "
                                 f"{_dim_name(mesh, dim)}; supported: Shard(0) (vocabulary parallel, "
                                 f"loss_parallel) or Replicate()")
        return w.to_local(), group, w.shape[0]
    if get_spmd_backend() == "spmd_types" and spmd_mesh_size("tp") > 1:
        # spmd_types: parameters are this rank's rows as plain tensors on the current mesh.
        return w, current_spmd_mesh().get_group("tp"), None
    return w, None, w.shape[0]


def _check_vocab(global_vocab_size, rows) -> None:
    """The full row count against ``global_vocab_size`` where it is known without a collective
    (spmd_types rows: logitless' own layout exchange checks the blocks)."""
    if global_vocab_size is None or rows is None:
        return
    if rows != global_vocab_size:
        raise ValueError(f"LogitlessLoss: global_vocab_size={global_vocab_size} but lm_head.weight has "
                         f"{rows} rows")


def _dim_name(mesh, dim: int) -> str:
    names = mesh.mesh_dim_names
    return repr(names[dim]) if names else str(dim)


def _local_hidden(h: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """(the tensor whose gradient the decoder receives, its local tensor). A DTensor hidden
    state is made ``Replicate()`` over the mesh dimension that shards the head's vocabulary
    (sequence parallel gathers there); token dimensions may stay sharded (DP, CP)."""
    if not isinstance(h, DTensor):
        return h, h
    vocab_dims = ()
    if isinstance(weight, DTensor):
        names = weight.device_mesh.mesh_dim_names or ()
        vocab_dims = tuple(names[d] for d, p in enumerate(weight.placements) if p.is_shard(0) and names)
    mesh, placements = h.device_mesh, list(h.placements)
    names = mesh.mesh_dim_names or ()
    for d, p in enumerate(placements):
        if p.is_partial():
            raise ValueError(f"LogitlessLoss: the hidden states are Partial() on mesh dimension "
                             f"{_dim_name(mesh, d)}; reduce them before the loss")
        if p.is_shard() and p.dim % h.dim() == h.dim() - 1:
            raise ValueError(f"LogitlessLoss: the hidden states are sharded over the hidden dimension "
                             f"({p} on mesh dimension {_dim_name(mesh, d)}); only token dimensions may be sharded")
        if p.is_shard() and names and names[d] in vocab_dims:
            placements[d] = Replicate()
    if placements != list(h.placements):
        h = h.redistribute(mesh, placements)
    return h, h.to_local()


def _check_pair(h, t, name: str) -> None:
    if not isinstance(h, Tensor) or h.dim() != 3:
        raise ValueError(f"LogitlessLoss: {name} must be (batch, seq, hidden) hidden states (the model with "
                         f"_skip_lm_head=True), got {type(h).__name__}"
                         + (f" of shape {tuple(h.shape)}" if isinstance(h, Tensor) else ""))
    if not h.is_floating_point():
        raise TypeError(f"LogitlessLoss: {name} must be floating point, got {h.dtype}")
    if not isinstance(t, Tensor) or t.dim() != 2:
        raise ValueError("LogitlessLoss: labels must be a (batch, seq) tensor, got "
                         + (f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__))
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex:
        raise TypeError(f"LogitlessLoss: labels must be integer token ids, got {t.dtype}")
    if tuple(h.shape[:2]) != tuple(t.shape):
        raise ValueError(f"LogitlessLoss: {name} has (batch, seq) {tuple(h.shape[:2])} but labels "
                         f"{tuple(t.shape)}")


def _scaled(loss: Tensor, global_valid_tokens: Tensor | None) -> Tensor:
    return loss if global_valid_tokens is None else loss / global_valid_tokens


def _check_not_fsdp_sharded(weight: Tensor, hiddens: list) -> None:
    """A DTensor head weight beside plain hidden states is FSDP2's sharded parameter (a
    tensor-parallel head comes with DTensor hidden states, or as plain rows under
    spmd_types): read outside the forward of the FSDP module that owns it, it is not the
    head (as a vocabulary-parallel one it would give a wrong loss)."""
    if isinstance(weight, DTensor) and not any(isinstance(h, DTensor) for h in hiddens):
        raise TypeError(
            f"LogitlessLoss: lm_head.weight is a DTensor ({weight.placements} on mesh dimensions "
            f"{weight.device_mesh.mesh_dim_names}) beside plain hidden states: FSDP2's sharded parameter, outside the "
            "forward of the FSDP module that owns it (the head in its parent's FSDP group, which resharded it "
            "after its forward: reshard_after_forward=True there). fully_shard the head itself (alone, or with the "
            "final norm as torchtitan's apply_fsdp_to_decoder does), or set reshard_after_forward=False on its parent")


@contextlib.contextmanager
def _unsharded(head: nn.Module, backward: bool):
    """FSDP2: the head's weight all-gathered once for the call (the fused op's forward and,
    with ``backward``, its backward inside the call), and left as it was found. Sharded on
    entry (the head its own FSDP root, or a group whose forward resharded it:
    ``reshard_after_forward=True``): gathered here, kept unsharded through the call, resharded
    at its end (nothing else would reshard it, and its sharded gradient is what
    ``head.weight`` shows once resharded). Unsharded on entry (its group with the final norm
    after the norm's forward, ``reshard_after_forward=False``): nothing gathered; it stays
    unsharded through the head's backward into the norm's, whose post-backward reshards the
    group. Not an FSDP module (the head under the root's group): nothing to do. FSDP2 swaps a
    module's registered parameter between the sharded and the unsharded one: that tells
    which case this is."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(head, FSDPModule):
        yield
        return
    before = head.weight
    head.unshard()
    gathered = head.weight is not before
    if gathered:
        head.set_reshard_after_forward(False)
    if backward:
        head.set_reshard_after_backward(False)
    try:
        yield
    finally:
        if gathered:
            head.set_reshard_after_forward(True)
        if backward:
            head.set_reshard_after_backward(True)
        if gathered:
            head.reshard()


class _no_spmd_typecheck:
    """spmd_types' ``no_typecheck`` when its checking is on (debug.spmd_typecheck)."""

    def __enter__(self):
        import spmd_types as spmd

        self._cm = spmd.no_typecheck() if spmd.is_type_checking() else None
        if self._cm is not None:
            self._cm.__enter__()

    def __exit__(self, *exc):
        if self._cm is not None:
            return self._cm.__exit__(*exc)
        return False


class _HiddenGrad(torch.autograd.Function):
    """Returns the loss (already back-propagated through the head) with a backward that
    hands each hidden-state tensor its gradient, times the upstream gradient."""

    @staticmethod
    def forward(ctx, loss, n, *sources_and_grads):
        sources, grads = sources_and_grads[:n], sources_and_grads[n:]
        ctx.n = n
        ctx.layouts = [(s.device_mesh, s.placements) if isinstance(s, DTensor) else None for s in sources]
        ctx.save_for_backward(*grads)
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, g):
        out = []
        for dx, layout in zip(ctx.saved_tensors, ctx.layouts):
            dx = dx * g.to(dx.dtype) if dx is not None else None
            if dx is not None and layout is not None:
                dx = DTensor.from_local(dx, layout[0], layout[1], run_check=False)
            out.append(dx)
        return (None, None, *out, *([None] * ctx.n))


@override(target=BaseLoss.Config, fqns=["loss"],
          description="logitless: the trainer's cross-entropy without the logits")
def logitless_loss(cfg: BaseLoss.Config, **options) -> LogitlessLoss.Config:
    """torchtitan override factory (``--override.imports
    logitless.integrations.torchtitan.logitless_loss``): the trainer's ``loss`` config,
    ``CrossEntropyLoss.Config`` or ``ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config)``,
    becomes ``LogitlessLoss.Config`` with its ``global_vocab_size``; ``options`` (the JSON
    kwargs of the override entry) set LogitlessLoss.Config's fields. Any other loss raises."""
    if isinstance(cfg, LogitlessLoss.Config):
        return dataclasses.replace(cfg, **options)
    inner = cfg.loss_fn if type(cfg) is ChunkedLossWrapper.Config else cfg
    if type(inner) is CrossEntropyLoss.Config:
        fields = {"global_vocab_size": inner.global_vocab_size}
    elif type(inner).__qualname__ == "MTPLoss.Config":
        raise ValueError(
            "logitless_loss: the trainer's loss is MTPLoss; torchtitan's trainer wires a ChunkedLossWrapper "
            "(LogitlessLoss is one) by setting model._skip_lm_head, which torchtitan's MTPDecoder refuses "
            "('skip_lm_head is not supported with MTP decoder'). LogitlessLoss takes MTP lists of hidden "
            "states when called directly (docs/torchtitan.md)")
    else:
        what = (f"ChunkedLossWrapper around {type(inner).__qualname__}"
                if type(cfg) is ChunkedLossWrapper.Config else type(cfg).__qualname__)
        raise ValueError(f"logitless_loss replaces torchtitan's CrossEntropyLoss (or a ChunkedLossWrapper "
                         f"around it); the trainer's loss is {what}, which it does not compute")
    fields.update(options)
    unknown = set(fields) - {f.name for f in dataclasses.fields(LogitlessLoss.Config)}
    if unknown:
        raise ValueError(f"logitless_loss: unknown option(s) {sorted(unknown)}; LogitlessLoss.Config has "
                         f"global_vocab_size, mtp_scale, memory_budget, backend")
    return LogitlessLoss.Config(**fields)
