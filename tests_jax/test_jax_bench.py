"""The JAX benchmark harness runs end to end on a tiny case and writes its files.

Runs on any machine: ``--cpu`` selects the small fp32 shapes and names the files
``*-cpu.*`` even where the default device is a GPU.
"""

import json
import signal
import warnings

import jax
import pytest

from logitless_bench import jax_suite


def test_jax_suite_smoke(tmp_path, monkeypatch):
    from logitless_bench import shapes as bench_shapes

    tiny = (bench_shapes.JaxShape("cpu-tiny", 32, 16, 257, "float32"),)
    monkeypatch.setattr(bench_shapes, "CPU_JAX_SHAPES", tiny)
    # The float64 reference weight (257 x 16 x 8 bytes = 33 KB) must be an argument of
    # the jitted reference, never a captured constant (gigabytes at the real shapes).
    old = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", 16_000)
    handlers = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGALRM))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rc = jax_suite.main(["--suite", "jax", "--cpu", "--quick", "--out", str(tmp_path),
                                 "--methods", "logitless-xla,logitless-xla-hv,xla-logits,logitless-mosaic",
                                 "--max-minutes", "5"])
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", old)
    # --max-minutes arms a timer and signal handlers; the caller's are restored after.
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGALRM)) == handlers
    consts = [str(w.message)[:200] for w in caught if "constants were captured" in str(w.message)]
    assert not consts, consts
    assert rc == 0
    data = json.loads((tmp_path / "latest-jax-cpu.json").read_text())
    assert data["complete"] and data["meta"]["tag"] == "cpu"
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"gemm", "gemm-hv", "logitless-xla", "logitless-xla-hv", "xla-logits", "logitless-mosaic"}
    # A row that takes the (H, V) kernel is timed against the GEMM in that layout.
    assert rows["gemm-hv"]["fwd ms"] > 0
    hv_row = rows["logitless-xla-hv"]
    assert hv_row["fwd/1 GEMM"] == hv_row["fwd ms"] / rows["gemm-hv"]["fwd ms"]
    # The flax (H, V) kernel: read in place, no more temporaries than the (V, H) weight.
    hv = rows["logitless-xla-hv"]
    assert hv["|loss-ref|"] < 1e-5 and hv["fwd ms"] > 0
    for col in ("fwd temp MiB", "temp MiB"):
        assert hv[col] <= rows["logitless-xla"][col] + 0.0625, col
    ours = rows["logitless-xla"]
    assert ours["fwd ms"] > 0 and ours["fwd+bwd ms"] > 0 and ours["f+b/3 GEMMs"] > 0
    assert ours["compile s"] > 0
    assert ours["|loss-ref|"] < 1e-5 and ours["max tok err"] < 1e-5
    assert "note" in rows["logitless-mosaic"] or "fwd ms" in rows["logitless-mosaic"]
    assert (tmp_path / "latest-jax-cpu.md").read_text().startswith("# JAX linear cross-entropy")
    assert jax_suite.wants_jax(["--suite", "jax"]) and not jax_suite.wants_jax(["--suite", "lce"])


def test_jax_suite_time_limits(tmp_path, monkeypatch):
    """A method slower than --method-seconds is skipped on the next shapes; files are
    written and the run says it is partial."""
    from logitless_bench import shapes as bench_shapes

    tiny = (bench_shapes.JaxShape("cpu-a", 16, 16, 129, "float32"),
            bench_shapes.JaxShape("cpu-b", 24, 16, 131, "float32"))
    monkeypatch.setattr(bench_shapes, "CPU_JAX_SHAPES", tiny)
    rc = jax_suite.main(["--suite", "jax", "--cpu", "--out", str(tmp_path), "--warmup", "0", "--reps", "1",
                         "--methods", "xla-logits", "--method-seconds", "0", "--no-errors"])
    assert rc == 130
    data = json.loads((tmp_path / "latest-jax-cpu.json").read_text())
    assert not data["complete"]
    rows = [(r["shape"].split()[0], r["method"], r.get("note", "")) for r in data["rows"]]
    assert ("cpu-a", "xla-logits", "") in rows
    assert any(s == "cpu-b" and m == "xla-logits" and n.startswith("skipped: took") for s, m, n in rows)
    gemm_b = next(r for r in data["rows"] if r["shape"].startswith("cpu-b") and r["method"] == "gemm")
    assert gemm_b["fwd ms"] > 0  # the unit of the ratios is never skipped for slowness


