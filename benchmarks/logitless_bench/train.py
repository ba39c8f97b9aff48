"""End-to-end training benchmark: a model trained with transformers, with and without logitless.

    python -m logitless_bench --suite train [--model llama|qwen3-moe] [--steps 150] [--max-minutes 8] ...

Models (``--model``): ``llama``, Llama-3.2-1B-shaped (LlamaForCausalLM, vocabulary 128256);
``qwen3-moe``, Qwen3-MoE-shaped (Qwen3MoeForCausalLM: Qwen3-30B-A3B's layer and vocabulary
shapes, 12 layers of 32 experts, 8 active: ~2.4B parameters, ~0.9B active per token with
the embedding, ~1.2B counting the head), the router auxiliary loss on
(``output_router_logits``, coefficient 0.001) as in Qwen3-MoE training.

One run trains the same randomly initialised model (same seed, same data) with
transformers' own loss ("hf"), with ``logitless.transformers.patch`` ("logitless") and
with liger-kernel's instance patch (``apply_liger_kernel_to_llama(model=...)``, its fused
linear cross-entropy only, when installed: "liger"), and, when named in ``--methods`` and
trl is installed, through TRL's ``SFTTrainer.compute_loss`` on the same model, batches and
optimizer: with TRL's own fused head ("trl-head") and with ``patch_sft`` ("trl+logitless");
"hf" is then the unpatched row, under autocast bf16 with fp32
master weights (what ``Trainer(bf16=True)`` does) and in pure bf16. For each: the
median step time, the peak memory (``torch.cuda.max_memory_allocated`` over the run:
weights, optimizer states, activations, loss) and the loss curve. HF is re-run with
another data order ("hf-seed2") to show how far two curves of the same method are
apart: the yardstick for "indistinguishable". Then the larger-batch point: with
gradient checkpointing (where the logits dominate what remains), the most tokens per
step each method fits, growing the batch until it runs out of memory.

Data: a learnable synthetic stream, a first-order Markov chain over ``--active`` token
ids spread over the whole vocabulary, each token having 4 successors with
probabilities 0.5/0.25/0.15/0.1 (seeded, deterministic): the loss falls from ln(V) to
the unigram entropy ln(active) and then towards the chain's entropy (1.21 nats).

On a machine without a GPU it trains a tiny model for a few steps and says loudly that
this checks the harness, not the benchmark.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from . import report, timing
from .common import add_run_options, line_buffered_stdout

EXAMPLES = """\
examples:
  python -m logitless_bench --suite train                       # everything: ~8 runs x 200 steps + the probe
                                                                # (~10 min on an H100)
  python -m logitless_bench --suite train --model qwen3-moe --modes autocast --methods hf,logitless --no-big
  python -m logitless_bench --suite train --steps 60 --no-big   # shorter curves, no batch probe
  python -m logitless_bench --suite train --modes autocast --methods hf,logitless
  python -m logitless_bench --suite train --modes autocast --methods hf,trl-head,trl+logitless --steps 30 \
      --no-big --no-spread                                      # TRL SFTTrainer rows (hf = unpatched)
