"""The fast launch path (``triton_lib.fast_launch``): its version gate and fallback (one
warning, then ``kernel[grid]``), and the launch key against the installed Triton's own
binder (on the CPU: sm_90 specialisation). Runs in both CI legs (the oldest and newest
supported Triton: scripts/test.sh, scripts/test_newest.sh); the compiled launches
themselves on a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch
import triton

from logitless.triton_lib import fast_launch

from .helpers import fake_triton_launches


def test_installed_triton_is_supported():
    """Both CI legs' Triton (3.6 and 3.9) are inside SUPPORTED, so the fast path is the one
    tested there; a release outside it is refused."""
    assert fast_launch.supported(triton.__version__), triton.__version__
    for v in ("3.6.0", "3.6.1", "3.7.0", "3.9.0", "3.9.0+git1234"):
        assert fast_launch.supported(v), v
    for v in ("3.5.1", "3.10.0", "4.0.0", "2.3.1", "nightly"):
        assert not fast_launch.supported(v), v


def test_gate_warns_once_and_falls_back():
    """An unsupported release: the gate is off with one FastLaunchWarning naming the range;
    LOGITLESS_FAST_LAUNCH=0: off without a warning; a supported one: on, silently."""
    with pytest.warns(fast_launch.FastLaunchWarning, match="3.6 to 3.9") as record:
        assert fast_launch.gate("3.12.0") is False
    assert len(record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fast_launch.gate("3.12.0", env="0") is False
        assert fast_launch.gate(triton.__version__) is True
    assert fast_launch.ENABLED is fast_launch.gate(triton.__version__, "1")


def test_disabled_gate_launches_through_kernel_grid(monkeypatch):
    """With the gate off every launch goes through ``kernel[grid]`` (a key already cached
    included) and descriptors through Triton's constructor."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from logitless.triton_lib import jsd_rows

    jit, launched, slow = fake_triton_launches(monkeypatch, jsd_rows.jsd_finish_kernel, stream=7)
    n = 33
    args = (torch.zeros(n, 8), torch.zeros(n, dtype=torch.long), torch.zeros(4, 2, n), torch.zeros(2, 2, n),
            torch.zeros(6, n), n, 8, 2, 8, 1, n, 1.0)
    kw = dict(MODE=0, HAS_HARD=False, HAS_CAP_S=False, BLOCK_N=64, num_warps=4)
    fast_launch.run_kernel(jit, (1,), *args, **kw)  # compiles (faked), caches
    fast_launch.run_kernel(jit, (1,), *args, **kw)
    assert len(slow) == 1 and len(launched) == 1
    monkeypatch.setattr(fast_launch, "ENABLED", False)
    before = dict(fast_launch.LAUNCHES)
    fast_launch.run_kernel(jit, (1,), *args, **kw)
    assert len(slow) == 2 and len(launched) == 1
    assert fast_launch.LAUNCHES["triton"] - before.get("triton", 0) == 1
    calls = []
    real_init = TensorDescriptor.__post_init__
    monkeypatch.setattr(TensorDescriptor, "__post_init__", lambda self: calls.append(1) or real_init(self))
    base = torch.zeros(16, 64, dtype=torch.bfloat16)
    for _ in range(2):
        fast_launch.descriptor(base, (16, 64), (64, 1), (16, 64))
    assert len(calls) == 2


def test_descriptor_fast_fill_sets_every_field(monkeypatch):
    """A descriptor of a checked layout is filled in directly: equal to the one Triton's
    constructor makes, every dataclass field set (a release's new fields at their defaults)."""
    import dataclasses

    from triton.tools.tensor_descriptor import TensorDescriptor

    monkeypatch.setattr(fast_launch, "ENABLED", True)
    base = torch.zeros(32, 64, dtype=torch.bfloat16)
    fast_launch.descriptor(base, (32, 64), (64, 1), (16, 32))
    fast = fast_launch.descriptor(base[16:], (16, 64), (64, 1), (16, 32))
    public = TensorDescriptor(base[16:], [16, 64], [64, 1], [16, 32])
    for f in dataclasses.fields(TensorDescriptor):
        assert f.name in vars(fast), f.name
        a, b = getattr(fast, f.name), getattr(public, f.name)
        assert (a.data_ptr(), a.shape) == (b.data_ptr(), b.shape) if f.name == "base" else a == b, f.name


