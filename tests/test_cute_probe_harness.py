"""The CuTe probes' CPU harnesses (benchmarks/cute/): interleaved timing and the dz checks.

The kernels themselves need an H100 (benchmarks/gpu/cute_dlogits.sh, cute_pingpong.sh); here
the harnesses that judge them run on stand-ins: the interleaved timing must give per-round
ratios (a drifting clock cannot bias them), the d(logits) correctness harness must pass a
float64 stand-in and catch a one-column error and a store past column C.
"""

from __future__ import annotations

import os
import sys
import time

CUTE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "cute")
sys.path.insert(0, CUTE)

import interleave  # noqa: E402
import probe_dlogits  # noqa: E402
import probe_pingpong  # noqa: E402


def test_interleaved_ratio_is_per_round():
    res = interleave.self_test()
    assert res["ok"], res
    assert abs(res["cand_ratio"] - 1.5) < 0.2


def test_interleaved_rotates_order_and_stops_at_deadline():
    order = []
    ms = {k: (lambda k=k: order.append(k) or 1.0) for k in ("a", "b", "c")}
    res = interleave.interleaved(ms, rounds=3, baseline="a")
    assert res["_rounds"] == 3
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert res["b"]["ratio"] == 1.0 and res["b"]["n"] == 3
    # a deadline already past: one round only
    res = interleave.interleaved(ms, rounds=5, deadline=time.monotonic() - 1.0)
    assert res["_rounds"] == 1 and res["a"]["n"] == 1


def test_pad_report_sees_both_sides():
    buf, dz = probe_dlogits.dz_buffer(3, 13, "cpu")
    assert buf.stride(0) % 64 == 0 and dz.data_ptr() % 16 == 0
    dz.zero_()
    assert probe_dlogits.pad_report(buf, 13) == {
        "pad_untouched": True, "pad_written_cols": 0, "left_written": False}
    buf[1, probe_dlogits.PAD_LEFT + 13 + 2] = 0.0  # 3 columns past C
    rep = probe_dlogits.pad_report(buf, 13)
    assert not rep["pad_untouched"] and rep["pad_written_cols"] == 3 and not rep["left_written"]
    buf[2, 0] = 0.0
    assert probe_dlogits.pad_report(buf, 13)["left_written"]


def test_dlogits_probe_harness_on_stand_in():
    res, rows, trows = probe_dlogits.smoke()
    assert res["ok"], res
    assert res["harness_catches_store_past_c"] and res["harness_catches_wrong"]
    assert all(r["rounds"] == 3 for r in trows)
    # the ragged cases come first and every variant has a row
    cases = probe_dlogits.default_cases()
    assert cases[0][2] % 8 and all(c[2] % 8 == 0 for c in cases[-5:])


def test_pingpong_probe_harness_on_stand_in():
    out, good, _trows = probe_pingpong.smoke()
    assert out["ok"], out
    assert out["harness_ok"] and out["harness_catches_a_wrong_column"] and out["merge_err_float64"] < 1e-9
    assert good and all(r["ok"] for r in good)
