"""TRL: SFTTrainer, GRPOTrainer (and RLOO) with per-token log-probs from logitless.

TRL >= 1.x computes the policy's and reference model's per-token log-probs by calling
``model(input_ids=..., attention_mask=..., labels=labels, fused_lm_head=True)`` on a
forward that ``trl.trainer.utils.add_fused_lm_head`` installs at trainer set-up
(labels: -100 outside the completion). :func:`patch_grpo` installs, on top of it, a
forward whose ``fused_lm_head=True`` path runs the backbone to the last hidden states
and calls ``logitless.linear_log_probs`` (exact fp32 statistics, no logits); every other
call (generation, ``fused_lm_head=False``) goes to the previous forward unchanged::

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...)
    logitless.integrations.trl.patch_grpo(trainer)
    trainer.train()

Returns TRL's ``FusedCausalLMOutput`` fields: loss, log_probs, entropy (both 0 where the
label is -100), label_mask; the optional fields (log_sum_sq_probs, mean_logits,
is_top1, aux_loss) are None. MoE load-balancing losses and models that scale their
logits other than by ``final_logit_softcapping`` are refused (ValueError).

SFT uses the same protocol (TRL's ``SFTTrainer.compute_loss`` reduces ``log_probs`` to
its loss and reads ``entropy`` and ``is_top1`` for its metrics): :func:`patch_sft`
installs a head whose log-probs and ``is_top1`` come from one
``logitless.linear_cross_entropy(..., reduction="none", return_stats=True)`` call::

    trainer = SFTTrainer(model=..., args=SFTConfig(...), train_dataset=...)
    logitless.integrations.trl.patch_sft(trainer)
    trainer.train()

TRL's own entry point: :func:`add_fused_lm_head` has the signature of TRL 1.16's
``add_fused_lm_head(model, temperature, cast_lm_head_to_fp32, outputs)`` and returns every
field TRL can ask for (log_sum_sq_probs, mean_logits and is_top1 included, from one pass:
``trl_fields``); :func:`patch_trl` puts it in place of TRL's in every TRL module that binds
it, so every trainer built afterwards (SFT, GRPO, RLOO, DPO, KTO, async GRPO) uses it.
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
from typing import Any, Optional

import torch

from logitless.ops.linear_cross_entropy import api as _lce_api
from logitless.transformers.patch import run_backbone as _run_backbone

from . import hf as _hf
from ._announce import announce


def _output_class():
    try:
        from trl.trainer.utils import FusedCausalLMOutput
        return FusedCausalLMOutput
    except Exception:  # trl not installed, or a version without it: a plain namespace
        return types.SimpleNamespace


def _unfused(previous, args, kwargs, labels, shift_labels, num_items_in_batch):
    """A head's forward without ``fused_lm_head``: the model's own, with the label
    arguments that were given."""
    for k, v in (("labels", labels), ("shift_labels", shift_labels), ("num_items_in_batch", num_items_in_batch)):
        if v is not None:
            kwargs[k] = v
    return previous(*args, **kwargs)


def _shifted_hidden(model, args, kwargs, labels, shift_labels):
    """(hidden, labels) of a fused head: the backbone's last hidden states (no cache; not a
    bypass of ``patch(model)``) and the labels they predict (shifted by one unless
    ``shift_labels`` is given)."""
    kwargs["use_cache"] = False
    hidden = _run_backbone(model, _hf.backbone(model), *args, **kwargs).last_hidden_state
    if shift_labels is None:
        return hidden[:, :-1], labels[:, 1:]
    return hidden, shift_labels


def add_logitless_lm_head(model, temperature: float = 1.0, entropy: bool = True, is_top1: bool = False,
                          cast_lm_head_to_fp32: bool = False) -> None:
    """Make ``model(..., labels=labels, fused_lm_head=True)`` return per-token log-probs
    (and entropy) from logitless: TRL's fused-head protocol (``add_fused_lm_head``).

    With ``is_top1=False`` the log-probs (and entropy) come from one
    ``logitless.linear_log_probs`` pass. With ``is_top1=True`` (SFT's token accuracy;
    temperature must be 1) they come from ``logitless.linear_cross_entropy(...,
    reduction="none", return_stats=True)``: log_probs = -per-token loss, is_top1 =
    (argmax == label), both from the same pass; ``entropy=True`` then costs one more
    forward-only pass over the vocabulary (``linear_log_probs`` under no_grad, one GEMM),
    and ``entropy=False`` returns NaN entropies (a metric that reads them logs NaN).
    ``cast_lm_head_to_fp32`` (GRPOConfig's, with ``is_top1=False``): the hidden states and
    the head in fp32, outside autocast, as TRL's head does then.
    """
    _hf.head_options(model)  # refuse unsupported logit scalings now, not mid-training
    if getattr(_hf.text_config(model), "output_router_logits", False):
        raise ValueError("MoE router aux losses are not supported by the logitless TRL head")
    if is_top1 and float(temperature) != 1.0:
        raise ValueError(f"is_top1=True needs temperature=1.0, got temperature={temperature!r}")
    announce("trl", "the TRL trainer's LM head computed by logitless (no logits)")
    previous = model.forward

    def forward(self, *args, fused_lm_head: bool = False, labels=None, shift_labels=None,
                num_items_in_batch: Optional[Any] = None, **kwargs):
        if not fused_lm_head:
            return _unfused(previous, args, kwargs, labels, shift_labels, num_items_in_batch)
        hidden, labels = _shifted_hidden(self, args, kwargs, labels, shift_labels)
        head = _hf.lm_head(self)
        _refuse_zero3(head.weight, "logitless TRL head")
        hidden, labels = hidden.to(head.weight.device), labels.to(head.weight.device)
        hw, hb = _head_in_compute_dtype(hidden, head.weight, head.bias, cast_lm_head_to_fp32)
        opts = _hf.head_options(self)
        mask = labels != -100
        top1 = None
        if is_top1:
            nll, stats = _lce_api.linear_cross_entropy(hidden, hw, labels, hb, ignore_index=-100,
                                                       reduction="none", return_stats=True, **opts)
            log_probs, top1 = -nll, stats.correct
            if entropy:
                with torch.no_grad():
                    ent = _hf.linear_log_probs(hidden.detach(), hw.detach(), labels,
                                               None if hb is None else hb.detach(), entropy=True,
                                               ignore_index=-100, **opts)[1]
            else:
                _warn_no_entropy()
                ent = torch.full(labels.shape, float("nan"), device=labels.device)
        else:
            x, w, b = hidden, hw, hb
            ctx = contextlib.nullcontext()
            if cast_lm_head_to_fp32:
                x, w, b = x.float(), w.float(), None if b is None else b.float()
                ctx = torch.autocast(x.device.type, enabled=False)
            with ctx:
                res = _hf.linear_log_probs(x, w, labels, b, temperature=temperature, entropy=entropy,
                                           ignore_index=-100, **opts,
                                           **getattr(self, "_logitless_sampling", {}))  # (patch_grpo's)
            log_probs, ent = res if entropy else (res, None)
        denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return _output_class()(loss=-log_probs.sum() / denom, log_probs=log_probs, entropy=ent,
                               log_sum_sq_probs=None, mean_logits=None, is_top1=top1, label_mask=mask, aux_loss=None)

    model.forward = types.MethodType(forward, model)


def _head_in_compute_dtype(hidden, weight, bias, cast_lm_head_to_fp32: bool):
    """TRL's mixed-dtype rule outside autocast: the head is cast (autograd-tracked) to the
    hidden states' dtype, e.g. an fp32 head under a bf16 backbone (TRL computes in the
    hidden states' dtype). Under autocast, or with cast_lm_head_to_fp32, unchanged (the
    ops cast as F.linear does; the fp32 path casts both)."""
    if cast_lm_head_to_fp32 or torch.is_autocast_enabled(hidden.device.type) or weight.dtype == hidden.dtype:
        return weight, bias
    return weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)


_warned = False


def _refuse_zero3(weight, where: str) -> None:
    """ValueError for a DeepSpeed ZeRO-3 head weight: these heads read it outside the head's
    forward, where ZeRO-3 keeps only an empty placeholder (``logitless.transformers.patch``
    reads it inside the head's forward and is ZeRO-3-safe)."""
    if hasattr(weight, "ds_id"):
        raise ValueError(f"{where}: the LM-head weight is a DeepSpeed ZeRO-3 parameter (partitioned outside the "
                         f"head's forward); logitless' TRL heads do not gather it: use TRL's own head under "
                         f"ZeRO-3 (do not call patch_trl / patch_sft / patch_grpo / patch_gkd), or ZeRO-2 / FSDP2")


def _warn_no_entropy() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("logitless SFT head: entropy not computed (patch_sft(trainer, entropy=False)); the logged "
                      "'entropy' metric is NaN", stacklevel=3)


def _unwrapped(model):
    get_base = getattr(model, "get_base_model", None)
    if get_base is not None and hasattr(model, "peft_config"):
        return get_base()
    return model


def patch_sft(trainer, entropy: bool = True) -> None:
    """Route a TRL ``SFTTrainer``'s training loss and its ``mean_token_accuracy`` metric
    through ``logitless.linear_cross_entropy`` (no logits). Call after constructing the
    trainer, before ``train()``.

    Same loss as TRL's own fused head for ``loss_type`` "nll" and "dft", with
    completion-only / assistant-only masks, padding-free packing and
    ``num_items_in_batch`` (TRL's ``compute_loss`` reduces the per-token log-probs this
    head returns). ``entropy=True`` (default) also computes TRL's logged ``entropy``
    metric with one extra forward-only pass over the vocabulary (no gradient);
    ``entropy=False`` skips it and the metric logs NaN (warned once). Paths of TRL that
    need the full logits (``label_smoothing_factor > 0``, ``compute_loss_func``) keep
    calling the model's unpatched forward for their loss.
    """
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError("MoE router aux losses are not supported by patch_sft: "
                         "set output_router_logits=False or use TRL's own head")
    add_logitless_lm_head(_unwrapped(trainer.model), 1.0, entropy=entropy, is_top1=True)


def patch_grpo(trainer, truncated_log_probs: bool = True, batch_invariant: Optional[bool] = None) -> None:
    """Route a TRL ``GRPOTrainer``'s (or ``RLOOTrainer``'s) per-token log-probs and
    entropy, for the policy and the reference model, through logitless. Call after
    constructing the trainer, before ``train()``.

    ``truncated_log_probs`` (default True): when the trainer samples with top-k, top-p
    or min-p (``GRPOConfig.top_k/top_p/min_p``, or the same keys of
    ``generation_kwargs``, which override them as in TRL), the policy's log-probs (the
    current and the old policy's, one forward) are those of the distribution vLLM
    samples from (``linear_log_probs(top_k=, top_p=, min_p=)``: min-p, top-k, top-p in
    vLLM's order; HF ``generate`` applies min-p last, which differs only when min-p and
    top-p are combined), so the importance ratio compares like with like. A sampled
    token outside the trainer's kept set (a policy/sampler mismatch) gets log p = -inf.
    The reference model's log-probs (the KL term) stay untruncated. False: today's
    untruncated log-probs. ``batch_invariant``: per-token log-probs bitwise independent
    of the micro-batch (``linear_log_probs(batch_invariant=True)``); None (default):
    when the trainer asks for determinism (``args.full_determinism``).
    """
    temperature = float(getattr(trainer, "temperature", getattr(trainer.args, "temperature", 1.0)))
    fp32 = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
    policy = _unwrapped(trainer.model)
    add_logitless_lm_head(policy, temperature, cast_lm_head_to_fp32=fp32)
    sampling = grpo_sampling_options(trainer) if truncated_log_probs else {}
    if batch_invariant is None:
        batch_invariant = bool(getattr(trainer.args, "full_determinism", False))
    if batch_invariant:
        sampling["batch_invariant"] = True
    policy._logitless_sampling = sampling
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        add_logitless_lm_head(ref, temperature, entropy=False, cast_lm_head_to_fp32=fp32)
        ref._logitless_sampling = {"batch_invariant": True} if batch_invariant else {}


def grpo_sampling_options(trainer) -> dict:
    """{top_k, top_p, min_p} the trainer samples with (only those that truncate): the
    trainer's attributes (GRPOConfig's), overridden by ``args.generation_kwargs``."""
    args = trainer.args
    values = {k: getattr(trainer, k, getattr(args, k, None)) for k in ("top_k", "top_p", "min_p")}
    extra = getattr(args, "generation_kwargs", None)
    if isinstance(extra, dict):
        values.update({k: extra[k] for k in ("top_k", "top_p", "min_p") if k in extra})
    out = {}
    if values["top_k"] not in (None, 0, -1):
        out["top_k"] = int(values["top_k"])
    if values["top_p"] is not None and float(values["top_p"]) < 1.0:
        out["top_p"] = float(values["top_p"])
    if values["min_p"] not in (None, 0, 0.0):
        out["min_p"] = float(values["min_p"])
    return out


# --------------------------------------------------------------------------------------------
# Distillation: GKDTrainer (trl.experimental.gkd) and DistillationTrainer through linear_jsd
# --------------------------------------------------------------------------------------------

_GKD_REDUCTIONS = ("batchmean", "sum", "mean")
# DistillationTrainer's multimodal inputs, passed through to its own _get_last_hidden_state.
_MM_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
            "token_type_ids", "mm_token_type_ids", "image_position_ids")