def _random_launch_args(params, g, pool_t, pool_i, pool_c):
    """Positional values for the params before the first constexpr, keywords from there
    on (as the backends call the kernels); one call in four passes everything by
    position (constexprs too)."""
    positional = g.random() < 0.25
    args, kwargs = [], {}
    for p in params:
        if p.is_constexpr:
            value = pool_c[g.randrange(len(pool_c))]
        elif p.name.endswith("_ptr") or p.name.endswith("_desc"):
            value = pool_t[g.randrange(len(pool_t))]
        else:
            value = pool_i[g.randrange(len(pool_i))]
        if not positional and (kwargs or p.is_constexpr):
            kwargs[p.name] = value
        else:
            args.append(value)
    kwargs["num_warps"] = g.choice([4, 8])
    kwargs["num_stages"] = g.choice([2, 3])
    return tuple(args), kwargs


@pytest.mark.parametrize("kernel", ["forward_stats_kernel", "dlogits_kernel", "kept_dlogits_kernel"])
def test_launch_key_implies_tritons_specialisation(kernel):
    """``fast_launch.run_kernel`` reuses a compiled kernel for calls with equal ``launch_key``:
    sound only if equal keys imply equal Triton specialisation and options (then
    ``kernel[grid]`` would pick the same compiled kernel). Checked against Triton's own
    binder for sm_90 (it runs on the CPU) over random arguments: tensors of several dtypes
    and alignments, TMA descriptors, ints around 1 / 16 / 2^31, floats, bools, None. Also
    that the fast path hands the launcher the values ``JITFunction.run`` would."""
    import random

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from logitless.triton_lib import fast_launch
    from logitless.triton_lib import lce_kernels as K

    fn = getattr(K, kernel)
    jit = JITFunction(getattr(fn, "fn", fn))  # (under the interpreter: the kernel's Python function)
    binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
    flat = {dt: torch.zeros(4096, dtype=dt) for dt in (torch.bfloat16, torch.float32, torch.int64, torch.int32)}
    # Offsets 0, 8, 16 elements: aligned (equal keys, other pointers), 1 and 3: not;
    # strided and 2-D views, a tensor that requires grad: other properties, equal keys.
    pool_t = [flat[dt][off:off + 512] for dt in flat for off in (0, 1, 3, 8, 16)]
    pool_t += [flat[dt][::2] for dt in flat] + [flat[dt][16:528].view(8, 64) for dt in flat]
    pool_t += [torch.zeros(64, requires_grad=True)]
    pool_t += [fast_launch.descriptor(flat[torch.bfloat16][off:off + 1024].view(16, 64), (16, 64), (64, 1), bs)
               for bs in ((16, 64), (16, 32)) for off in (0, 64)] + [None]
    pool_i = [0, 1, 2, 15, 16, 17, 48, 2**31 - 1, 2**31, 2**40, -1, 1.0, 0.5, 2.0, True, False]
    pool_c = [True, False, 0, 1, 16, 64, "tf32", "tf32x3", 0.5, 2.0, None]
    same = {}  # our key -> the pool values that have it
    for value in pool_t + pool_i + pool_c:
        same.setdefault(fast_launch.launch_key(jit, 0, (value,), {}), []).append(value)
    g = random.Random(kernel)
    seen: dict = {}
    collisions = 0
    for _ in range(200):
        base_args, base_kwargs = _random_launch_args(jit.params, g, pool_t, pool_i, pool_c)
        for _ in range(6):  # variants: values swapped for others of an equal key
            def swap(a):
                return g.choice(same.get(fast_launch.launch_key(jit, 0, (a,), {}), [a]))

            args = [swap(a) for a in base_args]
            kwargs = {k: swap(a) for k, a in base_kwargs.items()}
            ours = fast_launch.launch_key(jit, 0, tuple(args), kwargs)
            bound, spec, options = binder(*args, **kwargs)
            tail = tuple((p.name, p.default) for p in list(jit.signature.parameters.values())[len(args):])
            assert fast_launch.bound_values(tuple(args), kwargs, tail) == tuple(bound.values())  # launcher args
            theirs = (str(spec), str(options))
            if ours in seen:
                collisions += 1
                assert seen[ours] == theirs, (args, kwargs)
            seen[ours] = theirs
    assert collisions > 50  # the check had equal keys to compare (small pools)


