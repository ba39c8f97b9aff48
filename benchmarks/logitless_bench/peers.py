"""Every method the benchmark runs: one small adapter each, logitless and its peers.

An adapter ``make(case, device)`` returns the loss function the suite times:

    lce suite: fn(x, weight, target) -> mean loss     x (B, H), weight (V, H), target (B,)
               (logitless at each budget; torch eager and compiled, liger, cce; torch's own
               F.linear_cross_entropy with its chunked options, and logitless behind it
               through patch_torch: "n/a (torch < 2.13)" on older torch)
    ce suite:  fn(logits, target)    -> mean loss     logits (N, V)

or raises ``Skip(reason)`` when the method cannot run here (library not installed,
no GPU). Peers are imported inside their adapter, never at module import, so the CPU
path imports neither liger-kernel, cut-cross-entropy nor triton.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


class Skip(Exception):
    """The method cannot run here; the message says why (it goes in the report)."""


@dataclass(frozen=True)
class Method:
    name: str
    make: Callable  # (case, device) -> loss function
    peer: bool = True  # False for logitless itself
    gpu_only: bool = False
    #: ce suite: the method writes into the logits (the gradient, in place); the suite
    #: regenerates them, untimed, before each forward+backward.
    clobbers_input: bool = False
    description: str = ""


def _import(module: str, package: str):
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, or a peer failing at import on this machine
        raise Skip(f"{package} not importable: {type(exc).__name__}: {exc}") from None


def _on_gpu(device) -> bool:
    return torch.device(device).type == "cuda"


def _need_gpu(device) -> None:
    if not _on_gpu(device):
        raise Skip("needs a CUDA GPU")


def _compiled(fn):
    # A fresh compile per case: dynamo caches graphs per code object, and after a few
    # shapes it would either hit its recompile limit (silently running eager) or
    # switch to dynamic shapes. reset() forgets the previous cases.
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def _graphed(fn):
    """``fn(x, w, t)`` under ``torch.compile(mode="reduce-overhead")``: inductor's CUDA-graph
    trees replay the call (how users remove host time at small batches). The weight is
    marked a static input, as a model's parameter is (else each replay copies it)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, dynamic=False, mode="reduce-overhead")

    def call(x, w, t):
        torch._dynamo.mark_static_address(w)
        return compiled(x, w, t)

    return call


