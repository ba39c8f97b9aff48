"""The suites' shared command-line and file helpers (logitless_bench.common, runner.select,
runner.fill_row): selections in order, unknown names refused, both result files written."""

import argparse
import json

import pytest

from logitless_bench import common, runner
from logitless_bench.peers import Skip
from logitless_bench.shapes import CPU_RL_SHAPES, RL_SHAPES


def test_chosen_keeps_the_order_and_refuses_unknown_names():
    assert common.chosen(" b, a ,", ["a", "b"], "x") == ["b", "a"]
    assert common.chosen(None, ["a"], "x") == [] and common.chosen("", ["a"], "x") == []
    with pytest.raises(SystemExit, match=r"unknown rl method\(s\) \['c'\]; known: \['a', 'b'\]"):
        common.chosen("a,c", ["a", "b"], "rl method")


def test_write_results_and_table_report(tmp_path):
    text = common.table_report(["# t", ""], ["a", "b"], [{"a": 1}, {"a": 2, "b": 3}],
                               lambda v: "-" if v is None else str(v),
                               ["n1"])
    assert text == "# t\n\n| a | b |\n|---|---|\n| 1 | - |\n| 2 | 3 |\n\n- n1\n"
    paths = common.write_results(tmp_path / "out", ("s-1", "latest-s"), {"x": 1}, text)
    assert [p.name for p in paths] == ["s-1.json", "s-1.md", "latest-s.json", "latest-s.md"]
    assert json.loads(paths[2].read_text()) == {"x": 1} and paths[3].read_text() == text


def _args(**kw):
    base = dict(shapes=None, methods=None, quick=False, no_peers=False, warmup=None, reps=None, max_minutes=None)
    return argparse.Namespace(**{**base, **kw})


def test_select_picks_shapes_and_methods(capsys):
    methods = {"logitless": None, "torch-eager": None, "verl": None}
    device, shapes, names, (warmup, reps, deadline) = runner.select(_args(), True, RL_SHAPES, CPU_RL_SHAPES,
                                                                    methods, "rl")
    assert device.type == "cpu" and shapes == CPU_RL_SHAPES and names == list(methods)
    assert (warmup, reps, deadline) == (3, 10, None) and "NO GPU FOUND" in capsys.readouterr().out
    _, shapes, names, (warmup, reps, _) = runner.select(
        _args(shapes=RL_SHAPES[1].name, methods="verl,logitless", no_peers=True, quick=True, reps=5), True,
        RL_SHAPES, CPU_RL_SHAPES, methods, "rl")
    assert shapes == [RL_SHAPES[1]] and names == ["logitless"] and (warmup, reps) == (1, 5)
    _, shapes, _, _ = runner.select(_args(quick=True), True, (), RL_SHAPES, methods, "rl")  # --quick: the first
    assert shapes == RL_SHAPES[:1]
    with pytest.raises(SystemExit, match="unknown rl shape"):
        runner.select(_args(shapes="nope"), True, RL_SHAPES, CPU_RL_SHAPES, methods, "rl")


def test_fill_row_statuses():
    def row():
        return {"status": "ok", "reason": "", "errors": []}

    r = row()
    runner.fill_row(r, lambda: 1, lambda fn: r["errors"].append("memory: boom"))
    assert (r["status"], r["reason"]) == ("failed", "memory: boom")
    r = row()
    runner.fill_row(r, lambda: (_ for _ in ()).throw(Skip("no GPU")), lambda fn: None)
    assert (r["status"], r["reason"]) == ("skipped", "no GPU")
    r = row()
    runner.fill_row(r, lambda: 1 / 0, lambda fn: None)
    assert r["status"] == "failed" and r["reason"].startswith("set-up: ZeroDivisionError")
    r = row()
    runner.fill_row(r, lambda: 1, lambda fn: None, out_of_time=True)
    assert r["status"] == "skipped" and "time limit" in r["reason"]


def test_rounds_interleave_the_methods_and_keep_the_median_round():
    """--rounds R: every method of a case runs R times, A B A B (a clock episode hits each
    alike); its row holds the median of the rounds' times (what derives from one rescaled),
    every round's time beside it."""
    import torch

    order, times = [], {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}

    class Method:
        def __init__(self, name):
            self.name, self.peer = name, False

        def make(self, case, device):
            return self.name

    class Results:
        rows: list = []

        def add(self, row):
            self.rows.append(row)

    class Progress:
        def step(self, text):
            pass

    def measure(fn, method, row):
        order.append(fn)
        ms = next(times[fn])
        row.update(fwdbwd_ms=ms, fwdbwd_per_3gemm=ms / 3, fwd_ms=0.5)

    case = argparse.Namespace(name="s")
    cfg = runner.Config(device=torch.device("cpu"), rounds=3)
    results = Results()
    runner.run_methods("lce", case, [Method("a"), Method("b")], cfg, results, Progress(), measure)
    assert order == ["a", "b"] * 3
    a, b = results.rows
    assert (a["method"], a["fwdbwd_ms"], a["fwdbwd_ms_rounds"]) == ("a", 3.0, [5.0, 1.0, 3.0])
    assert (b["method"], b["fwdbwd_ms"], b["fwdbwd_ms_rounds"]) == ("b", 4.0, [2.0, 9.0, 4.0])
    assert a["fwdbwd_per_3gemm"] == pytest.approx(1.0) and b["fwdbwd_per_3gemm"] == pytest.approx(4 / 3)
    assert a["fwd_ms"] == 0.5 and a["fwd_ms_rounds"] == [0.5] * 3
    failed = {"status": "failed", "reason": "x"}
    assert runner.median_round([{"status": "ok", "fwdbwd_ms": 1.0}, failed]) is failed


def test_rounds_are_refused_where_a_suite_would_ignore_them():
    from logitless_bench.cli import main

    for argv in (["--suite", "distill", "--rounds", "3"], ["--suite", "lce", "--rounds", "0"]):
        with pytest.raises(SystemExit, match="--rounds"):
            main(argv)