def gkd_loss(student_x, student_weight, teacher_x, teacher_weight, labels=None, *, beta: float = 0.5,
             temperature: float = 1.0, reduction: str = "batchmean", num_items_in_batch=None,
             student_bias=None, teacher_bias=None, student_softcap: Optional[float] = None,
             teacher_softcap: Optional[float] = None, backend: str = "auto"):
    """TRL's ``GKDTrainer.generalized_jsd_loss`` from hidden states and LM-head weights:
    the same number as ``generalized_jsd_loss(student_x @ student_weight.T, teacher_x @
    teacher_weight.T, labels, beta, temperature, reduction, num_items_in_batch)``,
    computed by one ``logitless.linear_jsd(..., reduction="none")`` call (fp32
    statistics; neither model's (tokens x vocab) logits is stored).

    Per token: beta * KL(q || m) + (1 - beta) * KL(p || m) with m = beta * q + (1 - beta) * p,
    p = softmax(z_student / T), q = softmax(z_teacher / T); beta = 0 is exactly the forward
    KL(q || p), beta = 1 the reverse KL(p || q); no T**2 factor. Tokens whose label is -100
    count for nothing. Reduction (TRL's): with ``num_items_in_batch``, sum / num_items_in_batch;
    else "batchmean": sum / (number of labelled tokens, at least 1), or sum / x.shape[0]
    without labels; "sum"; "mean": sum / (counted tokens x V), TRL's mean over the
    (tokens, V) elements. TRL's "none" (a (tokens, V) tensor) is refused: it is the
    logits-sized tensor this function exists to avoid (use ``linear_jsd(...,
    reduction="none")`` for per-token losses).

    Args: student_x (B, T, H_s), teacher_x (B, T, H_t) (already shifted: position t
    scores labels[:, t]); student_weight (V, H_s), teacher_weight (V, H_t): one vocabulary,
    hidden sizes may differ; labels (B, T) with -100 to ignore, or None; softcaps, biases
    and ``backend`` as in ``linear_jsd``. Errors: a bad
    reduction or x with fewer than 2 dims raise ValueError; everything else is
    ``linear_jsd``'s checks (vocabularies, shapes, dtypes, a teacher requiring grad).
    Memory traffic: that of ``linear_jsd`` (both heads read once per token block in the
    forward, the student's again in the backward).
    """
    if reduction not in _GKD_REDUCTIONS:
        raise ValueError(f"reduction must be one of {_GKD_REDUCTIONS} (TRL's 'none' returns a (tokens x vocab) "
                         f"tensor, which logitless never builds), got {reduction!r}")
    if student_x.dim() < 2:
        raise ValueError(f"student_x must have shape (B, T, H) or (N, H), got {tuple(student_x.shape)}")
    loss_tok = _jsd_api().linear_jsd(student_x, student_weight, teacher_x, teacher_weight, labels, beta=beta,
                                     temperature=temperature, ignore_index=-100, reduction="none",
                                     student_bias=student_bias, teacher_bias=teacher_bias,
                                     student_softcap=student_softcap, teacher_softcap=teacher_softcap,
                                     backend=backend)
    total = loss_tok.sum()
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    counted = (labels != -100).sum() if labels is not None else loss_tok.numel()
    if reduction == "batchmean":
        return total / (counted.clamp_min(1) if labels is not None else max(loss_tok.shape[0], 1))
    if reduction == "sum":
        return total
    return total / (counted * student_weight.shape[0])  # "mean": 0 / 0 = NaN with no token, as TRL


