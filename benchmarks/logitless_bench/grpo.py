"""Suite ``grpo``: one GRPO training step of an HF model, end to end, per LM-head method.

    python -m logitless_bench --suite grpo [--methods ...] [--steps 8] [--mode autocast] ...

The model: Llama-3.2-1B-shaped (``train.GPU_MODEL``: LlamaForCausalLM, vocabulary 128256,
tied embeddings), randomly initialised with a fixed seed, the same for every method.
A step of GRPO (TRL's ``GRPOTrainer`` loss, ``loss_type="dapo"``) on ``batch`` sequences of
``prompt`` + ``completion`` tokens (default 4 x (256 + 2048): 8192 completion tokens;
the prompt is never scored), uniform random token ids, one advantage per sequence
(N(0, 1), seeded), completion masks (``--min-completion-frac`` < 1 ends each completion
at a random length; the rest is padding, masked in the loss):

1. old log-probs: a no-grad forward of the policy itself (what TRL does when
   ``num_iterations > 1``; with one iteration the ratio is exactly 1 but its gradient is not);
2. reference log-probs: a no-grad forward of the reference model, a frozen **second model**
   (a copy of the initial policy in bf16, as TRL loads its ``ref_model``);
3. the policy's forward with gradients, log p_t = log softmax(logits / T)[token] and the
   entropy H_t of softmax(logits / T) (T = 0.7), and the loss (``grpo_loss``)::

       r_t = exp(log p_t - old_t),  pg_t = -min(r_t A, clip(r_t, 1 - eps, 1 + eps) A)
       kl_t = exp(ref_t - log p_t) - (ref_t - log p_t) - 1          (k3, beta = 0.04)
       loss = sum_t m_t (pg_t + beta kl_t - c H_t) / sum_t m_t       (entropy bonus c = 0.01)

4. backward, grad-norm clip 1.0, AdamW step (fp32 master weights and states under bf16
   autocast, as ``Trainer(bf16=True)``; or pure bf16 with ``--mode bf16``).

Methods (how steps 1-3 get log p and H): ``unpatched`` (``model(...).logits`` for the
completion positions (``logits_to_keep``), fp32 ``log_softmax(logits / T)``, gather, entropy
from the same log-softmax: the plain PyTorch way, the baseline), ``trl-logits`` (the same
bf16 logits, then TRL's ``selective_log_softmax_and_entropy``, a Triton kernel on the logits
on CUDA: what TRL did before its fused head), ``logitless``
(``logitless.integrations.hf_log_probs``: backbone + ``linear_log_probs``, no logits),
``logitless-trl`` (``logitless.integrations.trl.add_logitless_lm_head`` on both models, TRL's
fused-head protocol: what ``patch_grpo`` installs), ``trl-head`` (TRL's own fused head,
``trl.trainer.utils.add_fused_lm_head``, when trl is importable) and ``liger``
(``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` for step 3, when importable; it has
no entropy bonus, so its row compares the loss without it; its old/ref log-probs come from
the backbone and a no-grad loop over 1024-token chunks of the logits).

Per method: median step time (forward passes + backward + optimizer, CUDA events, after
warm-up steps), peak memory (``torch.cuda.max_memory_allocated`` from before the models
are built: both models, optimizer states, activations, head), ratios to ``unpatched``, the
size of the logits a step would materialise, and the loss difference to ``unpatched`` at the
first step (same weights, same batch) and over all steps. Targets (issue 20): peak lower
than unpatched by at least the bf16 logits' size, step time no slower than unpatched.

Without a GPU it runs a tiny model for a few steps and says loudly that this checks the
harness, not the benchmark.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from . import report, timing
from .common import add_run_options, line_buffered_stdout

EXAMPLES = """\
examples:
  python -m logitless_bench --suite grpo                       # every method, 3 warm-up + 8 timed steps
  python -m logitless_bench --suite grpo --methods unpatched,logitless --steps 4
  python -m logitless_bench --suite grpo --batch 8 --completion 1024   # 8 x 1024 completion tokens
  python -m logitless_bench --suite grpo --cpu                 # harness check on a tiny model
