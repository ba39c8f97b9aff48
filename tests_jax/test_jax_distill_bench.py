"""``python -m logitless_bench --suite jax-distill`` on the CPU: the tiny case of each op runs
without torch, writes its JSON and table, and logitless' loss agrees with the bf16-logits
baseline's (the GPU numbers: benchmarks/results/jax-distill-H100-2026-11-26.md)."""

from __future__ import annotations

import json

from logitless_bench import jax_suite


def test_the_suite_is_a_jax_one_and_runs_on_the_cpu(tmp_path):
    assert jax_suite.wants_jax(["--suite", "jax-distill"])
    assert jax_suite.main(["--suite", "jax-distill", "--cpu", "--warmup", "0", "--reps", "1", "--out",
                           str(tmp_path)]) == 0
    data = json.loads((tmp_path / "latest-jax-distill-cpu.json").read_text())
    rows = {(r["op"], r["method"]): r for r in data["rows"]}
    assert {("jsd", "logitless"), ("jsd", "xla-bf16-logits"), ("topk", "logitless-topk"), ("topk", "logitless-lce"),
            ("topk", "xla-bf16-logits-topk"), ("topk", "xla-bf16-logits-topk-hard-T2")} <= set(rows)
    assert rows[("jsd", "logitless")]["|loss-baseline|"] < 1e-3
    assert rows[("topk", "logitless-topk")]["|loss-baseline|"] < 1e-3
    assert rows[("topk", "logitless-topk-hard-T2")]["|loss-baseline|"] < 1e-3
    assert all(rows[("topk", f"logitless-topk-{m}")]["f+b/lce"] > 0 for m in ("hard-T2", "hard-T1.5", "hv"))
    assert "def xla_jsd" in data["baselines"] and (tmp_path / "latest-jax-distill-cpu.md").exists()