def _jsd_api():
    from logitless.ops.linear_jsd import api  # looked up per call: tests count the calls
    return api


def _install_loss_forward(model) -> None:
    """``model(..., logitless_loss=fn)`` returns ``fn(model)``: the loss runs inside the
    model's forward, so DDP / accelerate wrappers see a forward (gradient sync, autocast);
    every other call goes to the previous forward unchanged."""
    if getattr(model, "_logitless_loss_forward", False):
        return
    previous = model.forward

    def forward(self, *args, logitless_loss=None, **kwargs):
        if logitless_loss is None:
            return previous(*args, **kwargs)
        return logitless_loss(self)

    model.forward = types.MethodType(forward, model)
    model._logitless_loss_forward = True


def _last_hidden(model, input_ids, attention_mask):
    out = _run_backbone(model, _hf.backbone(model), input_ids=input_ids, attention_mask=attention_mask,
                        use_cache=False)  # (not a bypass of patch(model))
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _head_tensors(model, teacher: bool):
    head = _hf.lm_head(model)
    weight, bias = head.weight, head.bias
    _refuse_zero3(weight, "patch_gkd")
    if weight.numel() == 0:
        raise ValueError(f"the {'teacher' if teacher else 'student'}'s LM-head weight is empty (sharded by "
                         "DeepSpeed ZeRO-3?): patch_gkd needs the full head outside the forward")
    if teacher:
        if hasattr(weight, "full_tensor"):  # FSDP2 DTensor read outside the teacher's forward: gather it
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
    return weight, bias


