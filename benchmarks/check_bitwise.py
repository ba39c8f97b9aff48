"""Bitwise-neutrality check of a refactor: the public ops' outputs, saved and compared.

    python benchmarks/check_bitwise.py save FILE     # run every case, save the tensors
    python benchmarks/check_bitwise.py compare A B   # every tensor of A equal to B's, bit for bit
    python benchmarks/check_bitwise.py digest FILE   # run every case, save a SHA-256 per tensor (JSON, small:
                                                     # a GPU run's tensors are ~90 MB); compare takes either kind

Cases: linear_cross_entropy (Triton and torch backends; budgets that keep all, part or
none of the logits; the gradient-in-forward strategy forced), cross_entropy, jsd,
linear_jsd and linear_log_probs (budgets as linear_cross_entropy's, with and without
entropy, temperature and soft-cap; on trees that have it), top-k/top-p/min-p and
batch-invariant log-probs (fused and on given logits), with every option, in bf16
and fp32. Only the public API (and the
strategy override, found under its old or new name) is used, so the same script runs
against the code before and after a change. On a CPU the Triton kernels run on the
interpreter (TRITON_INTERPRET=1, set here) at small sizes; on a GPU at larger ones.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import logitless  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = DEV.type == "cuda"


def forced_grad_in_forward(token_chunk):
    """The planner forced to gradient-in-forward, under the old or the new API."""
    try:
        from logitless.planning.overrides import override
    except ImportError:  # the tree before the refactor (issue 17)
        import importlib

        return importlib.import_module("logitless._plans").forced_strategy("grad_in_forward", token_chunk=token_chunk)
    return override(strategy=("grad_in_forward", token_chunk))


def inputs(n, h, v, dtype, seed, hidden_t=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype).to(DEV).requires_grad_()
    w = (torch.randn(v, h, generator=g) * h ** -0.5 * 2).to(dtype).to(DEV).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.5).to(dtype).to(DEV).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -100
    cw = (torch.rand(v, generator=g) + 0.5).to(DEV)
    out = dict(x=x, w=w, b=b, t=t.to(DEV), cw=cw)
    if hidden_t:
        out["xt"] = torch.randn(n, hidden_t, generator=g).to(dtype).to(DEV)
        out["wt"] = (torch.randn(v, hidden_t, generator=g) * hidden_t ** -0.5 * 2).to(dtype).to(DEV)
    return out


def lce_cases():
    n, h, v = (300, 136, 1500) if GPU else (29, 40, 257)
    full = n * v * 2
    for dtype in (torch.bfloat16, torch.float32):
        for backend in ("triton", "torch"):
            for budget_name, budget in (("keep", 4 * full), ("part", full // 3 + 4 * n * h), ("recompute", 2000)):
                for opt_name, kw in (("plain", {}), ("all", dict(label_smoothing=0.1, softcap=6.0, z_loss=1e-3))):
                    for red in ("mean", "none"):
                        yield (f"lce/{backend}/{dtype}/{budget_name}/{opt_name}/{red}",
                               dict(dtype=dtype, backend=backend, budget=budget, kw=kw, red=red, force=None))
        for chunk in (7, 64):
            yield (f"lce/triton/{dtype}/grad_in_forward{chunk}",
                   dict(dtype=dtype, backend="triton", budget=None, red="sum", force=chunk,
                        kw=dict(label_smoothing=0.1, softcap=6.0, z_loss=1e-3)))


def run_lce(c, seed):
    n, h, v = (300, 136, 1500) if GPU else (29, 40, 257)
    d = inputs(n, h, v, c["dtype"], seed)
    kw = dict(c["kw"])
    if kw:
        kw["class_weight"] = d["cw"]
    ctx = forced_grad_in_forward(c["force"]) if c["force"] else contextlib.nullcontext()
    with ctx:
        loss, stats = logitless.linear_cross_entropy(
            d["x"], d["w"], d["t"], d["b"], reduction=c["red"], backend=c["backend"],
            memory_budget=c["budget"], return_stats=True, **kw)
    g = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed)).to(DEV)
    grads = torch.autograd.grad(loss, (d["x"], d["w"], d["b"]), g)
    return [loss, stats.lse, stats.correct, *grads]


def run_ce(dtype, backend, seed):
    n, v = (300, 1500) if GPU else (29, 257)
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, v, generator=g) * 3).to(dtype).to(DEV).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to(DEV)
    cw = (torch.rand(v, generator=g) + 0.5).to(DEV)
    loss, stats = logitless.cross_entropy(z, t, backend=backend, label_smoothing=0.1, softcap=6.0,
                                          z_loss=1e-3, class_weight=cw, return_stats=True)
    return [loss, stats.lse, stats.correct, *torch.autograd.grad(loss, z)]


def run_jsd(dtype, backend, beta, seed):
    n, v = (300, 1500) if GPU else (29, 257)
    g = torch.Generator().manual_seed(seed)
    zs = (torch.randn(n, v, generator=g) * 3).to(dtype).to(DEV).requires_grad_()
    zt = (torch.randn(n, v, generator=g) * 3).to(dtype).to(DEV)
    t = torch.randint(0, v, (n,), generator=g).to(DEV)
    loss = logitless.jsd(zs, zt, t, beta=beta, temperature=0.7, hard_label_weight=0.3,
                         student_softcap=8.0, backend=backend)
    return [loss, *torch.autograd.grad(loss, zs)]


def run_linear_jsd(dtype, backend, beta, seed):
    n, h, v = (300, 136, 1500) if GPU else (29, 40, 257)
    d = inputs(n, h, v, dtype, seed, hidden_t=h + 8)
    loss = logitless.linear_jsd(d["x"], d["w"], d["xt"], d["wt"], d["t"], beta=beta, temperature=0.7,
                                hard_label_weight=0.3, student_bias=d["b"], student_softcap=8.0,
                                backend=backend, memory_budget=(1 << 20) if GPU else 4000)
    return [loss, *torch.autograd.grad(loss, (d["x"], d["w"], d["b"]))]


def run_linear_log_probs(dtype, backend, budget_name, opts, seed):
    n, h, v = (300, 136, 1500) if GPU else (29, 40, 257)
    full = n * v * 2
    budget = {"keep": 4 * full, "part": full // 3 + 4 * n * h, "recompute": 2000}[budget_name]
    d = inputs(n, h, v, dtype, seed)
    kw = dict(entropy=True, temperature=0.7, softcap=6.0) if opts == "all" else {}
    out = logitless.linear_log_probs(d["x"], d["w"], d["t"], d["b"], backend=backend, memory_budget=budget, **kw)
    outs = list(out) if isinstance(out, tuple) else [out]
    gen = torch.Generator().manual_seed(seed)
    obj = sum((o * torch.randn(o.shape, generator=gen).to(DEV)).sum() for o in outs)
    return [*outs, *torch.autograd.grad(obj, (d["x"], d["w"], d["b"]))]


#: Truncation and batch-invariant options of the log-prob ops (cases ``llpx``/``lp``).
LOG_PROB_EXTRAS = {
    "top_k": dict(top_k=17, temperature=0.7, entropy=True),
    "top_p": dict(top_p=0.8, temperature=0.9, entropy=True),
    "min_p": dict(min_p=0.05, temperature=1.2),
    "all": dict(top_k=40, top_p=0.9, min_p=0.01, temperature=0.7, entropy=True),
    "invariant": dict(batch_invariant=True, entropy=True),
}


def run_log_probs_extra(linear, dtype, backend, opts, seed):
    """linear_log_probs (``linear``; the "part" budget) or log_probs on given logits under
    the truncation / batch-invariant options ``LOG_PROB_EXTRAS[opts]``."""
    n, h, v = (300, 136, 1500) if GPU else (29, 40, 257)
    d = inputs(n, h, v, dtype, seed)
    kw = dict(LOG_PROB_EXTRAS[opts])
    if linear:
        args, wrt = (d["x"], d["w"], d["t"], d["b"]), (d["x"], d["w"], d["b"])
        kw["memory_budget"] = n * v * 2 // 3 + 4 * n * h
        fn = logitless.linear_log_probs
    else:
        z = (d["x"] @ d["w"].T).detach().requires_grad_()
        args, wrt, fn = (z, d["t"]), (z,), logitless.log_probs
    try:
        out = fn(*args, backend=backend, **kw)
    except TypeError:  # (a tree without the option)
        return []
    outs = list(out) if isinstance(out, tuple) else [out]
    gen = torch.Generator().manual_seed(seed)
    obj = sum((o * torch.randn(o.shape, generator=gen).to(DEV)).sum() for o in outs)
    return [*outs, *torch.autograd.grad(obj, wrt)]


def run_linear_jsd_budget(dtype, backend, budget_name, seed):
    """linear_jsd (beta 0.5, the default options) at budgets that keep all, part or none."""
    n, h, v = (300, 136, 1500) if GPU else (29, 40, 257)
    d = inputs(n, h, v, dtype, seed, hidden_t=h)
    budget = {"keep": 16 * n * v, "part": n * v + 8 * n * h, "recompute": 2000, "default": None}[budget_name]
    loss = logitless.linear_jsd(d["x"], d["w"], d["xt"], d["wt"], d["t"], beta=0.5, backend=backend,
                                memory_budget=budget)
    return [loss, *torch.autograd.grad(loss, (d["x"], d["w"]))]


def all_results():
    out = {}
    for i, (name, c) in enumerate(lce_cases()):
        out[name] = run_lce(c, seed=i)
    for dtype in (torch.bfloat16, torch.float32):
        for backend in ("triton", "torch"):
            out[f"ce/{backend}/{dtype}"] = run_ce(dtype, backend, seed=1)
            for beta in (0.0, 0.5, 1.0):
                out[f"jsd/{backend}/{dtype}/{beta}"] = run_jsd(dtype, backend, beta, seed=2)
                out[f"linear_jsd/{backend}/{dtype}/{beta}"] = run_linear_jsd(dtype, backend, beta, seed=3)
    if hasattr(logitless, "linear_log_probs"):
        for dtype in (torch.bfloat16, torch.float32):
            for backend in ("triton", "torch"):
                for budget_name in ("keep", "part", "recompute"):
                    for opts in ("plain", "all"):
                        out[f"llp/{backend}/{dtype}/{budget_name}/{opts}"] = run_linear_log_probs(
                            dtype, backend, budget_name, opts, seed=5)
        for dtype in (torch.bfloat16, torch.float32):
            for backend in ("triton", "torch"):
                for opts in LOG_PROB_EXTRAS:
                    out[f"llpx/{backend}/{dtype}/{opts}"] = run_log_probs_extra(True, dtype, backend, opts, seed=6)
                    out[f"lp/{backend}/{dtype}/{opts}"] = run_log_probs_extra(False, dtype, backend, opts, seed=7)
    for dtype in (torch.bfloat16, torch.float32):
        for backend in ("triton", "torch"):
            for budget_name in ("keep", "part", "recompute", "default"):
                out[f"ljsd/{backend}/{dtype}/{budget_name}"] = run_linear_jsd_budget(dtype, backend, budget_name, 8)
    return {k: [t.detach().cpu() for t in v] for k, v in out.items()}


def digest(tensors) -> list[str]:
    """One SHA-256 per tensor, over its dtype, shape and bytes."""
    import hashlib

    out = []
    for t in tensors:
        h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        out.append(h.hexdigest())
    return out


def load(path):
    """Saved results as {case: [digest, ...]} (a digest file, or tensors digested here)."""
    if path.endswith(".json"):
        import json

        with open(path) as f:
            return json.load(f)
    return {k: digest(v) for k, v in torch.load(path).items()}


def main(argv):
    if argv[:1] == ["digest"] and len(argv) == 2:
        import json

        res = {k: digest(v) for k, v in all_results().items()}
        with open(argv[1], "w") as f:
            json.dump({"device": str(torch.cuda.get_device_name() if GPU else "cpu"), **res}, f, indent=0)
        print(f"digested {len(res)} cases on {DEV} to {argv[1]}")
        return 0
    if argv[:1] == ["save"] and len(argv) == 2:
        res = all_results()
        torch.save(res, argv[1])
        print(f"saved {len(res)} cases ({sum(len(v) for v in res.values())} tensors) on {DEV} to {argv[1]}")
        return 0
    if argv[:1] == ["compare"] and len(argv) == 3:
        a, b = load(argv[1]), load(argv[2])
        a.pop("device", None), b.pop("device", None)
        bad = [k for k in a if k not in b or a[k] != b[k]]
        missing = sorted(set(b) - set(a))
        print(f"{len(a) - len(bad)}/{len(a)} cases bitwise equal" + (f"; differ: {bad}" if bad else "")
              + (f"; only in {argv[2]}: {missing}" if missing else ""))
        return 1 if bad or missing else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