def peer_versions() -> dict:
    """Installed versions of the peers (None when not installed), without importing them."""
    out = {}
    for dist in ("liger-kernel", "cut-cross-entropy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


# --------------------------------------------------------------------------- budgets

_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def budget_bytes(spec: str, tokens: int, vocab: int, itemsize: int) -> Optional[int]:
    """``--budgets`` entry -> bytes: "default" (None: the op's default), "logits" (the
    size of the (tokens, vocab) logits in the input dtype), or a size such as "64MiB"."""
    if spec == "default":
        return None
    if spec == "logits":
        return tokens * vocab * itemsize
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", spec)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"bad budget {spec!r}: use default, logits, or a size like 64MiB, 1GiB, 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def budget_method_name(spec: str) -> str:
    return "logitless" if spec == "default" else f"logitless@{spec}"


# --------------------------------------------------------------------------- lce suite


def logitless_lce(spec: str) -> Method:
    def make(shape, device):
        from logitless.ops.linear_cross_entropy.api import linear_cross_entropy

        itemsize = torch.empty(0, dtype=getattr(torch, shape.dtype)).element_size()
        budget = budget_bytes(spec, shape.tokens, shape.vocab, itemsize)
        backend = "auto" if _on_gpu(device) else "torch"  # the CPU run: PyTorch chunks
        return lambda x, w, t: linear_cross_entropy(x, w, t, memory_budget=budget, backend=backend)

    return Method(budget_method_name(spec), make, peer=False,
                  description=f"logitless.linear_cross_entropy, memory_budget={spec}")


def _eager_lce(x, w, t):
    return F.cross_entropy(x @ w.T, t)  # bf16 logits, as a user writes it


def _torch_and_liger(eager, liger_function: str) -> tuple:
    """The set-ups of three peers of one loss: ``eager`` torch, torch.compile of it (GPU
    only), and liger-kernel's ``liger_kernel.transformers.functional.<liger_function>``."""
    def make_eager(case, device):
        return eager

    def make_compile(case, device):
        _need_gpu(device)
        return _compiled(eager)

    def make_liger(case, device):
        _need_gpu(device)
        f = getattr(_import("liger_kernel.transformers.functional", "liger-kernel"), liger_function)
        return lambda *tensors: f(*tensors)

    return make_eager, make_compile, make_liger


# liger_fused_linear_cross_entropy(input, weight, target, bias=None, ...)
_make_eager_lce, _make_compile_lce, _make_liger_lce = _torch_and_liger(_eager_lce, "liger_fused_linear_cross_entropy")


def _make_graphed_lce(shape, device):
    _need_gpu(device)
    return _graphed(_eager_lce)


def _make_cce(filter_eps):
    def make(shape, device):
        _need_gpu(device)
        cce = _import("cut_cross_entropy", "cut-cross-entropy")
        if filter_eps == "default":
            return lambda x, w, t: cce.linear_cross_entropy(x, w, t)  # filter_eps="high"
        return lambda x, w, t: cce.linear_cross_entropy(x, w, t, filter_eps=filter_eps)

    return make


LCE_PEERS: tuple[Method, ...] = (
    Method("torch-eager", _make_eager_lce, description="F.cross_entropy(x @ W.T, t), logits in the input dtype (bf16)"),
    Method("torch-compile", _make_compile_lce, gpu_only=True,
           description="torch.compile of the eager function (dynamic=False)"),
    Method("torch-compile-graphed", _make_graphed_lce, gpu_only=True,
           description="torch.compile(mode='reduce-overhead') of the eager function (CUDA graphs)"),
    Method("liger", _make_liger_lce, gpu_only=True,
           description="liger_kernel.transformers.functional.liger_fused_linear_cross_entropy"),
    Method("cce", _make_cce("default"), gpu_only=True,
           description="cut_cross_entropy.linear_cross_entropy, default filter_eps ('high')"),
    Method("cce-exact", _make_cce(None), gpu_only=True,
           description="cut_cross_entropy.linear_cross_entropy(filter_eps=None)"),
)


# torch's own F.linear_cross_entropy (torch >= 2.13), and logitless behind it (patch_torch).

TORCH_API_MISSING = "n/a (torch < 2.13): torch {} has no torch.nn.functional.linear_cross_entropy"


def _torch_lce():
    f = getattr(F, "linear_cross_entropy", None)
    if f is None or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        raise Skip(TORCH_API_MISSING.format(torch.__version__))
    return f


def _make_torch_api_lce(**options):
    def make(shape, device):
        f = _torch_lce()
        opts = torch.nn.LinearCrossEntropyOptions(**options)
        return lambda x, w, t: f(x, w, t, options=opts)

    return make


def _make_logitless_torch_api(shape, device):
    _torch_lce()
    import logitless

    backend = "auto" if _on_gpu(device) else "torch"  # the CPU run: PyTorch chunks

    def fn(x, w, t):
        # Patched for the call only, so that the torch-lce rows keep torch's own function.
        with logitless.patch_torch(backend=backend):
            return F.linear_cross_entropy(x, w, t)

    return fn


TORCH_API_LCE: tuple[Method, ...] = (
    Method("torch-lce", _make_torch_api_lce(),
           description="F.linear_cross_entropy(x, W, t, options=LinearCrossEntropyOptions()) (torch >= 2.13)"),
    Method("torch-lce-chunk1024", _make_torch_api_lce(batch_chunk_size=1024),
           description="F.linear_cross_entropy(..., options=LinearCrossEntropyOptions(batch_chunk_size=1024))"),
    Method("logitless-torch-api", _make_logitless_torch_api, peer=False,
           description="F.linear_cross_entropy(x, W, t) under logitless.patch_torch() (default memory budget)"),
)


def _logitless_under(wrap):
    """The set-up of the default call ``linear_cross_entropy(x, w, t)`` inside ``wrap``
    (``_compiled``, ``_graphed``)."""
    def make(shape, device):
        _need_gpu(device)
        from logitless.ops.linear_cross_entropy.api import linear_cross_entropy

        return wrap(lambda x, w, t: linear_cross_entropy(x, w, t))

    return make


#: The default call under torch.compile(mode="reduce-overhead").
LOGITLESS_GRAPHED = Method("logitless-graphed", _logitless_under(_graphed), peer=False, gpu_only=True,
                           description="logitless.linear_cross_entropy (default budget) under "
                                       "torch.compile(mode='reduce-overhead') (CUDA graphs)")

#: The default call inside a function under torch.compile (the custom-op path: the host
#: cost of torch.library's wrappers, against the eager path's plain autograd.Function).
LOGITLESS_COMPILED = Method("logitless-compiled", _logitless_under(_compiled), peer=False, gpu_only=True,
                            description="logitless.linear_cross_entropy (default budget) inside torch.compile "
                                        "(its custom ops)")


def lce_methods(budgets, *, cpu: bool, peers: bool) -> list[Method]:
    methods = [logitless_lce(b) for b in budgets]
    if not cpu:
        methods += [LOGITLESS_COMPILED, LOGITLESS_GRAPHED]
    if peers:
        methods += [m for m in LCE_PEERS + TORCH_API_LCE if not (cpu and m.gpu_only)]
    return methods


# --------------------------------------------------------------------------- ce suite


def logitless_cross_entropy():
    """``logitless.ops.cross_entropy`` (another developer's op); raises Skip while it does not exist."""
    try:
        mod = importlib.import_module("logitless.ops.cross_entropy")
    except Exception as exc:
        raise Skip(f"logitless.ops.cross_entropy not importable: {type(exc).__name__}: {exc}") from None
    fn = getattr(mod, "cross_entropy", None)
    if not callable(fn):
        raise Skip("logitless.ops.cross_entropy has no function cross_entropy")
    return fn


def _make_logitless_ce(inplace: bool):
    def make(case, device):
        ce = logitless_cross_entropy()
        backend = "auto" if _on_gpu(device) else "torch"  # the CPU run: PyTorch chunks
        kw = {"inplace_backward": True} if inplace else {}
        return lambda logits, t: ce(logits, t, backend=backend, **kw)

    return make


def _eager_ce(logits, t):
    return F.cross_entropy(logits, t)


# liger_cross_entropy writes the gradient into its input in the forward.
_make_eager_ce, _make_compile_ce, _make_liger_ce = _torch_and_liger(_eager_ce, "liger_cross_entropy")


def ce_methods(*, cpu: bool, peers: bool) -> list[Method]:
    methods = [
        Method("logitless", _make_logitless_ce(False), peer=False, description="logitless.cross_entropy"),
        Method("logitless-inplace", _make_logitless_ce(True), peer=False, clobbers_input=True,
               description="logitless.cross_entropy(inplace_backward=True)"),
    ]
    if peers:
        methods += [
            Method("torch-eager", _make_eager_ce, description="F.cross_entropy(logits, t)"),
            Method("torch-compile", _make_compile_ce, gpu_only=True, description="torch.compile of it"),
            Method("liger", _make_liger_ce, gpu_only=True, clobbers_input=True,
                   description="liger_kernel.transformers.functional.liger_cross_entropy"),
        ]
    return [m for m in methods if not (cpu and m.gpu_only)]