"""

METHODS = {
    "unpatched": "model(...).logits (completion positions) -> fp32 log_softmax(logits / T), gather, entropy",
    "logitless": "logitless.integrations.hf_log_probs(model, ids, temperature=T, entropy=True, logits_to_keep=C)",
    "logitless-trl": "logitless.integrations.trl.add_logitless_lm_head (TRL's fused-head protocol; patch_grpo)",
    "trl-logits": "model(...).logits + trl.trainer.utils.selective_log_softmax_and_entropy (TRL's kernel on the "
                  "bf16 logits: TRL before its fused head)",
    "trl-head": "TRL's own fused head: trl.trainer.utils.add_fused_lm_head(outputs=(log_probs, entropy))",
    "liger": "liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss (no entropy bonus); old/ref: chunked no-grad logits",
}
DEFAULT_METHODS = ",".join(METHODS)
#: What each method materialises of the (tokens x V) logits of a forward with gradients.
LOGITS = {
    "unpatched": "all: bf16 + fp32 copies",
    "trl-logits": "all: bf16",
    "logitless": "none (tiles within the memory budget)",
    "logitless-trl": "none (tiles within the memory budget)",
    "trl-head": "chunks of tokens x V",
    "liger": "one sequence x V at a time",
}

#: Chunk (tokens) of the no-grad logits loop of the liger row's old/ref log-probs.
REF_CHUNK = 1024


@dataclass(frozen=True)
class LossConfig:
    temperature: float = 0.7
    beta: float = 0.04
    entropy_coef: float = 0.01
    epsilon: float = 0.2


class Skip(Exception):
    """A method that cannot run here (a peer not installed): reported, not an error."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m logitless_bench --suite grpo", epilog=EXAMPLES,
                                description="One GRPO step (old + reference no-grad forwards, policy forward with "
                                "the clipped surrogate, KL and entropy bonus, backward, AdamW) of a "
                                "Llama-3.2-1B-shaped model: unpatched logits vs logitless vs TRL's fused head vs "
                                "liger's fused GRPO loss.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=("grpo",), default="grpo")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"of {', '.join(METHODS)} (default: all)")
    p.add_argument("--mode", default="autocast", choices=("autocast", "bf16", "fp32"),
                   help="autocast: bf16 autocast, fp32 weights and AdamW states; bf16: bf16 weights and states; "
                   "fp32: fp32 everywhere, no autocast, fp32 reference model (an exactness check: the methods "
                   "then agree to fp32 rounding) (default %(default)s)")
    p.add_argument("--batch", type=int, help="sequences per step (default 4; CPU 2)")
    p.add_argument("--prompt", type=int, help="prompt tokens per sequence, never scored (default 256; CPU 8)")
    p.add_argument("--completion", type=int, help="completion tokens per sequence (default 2048; CPU 24)")
    p.add_argument("--min-completion-frac", type=float, default=None,
                   help="each completion ends at a random length in [frac, 1] x completion, the rest is masked "
                   "padding (default 1: all tokens scored; CPU 0.5)")
    p.add_argument("--steps", type=int, help="timed steps per method, median reported (default 8; CPU 3)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 3; CPU 1)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient (default %(default)s)")
    p.add_argument("--entropy-coef", type=float, default=0.01, help="entropy bonus (default %(default)s)")
    p.add_argument("--epsilon", type=float, default=0.2, help="clip range of the ratio (default %(default)s)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (default %(default)s)")
    add_run_options(p, "time guard: skip the remaining methods after M minutes, save what was measured")
    return p


# --------------------------------------------------------------------------- data and loss


