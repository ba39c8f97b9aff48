"""The JAX benchmark harness runs end to end on a tiny case and writes its files."""

import json

from logitless.bench import jax_suite


def test_jax_suite_smoke(tmp_path, monkeypatch):
    from logitless.jax.linear_cross_entropy import bench_shapes

    tiny = (bench_shapes.JaxShape("cpu-tiny", 32, 16, 257, "float32"),)
    monkeypatch.setattr(bench_shapes, "CPU_SHAPES", tiny)
    rc = jax_suite.main(["--suite", "jax", "--cpu", "--quick", "--out", str(tmp_path),
                         "--methods", "logitless-xla,xla-logits,logitless-mosaic"])
    assert rc == 0
    data = json.loads((tmp_path / "latest-jax-cpu.json").read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"gemm", "logitless-xla", "xla-logits", "logitless-mosaic"}
    ours = rows["logitless-xla"]
    assert ours["fwd ms"] > 0 and ours["fwd+bwd ms"] > 0 and ours["f+b/3 GEMMs"] > 0
    assert ours["|loss-ref|"] < 1e-5 and ours["max tok err"] < 1e-5
    assert "note" in rows["logitless-mosaic"] or "fwd ms" in rows["logitless-mosaic"]
    assert (tmp_path / "latest-jax-cpu.md").read_text().startswith("# JAX linear cross-entropy")
    assert jax_suite.wants_jax(["--suite", "jax"]) and not jax_suite.wants_jax(["--suite", "lce"])