def _check_pair(student, teacher) -> tuple[Optional[float], Optional[float]]:
    """Refuse what linear_jsd cannot reproduce; return the two soft-caps."""
    s_opts, t_opts = _hf.head_options(student), _hf.head_options(teacher)
    if getattr(_hf.text_config(student), "output_router_logits", False):
        raise ValueError("MoE router aux losses are not supported by patch_gkd")
    vs, vt = _hf.lm_head(student).weight.shape[0], _hf.lm_head(teacher).weight.shape[0]
    if vs != vt:
        raise ValueError(f"student and teacher LM heads have different vocabularies ({vs} vs {vt} rows): "
                         "distillation through linear_jsd needs one vocabulary")
    return s_opts["softcap"], t_opts["softcap"]


def _gkd_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """GKDTrainer.compute_loss (TRL 1.16) without logits: same shift, -100 mask, beta and
    reduction; the loss temperature is 1 as in TRL (``args.temperature`` is only the
    sampling temperature of the on-policy generation, which stays TRL's)."""
    teacher = self.accelerator.unwrap_model(self.teacher_model)
    s_cap, t_cap = self._logitless_softcaps
    self.teacher_model.eval()
    with torch.no_grad(), self.accelerator.autocast():
        teacher_hidden = _last_hidden(teacher, inputs["input_ids"], inputs["attention_mask"])[:, :-1]
    labels = inputs["labels"][:, 1:]
    beta = self.beta

    def loss_fn(student):
        hidden = _last_hidden(student, inputs["input_ids"], inputs["attention_mask"])[:, :-1]
        sw, sb = _head_tensors(student, False)
        tw, tb = _head_tensors(teacher, True)
        hidden = hidden.to(sw.device)
        th = teacher_hidden.to(device=sw.device, dtype=hidden.dtype)
        tw, tb = tw.to(device=sw.device, dtype=hidden.dtype), None if tb is None else tb.to(sw.device, hidden.dtype)
        return gkd_loss(hidden, sw, th, tw, labels.to(sw.device), beta=beta, temperature=1.0,
                        reduction="batchmean", num_items_in_batch=num_items_in_batch, student_bias=sb,
                        teacher_bias=tb, student_softcap=s_cap, teacher_softcap=t_cap)

    loss = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], logitless_loss=loss_fn)
    if return_outputs:
        return loss, {"loss": loss}  # no logits: prediction_step gets none
    return loss