"""

SUCCESSOR_PROBS = (0.5, 0.25, 0.15, 0.1)
CHAIN_ENTROPY = -sum(p * math.log(p) for p in SUCCESSOR_PROBS)

GPU_MODEL = dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
CPU_MODEL = dict(vocab_size=2048, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                 max_position_embeddings=256)
GPU_MOE = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=12, intermediate_size=6144,
               moe_intermediate_size=768, num_experts=32, num_experts_per_tok=8, num_attention_heads=32,
               num_key_value_heads=4, head_dim=128, tie_word_embeddings=True, max_position_embeddings=8192,
               rope_theta=1000000.0, rms_norm_eps=1e-6, output_router_logits=True, router_aux_loss_coef=0.001,
               norm_topk_prob=True)
CPU_MOE = dict(vocab_size=2048, hidden_size=64, num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32,
               num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               tie_word_embeddings=True, max_position_embeddings=256, output_router_logits=True,
               router_aux_loss_coef=0.001)
#: --model -> (label, transformers class, config class, GPU config, CPU config, liger's instance patch)
MODELS = {
    "llama": ("Llama-3.2-1B-shaped", "LlamaForCausalLM", "LlamaConfig", GPU_MODEL, CPU_MODEL,
              "apply_liger_kernel_to_llama"),
    "qwen3-moe": ("Qwen3-MoE-shaped (12 x 32 experts, 8 active)", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", GPU_MOE,
                  CPU_MOE, "apply_liger_kernel_to_qwen3_moe"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m logitless_bench --suite train", epilog=EXAMPLES,
                                description="End-to-end training of a Llama-3.2-1B-shaped model: transformers' "
                                "loss vs logitless.transformers.patch vs liger's patch.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=("train",), default="train")
    p.add_argument("--model", choices=tuple(MODELS), default="llama",
                   help="llama: Llama-3.2-1B-shaped; qwen3-moe: Qwen3-MoE-shaped, ~1B active (default %(default)s)")
    p.add_argument("--steps", type=int, help="optimizer steps per curve (default 200; CPU 10)")
    p.add_argument("--batch", type=int, help="sequences per step (default 4; CPU 2)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 2048; CPU 64)")
    p.add_argument("--lr", type=float, help="AdamW peak learning rate (default 3e-4; CPU 3e-3)")
    p.add_argument("--warmup-steps", type=int, help="linear learning-rate warm-up (default steps // 8)")
    p.add_argument("--active", type=int, help="token ids used by the Markov stream (default 2048; CPU 128)")
    p.add_argument("--modes", default="autocast,bf16", help="autocast (bf16 autocast, fp32 master weights) "
                   "and/or bf16 (pure bf16 weights) (default %(default)s)")
    p.add_argument("--methods", default="hf,logitless,liger",
                   help="hf, logitless (default memory budget), logitless@BUDGET (BUDGET: logits = the bf16 "
                   "logits of a step, or a size like 1GiB), liger, trl-head (TRL's SFTTrainer.compute_loss with "
                   "its own fused head), trl+logitless (the same after logitless.integrations.trl.patch_sft) "
                   "(default %(default)s)")
    p.add_argument("--no-spread", action="store_true", help="skip the hf re-run with another data order")
    p.add_argument("--no-big", action="store_true", help="skip the larger-batch probe")
    p.add_argument("--big-batches", default="4,6,8,10,12,14,16,20,24,32",
                   help="sequences per step tried by the larger-batch probe without gradient checkpointing, "
                   "ascending (default %(default)s)")
    p.add_argument("--big-batches-ckpt", default="8,16,32,48,64,96,128",
                   help="the same with gradient checkpointing (empty: skip) (default %(default)s)")
    p.add_argument("--big-mode", default="autocast", choices=("autocast", "bf16"))
    add_run_options(p, "time guard: stop (and save what was measured) after M minutes")
    return p


# --------------------------------------------------------------------------- data


class MarkovStream:
    """Token batches of a seeded first-order Markov chain over ``active`` ids of the vocabulary."""

    def __init__(self, vocab: int, active: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randperm(vocab, generator=g)[:active]
        self.succ = torch.randint(0, active, (active, len(SUCCESSOR_PROBS)), generator=g)
        self.cum = torch.tensor(SUCCESSOR_PROBS).cumsum(0)
        self.active = active

    def batches(self, n: int, batch: int, seq: int, seed: int) -> torch.Tensor:
        """(n, batch, seq) int64 token ids on the CPU."""
        g = torch.Generator().manual_seed(10_000 + seed)
        rows = n * batch
        choice = torch.searchsorted(self.cum, torch.rand(rows, seq, generator=g)).clamp_(max=len(SUCCESSOR_PROBS) - 1)
        states = torch.empty(rows, seq, dtype=torch.long)
        states[:, 0] = torch.randint(0, self.active, (rows,), generator=g)
        for t in range(1, seq):
            states[:, t] = self.succ[states[:, t - 1], choice[:, t]]
        return self.ids[states].view(n, batch, seq)


# --------------------------------------------------------------------------- one run


class Deadline(Exception):
    pass


def _budget(method, tokens, vocab=GPU_MODEL["vocab_size"]):
    """memory_budget of a "logitless[@SPEC]" method: SPEC = default, logits (tokens x V x 2 bytes) or a size."""
    from .peers import budget_bytes

    spec = method.split("@", 1)[1] if "@" in method else "default"
    return budget_bytes(spec, tokens, vocab, 2)


def _build(cfg_kwargs, mode, method, device, seed, checkpointing=False, tokens=0, arch="llama"):
    import transformers

    import logitless.transformers as lt

    _, cls_name, cfg_name, _, _, liger_fn = MODELS[arch]
    cfg = getattr(transformers, cfg_name)(**cfg_kwargs, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, cls_name)(cfg)
    if mode == "bf16":
        model.to(torch.bfloat16)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if method.startswith("logitless"):
        budget = _budget(method, tokens, cfg_kwargs["vocab_size"])
        lt.patch(model, **({} if budget is None else {"memory_budget": budget}))
    elif method == "liger":
        import liger_kernel.transformers as liger

        # its fused linear cross-entropy only, on this instance (no class-wide patches)
        getattr(liger, liger_fn)(rope=False, cross_entropy=False, fused_linear_cross_entropy=True,
                                 rms_norm=False, swiglu=False, model=model)
    return model


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _lr_lambda(warmup):
    return lambda step: min(1.0, (step + 1) / max(1, warmup))


def train_run(name, method, mode, data, cfg_kwargs, args, device, deadline, seed):
    """Trains ``data.shape[0]`` steps; returns a result dict (losses, step times, memory)."""
    gpu = device.type == "cuda"
    res = {"name": name, "method": method, "mode": mode, "steps_planned": int(data.shape[0]),
           "tokens_per_step": int(data[0].numel())}
    _free(device)
    t_build = time.perf_counter()
    model = opt = None
    try:
        model = _build(cfg_kwargs, mode, method, device, args.seed, tokens=res["tokens_per_step"],
                       arch=getattr(args, "model", "llama"))
        trainer = _sft_trainer(model, method, args, device) if method in TRL_METHODS else None
        if trainer is not None:
            res["forward_file"] = forward_file(model)  # which head answers fused_lm_head=True
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                eps=1e-8, fused=gpu)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(args.warmup_steps))
        res["build_s"] = time.perf_counter() - t_build
        n = data.shape[0]
        losses = torch.zeros(n, device=device)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)] if gpu else []
        host_marks = []
        if gpu:
            marks[0].record()
        host_marks.append(time.perf_counter())
        done = 0
        for i in range(n):
            if deadline is not None and time.monotonic() > deadline:
                res["truncated"] = f"time guard after {i} steps"
                break
            ids = data[i].to(device, non_blocking=True)
            if trainer is not None:  # TRL's SFTTrainer.compute_loss (its fused head, or patch_sft's)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "autocast"):
                    loss = trainer.compute_loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                        "labels": ids})
            else:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "autocast"):
                    out = model(input_ids=ids, labels=ids)
                loss = out.loss
                if i == 0:
                    res["logits_none"] = out.logits is None  # the patch is in use (transformers returns logits)
                del out
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses[i] = loss.detach().float()
            del loss
            if gpu:
                marks[i + 1].record()
            else:
                host_marks.append(time.perf_counter())
            done = i + 1
        if gpu:
            torch.cuda.synchronize(device)
            step_ms = [marks[i].elapsed_time(marks[i + 1]) for i in range(done)]
            res["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
            res["resident_mib"] = torch.cuda.memory_allocated(device) / 2**20
        else:
            step_ms = [1e3 * (b - a) for a, b in zip(host_marks, host_marks[1:])]
        res["steps"] = done
        res["losses"] = losses[:done].tolist()
        res["step_ms"] = step_ms
        skip = min(5, done // 4)
        res["median_step_ms"] = statistics.median(step_ms[skip:]) if step_ms[skip:] else None
        if method.startswith("logitless"):
            res["memory_budget"] = _budget(method, res["tokens_per_step"], cfg_kwargs["vocab_size"])
    except Exception as exc:  # noqa: BLE001 - OOM, a peer failing on this transformers: reported, not fatal
        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        del model, opt
        trainer = None
        _free(device)
    return res


#: Methods that train through TRL's SFTTrainer.compute_loss on the same model, batches and optimizer:
#: "trl-head" (TRL's own fused head, which SFTTrainer installs) and "trl+logitless"
#: (logitless.integrations.trl.patch_sft on top of it). "hf" is the unpatched row.
TRL_METHODS = ("trl-head", "trl+logitless")


def _sft_trainer(model, method, args, device):
    """A TRL ``SFTTrainer`` around ``model`` (a one-row dataset and a word-level tokenizer: only
    its ``compute_loss`` is used, the loop and the optimizer are this suite's), with TRL's fused
    head, and for "trl+logitless" ``patch_sft`` on top."""
    import tempfile

    import datasets
    import tokenizers
    import transformers
    from trl import SFTConfig, SFTTrainer

    import logitless.integrations.trl as lt_trl

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, "a": 3, "b": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                                     eos_token="<eos>")
    cfg = SFTConfig(output_dir=tempfile.mkdtemp(prefix="logitless-bench-sft-"), report_to="none",
                    save_strategy="no", use_cpu=device.type != "cuda", bf16=False, fp16=False,
                    per_device_train_batch_size=args.batch, max_length=args.seq, dataloader_num_workers=0,
                    gradient_checkpointing=False, seed=args.seed)  # as the hf row (TRL's default is on)
    datasets.disable_progress_bars()
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=datasets.Dataset.from_list([{"text": "a b a"}]),
                         processing_class=tokenizer)
    if method == "trl+logitless":
        lt_trl.patch_sft(trainer)
    return trainer


def forward_file(model) -> str:
    """The source file (last 3 parts) of ``model.forward``: shows which head is installed
    (functools.wraps copies names, not the code object)."""
    fn = getattr(model.forward, "__func__", model.forward)
    code = getattr(fn, "__code__", None)
    return "/".join(Path(code.co_filename).parts[-3:]) if code is not None else type(fn).__name__


def _trl_missing() -> str:
    """Why TRL's SFTTrainer cannot run here ("" when it can)."""
    for mod in ("trl", "datasets", "tokenizers"):
        try:
            __import__(mod)
        except Exception as exc:  # noqa: BLE001
            return f"{mod} not importable ({type(exc).__name__}: {str(exc)[:100]})"
    return ""


def big_batch_probe(method, mode, stream, cfg_kwargs, args, device, deadline, sizes, seq, checkpointing):
    """Largest batch (sequences of ``seq``) that trains one step (growing until out of memory)."""
    res = {"method": method, "mode": mode, "checkpointing": checkpointing, "tried": []}
    _free(device)
    model = opt = None
    try:
        model = _build(cfg_kwargs, mode, method, device, args.seed, checkpointing=checkpointing,
                       tokens=args.batch * seq, arch=getattr(args, "model", "llama"))
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
        gpu = device.type == "cuda"
        for b in sizes:
            if deadline is not None and time.monotonic() > deadline:
                res["truncated"] = "time guard"
                break
            ids = loss = None
            if gpu:
                torch.cuda.reset_peak_memory_stats(device)
            try:
                ids = stream.batches(1, b, seq, seed=99)[0].to(device)
                t0 = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "autocast"):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if gpu:
                    torch.cuda.synchronize(device)
                res["tried"].append({"batch": b, "tokens": b * seq, "fits": True,
                                     "ms": 1e3 * (time.perf_counter() - t0),
                                     "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if gpu else None,
                                     "loss": float(loss.detach())})
            except torch.OutOfMemoryError:
                res["tried"].append({"batch": b, "tokens": b * seq, "fits": False})
                break
            finally:
                ids = loss = None
                opt.zero_grad(set_to_none=True)
                gc.collect()
                if gpu:
                    torch.cuda.empty_cache()
        fits = [t for t in res["tried"] if t["fits"]]
        res["max_tokens"] = fits[-1]["tokens"] if fits else 0
        res["limit_reached"] = any(not t["fits"] for t in res["tried"])
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        del model, opt
        _free(device)
    return res


