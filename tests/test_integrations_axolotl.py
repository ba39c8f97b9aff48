"""logitless.integrations.axolotl: the axolotl plugin.

The config checks run everywhere. The tests marked ``axolotl`` need axolotl itself, in its
own environment (it pins its own transformers, TRL and PEFT): ``bash scripts/test_axolotl.sh``
builds it and runs this file there (opt-in: docs/testing.md). There, axolotl's own
``load_cfg`` loads the plugin from a YAML ``plugins:`` list, validates its options, and
axolotl's ``train`` runs two steps of SFT on a tiny random Llama on the CPU, with the
plugin and without: same losses, and logitless' loss was called on every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from logitless.integrations import axolotl as lt_axolotl

PLUGIN = "logitless.integrations.axolotl.LogitlessPlugin"
CCE = "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"


def _axolotl():
    return pytest.importorskip("axolotl", reason="axolotl is opt-in (its own environment: scripts/test_axolotl.sh)")


# ------------------------------------------------------------------ config checks (no axolotl)


@pytest.mark.parametrize("cfg, key", [
    ({"plugins": [PLUGIN, CCE]}, "cut_cross_entropy"),  # on by default once its plugin is listed
    ({"plugins": [PLUGIN], "cut_cross_entropy": True}, "cut_cross_entropy"),
    ({"plugins": [PLUGIN], "liger_fused_linear_cross_entropy": True}, "liger_fused_linear_cross_entropy"),
    ({"plugins": [PLUGIN], "chunked_cross_entropy": True}, "chunked_cross_entropy"),
    ({"plugins": [PLUGIN], "logitless_memory_budget": -1}, "logitless_memory_budget"),
    ({"plugins": [PLUGIN], "logitless_memory_budget": 1.5}, "logitless_memory_budget"),
])
def test_check_config_refuses(cfg, key):
    with pytest.raises(ValueError, match=key):
        lt_axolotl.check_config(cfg)


def test_check_config_accepts():
    lt_axolotl.check_config({"plugins": [PLUGIN], "liger_rms_norm": True, "logitless_memory_budget": 2**20})
    lt_axolotl.check_config({"plugins": [PLUGIN, CCE], "cut_cross_entropy": False})
    lt_axolotl.check_config({"plugins": [PLUGIN, CCE], "logitless": False})  # plugin off: no conflict
    assert lt_axolotl.patch_options({"logitless_memory_budget": 2**20, "logitless_backend": "torch"}) == {
        "memory_budget": 2**20, "backend": "torch"}


def test_patch_model_follows_the_switch():
    transformers = pytest.importorskip("transformers")
    import logitless.transformers as lt

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(cfg)
    lt_axolotl.patch_model({"logitless": False}, model)
    assert not lt.is_patched(model)
    lt_axolotl.patch_model({"logitless_memory_budget": 2**20}, model)
    assert lt.is_patched(model)
    with pytest.raises(ValueError, match="logitless: false"):
        lt_axolotl.patch_model({}, transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2)))


def test_plugin_without_axolotl_says_so():
    try:
        import axolotl  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs axolotl"):
            lt_axolotl.LogitlessPlugin()
    else:
        pytest.skip("axolotl is installed")


# ------------------------------------------------------------------ axolotl itself


def _tiny_model_dir(path) -> str:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    words = [f"w{i}" for i in range(120)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(path / "model")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                         pad_token="<pad>").save_pretrained(path / "model")
    rng = __import__("random").Random(0)
    with open(path / "data.jsonl", "w") as f:
        for _ in range(16):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(40))}) + "\n")
    return str(path / "model")


def _yaml(path, name: str, extra: str) -> str:
    text = textwrap.dedent(f"""\
        base_model: {path / 'model'}
        datasets:
          - path: {path / 'data.jsonl'}
            type: completion
        dataset_prepared_path: {path / name / 'prepared'}
        dataset_num_proc: 1
        sequence_len: 64
        micro_batch_size: 2
        num_epochs: 1
        max_steps: 2
        learning_rate: 0.001
        bf16: false
        fp16: false
        seed: 0
        output_dir: {path / name / 'out'}
        """) + textwrap.dedent(extra)
    file = path / f"{name}.yml"
    file.write_text(text)
    return str(file)


# Runs axolotl's own load_cfg / load_datasets / train in a fresh process (axolotl's
# PluginManager is a process-wide singleton, and its dataset saving spawns processes) and
# prints the losses and the number of logitless loss calls as JSON.
_TRAIN = """
import json, sys

