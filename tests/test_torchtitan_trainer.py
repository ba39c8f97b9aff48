"""docs/torchtitan.md's command end to end: torchtitan 0.3.0's own trainer (``torchtitan.train``,
``--module llama3 --config llama3_debugmodel``) with and without ``--override.imports
logitless.integrations.torchtitan.logitless_loss``, on CPU gloo ranks under torchrun
(tests/torchtitan_cpu_train.py says what it changes to run on a CPU: the device module and
the attention kernel, nothing of the loss): one rank, FSDP2 over two ranks, TP=2 with a
vocabulary-parallel head. Three steps of AdamW each; fp32 parameters
(``mixed_precision_param=float32``) so that both losses are fp32. Each pair: the same loss and
gradient norm at every step (the later steps' losses follow from the earlier steps' gradients),
logitless' op called on every rank with the override and never without, the override's line and
logitless' INFO line once per process.

A tokenizer (``tokenizers``, byte-level BPE) and a small text data set are made here; nothing
is downloaded. Opt-in (~1.5 min per layout on 2 cores): ``bash scripts/test_frameworks.sh torchtitan``
(docs/testing.md).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/test_frameworks.sh installs it)")
pytest.importorskip("tokenizers", reason="needs the tokenizers package (comes with transformers)")

from tests._distributed import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "torchtitan_cpu_train.py"
OVERRIDE = "logitless.integrations.torchtitan.logitless_loss"
STEPS = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json) and a json-lines text
    data set, in the layout torchtitan's ``hf_assets_path`` and ``c4_test`` loader read."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("torchtitan_assets")
    (root / "tokenizer").mkdir()
    (root / "data").mkdir()
    rng = random.Random(0)
    words = "the cat sat on a mat dog ran far away and then slept in sun".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) + "." for _ in range(200)]
    (root / "data" / "train.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True,
         "add_eos_token": True}))
    return root


def _train(assets: Path, tmp: Path, nproc: int, parallelism: list[str], override: bool) -> dict:
    """torchrun of the harness; {"records": per-rank step records, "calls": per-rank op calls, "out": log}."""
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(free_port()), str(HARNESS),
            "--module", "llama3", "--config", "llama3_debugmodel",
            "--hf_assets_path", str(assets / "tokenizer"), "--dataloader.dataset_path", str(assets / "data"),
            "--dump_folder", str(tmp / ("logitless" if override else "torchtitan")),
            "--training.steps", str(STEPS), "--training.seq_len", "64", "--training.local_batch_size", "2",
            "--training.mixed_precision_param", "float32", "--debug.seed", "0", "--debug.deterministic",
            *parallelism]
    if override:
        args += ["--override.imports", OVERRIDE]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    done = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    records, calls = {}, {}
    for line in done.stdout.splitlines():
        if "LOGITLESS_TEST " in line:
            r = json.loads(line.split("LOGITLESS_TEST ", 1)[1])
            if "calls" in r:
                calls[r["rank"]] = r["calls"]
            else:
                records.setdefault(r["rank"], []).append(r)
    return {"records": records, "calls": calls, "out": out}


LAYOUTS = {
    "one rank": (1, []),
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trainer_with_the_override_against_torchtitan_loss(layout, assets, tmp_path):
    nproc, parallelism = LAYOUTS[layout]
    ours = _train(assets, tmp_path, nproc, parallelism, override=True)
    theirs = _train(assets, tmp_path, nproc, parallelism, override=False)

    assert f"[Override] {OVERRIDE}: loss ChunkedLossWrapper.Config -> LogitlessLoss.Config" in ours["out"]
    assert ours["out"].count("logitless is active (torchtitan)") == nproc
    assert "logitless is active" not in theirs["out"]
    assert sorted(ours["calls"]) == list(range(nproc)), ours["calls"]
    assert all(n >= STEPS for n in ours["calls"].values()), ours["calls"]
    assert theirs["calls"] == {rank: 0 for rank in range(nproc)}

    for rank in range(nproc):
        a, b = ours["records"][rank], theirs["records"][rank]
        assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
        for x, y in zip(a, b):
            assert x["loss"] == pytest.approx(y["loss"], rel=2e-6), (layout, rank, a, b)
            assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4), (layout, rank, a, b)