def _distillation_compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
    """DistillationTrainer._compute_loss (TRL 1.16) through linear_jsd (and, for the logged
    entropy, one no-grad linear_log_probs pass); runs inside the student wrapper's forward
    like TRL's. Same hidden states (TRL's _get_last_hidden_state), completion/tool mask,
    beta, temperature and reduction."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    loss_mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        loss_mask = loss_mask * inputs["tool_mask"]
    keep = inputs["completion_ids"].size(1)
    mm = {k: inputs[k] for k in _MM_KEYS if k in inputs}
    hs = self._get_last_hidden_state(unwrapped_student, input_ids, attention_mask, keep, **mm)
    self.teacher_model.eval()
    teacher = self.accelerator.unwrap_model(self.teacher_model)
    with torch.no_grad():
        ht = self._forward_redirection(self.teacher_model, teacher, self._get_last_hidden_state, teacher,
                                       input_ids, attention_mask, keep, **mm)
    sw, sb = _head_tensors(unwrapped_student, False)
    tw, tb = _head_tensors(teacher, True)
    if sw.device != tw.device:
        raise ValueError(f"the student LM head is on {sw.device} but the teacher's on {tw.device}: "
                         "place both on one device")
    hs = hs.to(sw.device)
    ht = ht.to(device=sw.device, dtype=hs.dtype)
    tw, tb = tw.to(hs.dtype), None if tb is None else tb.to(hs.dtype)
    valid = loss_mask.to(sw.device) != 0
    target = torch.where(valid, 0, -100)  # only the mask matters (no hard-label term)
    s_cap, t_cap = self._logitless_softcaps
    temperature = float(self.temperature)
    loss_tok = _jsd_api().linear_jsd(hs, sw, ht, tw, target, beta=self.beta, temperature=temperature,
                                     ignore_index=-100, reduction="none", student_bias=sb, teacher_bias=tb,
                                     student_softcap=s_cap, teacher_softcap=t_cap)
    n_valid = valid.sum()
    loss = loss_tok.sum()
    if num_items_in_batch is None:
        loss = loss / n_valid.clamp(min=1)
    else:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    if self._logitless_entropy:
        with torch.no_grad():
            ent = _hf.linear_log_probs(hs.detach(), sw.detach(), target, None if sb is None else sb.detach(),
                                       temperature=temperature, entropy=True, softcap=s_cap, ignore_index=-100)[1]
        entropy_sum = torch.where(valid, ent, torch.zeros_like(ent)).sum()
    else:
        entropy_sum = torch.full((), float("nan"), device=loss.device)
    return loss, entropy_sum.detach(), n_valid


def _trainer_kind(trainer) -> str:
    for module, name, kind, method in (("trl.experimental.gkd", "GKDTrainer", "gkd", "compute_loss"),
                                       ("trl", "DistillationTrainer", "distillation", "_compute_loss")):
        try:
            cls = getattr(__import__(module, fromlist=[name]), name)
        except Exception:  # not in this TRL version
            continue
        if isinstance(trainer, cls):
            if getattr(type(trainer), method) is not getattr(cls, method):
                raise ValueError(f"{type(trainer).__name__} overrides {name}.{method}: patch_gkd reproduces "
                                 f"{name}'s own loss only")
            return kind
    raise ValueError(f"patch_gkd needs a TRL GKDTrainer or DistillationTrainer, got {type(trainer).__name__}")


def patch_gkd(trainer, entropy: bool = True) -> None:
    """Compute a TRL distillation trainer's student/teacher loss with
    ``logitless.linear_jsd`` from both models' last hidden states and LM-head weights:
    neither model's (tokens x vocab) logits is built. Call after constructing the
    trainer, before ``train()``::

        trainer = GKDTrainer(model=student, teacher_model=teacher, args=GKDConfig(...), ...)
        # or DistillationTrainer(model=..., teacher_model=..., args=DistillationConfig(...), ...)
        logitless.integrations.trl.patch_gkd(trainer)
        trainer.train()

    ``trl.experimental.gkd.GKDTrainer``: replaces ``compute_loss`` (TRL's loss on the full
    logits) with :func:`gkd_loss`: causal shift, labels -100 ignored (prompt, padding),
    ``beta`` (0 forward KL, 1 reverse KL, else the generalized JSD), "batchmean" or
    ``num_items_in_batch``, loss temperature 1 (TRL's ``compute_loss`` passes none;
    ``args.temperature`` is the sampling temperature). ``compute_loss(...,
    return_outputs=True)`` returns ``{"loss": loss}``: no logits reach prediction_step.

    ``trl.DistillationTrainer`` (TRL >= 1.x, the maintained one): replaces its chunked
    ``_compute_loss`` (same hidden states, completion and tool masks, beta, temperature,
    reduction); its logged ``entropy`` metric costs one extra no-grad pass over the
    vocabulary (``entropy=False`` skips it and the metric is dropped from the logs).

    Untouched: on-policy generation (``lmbda``, ``seq_kd``, vLLM), data collation, the
    optimizer. Teacher and student may have different hidden sizes; both heads must be
    on one device after the backbones.

    Refused (ValueError): different vocabularies; models that scale logits other than by
    ``final_logit_softcapping`` (``logit_scale``, ``logits_scaling``, ...); MoE router
    aux losses; trainer subclasses overriding the loss; other trainers. A LM head
    sharded outside the forward (DeepSpeed ZeRO-3) raises at the first step.
    """
    kind = _trainer_kind(trainer)
    student = _unwrapped(trainer.accelerator.unwrap_model(trainer.model))
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    trainer._logitless_softcaps = _check_pair(student, _unwrapped(teacher))
    if kind == "gkd":
        _install_loss_forward(student)
        trainer.compute_loss = types.MethodType(_gkd_compute_loss, trainer)
    else:
        trainer._logitless_entropy = bool(entropy)
        trainer._compute_loss = types.MethodType(_distillation_compute_loss, trainer)
    announce("trl", "the TRL trainer's distillation loss computed by logitless (no logits)")


# --------------------------------------------------------------------------------------------
# TRL's own entry point: add_fused_lm_head(model, temperature, cast_lm_head_to_fp32, outputs)
# --------------------------------------------------------------------------------------------

#: The TRL modules that bind ``add_fused_lm_head`` at import (TRL 1.16): every trainer
#: that installs a fused head (SFT, GRPO, RLOO, DPO, KTO, async GRPO).
TRL_MODULES = ("trl.trainer.utils", "trl.trainer", "trl.trainer.sft_trainer", "trl.trainer.grpo_trainer",
               "trl.trainer.rloo_trainer", "trl.trainer.dpo_trainer", "trl.trainer.kto_trainer",
               "trl.experimental.async_grpo.async_grpo_trainer")

_ORIGINALS: dict = {}


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """TRL's: the autocast dtype when autocast is on for x's device, else x's dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def add_fused_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                      outputs: tuple = ("log_probs",)) -> None:
    """TRL 1.16's ``trl.trainer.utils.add_fused_lm_head``, same signature and protocol,
    computed by logitless: ``model(..., labels=labels, fused_lm_head=True)`` returns
    TRL's ``FusedCausalLMOutput`` (loss, log_probs, entropy, log_sum_sq_probs,
    mean_logits, is_top1, label_mask; the fields not in ``outputs`` None, log_probs
    always), without the (tokens x vocab) logits; any other call (generation,
    ``fused_lm_head=False``) goes to the previous forward.

    As TRL: labels shifted by one (``shift_labels`` taken as they are), every field 0
    (False) where the label is -100, loss = -sum(log_probs) / (number of labelled tokens,
    at least 1, or ``num_items_in_batch``), logits divided by ``temperature`` after the
    model's ``final_logit_softcapping``. Dtypes as TRL's: the head runs in the compute
    dtype, the autocast dtype under autocast, else the hidden states' dtype, the weight
    (and bias) cast to it (autograd-tracked: an fp32 head weight with bf16 hidden states
    outside autocast gets its fp32 gradient); ``cast_lm_head_to_fp32=True``: hidden states
    and head in fp32, outside autocast. An FSDP2 DTensor head is gathered
    (``full_tensor``) as TRL does. Fields (``trl_fields``): log_probs and entropy alone
    come from ``linear_log_probs`` (one pass, its kernels); any other field asks for the
    one-pass path of all five (``trl_fields.head_fields``: the same kernels on a GPU).

    Refused (ValueError, at the call): MoE router aux losses (``output_router_logits``),
    models that scale logits other than by ``final_logit_softcapping``
    (``logit_scale``, ``logits_scaling``, ...), an unknown output name.
    """
    from .trl_fields import check_outputs, head_fields

    outputs = check_outputs(outputs)
    _hf.head_options(model)  # refuse unsupported logit scalings now, not mid-training
    if getattr(_hf.text_config(model), "output_router_logits", False):
        raise ValueError("MoE router aux losses are not supported by the logitless fused head; "
                         "set output_router_logits=False or use TRL's own head")
    temperature = float(temperature)
    previous = model.forward

    @functools.wraps(type(model).forward)  # generate() validates its kwargs against this signature
    def forward(self, *args, fused_lm_head: bool = False, labels=None, shift_labels=None,
                num_items_in_batch: Optional[Any] = None, **kwargs):
        if not fused_lm_head:
            return _unfused(previous, args, kwargs, labels, shift_labels, num_items_in_batch)
        hidden, labels = _shifted_hidden(self, args, kwargs, labels, shift_labels)
        head = _hf.lm_head(self)
        weight, bias = head.weight, head.bias
        _refuse_zero3(weight, "logitless add_fused_lm_head")
        if hasattr(weight, "full_tensor"):  # FSDP2: a sharded DTensor head, gathered as TRL does
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        hidden, labels = hidden.to(weight.device), labels.to(weight.device)
        mask = labels != -100
        ctx = contextlib.nullcontext()
        if cast_lm_head_to_fp32:
            hidden = hidden.float()
            ctx = torch.autocast(hidden.device.type, enabled=False)
        with ctx:
            cd = _compute_dtype(hidden)
            x, w = hidden.to(cd), weight.to(cd)
            b = None if bias is None else bias.to(cd)
            with torch.autocast(x.device.type, enabled=False):  # (already in the compute dtype)
                fields = head_fields(x, w, labels, b, temperature=temperature, outputs=outputs,
                                     ignore_index=-100, **_hf.head_options(self))
        log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = fields
        denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return _output_class()(loss=-log_probs.sum() / denom, log_probs=log_probs, entropy=entropy,
                               log_sum_sq_probs=log_sum_sq_probs, mean_logits=mean_logits, is_top1=is_top1,
                               label_mask=mask, aux_loss=None)

    model.forward = types.MethodType(forward, model)