def main():
    import logitless.transformers.loss as L
    calls = []
    orig = L.linear_cross_entropy
    def spy(*args, **kwargs):
        calls.append(tuple(args[1].shape))
        return orig(*args, **kwargs)
    L.linear_cross_entropy = spy
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.train import train
    cfg = load_cfg(sys.argv[1])
    model, _, trainer = train(cfg=cfg, dataset_meta=load_datasets(cfg=cfg))
    import logitless.transformers as lt
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print("RESULT " + json.dumps({"losses": losses, "calls": len(calls), "patched": lt.is_patched(model),
                                  "budget": cfg.get("logitless_memory_budget")}))

if __name__ == "__main__":
    main()
"""


# The child processes import this checkout's logitless, offline, without axolotl's telemetry.
_SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(lt_axolotl.__file__))))
_ENV = dict(os.environ, HF_HUB_OFFLINE="1", AXOLOTL_DO_NOT_TRACK="1", DO_NOT_TRACK="1",
            PYTHONPATH=os.pathsep.join(p for p in (_SRC, os.environ.get("PYTHONPATH")) if p))


def _train(tmp_path, yml: str) -> dict:
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    env = dict(_ENV, HF_DATASETS_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(script), yml], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_axolotl_train_with_plugin(tmp_path):
    _axolotl()
    _tiny_model_dir(tmp_path)
    plain = _train(tmp_path, _yaml(tmp_path, "plain", ""))
    fused = _train(tmp_path, _yaml(tmp_path, "fused", f"""\
        plugins:
          - {PLUGIN}
        logitless_memory_budget: 1048576
        """))
    assert not plain["patched"] and plain["calls"] == 0
    assert fused["patched"] and fused["budget"] == 2**20
    assert fused["calls"] == 2  # one loss per step, from logitless
    assert len(fused["losses"]) == len(plain["losses"]) == 2
    assert fused["losses"] == pytest.approx(plain["losses"], rel=1e-5, abs=1e-5)


def test_axolotl_load_cfg_registers_and_refuses(tmp_path):
    _axolotl()
    from axolotl.integrations.base import BasePlugin, PluginManager

    _tiny_model_dir(tmp_path)
    code = textwrap.dedent("""
        import sys
        from axolotl.cli.config import load_cfg
        from axolotl.integrations.base import BasePlugin, PluginManager
        try:
            cfg = load_cfg(sys.argv[1])
        except Exception as e:
            print("REFUSED", type(e).__name__, e)
        else:
            plugin = PluginManager.get_instance().plugins[PLUGIN]
            print("LOADED", isinstance(plugin, BasePlugin), cfg.get("logitless_memory_budget"))
        """).replace("PLUGIN", repr(PLUGIN))
    env = _ENV
    out = {}
    for name, extra in (("ok", f"plugins: [{PLUGIN}]\nlogitless_memory_budget: 4096\n"),
                        ("cce", f"plugins: [{PLUGIN}, {CCE}]\nbf16: true\n"),
                        ("liger", f"plugins: [{PLUGIN}]\nliger_fused_linear_cross_entropy: true\n"),
                        ("budget", f"plugins: [{PLUGIN}]\nlogitless_memory_budget: 0\n")):
        proc = subprocess.run([sys.executable, "-c", code, _yaml(tmp_path, name, extra)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        out[name] = proc.stdout + proc.stderr
    assert "LOADED True 4096" in out["ok"], out["ok"][-3000:]
    assert "REFUSED" in out["cce"] and "cut_cross_entropy" in out["cce"], out["cce"][-3000:]
    assert "REFUSED" in out["liger"] and "liger_fused_linear_cross_entropy" in out["liger"], out["liger"][-3000:]
    assert "REFUSED" in out["budget"] and "logitless_memory_budget" in out["budget"], out["budget"][-3000:]
    assert issubclass(lt_axolotl.LogitlessPlugin, BasePlugin)
    assert PluginManager is not None