def test_jax_sharded_suite_smoke(tmp_path):
    """``--suite jax-sharded`` on the CPU's host devices: every mode runs, the collectives
    are read from the compiled HLO, logitless agrees with XLA with the logits."""
    from logitless_bench import jax_sharded

    assert jax_suite.wants_jax(["--suite", "jax-sharded"]) and jax_suite.wants_jax(["--suite=jax-sharded"])
    rc = jax_suite.main(["--suite", "jax-sharded", "--cpu", "--tokens", "64", "--hidden", "32", "--vocab", "512",
                         "--dtype", "float32", "--warmup", "0", "--reps", "1", "--out", str(tmp_path),
                         "--methods", "xla-logits,logitless-xla"])
    assert rc == 0
    (latest,) = tmp_path.glob("latest-jax-sharded-*.json")  # named after the device (cpu, H100, ...)
    data = json.loads(latest.read_text())
    assert data["complete"] and data["meta"]["devices"] == len(jax.devices())
    modes = {r["mode"] for r in data["rows"]}
    assert {"data", "tensor", "fsdp"} <= modes and ("2d" in modes) == (len(jax.devices()) >= 4)
    for r in data["rows"]:
        assert "note" not in r, r
        assert r["fwd+bwd ms"] > 0 and r["temp MiB/dev"] >= 0
        if r["method"] == "logitless-xla":
            assert r["|loss-xla|"] < 1e-5
            if len(jax.devices()) > 1 and r["mode"] != "fsdp":
                assert "all-gather" not in r["collectives_detail"], r["collectives"]
            elif len(jax.devices()) > 1:  # FSDP, 3 N < 2 V: x gathered (not W), dW in W's split
                detail = r["collectives_detail"]
                assert "reduce-scatter" not in detail and detail["all-gather"]["largest"] == "f32[64,32]", detail
    hlo = "%x = f32[64,32]{1,0} all-gather(f32[8,32]{1,0} %p), dimensions={0}\n" \
          "%y = (f32[], f32[4]) all-reduce-start(f32[] %a, f32[4] %b)\n" \
          "%rs = ((f32[1024,32]{1,0}), f32[512,32]{1,0}) reduce-scatter-start(%g), dimensions={0}\n" \
          "%rd = f32[512,32]{1,0} reduce-scatter-done(%rs)"  # GPU async collectives: nested tuples
    got = jax_sharded.collectives(hlo)
    assert got == {"all-gather": {"count": 1, "largest": "f32[64,32]"},
                   "all-reduce": {"count": 1, "largest": "f32[4]"},
                   "reduce-scatter": {"count": 1, "largest": "f32[1024,32]"}}
    assert (tmp_path / "latest-jax-sharded-cpu.md").read_text().startswith("# JAX linear cross-entropy, sharded")


def test_trace_tables_sum_device_stream_kernels_per_step():
    """jax_bwd --profile's table: kernels on the device's CUDA stream lines, summed by name
    and divided by the steps; the host process and the "XLA Modules" line stay out."""
    from logitless_bench.jax_timing import trace_tables

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #14(Compute,Memset)"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 8, "args": {"name": "XLA Modules"}}]
    x = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "dur": dur}
    events = meta + [x(2, 7, "gemm", 300.0), x(2, 7, "gemm", 500.0), x(2, 7, "memcpy128", 40.0),
                     x(2, 8, "jit_fb", 2000.0), x(1, 3, "gemm", 9999.0)]
    t = trace_tables(events, steps=2)
    assert t["stream"] == [{"name": "gemm", "calls": 1.0, "ms": 0.4}, {"name": "memcpy128", "calls": 0.5, "ms": 0.02}]
    assert t["other"] == [{"name": "jit_fb", "calls": 0.5, "ms": 1.0}]
    assert t["threads"] == ["Stream #14(Compute,Memset)", "XLA Modules"]