# --------------------------------------------------------------------------- report


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def curve_stats(run, ref):
    """Differences of ``run``'s loss curve to ``ref``'s over their common steps."""
    a, b = run.get("losses") or [], ref.get("losses") or []
    n = min(len(a), len(b))
    if not n:
        return {}
    d = [abs(x - y) for x, y in zip(a[:n], b[:n])]
    tail = max(1, n // 10)
    return {"mean_abs_diff": _mean(d), "max_abs_diff": max(d),
            "final_diff": _mean(a[n - tail:n]) - _mean(b[n - tail:n])}


def summarize(data):
    runs = {r["name"]: r for r in data["runs"]}
    lines = []
    for mode in data["settings"]["modes"]:
        hf = runs.get(f"hf-{mode}")
        spread = runs.get(f"hf-seed2-{mode}")
        for r in [x for x in data["runs"] if x["mode"] == mode]:
            row = {"run": r["name"], "mode": mode, "method": r["method"], "error": r.get("error"),
                   "steps": r.get("steps"), "median_step_ms": r.get("median_step_ms"),
                   "logits_none": r.get("logits_none"),
                   "peak_gib": r["peak_mib"] / 1024 if r.get("peak_mib") else None,
                   "final_loss": _mean(r["losses"][-max(1, len(r["losses"]) // 10):]) if r.get("losses") else None}
            if hf and hf is not r and not hf.get("error") and not r.get("error"):
                if hf.get("median_step_ms") and r.get("median_step_ms"):
                    row["time_vs_hf"] = r["median_step_ms"] / hf["median_step_ms"]
                if hf.get("peak_mib") and r.get("peak_mib"):
                    row["memory_vs_hf"] = r["peak_mib"] / hf["peak_mib"]
                row.update({f"curve_{k}": v for k, v in curve_stats(r, hf).items()})
            lines.append(row)
        if hf and spread and not hf.get("error") and not spread.get("error"):
            data.setdefault("spread", {})[mode] = curve_stats(spread, hf)
    data["summary"] = lines
    data["targets"] = _targets(data, lines)
    return data


def _targets(data, lines):
    """Issue 9's targets, each with what this run measured: (text, measured, met or None)."""
    rows = {r["run"]: r for r in lines}
    out = []
    variants = [m for m in data["settings"]["methods"] if m.startswith("logitless")]
    for mode, variant in [(mode, v) for mode in data["settings"]["modes"] for v in variants]:
        ours, liger = rows.get(f"{variant}-{mode}", {}), rows.get(f"liger-{mode}", {})
        t = ours.get("time_vs_hf")
        label = f"{mode} {variant}"
        if ours.get("logits_none") is not None:
            out.append((f"{label}: the patch is in use (training forward returns logits=None)", None,
                        ours["logits_none"]))
        out.append((f"{label}: step time <= 0.97x hf", t, None if t is None else t <= 0.97))
        hf = rows.get(f"hf-{mode}", {})
        st = data["settings"]
        logits_gib = st["batch"] * st["seq"] * st["model"]["vocab_size"] * 4 / 2**30
        saved = None
        if hf.get("peak_gib") and ours.get("peak_gib"):
            saved = (hf["peak_gib"] - ours["peak_gib"]) / logits_gib
        out.append((f"{label}: peak memory <= hf peak - 0.8 x the fp32 logits ({logits_gib:.2f} GiB); measured: "
                    f"saved / logits", saved, None if saved is None else saved >= 0.8))
        if liger.get("median_step_ms") and ours.get("median_step_ms"):
            out.append((f"{label}: faster than liger (time ratio ours/liger)",
                        ours["median_step_ms"] / liger["median_step_ms"],
                        ours["median_step_ms"] < liger["median_step_ms"]))
        if liger.get("peak_gib") and ours.get("peak_gib"):
            out.append((f"{label}: smaller than liger (peak ratio ours/liger)", ours["peak_gib"] / liger["peak_gib"],
                        ours["peak_gib"] < liger["peak_gib"]))
        sp = data.get("spread", {}).get(mode)
        if sp and ours.get("curve_mean_abs_diff") is not None:
            d = ours["curve_mean_abs_diff"]
            out.append((f"{label}: curve mean abs diff to hf <= that of hf-seed2 ({sp['mean_abs_diff']:.4f})", d,
                        d <= sp["mean_abs_diff"]))
    for mode in data["settings"]["modes"]:  # the TRL SFTTrainer rows (issue 21): ours vs TRL's own head
        ours, theirs = rows.get(f"trl+logitless-{mode}", {}), rows.get(f"trl-head-{mode}", {})
        if ours.get("median_step_ms") and theirs.get("median_step_ms"):
            out.append((f"{mode} trl+logitless vs trl-head: step time ratio",
                        ours["median_step_ms"] / theirs["median_step_ms"], None))
        if ours.get("peak_gib") and theirs.get("peak_gib"):
            out.append((f"{mode} trl+logitless vs trl-head: peak ratio", ours["peak_gib"] / theirs["peak_gib"], None))
    return out


def _fmt(v, spec):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        width = "".join(c for c in spec.split(".")[0] if c.isdigit())
        return "-".rjust(int(width) if width else 1)
    return format(v, spec)


def markdown(data) -> str:
    m, s = data["meta"], data["settings"]
    out = [f"# Training benchmark: {s['model_name']} (transformers {s.get('model_class', 'LlamaForCausalLM')})", ""]
    if not m["gpu"]:
        out += ["**CPU RUN: a tiny model for a few steps, to check the harness. NOT the benchmark.**", ""]
    out += [f"- device: {m['device']} | torch {m['torch']} | cuda {m['cuda']} | triton {m['triton']} | "
            f"transformers {s.get('transformers')} | peers {m['peers']} | {m['date']}",
            f"- command: `{m['command']}`",
            f"- model: {json.dumps(s['model'])}",
            f"- {s['batch']} x {s['seq']} tokens per step, AdamW lr {s['lr']} (betas 0.9/0.95, wd 0.1, "
            f"warm-up {s['warmup_steps']} steps), grad-norm clip 1.0, {s['steps']} steps; data: Markov chain over "
            f"{s['active']} ids (unigram entropy {math.log(s['active']):.2f}, chain entropy {CHAIN_ENTROPY:.2f}, "
            f"ln V = {math.log(s['model']['vocab_size']):.2f})",
            "- autocast: bf16 autocast, fp32 weights and AdamW states (Trainer(bf16=True)); bf16: bf16 weights "
            "and states. peak = torch.cuda.max_memory_allocated over the whole run (weights, optimizer, "
            "activations, loss). step time: median of CUDA-event step times after the first 5.",
            "- curve diff: |loss - hf loss| per step over the common steps (mean / max), final = mean of the last "
            "10% minus hf's. hf-seed2 is hf on another data order: its diff is the spread of two hf runs.", ""]
    out += ["| run | steps | step ms | x hf | peak GiB | x hf | final loss | curve diff mean / max | final diff |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in data["summary"]:
        if r.get("error"):
            out.append(f"| {r['run']} | error: {r['error']} | | | | | | | |")
            continue
        out.append(f"| {r['run']} | {r['steps']} | {_fmt(r['median_step_ms'], '.1f')} | "
                   f"{_fmt(r.get('time_vs_hf'), '.3f')} | {_fmt(r['peak_gib'], '.2f')} | "
                   f"{_fmt(r.get('memory_vs_hf'), '.3f')} | {_fmt(r['final_loss'], '.4f')} | "
                   f"{_fmt(r.get('curve_mean_abs_diff'), '.4f')} / {_fmt(r.get('curve_max_abs_diff'), '.4f')} | "
                   f"{_fmt(r.get('curve_final_diff'), '+.4f')} |")
    if data.get("big"):
        out += ["", f"Larger batches (mode {s['big_mode']}, one AdamW step per size, growing the batch of "
                f"{s['seq']}-token sequences until out of memory):", "",
                "| method | checkpointing | most tokens per step | its peak GiB | its step ms "
                "| first size that did not fit |",
                "|---|---|---|---|---|---|"]
        for b in data["big"]:
            ck = "on" if b["checkpointing"] else "off"
            if b.get("error"):
                out.append(f"| {b['method']} | {ck} | error: {b['error']} | | | |")
                continue
            fits = [t for t in b["tried"] if t["fits"]]
            nofit = [t for t in b["tried"] if not t["fits"]]
            last = fits[-1] if fits else {}
            peak = _fmt((last.get('peak_mib') or 0) / 1024, '.1f')
            out.append(f"| {b['method']} | {ck} | {b['max_tokens']} | {peak} | "
                       f"{_fmt(last.get('ms'), '.0f')} | "
                       f"{nofit[0]['tokens'] if nofit else 'none (largest size tried fits)'} |")
    out += report.targets_and_notes(data, "issue 9")
    out.append("")
    return "\n".join(out)


def plot(data, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return False
    modes = data["settings"]["modes"]
    fig, axes = plt.subplots(2, len(modes), figsize=(7 * len(modes), 8), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.3]})
    styles = {"hf": ("black", "-"), "hf-seed2": ("grey", ":"), "logitless": ("tab:blue", "--"),
              "liger": ("tab:orange", "-.")}
    for j, mode in enumerate(modes):
        ax, axd = axes[0][j], axes[1][j]
        runs = [r for r in data["runs"] if r["mode"] == mode and r.get("losses")]
        hf = next((r for r in runs if r["name"] == f"hf-{mode}"), None)
        for r in runs:
            key = r["name"].rsplit("-", 1)[0]
            c, ls = styles.get(key, (None, "-"))
            ax.plot(r["losses"], color=c, ls=ls, lw=1.2, label=f"{key} ({_fmt(r.get('median_step_ms'), '.0f')} ms, "
                    f"{_fmt((r.get('peak_mib') or 0) / 1024, '.1f')} GiB)")
            if hf is not None and r is not hf:
                n = min(len(r["losses"]), len(hf["losses"]))
                axd.plot([a - b for a, b in zip(r["losses"][:n], hf["losses"][:n])], color=c, ls=ls, lw=1, label=key)
        ax.axhline(math.log(data["settings"]["model"]["vocab_size"]), color="red", lw=0.6, ls=":", label="ln V")
        ax.axhline(CHAIN_ENTROPY, color="green", lw=0.6, ls=":", label="chain entropy")
        ax.set_title(f"{mode}: loss per step")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
        axd.axhline(0, color="black", lw=0.6)
        axd.set_title("loss - hf loss (hf-seed2: spread of two hf runs)", fontsize=9)
        axd.set_xlabel("step")
        if axd.get_legend_handles_labels()[0]:
            axd.legend(fontsize=8)
    title = f"{data['settings']['model_name']} on {data['meta']['device']} ({data['meta']['date'][:10]})"
    if not data["meta"]["gpu"]:
        title += "  -- CPU HARNESS CHECK, NOT THE BENCHMARK"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def save(data, out_dir) -> list:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = data["meta"]["device_tag"]
    key = data["settings"].get("model_key", "llama")
    if key != "llama":
        tag = f"{key}-{tag}"
    date = data["meta"]["date"][:10]
    written = []
    summarize(data)
    for stem in (f"train-{tag}-{date}", f"latest-train-{tag}"):
        p = out_dir / f"{stem}.json"
        p.write_text(json.dumps(report._clean(data), indent=1))
        md = out_dir / f"{stem}.md"
        md.write_text(markdown(data))
        written += [p, md]
        png = out_dir / f"{stem}.png"
        if plot(data, png):
            written.append(png)
    return written


def print_table(data):
    print(f"{'run':<22} {'steps':>5} {'step ms':>9} {'x hf':>7} {'peak GiB':>9} {'x hf':>7} {'final loss':>10} "
          f"{'curve diff':>11}")
    for r in data["summary"]:
        if r.get("error"):
            print(f"{r['run']:<22} error: {r['error']}")
            continue
        print(f"{r['run']:<22} {r['steps']:>5} {_fmt(r['median_step_ms'], '9.1f')} {_fmt(r.get('time_vs_hf'), '7.3f')} "
              f"{_fmt(r['peak_gib'], '9.2f')} {_fmt(r.get('memory_vs_hf'), '7.3f')} {_fmt(r['final_loss'], '10.4f')} "
              f"{_fmt(r.get('curve_mean_abs_diff'), '11.4f')}")
    for t, v, ok in data.get("targets", []):
        print(f"target {t}: {_fmt(v, '.4f')} {'-' if ok is None else ('met' if ok else 'NOT MET')}")
    for b in data.get("big", []):
        print(f"larger batch [{b['mode']}, checkpointing {'on' if b['checkpointing'] else 'off'}] {b['method']:<10} "
              + (f"error: {b['error']}" if b.get("error") else
                 f"max tokens/step {b['max_tokens']}"
                 f"{'' if b.get('limit_reached') else ' (no OOM up to the largest tried)'}"))


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    line_buffered_stdout()
    import transformers

    cpu = args.cpu or not torch.cuda.is_available()
    device = timing.bench_device(cpu)
    if cpu:
        print(report.CPU_BANNER)
    label, cls_name, _, gpu_cfg, cpu_cfg, _ = MODELS[args.model]
    cfg_kwargs = cpu_cfg if cpu else gpu_cfg
    args.steps = args.steps or (10 if cpu else 200)
    args.lr = args.lr or (3e-3 if cpu else 3e-4)
    args.batch = args.batch or (2 if cpu else 4)
    args.seq = args.seq or (64 if cpu else 2048)
    args.active = args.active or (128 if cpu else 2048)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else max(1, args.steps // 8)
    modes = [m for m in args.modes.split(",") if m]
    methods = [m for m in args.methods.split(",") if m]
    for m in modes:
        if m not in ("autocast", "bf16"):
            raise SystemExit(f"unknown mode {m!r}: autocast, bf16")
    for m in methods:
        if m not in ("hf", "logitless", "liger") + TRL_METHODS and not m.startswith("logitless@"):
            raise SystemExit(f"unknown method {m!r}: hf, logitless, logitless@BUDGET, liger, trl-head, "
                             "trl+logitless")
        if m.startswith("logitless@"):
            try:
                _budget(m, 1)
            except ValueError as exc:
                raise SystemExit(str(exc)) from None
    deadline = time.monotonic() + 60 * args.max_minutes if args.max_minutes else None
    signal.signal(signal.SIGTERM, _on_sigterm)

    meta = report.environment(device)
    data = {"suite": "train", "meta": meta, "runs": [], "big": [], "notes": [], "settings": {
        "model_name": f"tiny {args.model} (CPU)" if cpu else label, "model": cfg_kwargs, "model_class": cls_name,
        "model_key": args.model,
        "steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr, "warmup_steps": args.warmup_steps,
        "active": args.active, "modes": modes, "methods": methods, "seed": args.seed, "big_mode": args.big_mode,
        "transformers": transformers.__version__, "max_minutes": args.max_minutes}}
    if any(m in TRL_METHODS for m in methods):
        data["settings"]["trl"] = report._version("trl")
    print(f"device: {meta['device']} | torch {meta['torch']} | transformers {transformers.__version__} | "
          f"peers: {meta['peers']}")
    out_dir = args.out or "benchmarks/results"
    stream = MarkovStream(cfg_kwargs["vocab_size"], args.active, args.seed)
    t0 = time.perf_counter()
    main_data = stream.batches(args.steps, args.batch, args.seq, seed=args.seed)
    print(f"data: {args.steps} x {args.batch} x {args.seq} tokens ({time.perf_counter() - t0:.1f} s)")

    # hf and logitless in every mode first (the targets), then the peers
    first = [m for m in methods if m != "liger"]
    plan = [(f"{meth}-{mode}", meth, mode, main_data) for group in (first, [m for m in methods if m == "liger"])
            for mode in modes for meth in group]
    spread = []
    if not args.no_spread and "hf" in methods:
        other = stream.batches(args.steps, args.batch, args.seq, seed=args.seed + 1)
        spread = [(f"hf-seed2-{mode}", "hf", mode, other) for mode in modes]
    interrupted = False
    try:
        _curves(plan, data, cfg_kwargs, args, device, deadline, out_dir, cpu)
        if not args.no_big:  # before the spread runs: the headline goes first under a time guard
            if cpu:
                data["notes"].append("larger-batch probe: skipped on the CPU (it measures GPU memory)")
            else:
                for ckpt, sizes_arg in ((False, args.big_batches), (True, args.big_batches_ckpt)):
                    sizes = [int(x) for x in sizes_arg.split(",") if x]
                    probe = [m for m in methods if "@" not in m and m not in TRL_METHODS]  # default budgets
                    for meth in [m for m in probe if m != "liger" or _importable("liger_kernel.transformers")]:
                        if not sizes:
                            break
                        if deadline is not None and time.monotonic() > deadline:
                            data["notes"].append(f"larger-batch probe of {meth} (checkpointing {ckpt}): skipped "
                                                 "by the time guard")
                            continue
                        b = big_batch_probe(meth, args.big_mode, stream, cfg_kwargs, args, device, deadline, sizes,
                                            args.seq, ckpt)
                        data["big"].append(b)
                        print(f"[big {meth} checkpointing={ckpt}] " + (f"error: {b['error']}" if b.get("error") else
                              f"max {b['max_tokens']} tokens/step; tried "
                              f"{[(t['batch'], t['fits']) for t in b['tried']]}"))
                        save(data, out_dir)
        _curves(spread, data, cfg_kwargs, args, device, deadline, out_dir, cpu)
    except KeyboardInterrupt:
        interrupted = True
        data["notes"].append("interrupted: partial results")
    data["wall_s"] = time.perf_counter() - t0
    written = save(data, out_dir)
    print("\n" + "=" * 100)
    print(f"train: {data['settings']['model_name']} | {meta['device']} | {meta['date']}")
    print_table(data)
    for mode, sp in data.get("spread", {}).items():
        print(f"spread of two hf runs ({mode}): mean |diff| {sp['mean_abs_diff']:.4f}, final diff "
              f"{sp['final_diff']:+.4f}")
    print("files: " + " ".join(str(p) for p in written if "latest-" not in p.name))
    if cpu:
        print("\n" + report.CPU_BANNER)
    return 130 if interrupted else 0


def _curves(plan, data, cfg_kwargs, args, device, deadline, out_dir, cpu):
    for name, meth, mode, d in plan:
        # skip a run that would not finish: estimate = the last run of the same method (else the last run)
        same = [r for r in data["runs"] if r["method"] == meth] or data["runs"]
        estimate = same[-1].get("wall_s", 0) if same else 0
        if deadline is not None and time.monotonic() + estimate > deadline:
            data["notes"].append(f"{name}: skipped by the time guard (a run takes ~{estimate:.0f} s)")
            continue
        if meth == "liger":
            if cpu:
                data["notes"].append(f"{name}: skipped (liger-kernel needs a CUDA GPU)")
                continue
            if not _importable("liger_kernel.transformers"):
                data["notes"].append(f"{name}: skipped (liger-kernel not importable)")
                continue
        if meth in TRL_METHODS and _trl_missing():
            data["notes"].append(f"{name}: skipped ({_trl_missing()})")
            continue
        if deadline is not None and time.monotonic() > deadline:
            data["notes"].append(f"{name}: skipped by the time guard")
            continue
        t = time.perf_counter()
        r = train_run(name, meth, mode, d, cfg_kwargs, args, device, deadline, args.seed)
        r["wall_s"] = time.perf_counter() - t
        data["runs"].append(r)
        print(f"[{name}] " + (f"error: {r['error']}" if r.get("error") else
              f"{r['steps']} steps, median {r['median_step_ms']:.1f} ms/step, peak "
              f"{(r.get('peak_mib') or 0) / 1024:.2f} GiB, loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")
              + f" ({time.perf_counter() - t:.0f} s)")
        save(data, out_dir)


def _on_sigterm(signum, frame):  # a time limit's kill: unwind so partial results are saved
    raise KeyboardInterrupt(f"signal {signum}")


def _importable(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":
    sys.exit(main())
