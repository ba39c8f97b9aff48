"""Tuned tiles as data (``_tuned``, ``logitless.tune``): lookup order and determinism.

What "deterministic" means here: the tiles come from the device class, dtype and shape
only (never from a timing at run time); the same tiles give bitwise identical results;
two different tiles give the same loss and gradients up to fp32 summation order.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import logitless
from logitless import tune as tuner
from logitless.planning import plans as _plans
from logitless.planning import tiles as _tiles
from logitless.planning import tuned as _tuned
from logitless.planning.overrides import override
from tests.conftest import DEVICE
from tests.planning_seams import H100
from tests.test_linear_cross_entropy import OPTIONS, make_inputs


def test_shipped_files_are_valid():
    for cls in ("h100", "h200"):
        data = json.loads((_tuned.SHIPPED_DIR / f"{cls}.json").read_text())
        assert data["device_class"].lower() == cls
        assert _tuned._lookup(data["configs"], "16-bit/n8k-hbig") == tuple(_tiles.CUDA_TILES[2])


def test_keys_and_lookup_order(tmp_path, monkeypatch):
    assert _tuned.config_key(2, 4096, 4096, 128256) == "16-bit/n8k-hbig"
    assert _tuned.config_key(4, 512, 768, 50257) == "32-bit/n1k-h2k"
    table = {"16-bit/n8k-hbig": {"tiles": [64, 128, 32, 4, 2]}, "16-bit/*": {"tiles": [128, 256, 64, 8, 3]},
             "32-bit/n1k-h2k": {"tiles": [1, 2, 3]}}  # malformed entries are ignored
    assert _tuned._lookup(table, "16-bit/n8k-hbig") == (64, 128, 32, 4, 2)
    assert _tuned._lookup(table, "16-bit/nbig-h2k") == (128, 256, 64, 8, 3)
    assert _tuned._lookup(table, "32-bit/n1k-h2k") is None
    # off a GPU nothing is read; a forced context wins everywhere
    assert _tuned.tiles_for(torch.device("cpu"), 2, 8, 8, 8) is None
    with override(tiles=(32, 64, 16, 4, 1)):
        assert _plans.triton_plan(29, 257, 40, 2, 1 << 20, torch.device("cpu")).block_v == 64
    assert _plans.triton_plan(29, 257, 40, 2, 1 << 20, torch.device("cpu")).block_v == _tiles.INTERPRETER_TILES[1]
    monkeypatch.setenv("LOGITLESS_CACHE_DIR", str(tmp_path))
    assert str(_tuned.cache_path(torch.device("cpu"))).startswith(str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_two_tile_configs_agree_and_each_is_repeatable(dtype):
    x, w, t, b, kw = make_inputs((37,), 40, 257, dtype, OPTIONS["all"], seed=2)
    outs = {}
    for tiles in ((16, 32, 16, 4, 1), (32, 64, 32, 4, 1), (16, 32, 16, 4, 1)):
        with override(tiles=tiles):
            loss = logitless.linear_cross_entropy(x, w, t, b, backend="triton", memory_budget=30_000, **kw)
        grads = torch.autograd.grad(loss, (x, w, b))
        if tiles in outs:  # same tiles again: bitwise identical
            for a, c in zip(outs[tiles], (loss,) + grads):
                assert torch.equal(a, c)
        outs[tiles] = (loss,) + grads
    a, c = outs[(16, 32, 16, 4, 1)], outs[(32, 64, 32, 4, 1)]
    tol = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 2e-3)}[dtype]
    for u, v in zip(a, c):
        torch.testing.assert_close(u.float(), v.float(), rtol=tol[0], atol=tol[1])


def test_tuner_writes_and_plans_read_the_cache(tmp_path, monkeypatch):
    """The tuner (timings replaced by a fixed table, on the CPU) writes the best tiles
    per class; plans made on a GPU of that name then use them."""
    monkeypatch.setenv("LOGITLESS_CACHE_DIR", str(tmp_path))
    fake = {(16, 32, 16, 4, 1): 2.0, (32, 64, 32, 4, 1): 1.0}

    def measure(shape, tiles, dtype, device, reps):
        if tiles == (8, 8, 8, 1, 1):
            raise RuntimeError("out of resources: shared memory")
        return fake[tiles]

    monkeypatch.setattr(tuner, "measure", measure)
    res = tuner.tune([(64, 40, 257), (64, 40, 300)], candidates=list(fake) + [(8, 8, 8, 1, 1)],
                     device="cpu", verbose=False)
    assert list(res) == ["16-bit/n1k-h2k"]  # one shape per class
    assert res["16-bit/n1k-h2k"]["tiles"] == [32, 64, 32, 4, 1]
    path = _tuned.cache_path(torch.device("cpu"))
    data = json.loads(path.read_text())
    assert data["configs"]["16-bit/n1k-h2k"]["tiles"] == [32, 64, 32, 4, 1]
    # A GPU whose name maps to that cache file reads it (the GPU described: ``DeviceFacts``).
    gpu = dataclasses.replace(H100, name="cpu")
    assert _tuned.cache_path(gpu) == path
    monkeypatch.setattr(_tuned, "cache_path", lambda device: path)
    _tuned.clear()
    try:
        assert _tuned.tiles_for(gpu, 2, 64, 40, 257) == (32, 64, 32, 4, 1)
        assert _tuned.tiles_for(gpu, 2, 64, 4096, 257) is None  # other class, no shipped file
        assert _tuned.tiles_for(torch.device("cpu"), 2, 64, 40, 257) is None  # never off GPUs
        monkeypatch.setenv("LOGITLESS_TUNED", "0")
        assert _tuned.tiles_for(gpu, 2, 64, 40, 257) is None
    finally:
        _tuned.clear()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="times real kernels: needs a CUDA GPU")
def test_tuner_measures_on_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("LOGITLESS_CACHE_DIR", str(tmp_path))
    res = tuner.tune([(1024, 1024, 32000)], candidates=[(128, 256, 64, 8, 3), (128, 128, 64, 8, 3)],
                     reps=2, verbose=False)
    (key, entry), = res.items()
    assert entry["ms"] > 0 and len(entry["all"]) == 2
    assert _tuned.tiles_for(DEVICE, 2, 1024, 1024, 32000) == tuple(entry["tiles"])
    _tuned.clear()