def test_trace_timeline_finds_the_gaps():
    """One call's timeline: span from the first kernel's start to the last one's end on the
    device's streams, the kernels' time, and the idle gaps between them, longest first."""
    from logitless_bench.jax_timing import trace_timeline

    meta = [{"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #14(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 8, "args": {"name": "XLA Modules"}}]
    x = lambda tid, name, ts, dur: {"ph": "X", "pid": 2, "tid": tid, "name": name, "ts": ts, "dur": dur}
    events = meta + [x(7, "fwd", 0.0, 1000.0), x(7, "dz", 1500.0, 200.0), x(7, "gemm", 1700.0, 800.0),
                     x(8, "jit_fb", 0.0, 3000.0)]
    t = trace_timeline(events)
    assert t["span ms"] == 2.5 and t["busy ms"] == 2.0
    assert t["gaps"] == [{"ms": 0.5, "after": "fwd", "before": "dz"}]


def test_interleaved_rounds_take_medians_and_ratios_again(monkeypatch):
    """``--rounds``: every row is timed again once per extra round, in turn, and reports
    the median over all rounds, with its ratios against the GEMM row's median."""
    clock = iter([3.0, 30.0, 60.0, 2.0, 20.0, 40.0, 1.0, 10.0, 50.0])  # gemm, fwd, f+b per round

    order = []

    def fake_median(fn, args, warmup, reps):
        order.append(fn)
        return next(clock)

    monkeypatch.setattr(jax_suite, "_median_ms", fake_median)
    gemm = {"method": "gemm", "fwd ms": 4.0}
    ours = {"method": "ours", "fwd ms": 40.0, "fwd+bwd ms": 70.0}
    jax_suite.interleaved_rounds([(gemm, "g", None, ()), (ours, "f", "fb", ())], 4, reps=2)
    assert order == ["g", "f", "fb"] * 3  # interleaved: each row in turn, per round
    assert gemm["fwd ms rounds"] == [4.0, 3.0, 2.0, 1.0] and gemm["fwd ms"] == 2.5
    assert ours["fwd ms rounds"] == [40.0, 30.0, 20.0, 10.0] and ours["fwd ms"] == 25.0
    assert ours["fwd+bwd ms rounds"] == [70.0, 60.0, 40.0, 50.0] and ours["fwd+bwd ms"] == 55.0
    assert ours["fwd/1 GEMM"] == 10.0 and abs(ours["f+b/3 GEMMs"] - 55.0 / 7.5) < 1e-12
    # With a GEMM row per layout, an (H, V) row's ratios are against the (H, V) GEMM's median.
    clock = iter([2.0, 5.0, 20.0, 40.0, 20.0, 40.0])
    gemm = {"method": "gemm", "fwd ms": 2.0}
    gemm_hv = {"method": "gemm-hv", "fwd ms": 4.0}
    ours_hv = {"method": "ours-hv", "fwd ms": 20.0, "fwd+bwd ms": 40.0}
    ours = {"method": "ours", "fwd ms": 20.0, "fwd+bwd ms": 40.0}
    jax_suite.interleaved_rounds([(gemm, "g", None, ()), (gemm_hv, "gh", None, ()), (ours_hv, "f", "fb", ()),
                                  (ours, "f", "fb", ())], 2, reps=2)
    assert gemm["fwd ms"] == 2.0 and gemm_hv["fwd ms"] == 4.5
    assert ours_hv["fwd/1 GEMM"] == 20.0 / 4.5 and ours["fwd/1 GEMM"] == 10.0


def test_rounds_below_one_are_refused(capsys):
    """--rounds 0 is a clear error, not a silent single round."""
    with pytest.raises(SystemExit) as exc:
        jax_suite.run(["--suite", "jax", "--cpu", "--rounds", "0"])
    assert exc.value.code == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err


def test_a_row_that_fails_after_its_timings_is_not_timed_again(monkeypatch):
    """``--rounds`` times again only rows whose method passed every check: one that
    fails after its timings (here its per-token check) keeps no entry in the rounds."""
    import jax.numpy as jnp
    import numpy as np

    from logitless_bench import shapes as bench_shapes

    def mean_fn(x, w, wt, t):
        return jnp.mean(x @ w.T)

    def failing_tok(x, w, wt, t):
        raise RuntimeError("per-token check failed")

    s = bench_shapes.JaxShape("cpu-tiny", 8, 16, 32, "float32")
    x, w, t = jnp.ones((8, 16)), jnp.ones((32, 16)), jnp.zeros((8,), jnp.int32)
    for tok_fn, entries in ((failing_tok, 0), (lambda x, w, wt, t: (x @ w.T)[:, 0], 1)):
        monkeypatch.setattr(jax_suite, "_loss_fns", lambda m, budget, tok_fn=tok_fn: (mean_fn, tok_fn))
        timers, row = [], {}
        try:
            jax_suite._run_method("ours", s, x, w, t, None, np.zeros(8), {"vh": 1.0}, 0, 1, row,
                                 timers=timers)
        except RuntimeError as exc:
            assert "per-token check failed" in str(exc)
        assert row["fwd+bwd ms"] > 0  # timed before the failure
        assert len(timers) == entries and all(e[0] is row for e in timers)
