"""The CuTe DSL forward's selection logic (``planning.cute``), on the CPU: no GPU, no DSL.

Every fact is an argument of the pure functions (availability too: ``available``, which
``forward_plan`` takes from ``DeviceFacts.cute_available`` or the DSL's own check); the
GPU tests (tests/test_cute_forward_gpu.py) check the kernel itself."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import logitless
from logitless.planning import cute, device
from logitless.planning.overrides import current, override
from tests.planning_seams import cute_launches, on_device

H100 = dict(capability=(9, 0), available=True, num_sms=132, dtype="bfloat16", layout_ok=True)


def facts(**kw):
    return {**dict(H100, n=4096, v=128256, h=4096), **kw}


def test_supported_call_gets_a_plan():
    plan = cute.choose(**facts())
    assert plan == cute.CutePlan(splits=8, stages=4, specialised=True)


@pytest.mark.parametrize("change", [
    dict(capability=(8, 0)), dict(capability=(10, 0)), dict(capability=None), dict(available=False),
    dict(dtype="float32"), dict(n=0), dict(v=0), dict(h=100), dict(h=4), dict(layout_ok=False),
    dict(bias=True), dict(softcap=True), dict(argmax=True), dict(weighted_smooth=True),
    dict(keep_cols=256, keep_block=96), dict(keep_cols=256, keep_block=512), dict(keep_cols=256),
])
def test_each_unsupported_fact_falls_back(change):
    f = facts(**change)
    kw = {k: f[k] for k in ("capability", "available", "dtype", "n", "v", "h", "layout_ok")}
    kw.update({k: v for k, v in change.items() if k not in kw})
    assert isinstance(cute.unsupported(**kw), str)
    assert cute.choose(**f) is None


def test_kept_columns_in_blocks_dividing_the_tile_are_supported():
    for block in (64, 128, 256):
        assert cute.choose(**facts(keep_cols=7936, keep_block=block)) is not None


def test_mostly_kept_columns_keep_triton():
    # logits budget at 4096 tokens: Triton (measured 3-6% faster f+b); at 512 and 1024 tokens
    # too (f+b 7-15% faster with Triton, DSL 4.8.1: benchmarks/results/small-batch-H100-2026-11-26.json)
    for n in (512, 1024, 4096):
        assert cute.choose(**facts(n=n, keep_cols=128256, keep_block=256)) is None
    assert cute.choose(**facts(n=512, keep_cols=128256 // 4, keep_block=256)) is not None  # a quarter kept
    assert cute.choose(**facts(keep_cols=7936, keep_block=256)) is not None  # default budget: 6% kept
    with override(cute=True):
        assert cute.choose(**facts(keep_cols=128256, keep_block=256)) is not None


def test_fp16_and_ragged_shapes_are_supported():
    for kw in (dict(dtype="float16"), dict(n=1, v=32003, h=72), dict(n=129, v=1, h=8)):
        f = facts(**kw)
        kw_u = {k: f[k] for k in ("capability", "available", "dtype", "n", "v", "h", "layout_ok")}
        assert cute.unsupported(**kw_u) is None, kw
        with override(cute=True):  # (the tiny ones are Triton's by choice: triton_faster)
            assert cute.choose(**f) is not None, kw


# The H100 tables behind ``plan_for`` and ``triton_faster`` (session 6, interleaved forward, x
# cuBLAS: CuTe vs Triton; the large-N rows with the grouped order, probe_raster.py).
@pytest.mark.parametrize("n, h, v, cute_chosen, grouped", [
    (512, 4096, 128256, True, False),     # 1.03 vs 1.63
    (2048, 2048, 128256, True, False),    # 0.93 vs 1.25
    (2048, 4096, 128256, True, False),    # 1.00 vs 1.11
    (4096, 4096, 32000, True, False),     # 0.99 vs 1.21
    (4096, 4096, 128256, True, False),    # 1.00-1.03 vs 1.07
    (4096, 5120, 131072, True, False),    # 1.00 vs 1.05
    (8192, 1152, 262144, True, False),    # 0.99 vs 1.09
    (8192, 896, 151936, True, False),     # 1.06 vs 1.19
    (8192, 768, 50257, True, False),      # 0.14 vs 0.22 (cuBLAS slow at odd V)
    (2048, 2048, 50304, True, False),     # 1.13 vs 1.48
    # x in flight over twice L2: Triton (DSL 4.8.1, 2026-11-24, four runs: CuTe grouped vs Triton)
    (16384, 4096, 128256, False, True),   # 1.027-1.125 vs 0.995-1.071 (4.2.1, session 6: 1.01 vs 1.03)
    (32768, 2048, 128256, True, True),    # grouped 0.99 (plain 1.08-1.12) vs 1.11
    (8192, 4096, 32768, True, True),      # grouped 1.01 (plain 1.05-1.10) vs 1.09
    (8192, 7168, 128256, False, True),    # 1.075-1.115 vs 0.999-1.077 (4.2.1, session 6: 1.04 vs 1.04)
    (1024, 768, 50257, False, False),     # 0.63 vs 0.44: 72 k slabs per CTA
])
def test_plan_matches_the_measured_table(n, h, v, cute_chosen, grouped):
    l2 = 50 * 2**20
    why = cute.triton_faster(n=n, v=v, h=h, num_sms=132, l2_bytes=l2)
    assert (why is None) == cute_chosen, why
    plan = cute.choose(**facts(n=n, v=v, h=h), l2_bytes=l2)
    assert (plan is not None) == cute_chosen
    with override(cute=True):  # forced: the Triton preference does not apply, the order does
        plan = cute.choose(**facts(n=n, v=v, h=h), l2_bytes=l2)
    assert (plan.group > 0) == grouped
    if grouped:
        assert plan.group == cute.GROUP and plan.splits >= cute.GROUP_SPLITS
    else:
        assert plan.splits == cute.splits_for(n, v, 132)


def test_entropy_keeps_triton_where_the_order_is_grouped():
    l2 = 50 * 2**20
    for n, h, v in ((8192, 7168, 128256), (16384, 4096, 128256)):
        assert cute.triton_faster(n=n, v=v, h=h, num_sms=132, l2_bytes=l2, entropy=True) is not None
        assert cute.choose(**facts(n=n, v=v, h=h), l2_bytes=l2, entropy=True) is None
    assert cute.choose(**facts(), l2_bytes=l2, entropy=True) is not None  # 4096 tokens: CuTe


def test_grouped_order_follows_l2():
    # 8192 x 7168: 117 MiB of x in flight; a (hypothetical) 128 MiB L2 would keep the plain grid
    assert cute.plan_for(8192, 128256, 7168, 132, 50 * 2**20).group == cute.GROUP
    assert cute.plan_for(8192, 128256, 7168, 132, 128 * 2**20) == cute.CutePlan(splits=4)
    # never more splits than vocabulary tiles
    assert cute.plan_for(16384, 1000, 4096, 132, 50 * 2**20).splits == 4


@pytest.mark.parametrize("n, v, want", [
    (4096, 128256, 8),    # measured best on the H100: 256 CTAs
    (8192, 128256, 4),    # measured best: 256 CTAs (8 splits, 512 CTAs, was 1.41x cuBLAS)
    (16384, 128256, 2),
    (2048, 128256, 16),
    (1000, 32003, 33),
    (1, 300, 2),          # never more splits than 256-column tiles
    (100000, 128256, 1),  # many row blocks: one split
])
def test_splits_fill_about_two_waves(n, v, want):
    assert cute.splits_for(n, v, 132) == want


def test_switches():
    assert cute.choose(**facts(), env_is_off=True) is None
    with override(cute=True):
        assert cute.choose(**facts(), env_is_off=True) is not None  # an explicit override wins
    with override(cute=False):
        assert cute.choose(**facts()) is None
    assert cute.choose(**facts(available=False)) is None
    # an override aimed at the Triton kernel keeps it, unless CuTe is asked for
    with override(tiles=(16, 16, 16, 4, 2)):
        assert cute.choose(**facts()) is None
        with override(cute=True):
            assert cute.choose(**facts()) is not None
    assert current().cute is None


def test_env_var(monkeypatch):
    monkeypatch.setenv(cute.ENV, "0")
    assert cute.env_off()
    monkeypatch.setenv(cute.ENV, "1")
    assert not cute.env_off()
    monkeypatch.delenv(cute.ENV)
    assert not cute.env_off()


def test_cpu_tensors_never_take_the_cute_path():
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    w = torch.randn(40, 16, dtype=torch.bfloat16)
    t = torch.randint(0, 40, (3,))
    backend = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "auto"  # (a GPU machine: torch on CPU)
    described = dataclasses.replace(device.facts(x.device), cute_available=True)
    with override(cute=True), on_device(described), cute_launches() as seen:
        assert cute.forward_plan(x.device, x.dtype, 3, 40, 16, True) is None
        loss = logitless.linear_cross_entropy(x, w, t, backend=backend)
        ref = logitless.linear_cross_entropy(x.double(), w.double(), t, backend="torch")
    assert seen == []
    assert abs(loss.item() - ref.item()) < 0.05


def test_import_logitless_does_not_import_cutlass():
    code = "import sys, logitless; import logitless.ops.linear_cross_entropy.triton_backend; " \
           "print(any(m == 'cutlass' or m.startswith('cutlass.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_override_still_rejected():
    with pytest.raises(TypeError):
        with override(cute_typo=True):
            pass
