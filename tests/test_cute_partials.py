"""The CuTe forward's partials mean what the library's epilogues expect (CPU: the torch
model ``cute_lib.reference`` of the kernel's output fed to ``ce_epilogue.forward_loss`` and
``log_probs_epilogue.forward_outputs`` on the Triton interpreter, vs the ops' float64
references). The kernel's own partials are compared to the same model on the GPU
(tests/test_cute_forward_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from logitless.cute_lib.reference import forward_partials, split_bounds
from logitless.ops.linear_cross_entropy.reference import linear_cross_entropy_reference
from logitless.ops.linear_log_probs.reference import linear_log_probs_reference
from logitless.options import CrossEntropyOptions, LogProbOptions
from logitless.triton_lib import ce_epilogue, log_probs_epilogue
from tests.conftest import DEVICE


def test_split_bounds_cover_the_vocabulary_in_tiles():
    for v, splits in ((1, 1), (257, 3), (32003, 33), (1000, 8), (512, 2)):
        b = split_bounds(v, splits)
        assert b[0][0] == 0 and b[-1][1] == v and len(b) == splits
        assert all((lo % 256 == 0 or lo == v) and (hi % 256 == 0 or hi == v) for lo, hi in b)
        assert all(b[i][1] == b[i + 1][0] for i in range(splits - 1))


def inputs(n, h, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * (2.0 / h ** 0.5)
    t = torch.randint(0, v, (n,), generator=g)
    t[::4] = -100
    return x.to(DEVICE), w.to(DEVICE), t.to(DEVICE)


@pytest.mark.parametrize("n, h, v, splits", [(5, 8, 257, 2), (9, 16, 600, 3), (3, 8, 1000, 8)])
@pytest.mark.parametrize("kw", [dict(reduction="none"), dict(label_smoothing=0.1, reduction="sum"),
                                dict(z_loss=1e-3, label_smoothing=0.2, reduction="mean")])
def test_cross_entropy_epilogue_on_modelled_partials(n, h, v, splits, kw):
    x, w, t = inputs(n, h, v)
    opts = CrossEntropyOptions.checked(**kw)
    m, e, tt, q, _ = forward_partials(x, w, t, splits, smooth=opts.needs_smooth_sum, dtype=torch.float32)
    _, loss, _ = ce_epilogue.forward_loss(m, e, tt, q, t, None, opts, v)
    ref = linear_cross_entropy_reference(x, w, t, dtype=torch.float64, **kw)[0]
    assert (loss.double() - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("n, h, v, splits", [(5, 8, 257, 2), (9, 16, 600, 3)])
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.7])
def test_log_probs_epilogue_on_modelled_partials(n, h, v, splits, temperature):
    x, w, t = inputs(n, h, v)
    opts = LogProbOptions.checked(temperature=temperature, entropy=True)
    m, e, tt, _, u = forward_partials(x, w, t, splits, scale=1.0 / temperature, entropy=True, dtype=torch.float32)
    logp, ent, _ = log_probs_epilogue.forward_outputs(m, e, u, tt, t, opts, v)
    ref_lp, ref_ent = linear_log_probs_reference(x, w, t, temperature=temperature)
    assert (logp.double() - ref_lp).abs().max().item() < 1e-4
    assert (ent.double() - ref_ent).abs().max().item() < 1e-4
