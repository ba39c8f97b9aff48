"""HF Trainer on a Llama-shaped model, unpatched vs ``logitless.transformers.patch``, under
DeepSpeed ZeRO-3 (1 and 2 GPUs) and FSDP2 through accelerate (2 GPUs): loss curve, peak
memory, median step time; one JSON per run under $OUT (default ./out), then a comparison.

The GPU machine has no network and no deepspeed. Build the wheels here (DeepSpeed is an
sdist on PyPI; with DS_BUILD_OPS=0 it builds a pure-Python py3-none-any wheel: its ops
JIT-compile on first use, and ZeRO-3 with torch's AdamW needs none) and carry them::

    DS_BUILD_OPS=0 pip wheel --no-deps deepspeed==0.19.8 hjson py-cpuinfo einops -w wheels/
    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
        msgpack ninja -d wheels/
    # on the GPU machine (Python 3.12, torch 2.11 cu130, transformers 5.17, accelerate 1.15):
    pip install --no-index --no-deps wheels/*.whl && pip install --no-deps -e .

Runs (each writes $OUT/hf_multi_gpu-<mode>-<N>gpu-<variant>.json; ~1-2 min each)::

    S=benchmarks/gpu/hf_multi_gpu.py
    for v in plain patched; do
      torchrun --nproc_per_node 1 $S --mode zero3 --variant $v
      torchrun --nproc_per_node 2 $S --mode zero3 --variant $v
      accelerate launch --num_processes 2 $S --mode fsdp2 --variant $v
    done
    python $S --compare          # table + max |loss difference| per set-up; exit 1 if over --tol

On a CPU at a tiny size (proves the Trainer runs, the logitless check, the JSON and --compare;
HF's Trainer sets up neither FSDP nor DeepSpeed on a CPU, so the ranks run unsharded: the
JSON's head_sharding says so; on GPUs the script asserts the head is sharded as --mode says.
Sharding on the CPU is tested in tests/test_deepspeed.py and tests/test_transformers_integration.py)::

    for v in plain patched; do torchrun --nproc_per_node 2 $S --mode fsdp2 --variant $v --tiny; done
    python $S --compare

Model: 6 layers, hidden 2048, vocabulary 128256 (Llama 3's), bf16; 4 sequences of 2048
tokens per optimizer step in all (per GPU 4 / N), learnable synthetic data (arithmetic
token sequences), 20 steps, AdamW lr 3e-4, same seed for both variants.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

OUT = os.environ.get("OUT", "./out")


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("zero3", "fsdp2", "ddp"), default="zero3")
    p.add_argument("--variant", choices=("plain", "patched"), default="patched")
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (proves the script)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--compare", action="store_true", help="compare the JSON files under $OUT")
    p.add_argument("--tol", type=float, default=0.05, help="--compare: max |loss difference| allowed (bf16 noise)")
    return p.parse_args(argv)


def _shape(tiny: bool) -> dict:
    if tiny:
        return dict(layers=2, hidden=64, heads=4, kv=2, inter=128, vocab=1000, seq=64, seqs=4, steps=4)
    return dict(layers=6, hidden=2048, heads=16, kv=8, inter=8192, vocab=128256, seq=2048, seqs=4, steps=20)


class _Data:
    """Learnable token sequences: ids[t] = (a * t + b) % vocab, a and b drawn per sequence."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        a = torch.randint(1, 17, (n, 1), generator=g)
        b = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (a * torch.arange(seq) + b) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def run(args) -> dict:
    import torch
    import transformers

    import logitless.transformers as lt
    import logitless.transformers.loss as lt_loss

    s = _shape(args.tiny)
    steps = args.steps or s["steps"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available() and not args.tiny
    per_device = max(1, s["seqs"] // world)
    common = dict(output_dir=os.path.join(OUT, "trainer"), per_device_train_batch_size=per_device, max_steps=steps,
                  learning_rate=3e-4, logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0,
                  bf16=cuda, use_cpu=not cuda, dataloader_drop_last=True,
                  lr_scheduler_type="constant",
                  gradient_checkpointing=False, remove_unused_columns=False)
    if args.mode == "zero3":
        ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": 1,
              "bf16": {"enabled": "auto"}, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "overlap_comm": False, "stage3_param_persistence_threshold": 0}}
        if not cuda:  # HF's "auto" counts one process on a CPU; DeepSpeed counts the gloo ranks
            ds.update(train_micro_batch_size_per_gpu=per_device, train_batch_size=per_device * world)
        targs = transformers.TrainingArguments(deepspeed=ds, **common)  # before the model: zero.Init partitions it
    elif args.mode == "fsdp2":
        targs = transformers.TrainingArguments(fsdp="full_shard auto_wrap", fsdp_config={
            "version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True},
            **common)
    else:
        targs = transformers.TrainingArguments(**common)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                                   num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                   num_key_value_heads=s["kv"], max_position_embeddings=s["seq"],
                                   tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if cuda else torch.float32)
    calls = []
    if args.variant == "patched":
        lt.patch(model)
        original = lt_loss.linear_cross_entropy

        def spy(x, weight, *a, **k):
            calls.append(tuple(weight.shape))
            return original(x, weight, *a, **k)

        lt_loss.linear_cross_entropy = spy

    times = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    data = _Data(s["seqs"] * steps, s["seq"], s["vocab"])
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=data, callbacks=[Clock()])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if args.variant == "patched":
        assert calls and all(c == (s["vocab"], s["hidden"]) for c in calls), f"logitless saw {calls[:3]}"
    peaks = [peak]
    if world > 1 and torch.distributed.is_initialized() and cuda:
        t = torch.tensor([peak], device="cuda")
        gathered = [torch.zeros_like(t) for _ in range(world)]
        torch.distributed.all_gather(gathered, t)
        peaks = [float(g) for g in gathered]
    head = trainer.accelerator.unwrap_model(trainer.model_wrapped).lm_head.weight
    sharding = ("zero3" if hasattr(head, "ds_id") else "fsdp2" if hasattr(head, "full_tensor") else "none")
    if cuda:  # (HF's Trainer runs no distributed set-up on a CPU: --tiny proves the rest of the script)
        assert sharding == args.mode or args.mode == "ddp", f"--mode {args.mode} but the head is sharded by {sharding}"
    warm = times[2:] or times
    result = {"mode": args.mode, "world": world, "variant": args.variant, "tiny": args.tiny,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "transformers": transformers.__version__, "shape": s, "steps": steps, "losses": losses,
              "step_ms_median": 1e3 * statistics.median(warm), "peak_mib_per_rank": peaks,
              "logitless_calls": len(calls), "head_sharding": sharding}
    try:
        import deepspeed
        result["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    if rank == 0:
        os.makedirs(OUT, exist_ok=True)
        tag = f"{args.mode}-{world}gpu-{args.variant}{'-tiny' if args.tiny else ''}"
        path = os.path.join(OUT, f"hf_multi_gpu-{tag}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}: losses {[round(x, 4) for x in losses]}, median step "
              f"{result['step_ms_median']:.1f} ms, peak MiB {peaks}")
    return result


def compare(tol: float) -> int:
    runs = {}
    for path in sorted(glob.glob(os.path.join(OUT, "hf_multi_gpu-*.json"))):
        with open(path) as f:
            r = json.load(f)
        runs[(r["mode"], r["world"], r["tiny"], r["variant"])] = r
    bad = 0
    print("| set-up | step ms plain / patched | peak MiB (max rank) plain / patched | max abs loss diff |")
    print("|---|---|---|---|")
    for (mode, world, tiny, variant), p in sorted(runs.items()):
        if variant != "patched" or (mode, world, tiny, "plain") not in runs:
            continue
        q = runs[(mode, world, tiny, "plain")]
        diff = max(abs(a - b) for a, b in zip(p["losses"], q["losses"])) if p["losses"] else float("nan")
        peak = [max((x for x in r["peak_mib_per_rank"] if x is not None), default=float("nan")) for r in (q, p)]
        bad += not diff <= tol or len(p["losses"]) != len(q["losses"])
        print(f"| {mode} x{world}{' tiny' if tiny else ''} | {q['step_ms_median']:.1f} / {p['step_ms_median']:.1f} | "
              f"{peak[0]:.0f} / {peak[1]:.0f} | {diff:.2e} |")
    return 1 if bad else 0


def main(argv=None) -> int:
    args = _parse(argv)
    if args.compare:
        return compare(args.tol)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