def test_run_kernel_fast_path_launches_what_jit_run_would(monkeypatch):
    """``run_kernel``'s two paths on the CPU, with Triton's ``JITFunction.run`` and the
    CUDA stream faked: the first call of a key goes through ``kernel[grid]`` and keeps
    its compiled kernel; a call with other tensors of the same layout calls that kernel's
    launcher with (grid, stream, function, metadata, hooks, every parameter in order);
    a new alignment, dtype or int goes through ``kernel[grid]`` again."""
    from triton import knobs

    from logitless.triton_lib import fast_launch
    from logitless.triton_lib import lce_kernels as K

    jit, launched, slow = fake_triton_launches(monkeypatch, K.kept_dlogits_kernel, stream=77)

    def args_of(offset=0, n=45, dtype=torch.bfloat16):
        dz = torch.zeros(4096, dtype=dtype)[offset:offset + n * 64].view(n, 64)
        f32 = torch.zeros(n + 16)[offset:offset + n]
        return (dz, torch.zeros(4, n), dz, f32, torch.zeros(n, dtype=torch.long), f32, torch.zeros(3, n), n, 101,
                0, 64, 64, 64, 1.5)

    kw = dict(HAS_SOFTCAP=False, HAS_CW=False, IN_PLACE=True, BLOCK_N=16, BLOCK_V=64, num_warps=4)
    fast_launch.run_kernel(jit, (3, 2), *args_of(), **kw)
    assert slow == [(3, 2)] and not launched
    args = args_of(offset=8)  # other pointers, the same alignment
    fast_launch.run_kernel(jit, (3, 2), *args[:-1], 2.5, **kw)  # another float
    assert len(slow) == 1 and len(launched) == 1
    g0, g1, g2, stream, function, packed, meta, enter, exit_, *full = launched[0]
    assert (g0, g1, g2, stream, function, packed) == (3, 2, 1, 77, "function", "packed")
    assert meta == ("meta", (3, 2), 77)
    assert enter is knobs.runtime.launch_enter_hook and exit_ is knobs.runtime.launch_exit_hook
    names = [p.name for p in jit.params]
    assert len(full) == len(names) and full[:len(args)] == [*args[:-1], 2.5]
    assert [full[names.index(k)] for k in kw if k != "num_warps"] == [v for k, v in kw.items() if k != "num_warps"]
    for other in (args_of(offset=1), args_of(dtype=torch.float32), args_of(n=46)):  # alignment, dtype, an int
        fast_launch.run_kernel(jit, (3, 2), *other, **kw)
    assert len(slow) == 4 and len(launched) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast launch path runs compiled kernels (CUDA)")
@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_log_probs"])
def test_fast_launch_is_taken_and_bitwise(op):
    """After a first call (``kernel[grid]``, which compiles), the same call with new
    tensors of the same layout launches the cached compiled kernels directly (the forward
    statistics and dlogits kernels and the two epilogues): the same
    loss and gradients bitwise; and a CUDA graph captured on a side stream (the fast path
    launches on the current, capturing stream) replays them bitwise."""
    import logitless
    from logitless.triton_lib import fast_launch

    g = torch.Generator().manual_seed(5)
    n, h, v = 300, 96, 1009
    x0 = torch.randn(n, h, generator=g).to("cuda", torch.bfloat16)
    w0 = (torch.randn(v, h, generator=g) * 0.1).to("cuda", torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=g).to("cuda")
    scale = torch.linspace(0, 1, n, device="cuda")
    fn = getattr(logitless, op)

    def loss_of(x, w, budget):
        out = fn(x, w, t, backend="triton", memory_budget=budget)
        return out if out.dim() == 0 else (out * scale).sum()

    def run(budget):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        out = loss_of(x, w, budget)
        out.backward()
        return [out.detach(), x.grad, w.grad]

    for budget in (1 << 16, None):  # recomputed chunks; all columns kept
        fast_launch._FAST.clear()
        first = run(budget)
        before = fast_launch.LAUNCHES["fast"]
        second = run(budget)
        # forward stats, (kept) dlogits, the forward and gradient epilogues
        assert fast_launch.LAUNCHES["fast"] - before >= 4, dict(fast_launch.LAUNCHES)
        for a, b in zip(first, second):
            assert torch.equal(a, b)
    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            loss_of(x, w, None).backward()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = loss_of(x, w, None)
        out.backward()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip([out, x.grad, w.grad], first):
        assert torch.equal(a, b)