def patch_trl() -> None:
    """Make TRL's own ``add_fused_lm_head`` logitless's, in every TRL module that binds it
    (``TRL_MODULES``): each trainer created afterwards (SFTTrainer, GRPOTrainer,
    RLOOTrainer, DPOTrainer, KTOTrainer, AsyncGRPOTrainer) installs the logitless head
    with the arguments it passes TRL's (temperature, cast_lm_head_to_fp32, outputs)::

        import logitless.integrations.trl as lt_trl
        lt_trl.patch_trl()
        trainer = DPOTrainer(...)  # its fused head is logitless's
        trainer.train()

    Idempotent; :func:`unpatch_trl` restores TRL's function. Modules of TRL not
    importable here are skipped; ImportError if TRL itself is not installed."""
    import importlib

    importlib.import_module("trl")
    modules = []
    for name in TRL_MODULES:  # all imported first: a module imported later would bind the replacement
        try:
            modules.append((name, importlib.import_module(name)))
        except Exception:  # not in this TRL version, or its optional dependencies missing
            continue
    for name, module in modules:
        current = getattr(module, "add_fused_lm_head", None)
        if current is None or current is add_fused_lm_head:
            continue
        _ORIGINALS[name] = current
        module.add_fused_lm_head = add_fused_lm_head


def unpatch_trl() -> None:
    """Restore TRL's ``add_fused_lm_head`` where :func:`patch_trl` replaced it."""
    import sys

    for name, original in list(_ORIGINALS.items()):
        module = sys.modules.get(name)
        if module is not None:
            module.add_fused_lm_head = original
        del _ORIGINALS[name]
