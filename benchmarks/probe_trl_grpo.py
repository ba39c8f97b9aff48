"""A real TRL GRPOTrainer run on one device, TRL's own fused head vs patch_grpo, and the
PatchBypassedWarning of a plainly patched model.

    PYTHONPATH=src python benchmarks/probe_trl_grpo.py [--device cuda] [--bf16] [--steps 4] [--out f.json]

A random Llama-shaped model (hidden 256, 4 layers, vocab 4099, saved to a temp dir: the
reference model is built from the path), 8 prompts, num_generations 4, 16 new tokens,
beta 0.04, temperature 0.9, seeded sampling. Three runs from the same seed: TRL's head,
lt.patch(model) alone (must warn, PatchBypassedWarning), lt.patch + patch_grpo (must not
warn; logitless must be called for policy and reference). Prints per-step loss / kl /
entropy of TRL vs logitless and the max differences (bf16: TRL's bf16 tiles vs logitless'
fp32 statistics differ by ~1e-2; fp32: 1e-5), whether the completions matched, and the
calls counted. Writes a JSON summary when --out is given. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import datasets
    import tokenizers
    import torch
    import transformers
    import trl
    from trl import GRPOConfig, GRPOTrainer

    import logitless.integrations.hf as hf
    import logitless.integrations.trl as lt_trl
    import logitless.transformers as lt
    from logitless.transformers.bypass import PatchBypassedWarning

    vocab_words = [f"w{i}" for i in range(4096)]
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(vocab_words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                                     eos_token="<eos>")
    g = torch.Generator().manual_seed(1)
    prompts = datasets.Dataset.from_list([
        {"prompt": " ".join(vocab_words[i] for i in torch.randint(0, 4096, (4 + k % 5,), generator=g).tolist())}
        for k in range(16)])
    tmp = tempfile.mkdtemp(prefix="trl-grpo-probe-")
    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(f"{tmp}/model")

    calls = []
    real = hf.linear_log_probs

    def counted(*args, **kw):
        calls.append(bool(kw.get("entropy")))
        return real(*args, **kw)

    hf.linear_log_probs = counted

    def run(name, plain_patch, grpo_patch):
        seen = []

        def reward(prompts, completions, **kw):
            seen.extend(completions)
            return [float(sum(int(w[1:]) % 7 for w in c.split() if w[1:].isdigit())) for c in completions]

        args = GRPOConfig(output_dir=f"{tmp}/{name}", max_steps=a.steps, per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=16, beta=0.04, temperature=0.9, num_iterations=1,
                          learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
                          use_cpu=a.device == "cpu", bf16=a.bf16, seed=11, dataloader_num_workers=0,
                          disable_dropout=True)
        model = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/model")
        if plain_patch:
            lt.patch(model)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=prompts,
                              processing_class=tokenizer)
        if grpo_patch:
            lt_trl.patch_grpo(trainer)
        n0 = len(calls)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        return {"logs": logs, "completions": seen, "seconds": time.perf_counter() - t0,
                "bypass_warnings": sum(issubclass(x.category, PatchBypassedWarning) for x in w),
                "policy_calls": sum(calls[n0:]), "ref_calls": len(calls[n0:]) - sum(calls[n0:])}

    theirs = run("trl", False, False)
    plain = run("plain_patch", True, False)
    ours = run("patch_grpo", True, True)
    tol = 5e-2 if a.bf16 else 1e-4
    keys = ("loss", "kl", "entropy")
    diffs = {k: max(abs(o[k] - t[k]) for o, t in zip(ours["logs"], theirs["logs"])) for k in keys}
    checks = {
        "plain patch warns once": plain["bypass_warnings"] == 1,
        "plain patch: logitless not called": plain["policy_calls"] == plain["ref_calls"] == 0,
        "patch_grpo: no warning": ours["bypass_warnings"] == 0,
        "patch_grpo: policy + reference through logitless": ours["policy_calls"] > 0 and ours["ref_calls"] > 0,
        f"loss/kl/entropy within {tol:g}": all(d <= tol for d in diffs.values()),
    }
    if not a.bf16:
        checks["same completions"] = ours["completions"] == theirs["completions"]
    print(f"device {a.device} ({torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu'}), "
          f"{'bf16' if a.bf16 else 'fp32'}, torch {torch.__version__}, trl {trl.__version__}")
    print(f"{'step':>4} {'loss trl':>11} {'loss ours':>11} {'kl trl':>10} {'kl ours':>10} "
          f"{'ent trl':>9} {'ent ours':>9}")
    for i, (o, t) in enumerate(zip(ours["logs"], theirs["logs"])):
        print(f"{i + 1:>4} {t['loss']:>11.6f} {o['loss']:>11.6f} {t['kl']:>10.6f} {o['kl']:>10.6f} "
              f"{t['entropy']:>9.5f} {o['entropy']:>9.5f}")
    print("max |diff|: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    print(f"completions equal: {ours['completions'] == theirs['completions']}; train() seconds: trl "
          f"{theirs['seconds']:.1f}, plain {plain['seconds']:.1f}, patch_grpo {ours['seconds']:.1f}")
    for k, v in checks.items():
        print(f"  {'ok ' if v else 'FAIL'} {k}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": a.device, "bf16": a.bf16, "torch": torch.__version__, "trl": trl.__version__,
                       "diffs": diffs, "checks": checks, "theirs": theirs["logs"], "ours": ours["logs"],
                       "seconds": {n: r["seconds"] for n, r in (("trl", theirs), ("plain", plain),
                                                                 ("patch_grpo", ours))}}, f, indent=1)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
