"""Host work per call (issue 23 item 3): memoised planning that still follows overrides and
tuned configs, and a bound on the device ops one forward+backward issues."""

from __future__ import annotations

import json

import pytest
import torch

from logitless.planning import memo as _memo
from logitless.planning import plans as _plans
from logitless.planning import tuned as _tuned
from logitless.planning.overrides import override

CPU = torch.device("cpu")


def test_plans_are_memoised_and_follow_overrides():
    args = (300, 1001, 72, 2, 1 << 20, CPU)
    p1 = _plans.triton_plan(*args, keep_allowed=True)
    assert _plans.triton_plan(*args, keep_allowed=True) is p1  # served from the memo
    assert p1 == _plans.triton_plan.uncached(*args, keep_allowed=True)
    assert _plans.triton_plan(*args, keep_allowed=False) == _plans.triton_plan.uncached(*args, keep_allowed=False)
    with override(tiles=(32, 64, 16, 4, 1)):
        p2 = _plans.triton_plan(*args, keep_allowed=True)
        assert (p2.block_n, p2.block_v) == (32, 64)
    with override(kernel_options={"group": False}):  # unhashable override: planned afresh, still applied
        p3 = _plans.triton_plan(*args, keep_allowed=True)
        assert p3.group_n == 0 and p3 == _plans.triton_plan.uncached(*args, keep_allowed=True)
        assert _plans.triton_plan(*args, keep_allowed=True) is not p3
    with override(plan=lambda p: p.__class__(**{**p.__dict__, "keep_cols": 0})):
        assert _plans.triton_plan(*args, keep_allowed=True).keep_cols == 0
    with override(strategy=("grad_in_forward", 7)):
        assert _plans.lce_strategy(*args).token_chunk == 7
    assert _plans.lce_strategy(*args).strategy != "grad_in_forward"
    assert _plans.triton_plan(*args, keep_allowed=True) is p1  # back outside: the same plan again


def test_memo_sees_a_new_tuned_config(tmp_path, monkeypatch):
    """A GPU plan reads tuned tiles; after the tuner writes new ones (``tuned.clear``), the
    next plan has them. Device queries are faked: this runs on the CPU."""
    path = tmp_path / "cache.json"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(_tuned, "cache_path", lambda device: path)
    gpu = torch.device("cuda", 0)
    args = (512, 32000, 1024, 2, 1 << 30, gpu)

    def write(tiles):
        path.write_text(json.dumps({"configs": {"16-bit/n1k-h2k": {"tiles": list(tiles)}}}))
        _tuned.clear()

    try:
        with override(num_sms=132, model_plans=False):
            write((64, 128, 32, 4, 2))
            p1 = _plans.triton_plan(*args, keep_allowed=True)
            assert (p1.block_n, p1.block_v, p1.block_h) == (64, 128, 32)
            assert _plans.triton_plan(*args, keep_allowed=True) is p1
            write((128, 64, 64, 8, 3))
            p2 = _plans.triton_plan(*args, keep_allowed=True)
            assert (p2.block_n, p2.block_v, p2.block_h) == (128, 64, 64)
            monkeypatch.setenv("LOGITLESS_TUNED", "0")  # the environment is part of the key
            p3 = _plans.triton_plan(*args, keep_allowed=True)
            assert (p3.block_n, p3.block_v) == _plans.CUDA_TILES[2][:2]
    finally:
        _tuned.clear()


def test_memo_is_bounded_and_cleared():
    _memo.clear()
    calls = []

    @_memo.memoised
    def f(a, device=None):
        calls.append(a)
        return (a,)

    assert f(1, device=CPU) is f(1, device=CPU) and calls == [1]
    assert f([1]) == ([1],) and f([1]) == ([1],) and calls == [1, [1], [1]]  # unhashable: not cached
    _memo.clear()
    f(1, device=CPU)
    assert calls == [1, [1], [1], 1]
    for i in range(_memo.MAX_ENTRIES + 5):
        f(i)
    assert all(len(m) <= _memo.MAX_ENTRIES for m in _memo._MEMOS)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