@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast launch path runs compiled kernels (CUDA)")
@pytest.mark.parametrize("budget", [1 << 20, None])  # several forward chunks / vocab chunks; the default
def test_linear_jsd_launches_are_fast_and_bitwise(budget, monkeypatch):
    """linear_jsd's kernels (row statistics, epilogues, dlogits) take the cached launches on
    a repeated call: loss and gradients bitwise equal to the same call with every launch
    through kernel[grid] (the fallback: ``fast_launch.ENABLED`` off, in the backward too)."""
    import logitless
    from logitless.triton_lib import fast_launch

    g = torch.Generator().manual_seed(3)
    n, hs, ht, v = 300, 96, 160, 1009
    xs0 = torch.randn(n, hs, generator=g).to("cuda", torch.bfloat16)
    ws0 = (torch.randn(v, hs, generator=g) * 0.1).to("cuda", torch.bfloat16)
    xt = torch.randn(n, ht, generator=g).to("cuda", torch.bfloat16)
    wt = (torch.randn(v, ht, generator=g) * 0.1).to("cuda", torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=g).to("cuda")

    def run():
        xs, ws = xs0.clone().requires_grad_(True), ws0.clone().requires_grad_(True)
        loss = logitless.linear_jsd(xs, ws, xt, wt, t, backend="triton", memory_budget=budget,
                                    hard_label_weight=0.25)
        loss.backward()
        return [loss.detach(), xs.grad, ws.grad]

    first = run()
    before = dict(fast_launch.LAUNCHES)
    second = run()
    fast = fast_launch.LAUNCHES["fast"] - before["fast"]
    # every launch of the repeated call is a cached one (stats, epilogues, dlogits: how many
    # depends on the plan the budget gives)
    assert fast_launch.LAUNCHES["triton"] == before["triton"] and fast > 0, dict(fast_launch.LAUNCHES)
    monkeypatch.setattr(fast_launch, "ENABLED", False)
    before = dict(fast_launch.LAUNCHES)
    slow = run()
    assert fast_launch.LAUNCHES["fast"] == before["fast"]
    assert fast_launch.LAUNCHES["triton"] - before["triton"] == fast  # the same launches, all through kernel[grid]
    for a, b, c in zip(first, second, slow):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("kernel", ["jsd_partial_kernel", "jsd_divergence_kernel", "jsd_finish_kernel",
                                    "jsd_loss_epilogue_kernel", "jsd_upstream_kernel", "jsd_dlogits_kernel",
                                    "jsd_backward_kernel"])
def test_launch_key_implies_tritons_specialisation_for_jsd_kernels(kernel):
    """linear_jsd's kernels now launch through ``run_kernel``: equal ``launch_key`` must
    imply equal Triton specialisation and options (Triton's own binder for sm_90, on the
    CPU), and the fast path must hand the launcher the values ``JITFunction.run`` would;
    over random arguments (tensors of several dtypes and alignments, TMA descriptors, ints
    around 1 / 16 / 2^31, floats (the kernels' scalar options), bools, None)."""
    import random

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from logitless.triton_lib import fast_launch, jsd_epilogue, jsd_rows
    from logitless.triton_lib import linear_jsd_kernels as LK

    fn = next(getattr(m, kernel) for m in (jsd_rows, jsd_epilogue, LK) if hasattr(m, kernel))
    jit = JITFunction(getattr(fn, "fn", fn))
    binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
    flat = {dt: torch.zeros(4096, dtype=dt) for dt in (torch.bfloat16, torch.float32, torch.int64)}
    pool_t = [flat[dt][off:off + 512] for dt in flat for off in (0, 1, 8, 16)]
    pool_t += [flat[dt][16:528].view(8, 64) for dt in flat]
    pool_t += [fast_launch.descriptor(flat[torch.bfloat16][off:off + 1024].view(16, 64), (16, 64), (64, 1), bs)
               for bs in ((16, 64), (16, 32)) for off in (0, 64)] + [None]
    pool_i = [0, 1, 2, 16, 17, 2**31 - 1, 2**31, -1, 1.0, 0.5, -0.25, True, False]
    pool_c = [True, False, 0, 1, 2, 16, 64, "tf32", "tf32x3", None]
    same = {}
    for value in pool_t + pool_i + pool_c:
        same.setdefault(fast_launch.launch_key(jit, 0, (value,), {}), []).append(value)
    g = random.Random(kernel)
    seen: dict = {}
    collisions = 0
    for _ in range(150):
        base_args, base_kwargs = _random_launch_args(jit.params, g, pool_t, pool_i, pool_c)
        for _ in range(5):
            def swap(a):
                return g.choice(same.get(fast_launch.launch_key(jit, 0, (a,), {}), [a]))

            args = [swap(a) for a in base_args]
            kwargs = {k: swap(a) for k, a in base_kwargs.items()}
            ours = fast_launch.launch_key(jit, 0, tuple(args), kwargs)
            bound, spec, options = binder(*args, **kwargs)
            tail = tuple((p.name, p.default) for p in list(jit.signature.parameters.values())[len(args):])
            assert fast_launch.bound_values(tuple(args), kwargs, tail) == tuple(bound.values())
            theirs = (str(spec), str(options))
            if ours in seen:
                collisions += 1
                assert seen[ours] == theirs, (args, kwargs)
            seen[ours] = theirs
    assert collisions > 50