def make_batches(n, vocab, batch, prompt, completion, min_frac, seed, device) -> list:
    """``n`` GRPO batches: input_ids (B, P + C), attention_mask (B, P + C), completion_mask
    (B, C) float, advantages (B,) float. Seeded; padded completion tokens are masked in
    both the attention mask and the completion mask (as TRL builds them)."""
    g = torch.Generator().manual_seed(20_000 + seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, prompt + completion), generator=g)
        lo = max(1, math.ceil(min_frac * completion))
        lengths = torch.randint(lo, completion + 1, (batch,), generator=g)
        cmask = (torch.arange(completion)[None] < lengths[:, None])
        attn = torch.cat([torch.ones(batch, prompt, dtype=torch.long), cmask.long()], dim=1)
        adv = torch.randn(batch, generator=g)
        out.append({"input_ids": ids.to(device), "attention_mask": attn.to(device),
                    "completion_mask": cmask.float().to(device), "advantages": adv.to(device),
                    "completion": completion})
    return out


def grpo_loss(logp, entropy, old, ref, advantages, mask, cfg: LossConfig):
    """TRL's GRPO loss (``loss_type="dapo"``: mean over the batch's completion tokens) with
    the k3 KL to the reference and an entropy bonus.

    logp, entropy, old, ref, mask: (B, C); advantages: (B,). Returns ``(loss, loss
    without the entropy bonus)``, both scalars (the second is what liger's fused loss
    computes)."""
    a = advantages[:, None]
    ratio = torch.exp(logp - old)
    pg = -torch.min(ratio * a, ratio.clamp(1 - cfg.epsilon, 1 + cfg.epsilon) * a)
    d = ref - logp
    kl = torch.exp(d) - d - 1
    denom = mask.sum().clamp(min=1)
    pg_kl = ((pg + cfg.beta * kl) * mask).sum() / denom
    if entropy is None:
        return pg_kl, pg_kl
    return pg_kl - cfg.entropy_coef * (entropy * mask).sum() / denom, pg_kl


def _fused_labels(b):
    """TRL's labels for its fused head: the completion tokens, -100 on the prompt and padding."""
    ids, attn, c = b["input_ids"], b["attention_mask"], b["completion"]
    labels = ids.masked_fill(attn == 0, -100)
    labels[:, :-c] = -100
    return labels


# --------------------------------------------------------------------------- methods


class Method:
    """How a step gets per-token log-probs (and entropy) of the completion tokens."""

    has_entropy_bonus = True

    def __init__(self, cfg: LossConfig):
        self.cfg = cfg

    def setup(self, policy, ref) -> None:
        pass

    def logps(self, model, b, entropy: bool):
        """(log p (B, C) fp32, entropy (B, C) or None) of the completion tokens."""
        raise NotImplementedError

    def loss(self, policy, b, old, ref):
        logp, ent = self.logps(policy, b, True)
        return grpo_loss(logp, ent, old, ref, b["advantages"], b["completion_mask"], self.cfg)


class Unpatched(Method):
    def logps(self, model, b, entropy):
        c = b["completion"]
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], logits_to_keep=c + 1,
                       use_cache=False).logits[:, :-1]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (fp64 stays: references)
        ls = torch.log_softmax(logits / self.cfg.temperature, dim=-1)
        del logits
        lp = ls.gather(-1, b["input_ids"][:, -c:, None])[..., 0]
        return lp, (-(ls.exp() * ls).sum(-1) if entropy else None)


class TrlLogits(Method):
    """The model's logits, then TRL's log-softmax/entropy on them (a Triton kernel on CUDA)."""

    def logps(self, model, b, entropy):
        from trl.trainer.utils import selective_log_softmax, selective_log_softmax_and_entropy

        c = b["completion"]
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], logits_to_keep=c + 1,
                       use_cache=False).logits[:, :-1]
        tokens = b["input_ids"][:, -c:]
        if not entropy:
            return selective_log_softmax(logits, tokens, temperature=self.cfg.temperature), None
        return selective_log_softmax_and_entropy(logits, tokens, temperature=self.cfg.temperature)


class Logitless(Method):
    def logps(self, model, b, entropy):
        from logitless.integrations import hf_log_probs

        out = hf_log_probs(model, b["input_ids"], b["attention_mask"], temperature=self.cfg.temperature,
                           entropy=entropy, logits_to_keep=b["completion"])
        return out if entropy else (out, None)


