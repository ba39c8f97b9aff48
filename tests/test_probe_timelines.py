"""The trace reading of benchmarks/probe_jsd_timeline.py on a synthetic chrome trace: gaps,
queue delays, host-starved idle and the host calls during a gap are what the events say."""

from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "probe_jsd_timeline.py")


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("probe_jsd_timeline", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _x(name, cat, ts, dur, tid=1, corr=None):
    e = dict(ph="X", name=name, cat=cat, ts=ts, dur=dur, tid=tid, args={})
    if corr is not None:
        e["args"]["correlation"] = corr
    return e


def test_timeline_gaps_queue_and_starved_idle(probe):
    ev = [
        _x("fwd", "user_annotation", 100.0, 1000.0),
        _x("flush", "kernel", 50.0, 60.0, corr=1),  # launched before the range: not counted
        _x("cudaLaunchKernel", "cuda_runtime", 20.0, 5.0, corr=1),
        # kernel A launched at 110, runs 120..320 (queue 5 us)
        _x("cudaLaunchKernel", "cuda_runtime", 110.0, 5.0, corr=2),
        _x("A", "kernel", 120.0, 200.0, corr=2),
        # kernel B launched early (130): runs back to back at 320
        _x("cuLaunchKernelEx", "cuda_driver", 130.0, 4.0, corr=3),
        _x("B", "kernel", 320.0, 100.0, corr=3),
        # the host is busy in aten::item and a sync from 140 to 600; C launched at 600
        _x("aten::item", "cpu_op", 140.0, 455.0),
        _x("cudaStreamSynchronize", "cuda_runtime", 150.0, 280.0),
        _x("cudaLaunchKernel", "cuda_runtime", 600.0, 5.0, corr=4),
        _x("C", "kernel", 610.0, 50.0, corr=4),
        # D launched at 606, before C ends, but starts 40 us after C (not host-starved)
        _x("cudaMemsetAsync", "cuda_runtime", 606.0, 2.0, corr=5),
        _x("Memset (Device)", "gpu_memset", 700.0, 10.0, corr=5),
        # E: no launch record in the trace (e.g. a driver call not recorded), inside the range
        _x("E", "kernel", 760.0, 10.0, corr=9),
        _x("gpu annotation", "gpu_user_annotation", 100.0, 900.0),  # not device work
    ]
    tl = probe.timeline(dict(traceEvents=ev), "fwd", gap_us=20.0)
    names = [r["name"] for r in tl["rows"]]
    assert names == ["A", "B", "C", "Memset (Device)", "E"]
    assert [r["gap_us"] for r in tl["rows"]] == [0.0, 0.0, 190.0, 40.0, 50.0]
    assert [r["queue_us"] for r in tl["rows"]] == [5.0, 186.0, 5.0, 92.0, None]
    assert tl["busy_us"] == 370.0 and tl["span_us"] == 650.0 and tl["idle_us"] == 280.0
    assert tl["idle_host_starved_us"] == 190.0 and tl["idle_other_us"] == 90.0
    assert tl["without_launch_record"] == 1
    assert tl["first_kernel_after_us"] == 20.0
    assert tl["syncing_calls"] == {"cudaStreamSynchronize": 1}
    assert tl["runtime_calls"]["cudaLaunchKernel"] == 2
    gap = tl["gaps"][0]
    assert gap["before"] == "C" and gap["host_starved"] and gap["gap_us"] == 190.0
    during = dict(gap["host_during"])
    assert during["aten::item (tid 1)"] == 175.0  # 420..595 of the gap 420..610
    assert during["cudaLaunchKernel (tid 1)"] == 5.0  # 600..605: the launch of C
    assert during["cudaStreamSynchronize (tid 1)"] == 10.0  # 420..430
    assert not tl["gaps"][1]["host_starved"]


def test_timeline_without_the_range(probe):
    assert "error" in probe.timeline(dict(traceEvents=[]), "fwd")
