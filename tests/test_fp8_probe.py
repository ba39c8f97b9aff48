"""The FP8 probe's emulation (``benchmarks/probe_fp8.py``): block quantisation round trips
within the format's half-ulp, its scales have the block grid's shape and the layouts
torch._scaled_mm takes, the emulated head without quantisation is the float64 head, the
rowwise emulation equals torch._scaled_mm on the CPU, and a CPU run writes its JSON."""

import importlib.util
import json
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks")


@pytest.fixture(scope="module")
def probe():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location("probe_fp8", os.path.join(BENCH, "probe_fp8.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BLOCKS = [(1, 128), (128, 128), (128, 1), (1, -1), (-1, 1)]


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("pow2", [False, True])
def test_round_trip_within_half_ulp(probe, fmt, block, pow2):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(300, 517, generator=g) * torch.logspace(-3, 3, 517)  # wide range per row
    t[7, :] = 0                                                        # an all-zero row
    t0 = t.clone()
    q, scale = probe.quantise(t, block, fmt, pow2)
    assert torch.equal(t, t0)                                          # its input unchanged
    assert q.dtype == fmt and q.shape == t.shape
    back = probe.dequantise(q, scale, block)
    fi = torch.finfo(fmt)
    br, bc = probe._block(t.shape, block)
    s = scale.repeat_interleave(br, 0)[:300].repeat_interleave(bc, 1)[:, :517]
    # half an ulp relative (normal range), half the subnormal spacing absolute (times the scale)
    bound = fi.eps / 2 * t.abs() + fi.smallest_normal * fi.eps / 2 * s
    assert ((back - t).abs() <= bound * (1 + 1e-6)).all()
    assert (back[7] == 0).all()
    amax = F.pad(t.abs(), (0, -517 % bc, 0, -300 % br)).view(-(-300 // br), br, -(-517 // bc), bc).amax(dim=(1, 3))
    if pow2:
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
        nz = amax > 0                                                  # all-zero blocks: scale 1
        assert (scale[nz] * fi.max >= amax[nz]).all() and (scale[nz] * fi.max < 2 * amax[nz]).all()
        assert (scale[~nz] == 1).all()
    else:  # each block's largest element maps to the format's max and comes back
        qmax = F.pad(q.float().abs(), (0, -517 % bc, 0, -300 % br)).view(amax.shape[0], br, amax.shape[1], bc)
        assert (qmax.amax(dim=(1, 3))[amax > 0] == fi.max).all()
        bmax = F.pad(back.abs(), (0, -517 % bc, 0, -300 % br)).view(amax.shape[0], br, amax.shape[1], bc)
        torch.testing.assert_close(bmax.amax(dim=(1, 3)), amax, rtol=1e-6, atol=0)


@pytest.mark.parametrize("block, shape", [((1, 128), (300, 5)), ((128, 128), (3, 5)), ((128, 1), (3, 517)),
                                          ((1, -1), (300, 1)), ((-1, 1), (1, 517))])
def test_scale_grid(probe, block, shape):
    _, scale = probe.quantise(torch.randn(300, 517), block)
    assert scale.shape == shape and scale.dtype == torch.float32


def test_head_without_quantisation_is_the_float64_head(probe):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 70, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(101, 70, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 101, (37,), generator=g)
    per_token = F.cross_entropy(x @ w.T, t, reduction="none")
    per_token.mean().backward()
    loss, tok, dx, dw = probe.head(x.detach(), w.detach(), t)
    torch.testing.assert_close(tok, per_token.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss, per_token.mean().detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, x.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dw, w.grad, rtol=1e-12, atol=1e-14)


def test_fp8_errors_have_e4m3_size_and_backward_only_keeps_the_loss(probe):
    x, w, t = probe.make_data("random", 64, 256, 515, 0)
    ref = probe.head(x, w, t)
    full = probe.errors(probe.fp8_head(x, w, t), ref)
    bwd = probe.errors(probe.fp8_head(x, w, t, forward=False), ref)
    bf16 = probe.errors(probe.torch_bf16_head(x, w, t), ref)
    # logits N(0, 1): e4m3's ~3% relative error per operand, not bf16's ~0.2%
    assert 5e-3 < full["token_rms"] < 0.1 and 5e-3 < full["dx"]["rms"] < 0.1 and 5e-3 < full["dw"]["rms"] < 0.1
    assert full["token_rms"] > 5 * bf16["token_rms"]
    assert bwd["token_rms"] < 1e-6 and 5e-3 < bwd["dw"]["rms"] < 0.1


def test_make_data_kinds(probe):
    for kind, lo, hi in (("random", 5.5, 7.5), ("peaked", 0.1, 4.0), ("aligned", 0.5, 2.0)):
        x, w, t = probe.make_data(kind, 256, 256, 1031, 3)
        assert x.dtype == w.dtype == torch.bfloat16 and t.shape == (256,)
        assert lo < probe.head(x, w, t)[0].item() < hi, kind      # log(1031) = 6.9
    with pytest.raises(ValueError, match="random, peaked or aligned"):
        probe.make_data("flat", 4, 8, 16, 0)


def test_rowwise_emulation_is_torch_scaled_mm(probe):
    """torch._scaled_mm's rowwise recipe on the CPU gives the emulation's fp32 GEMM."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(64, 256, generator=g).bfloat16()
    w = (torch.randn(96, 256, generator=g) / 16).bfloat16()
    qa, sa, qb, sb = probe._scaled_operands(a, w.T, "row")
    try:
        got = torch._scaled_mm(qa, qb, sa, sb, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        pytest.skip(f"this torch's CPU _scaled_mm takes no rowwise scales: {exc}"[:200])
    emu = probe.fake_quant(a, (1, -1)) @ probe.fake_quant(w, (1, -1)).T
    torch.testing.assert_close(got, emu, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)])
def test_block_scale_layouts_are_the_ones_scaled_mm_takes(probe, b_block):
    """The strides torch's ScaledBlas.cpp checks (is_blockwise_1x128_scaling /
    is_blockwise_128x128_scaling; a row-major, b column-major) and the meta kernel's shapes."""
    m, k, n = 256, 384, 640
    a = torch.randn(m, k).bfloat16()
    b = torch.randn(n, k).bfloat16().T
    qa, sa, qb, sb = probe._scaled_operands(a, b, "block", b_block)
    kb = math.ceil(k / 128)
    assert qa.stride() == (k, 1) and qb.stride() == (1, k)
    assert sa.shape == (m, kb) and sa.stride() == (1, m)
    sbt = sb.T
    if b_block == (128, 128):
        assert sbt.shape == (math.ceil(n / 128), kb) and sbt.stride() == (kb, 1)
    else:
        assert sbt.shape == (n, kb) and sbt.stride() == (1, n)
    out = torch._scaled_mm(qa.to("meta"), qb.to("meta"), sa.to("meta"), sb.to("meta"), out_dtype=torch.bfloat16)
    assert out.shape == (m, n)


def test_cpu_run_writes_the_verdict(probe, tmp_path):
    probe.main(["--cpu", "--out", str(tmp_path), "--seeds", "1", "--cpu-shapes", "32,256,131"])
    out = json.loads((tmp_path / "fp8-probe.json").read_text())
    assert [c["kind"] for c in out["accuracy"]] == ["random", "peaked", "aligned"]
    case = out["accuracy"][0]
    assert set(case["errors"]) == {"torch-bf16", "logitless-bf16", *probe.VARIANTS}
    assert set(case["verdict"]) == set(probe.VARIANTS)
    assert out["ceiling"] == []


def test_ceiling_row_on_cpu(probe, monkeypatch):
    """The GPU ceiling's code path on the CPU (a wall-clock timer for CUDA events): the rowwise
    _scaled_mm runs, a recipe the device does not take is recorded with its error, and the
    prediction uses only the recipes that ran."""
    import time

    def wall(fn, reps, warmup=0):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    monkeypatch.setattr(probe, "_cuda_time", wall)
    row = probe.ceiling_row("tiny", 256, 200, 384, "cpu", 1, chunk=128)
    assert [g["gemm"] for g in row["gemms"]] == ["logits", "dx", "dw"]
    assert [(g["m"], g["k"], g["n"]) for g in row["gemms"]] == [(256, 200, 384), (256, 384, 200), (384, 256, 200)]
    if row["gemms"][0]["fp8_row_ms"] is None:
        pytest.skip(f"this torch's CPU _scaled_mm takes no rowwise scales: {row['gemms'][0]['fp8_row_error']}"[:200])
    for g in row["gemms"]:
        assert g["bf16_ms"] > 0 and g["fp8_row_ms"] > 0 and g["fp8_row_speedup"] > 0
        # a recipe the device does not take (blockwise on a CPU): no time, each layout tried recorded
        if g["fp8_block_ms"] is None:
            assert g["fp8_block_timed"] is None and len(g["fp8_block_errors"]) == (4 if g["gemm"] == "dw" else 2)
            assert all("Invalid scaling" in e or "Error" in e for e in g["fp8_block_errors"])
        else:
            assert g["fp8_block_timed"]["b_block"] in ([128, 128], [1, 128])
    expect = {"row"} | ({"block"} if all(g["fp8_block_ms"] for g in row["gemms"]) else set())
    assert set(row["predicted"]) == expect
    assert set(row["predicted"]["row"]) == {"three_gemms", "four_gemms", "backward_only"}
    assert row["bf16_op_fb_ms"] > 0 and len(row["quant"]["passes"]) == 3


def test_gpu_branch_on_cpu(probe, monkeypatch, tmp_path):
    """main's GPU run through the CPU: tiny shapes, a wall-clock timer."""
    import argparse
    import time

    def wall(fn, reps, warmup=0):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    monkeypatch.setattr(probe, "_cuda_time", wall)
    monkeypatch.setattr(probe, "ANCHORS", {"a": (128, 256, 384), "b": (256, 128, 256)})
    monkeypatch.setattr(probe, "EMULATION_SHAPE", (64, 256, 128))
    small = [((32, 256, 131), True, None), ((64, 128, 257), False, ["torch-bf16", "fp8-row-e4m3"])]
    monkeypatch.setattr(probe, "GPU_ACCURACY", small)
    monkeypatch.setattr(probe.torch.cuda, "empty_cache", lambda: None)
    args = argparse.Namespace(out=str(tmp_path), seeds=2, reps=1, only=None, cpu_shapes="")
    probe._run(args, True, "cpu")
    out = json.loads((tmp_path / "fp8-probe.json").read_text())
    cases = [(c["shape"], c["seeds"]) for c in out["accuracy"]]
    assert cases == [([32, 256, 131], [0, 1])] * 3 + [([64, 128, 257], [0])] * 3
    assert set(out["accuracy"][-1]["errors"]) == {"torch-bf16", "fp8-row-e4m3"}
    assert [r["shape"] for r in out["ceiling"]] == ["a", "b"]
    assert set(out["emulation_check"]) == {"row", "block"}
    if "error" not in out["emulation_check"]["row"]:   # CPU rowwise _scaled_mm = the emulation
        assert out["emulation_check"]["row"]["max_abs_diff"] < 1e-4 * out["emulation_check"]["row"]["ref_max"]