class FusedHead(Method):
    """TRL's fused-head protocol: ``model(..., labels=labels, fused_lm_head=True)``."""

    def __init__(self, cfg, installer):
        super().__init__(cfg)
        self.installer = installer

    def setup(self, policy, ref):
        self.installer(policy, ref, self.cfg.temperature)

    def logps(self, model, b, entropy):
        c = b["completion"]
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=_fused_labels(b),
                    fused_lm_head=True)
        return out.log_probs[:, -c:], (out.entropy[:, -c:] if entropy else None)


def _install_logitless(policy, ref, temperature):
    from logitless.integrations.trl import add_logitless_lm_head

    add_logitless_lm_head(policy, temperature)  # entropy=True, as patch_grpo
    add_logitless_lm_head(ref, temperature, entropy=False)


def _install_trl(policy, ref, temperature):
    try:
        from trl.trainer.utils import add_fused_lm_head
    except Exception as exc:  # noqa: BLE001 - an optional peer
        raise Skip(f"trl's add_fused_lm_head not importable ({type(exc).__name__}: {exc})") from None
    add_fused_lm_head(policy, temperature=temperature, outputs=("log_probs", "entropy"))  # as GRPOTrainer
    add_fused_lm_head(ref, temperature=temperature)


def _hidden(model, b):
    """Last hidden states at the positions that score the completion tokens: (B, C, H)."""
    from logitless.integrations.hf import backbone

    out = backbone(model)(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
    return out.last_hidden_state[:, :-1][:, -b["completion"]:]


class Liger(Method):
    has_entropy_bonus = False

    def __init__(self, cfg, device):
        super().__init__(cfg)
        try:
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        except Exception as exc:  # noqa: BLE001 - an optional peer
            raise Skip(f"liger_kernel.chunked_loss not importable ({type(exc).__name__}: {exc})") from None
        self.fn = LigerFusedLinearGRPOLoss(beta=cfg.beta, compiled=device.type == "cuda", use_ref_model=True,
                                           epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon, loss_type="dapo",
                                           temperature=cfg.temperature)

    def logps(self, model, b, entropy):  # old / reference: no grad, REF_CHUNK tokens of logits at a time
        from logitless.integrations.hf import lm_head

        h = _hidden(model, b)
        w = lm_head(model).weight
        c = b["completion"]
        flat, tokens = h.reshape(-1, h.shape[-1]), b["input_ids"][:, -c:].reshape(-1)
        parts = []
        for n0 in range(0, flat.shape[0], REF_CHUNK):
            ls = torch.log_softmax((flat[n0:n0 + REF_CHUNK] @ w.T).float() / self.cfg.temperature, dim=-1)
            parts.append(ls.gather(-1, tokens[n0:n0 + REF_CHUNK, None])[:, 0])
        return torch.cat(parts).view(h.shape[0], c), None

    def loss(self, policy, b, old, ref):
        from logitless.integrations.hf import lm_head

        c = b["completion"]
        out = self.fn(_hidden(policy, b), lm_head(policy).weight, b["input_ids"][:, -c:], b["completion_mask"],
                      b["advantages"], ref_per_token_logps=ref, old_per_token_logps=old)
        loss = out[0] if isinstance(out, tuple) else out
        return loss, loss


def make_method(name, cfg, device) -> Method:
    if name == "unpatched":
        return Unpatched(cfg)
    if name == "logitless":
        return Logitless(cfg)
    if name == "logitless-trl":
        return FusedHead(cfg, _install_logitless)
    if name == "trl-logits":
        missing = _trl_importable("selective_log_softmax_and_entropy")
        if missing:
            raise Skip(missing)
        return TrlLogits(cfg)
    if name == "trl-head":
        missing = _trl_importable()
        if missing:
            raise Skip(missing)
        return FusedHead(cfg, _install_trl)
    if name == "liger":
        return Liger(cfg, device)
    raise ValueError(f"unknown grpo method {name!r}; known: {', '.join(METHODS)}")


def _trl_importable(name: str = "add_fused_lm_head") -> str:
    """"" when ``trl.trainer.utils.<name>`` imports, else why not."""
    try:
        import trl.trainer.utils as utils

        getattr(utils, name)
    except Exception as exc:  # noqa: BLE001
        return f"trl's {name} not importable ({type(exc).__name__}: {str(exc)[:120]})"
    return ""


# --------------------------------------------------------------------------- one method


def run_method(name, cfg_kwargs, args, loss_cfg, batches, device) -> dict:
    """Builds the policy and the reference model, runs warm-up + timed GRPO steps."""
    from .train import _build, _free

    gpu = device.type == "cuda"
    res = {"method": name, "status": "ok", "description": METHODS[name], "logits": LOGITS[name]}
    policy = ref = opt = method = None
    _free(device)
    try:
        method = make_method(name, loss_cfg, device)
        res["entropy_bonus"] = method.has_entropy_bonus
        t0 = time.perf_counter()
        policy = _build(cfg_kwargs, args.mode, "hf", device, args.seed)
        ref = copy.deepcopy(policy).eval().requires_grad_(False)
        if args.mode != "fp32":
            ref.to(torch.bfloat16)
        method.setup(policy, ref)
        from .train import forward_file

        res["policy_forward"], res["ref_forward"] = forward_file(policy), forward_file(ref)
        opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0, fused=gpu)
        res["build_s"] = time.perf_counter() - t0
        if gpu:
            res["resident_mib"] = torch.cuda.memory_allocated(device) / 2**20
        n = args.warmup + args.steps
        losses = torch.zeros(n, device=device)
        pg_kl = torch.zeros(n, device=device)
        norms = torch.zeros(n, device=device)

        def ac():
            return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.mode == "autocast")

        def step(i):
            b = batches[i]
            with torch.no_grad(), ac():
                old = method.logps(policy, b, False)[0]
                ref_lp = method.logps(ref, b, False)[0]
            with ac():
                loss, part = method.loss(policy, b, old, ref_lp)
            loss.backward()
            norms[i] = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0).float()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[i] = loss.detach().float()
            pg_kl[i] = part.detach().float()

        t0 = time.perf_counter()
        warm = timing.step_times_ms(step, args.warmup, device=device)
        res["warmup_s"] = time.perf_counter() - t0
        times = timing.step_times_ms(step, args.steps, device=device, first=args.warmup)
        res["warmup_step_ms"] = warm
        res["step_ms"] = times
        res["median_step_ms"] = statistics.median(times) if times else None
        res["losses"] = losses.tolist()
        res["losses_pg_kl"] = pg_kl.tolist()
        res["grad_norms"] = norms.tolist()
        if gpu:
            res["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    except Skip as exc:
        res.update(status="skipped", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - OOM, a peer failing: reported, not fatal
        text = str(exc).splitlines()[0][:300] if str(exc) else ""
        res.update(status="failed", reason=f"{type(exc).__name__}: {text}")
        if timing.is_oom(exc):
            res["oom"] = True
    finally:
        policy = ref = opt = method = None  # noqa: F841 - frees them (the step closure holds the cells)
        _free(device)
    return res


# --------------------------------------------------------------------------- report


def summarize(data) -> dict:
    """Ratios to unpatched, loss differences, targets."""
    rows = data["rows"]
    base = next((r for r in rows if r["method"] == "unpatched" and r["status"] == "ok"), None)
    logits_bytes = data["settings"]["logits_bf16_bytes"]
    targets = []
    for r in rows:
        if base is None or r is base or r["status"] != "ok":
            continue
        if base.get("median_step_ms") and r.get("median_step_ms"):
            r["time_vs_unpatched"] = r["median_step_ms"] / base["median_step_ms"]
        if base.get("peak_mib") and r.get("peak_mib"):
            r["peak_vs_unpatched"] = r["peak_mib"] / base["peak_mib"]
            r["saved_vs_logits"] = (base["peak_mib"] - r["peak_mib"]) * 2**20 / logits_bytes
        key = "losses" if r.get("entropy_bonus", True) else "losses_pg_kl"
        a, b = r.get(key) or [], base.get(key) or []
        if a and b:
            d = [abs(x - y) for x, y in zip(a, b)]
            r["loss_compared"] = "loss" if key == "losses" else "loss without entropy bonus"
            r["loss_diff_first"] = d[0]
            r["loss_diff_max"] = max(d)
        ga, gb = r.get("grad_norms") or [], base.get("grad_norms") or []
        if ga and gb and gb[0] > 0 and r.get("entropy_bonus", True):
            # the gradient of the first step (same weights, batch): its norm, relative to unpatched's
            r["grad_norm_rel_diff_first"] = abs(ga[0] - gb[0]) / gb[0]
        if r["method"].startswith("logitless"):
            saved, t = r.get("saved_vs_logits"), r.get("time_vs_unpatched")
            targets.append((f"{r['method']}: peak lower than unpatched by >= the bf16 logits "
                            f"({logits_bytes / 2**30:.2f} GiB); measured saved / logits", saved,
                            None if saved is None else saved >= 1.0))
            gpu = data["meta"].get("gpu", False)  # CPU timings of a tiny model judge nothing
            targets.append((f"{r['method']}: step time <= unpatched (ratio)", t,
                            None if t is None or not gpu else t <= 1.0))
            diff = r.get("loss_diff_first")
            targets.append((f"{r['method']}: |loss - unpatched loss| at the first step <= 1e-3", diff,
                            None if diff is None else diff <= 1e-3))
    data["targets"] = targets
    return data


def _fmt(v, spec):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def table(rows) -> str:
    out = ["| method | status | logits held | step ms | x unpatched | peak GiB | x unpatched | saved / logits "
           "| first loss | loss diff first / max | grad-norm rel diff (first step) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = r["status"] if not r.get("reason") else f"{r['status']}: {r['reason'][:100]}"
        first = (r.get("losses") or [None])[0]
        peak = r["peak_mib"] / 1024 if r.get("peak_mib") else None
        out.append(f"| {r['method']} | {status} | {LOGITS.get(r['method'], '-')} | "
                   f"{_fmt(r.get('median_step_ms'), '.1f')} | "
                   f"{_fmt(r.get('time_vs_unpatched'), '.3f')} | {_fmt(peak, '.2f')} | "
                   f"{_fmt(r.get('peak_vs_unpatched'), '.3f')} | {_fmt(r.get('saved_vs_logits'), '.2f')} | "
                   f"{_fmt(first, '.5f')} | {_fmt(r.get('loss_diff_first'), '.1e')} / "
                   f"{_fmt(r.get('loss_diff_max'), '.1e')} | {_fmt(r.get('grad_norm_rel_diff_first'), '.1e')} |")
    return "\n".join(out)


def markdown(data) -> str:
    s, m = data["settings"], data["meta"]
    out = [f"# grpo: {s['model_name']}, one GRPO step per method", "",
           f"{m['device']} | torch {m['torch']} | triton {m['triton']} | transformers {s['transformers']} | "
           f"trl {s.get('trl')} | liger-kernel {s.get('liger_kernel')} | {m['date']}", "", f"`{m['command']}`", ""]
    if not m["gpu"]:
        out += ["```", report.CPU_BANNER, "```", ""]
    out += [f"- model: {json.dumps(s['model'])}",
            f"- {s['batch']} x ({s['prompt']} prompt + {s['completion']} completion) tokens per step "
            f"({s['completion_tokens']} completion tokens scored, min completion fraction {s['min_completion_frac']}); "
            f"logits of a step: {s['logits_bf16_bytes'] / 2**30:.2f} GiB bf16 "
            f"({2 * s['logits_bf16_bytes'] / 2**30:.2f} GiB fp32)",
            f"- loss: GRPO (dapo), T = {s['loss']['temperature']}, clip eps {s['loss']['epsilon']}, "
            f"KL (k3) beta {s['loss']['beta']}, entropy bonus {s['loss']['entropy_coef']}; old log-probs: no-grad "
            f"forward of the policy; reference: a frozen {s['reference_model']} (a second model)",
            f"- mode {s['mode']} (autocast: bf16 autocast, fp32 weights + AdamW states), grad-norm clip 1.0, "
            f"AdamW lr {s['lr']}; {s['warmup']} warm-up + {s['steps']} timed steps per method",
            "- step ms: median of the timed steps (CUDA events between steps; the step = 2 no-grad forwards + the "
            "policy forward + backward + optimizer). peak: torch.cuda.max_memory_allocated from before the models "
            "are built (both models, AdamW states, activations, head). saved / logits = (unpatched peak - peak) / "
            "bf16 logits size.",
            "- loss diff: |loss - unpatched loss| at the first step (same weights and batch) / max over all steps "
            "(weights drift apart by rounding); liger has no entropy bonus: its row compares the loss without it. "
            "grad-norm rel diff: |norm - unpatched norm| / unpatched norm of the first step's whole-model gradient "
            "(before clipping). Under autocast it includes unpatched's own bf16 rounding (its backward through "
            "the bf16 logits): it measures agreement, not error; --mode fp32 compares to fp32 rounding.",
            "", table(data["rows"]), ""]
    out += ["Methods:", ""] + [f"- {k}: {v}" for k, v in data["methods"].items()]
    out += report.targets_and_notes(data, "issue 20")
    return "\n".join(out) + "\n"


def save(data, out_dir) -> list:
    summarize(data)
    return report.save_suite(data, out_dir, markdown(data), clean=True)


def print_table(data) -> None:
    print(f"{'method':<15} {'status':<8} {'step ms':>9} {'x unp':>7} {'peak GiB':>9} {'x unp':>7} {'saved/lg':>8} "
          f"{'loss diff first/max':>20}")
    for r in data["rows"]:
        peak = r["peak_mib"] / 1024 if r.get("peak_mib") else None
        print(f"{r['method']:<15} {r['status']:<8} {_fmt(r.get('median_step_ms'), '9.1f')} "
              f"{_fmt(r.get('time_vs_unpatched'), '7.3f')} {_fmt(peak, '9.2f')} "
              f"{_fmt(r.get('peak_vs_unpatched'), '7.3f')} {_fmt(r.get('saved_vs_logits'), '8.2f')} "
              f"{_fmt(r.get('loss_diff_first'), '9.1e')}/{_fmt(r.get('loss_diff_max'), '.1e')}"
              + (f"  {r['reason'][:120]}" if r.get("reason") else ""))
    for t, v, ok in data.get("targets", []):
        print(f"target {t}: {_fmt(v, '.4f')} {'-' if ok is None else ('met' if ok else 'NOT MET')}")


# --------------------------------------------------------------------------- main


_version = report._version  # installed version of a distribution, None when absent


def _on_sigterm(signum, frame):  # a time limit's kill: unwind so partial results are saved
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    line_buffered_stdout()
    import transformers

    from .train import CPU_MODEL, GPU_MODEL

    cpu = args.cpu or not torch.cuda.is_available()
    device = timing.bench_device(cpu)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown grpo method(s) {unknown}; known: {', '.join(METHODS)}")
    args.batch = args.batch or (2 if cpu else 4)
    args.prompt = args.prompt if args.prompt is not None else (8 if cpu else 256)
    args.completion = args.completion or (24 if cpu else 2048)
    frac = args.min_completion_frac if args.min_completion_frac is not None else (0.5 if cpu else 1.0)
    args.steps = args.steps if args.steps is not None else (3 if cpu else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    for name, v, lo in (("--batch", args.batch, 1), ("--completion", args.completion, 1), ("--prompt", args.prompt, 1),
                        ("--steps", args.steps, 1), ("--warmup", args.warmup, 0)):
        if v < lo:
            raise SystemExit(f"{name} must be >= {lo}, got {v}")
    if not 0.0 < frac <= 1.0:
        raise SystemExit(f"--min-completion-frac must be in (0, 1], got {frac}")
    loss_cfg = LossConfig(args.temperature, args.beta, args.entropy_coef, args.epsilon)
    cfg_kwargs = dict(CPU_MODEL if cpu else GPU_MODEL)
    cfg_kwargs["max_position_embeddings"] = max(cfg_kwargs["max_position_embeddings"], args.prompt + args.completion)
    if cpu:
        torch.set_num_threads(1)
        print(report.CPU_BANNER)
    deadline = time.monotonic() + 60 * args.max_minutes if args.max_minutes else None
    signal.signal(signal.SIGTERM, _on_sigterm)
    meta = report.environment(device)
    vocab = cfg_kwargs["vocab_size"]
    ref_kind = f"{'fp32' if args.mode == 'fp32' else 'bf16'} copy of the initial policy"
    data = {"suite": "grpo", "meta": meta, "rows": [], "notes": [],
            "methods": {m: METHODS[m] for m in methods},
            "settings": {"model_name": "tiny llama (CPU)" if cpu else "Llama-3.2-1B-shaped", "model": cfg_kwargs,
                         "mode": args.mode, "batch": args.batch, "prompt": args.prompt,
                         "completion": args.completion, "completion_tokens": args.batch * args.completion,
                         "min_completion_frac": frac, "steps": args.steps, "warmup": args.warmup, "lr": args.lr,
                         "seed": args.seed, "loss": asdict(loss_cfg), "reference_model": ref_kind,
                         "logits_bf16_bytes": args.batch * args.completion * vocab * 2,
                         "transformers": transformers.__version__, "trl": _version("trl"),
                         "liger_kernel": _version("liger-kernel")}}
    print(f"device: {meta['device']} | torch {meta['torch']} | transformers {transformers.__version__} | "
          f"peers: {meta['peers']}")
    print(f"setup: {args.batch} x ({args.prompt} + {args.completion}) tokens, V = {vocab}, mode {args.mode}, "
          f"{args.warmup} + {args.steps} steps, methods {', '.join(methods)}")
    out_dir = args.out or "benchmarks/results"
    batches = make_batches(args.warmup + args.steps, vocab, args.batch, args.prompt, args.completion, frac,
                           args.seed, device)
    t_all = time.perf_counter()
    try:
        for name in methods:
            # a method that would not finish is skipped: estimate = the last method's wall time
            estimate = data["rows"][-1].get("wall_s", 0) if data["rows"] else 0
            if deadline is not None and time.monotonic() + 0.8 * estimate > deadline:
                data["rows"].append({"method": name, "status": "skipped",
                                     "reason": f"time guard (--max-minutes; a method takes ~{estimate:.0f} s)"})
                continue
            t = time.perf_counter()
            r = run_method(name, cfg_kwargs, args, loss_cfg, batches, device)
            r["wall_s"] = time.perf_counter() - t
            data["rows"].append(r)
            print(f"[{name}] {r['status']}" + (f": {r['reason']}" if r.get("reason") else
                  f", median {_fmt(r.get('median_step_ms'), '.1f')} ms/step, peak "
                  f"{_fmt(r['peak_mib'] / 1024 if r.get('peak_mib') else None, '.2f')} GiB, losses "
                  f"{', '.join(f'{x:.5f}' for x in r['losses'])}") + f" ({r['wall_s']:.0f} s)")
            save(data, out_dir)
    except KeyboardInterrupt as exc:
        done = {r["method"] for r in data["rows"]}
        data["notes"].append(f"interrupted ({exc or 'KeyboardInterrupt'}): partial results; not measured: "
                             f"{', '.join(m for m in methods if m not in done)}")
    data["wall_s"] = time.perf_counter() - t_all
    written = save(data, out_dir)
    print("\n" + "=" * 100)
    print(f"grpo: {data['settings']['model_name']} | {meta['device']} | {meta['date']}")
    print_table(data)
    print("files: " + " ".join(str(p) for p in written if "latest-" not in p.name))
    if cpu:
        print("\n" + report.CPU_BANNER)
    return 0


if __name__ == "__main__":
    sys.exit(main())
