"""Run a peer's OWN test files against logitless's drop-ins, and record pass/fail counts.

    python benchmarks/peer_tests.py --peer liger --tests /tmp/peer-tests/liger \\
        --peer-path /tmp/peers/site [-k EXPR] [--out benchmarks/results/peer-tests-liger-cpu-DATE.json]
    python benchmarks/peer_tests.py --peer cce --tests /tmp/peer-tests/cce \\
        --peer-path /tmp/peers/cce-main
    LOGITLESS_VERL_CASES=2 python benchmarks/peer_tests.py --peer verl --tests /tmp/peer-tests/verl \\
        --peer-path /tmp/peers/verl-src /tmp/peers/verl-deps
    python benchmarks/peer_tests.py --peer tokamax --tests /tmp/peer-tests/tokamax \\
        --peer-path /tmp/peers/tokamax-whl /tmp/peers/tokamax-deps --python /work/main/.venv-jax/bin/python

--tests: a folder with the peer's test files, fetched from its repository into a
git-ignored place (never committed): for Liger, its ``test/`` package (``test/utils.py``,
``test/conftest.py``, ``test/transformers/test_{cross_entropy,fused_linear_cross_entropy,
jsd,fused_linear_jsd}.py``); for cut-cross-entropy, its ``tests/test_cce_loss_{forward,
backward}.py``; for verl, its ``tests/utils/test_linear_cross_entropy.py`` (a script, run
by a generated pytest driver, one test per case index, every ``assert_close`` recorded);
for tokamax, ``api_test.py`` and ``chunked_xla_test.py`` of
``tokamax/_src/ops/linear_softmax_cross_entropy_loss/`` (shipped in its wheel too).
--peer-path (one or more): where the peer package itself and its dependencies are
importable from (an installed wheel, ``pip install --no-deps --target``, or the
repository's source): the tests import its helpers (Liger's ``infer_device``, CCE's
``softcapping``/``compute_z_loss``, verl's reference paths, tokamax's reference and test
data). --python: the interpreter of the tests (tokamax's run in the JAX env).

How the drop-ins replace the peer: a pytest plugin, loaded before the test modules,
imports the peer and sets its public loss names (modules, functions, ``*Function``
classes, ``CrossEntropyOutput``) to ours (``logitless.integrations.liger`` / ``.cce``),
so every ``from liger_kernel... import X`` in a test gets our X (verl: its kernel's
``linear_cross_entropy``; tokamax: ``linear_softmax_cross_entropy_loss`` for every
``implementation`` but "xla", which its tests use as the reference, and its chunked
forward/backward functions, as thin adapters over ours). Assertions and tolerances are
unchanged. Tests that exercise only the peer's internals (Liger's Triton
kernel called directly) still run the peer's code; they are listed under
``peer_internal`` in the record. Edits, on a machine without CUDA only (reported as
``edits``): cut-cross-entropy's and verl's tests hard-code ``device="cuda"`` (and CCE a
``skip_no_cuda`` mark); in a copy of them "cuda" becomes "cpu" and the mark is dropped;
verl's reference ``logprobs_from_logits`` gets flat labels (as on its flash-attn
path; its CPU fallback needs them).

Writes a JSON record (counts, each failure with its assertion message: the measured
error) to --out, default benchmarks/results/peer-tests-<peer>-<cpu|cuda>-<date>.json.
Without CUDA, Liger's Triton kernels run on the interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Per peer: its test files (relative to --tests), and the alias plugin's body.
PEERS = {
    "liger": {
        "files": ["test/transformers/test_jsd.py", "test/transformers/test_fused_linear_jsd.py",
                  "test/transformers/test_fused_linear_cross_entropy.py", "test/transformers/test_cross_entropy.py"],
        "support": ["test/__init__.py", "test/utils.py", "test/conftest.py", "test/transformers/__init__.py"],
        "plugin": '''
import liger_kernel.ops as _ops
import liger_kernel.transformers as _tr
import liger_kernel.transformers.cross_entropy as _ce
import liger_kernel.transformers.functional as _fn
import liger_kernel.transformers.fused_linear_cross_entropy as _flce
import liger_kernel.transformers.fused_linear_jsd as _fjsd
import liger_kernel.transformers.jsd as _jsd
from logitless.integrations import liger as _ours

_NAMES = {
    _ops: ["LigerCrossEntropyFunction", "LigerFusedLinearCrossEntropyFunction", "LigerFusedLinearJSDFunction",
           "LigerJSDFunction"],
    _tr: ["LigerCrossEntropyLoss", "LigerFusedLinearCrossEntropyLoss", "LigerFusedLinearJSD", "LigerJSD"],
    _ce: ["LigerCrossEntropyLoss", "LigerCrossEntropyFunction", "CrossEntropyOutput"],
    _fn: ["CrossEntropyOutput", "liger_cross_entropy", "liger_fused_linear_cross_entropy", "liger_jsd",
          "liger_fused_linear_jsd", "LigerCrossEntropyFunction", "LigerFusedLinearCrossEntropyFunction",
          "LigerJSDFunction", "LigerFusedLinearJSDFunction"],
    _flce: ["LigerFusedLinearCrossEntropyLoss", "LigerFusedLinearCrossEntropyFunction", "CrossEntropyOutput"],
    _fjsd: ["LigerFusedLinearJSD", "LigerFusedLinearJSDFunction"],
    _jsd: ["LigerJSD", "LigerJSDFunction"],
}
for _mod, _names in _NAMES.items():
    for _name in _names:
        if hasattr(_mod, _name):
            setattr(_mod, _name, getattr(_ours, _name))
''',
        # tests that call the peer's kernel itself (not a drop-in name)
        "internal": re.compile(r"test_float32_internal"),
    },
    "cce": {
        "files": ["test_cce_loss_forward.py", "test_cce_loss_backward.py"],
        "support": [],
        "plugin": '''
import cut_cross_entropy as _cce
import cut_cross_entropy.linear_cross_entropy as _lce
from logitless.integrations import cce as _ours

for _mod in (_cce, _lce):
    for _name in ("linear_cross_entropy", "LinearCrossEntropy", "LinearCrossEntropyImpl"):
        setattr(_mod, _name, getattr(_ours, _name))
''',
        "internal": re.compile(r"$^"),
    },
    "verl": {
        "files": ["tests/utils/test_linear_cross_entropy.py"],
        "support": [],
        # verl's test is a script (a class with __init__, run from __main__): the driver below
        # runs it under pytest, one test per case
        "run": ["test_logitless_verl_driver.py"],
        "driver": '''
"""verl's tests/utils/test_linear_cross_entropy.py under pytest: one test per case index
(LOGITLESS_VERL_CASES, default "2", the smallest; LOGITLESS_VERL_ITERATIONS, default 2: its
timing summary drops the first iteration),
running its verify_correctness with every torch.testing.assert_close recorded instead of
stopping at the first failure; the test fails listing each failing comparison (its line
in verl's file and message). Without CUDA, torch.cuda's timing and memory calls are
no-ops (CPU timers)."""
import importlib.util
import inspect
import os
import time

import pytest
import torch

if not torch.cuda.is_available():
    class _Event:
        def __init__(self, enable_timing=False):
            self.t = 0.0

        def record(self, *args):
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    torch.cuda.Event = _Event
    for _name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        setattr(torch.cuda, _name, lambda *args, **kwargs: None)
    torch.cuda.max_memory_allocated = lambda *args, **kwargs: 0

_path = os.path.join(os.path.dirname(__file__), "tests", "utils", "test_linear_cross_entropy.py")
_spec = importlib.util.spec_from_file_location("verl_test_linear_cross_entropy", _path)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
_close = torch.testing.assert_close


@pytest.mark.parametrize("case", [int(c) for c in os.environ.get("LOGITLESS_VERL_CASES", "2").split(",")])
def test_verify_correctness(case, monkeypatch):
    results = []

    def recorded(actual, expected, **kwargs):
        line = inspect.stack()[1].lineno
        try:
            _close(actual, expected, **kwargs)
            results.append((line, None))
        except AssertionError as exc:
            results.append((line, str(exc).splitlines()[0:4]))

    monkeypatch.setattr(torch.testing, "assert_close", recorded)
    torch.manual_seed(case)
    iterations = int(os.environ.get("LOGITLESS_VERL_ITERATIONS", "2"))
    _mod.TestLinearCrossEntropy(case).verify_correctness(iterations=iterations)
    bad = [(line, msg) for line, msg in results if msg is not None]
    summary = f"case {case}: {len(results) - len(bad)}/{len(results)} comparisons close"
    print(summary)
    assert not bad, summary + "".join(f"\\nline {line}: {' '.join(msg)}" for line, msg in bad)
''',
        "plugin": '''
import verl.utils.kernel.linear_cross_entropy as _k
from logitless.integrations import verl as _ours

_k.linear_cross_entropy = _ours.linear_cross_entropy
''',
        # every comparison is run; those between torch and verl's own paths (not the kernel)
        # are verl's internals: the driver's message names each failing line
        "internal": re.compile(r"$^"),
    },
    "tokamax": {
        "files": ["api_test.py", "chunked_xla_test.py"],
        "support": [],
        "plugin": '''
import jax
import jax.numpy as jnp
import tokamax
from tokamax._src.ops.linear_softmax_cross_entropy_loss import api as _api
from tokamax._src.ops.linear_softmax_cross_entropy_loss import chunked_xla as _chunked
from logitless.jax import linear_cross_entropy as _lce
from logitless.jax import linear_softmax_cross_entropy_loss as _ours

_peer = _api.linear_softmax_cross_entropy_loss


def _dispatch(x, labels, weights, *, reduction="sum", precision=None, implementation=None):
    # implementation="xla" is the tests' reference (tokamax's op with the logits): kept
    if implementation == "xla":
        return _peer(x, labels, weights, reduction=reduction, precision=precision, implementation="xla")
    return _ours(x, labels, weights, reduction=reduction, precision=precision, implementation=implementation)


def _fwd(x, labels, w, *, reduction="sum", **_blocks_and_dtype):
    # tokamax's chunked forward: (loss, lse); labels outside [0, V) are ignored as in the drop-in
    v = w.shape[-1]
    labels = jnp.where((labels >= 0) & (labels < v), labels, -1)
    loss, stats = _lce(x, w, labels, ignore_index=-1, reduction="sum" if reduction == "mean" else reduction,
                       weight_layout="hv", return_stats=True)
    return (loss / x.shape[0] if reduction == "mean" else loss), stats.lse


def _bwd(dout, lse, x, labels, w, *, reduction="sum", **_blocks_and_dtype):
    # tokamax's chunked backward: (dx, dw) for the cotangent dout (lse is recomputed)
    out, vjp = jax.vjp(lambda x_, w_: _ours(x_, labels, w_, reduction=reduction), x, w)
    return vjp(jnp.asarray(dout, out.dtype))


tokamax.linear_softmax_cross_entropy_loss = _ours
_api.linear_softmax_cross_entropy_loss = _dispatch
_chunked.linear_softmax_cross_entropy_loss_fwd_chunked_xla = _fwd
_chunked.linear_softmax_cross_entropy_loss_bwd_chunked_xla = _bwd
''',
        # the api test with test_impl="xla" compares tokamax's reference with itself; the
        # implementation-choice test inspects tokamax's dispatch (no tokamax op in the HLO)
        "internal": re.compile(r"test_api_fwd_bwd_matches_reference_\w+_(sum|mean)_xla$"
                               r"|test_correct_implementation_used"),
    },
}

#: Per peer: the distribution whose version is recorded, and the framework of its tests.
DIST = {"liger": "liger-kernel", "cce": "cut-cross-entropy", "verl": "verl", "tokamax": "tokamax"}
JAX_PEERS = {"tokamax"}


def _copy_tests(peer: str, src: Path, dst: Path, cuda: bool) -> list[str]:
    edits = []
    spec = PEERS[peer]
    for rel in spec["files"] + spec["support"]:
        s, d = src / rel, dst / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        if not s.exists():
            if rel.endswith("__init__.py"):
                d.write_text("")
                continue
            raise SystemExit(f"missing {s}: fetch the peer's tests into --tests first")
        text = s.read_text()
        if peer in ("cce", "verl") and not cuda and rel in spec["files"]:
            new = text.replace('device="cuda"', 'device="cpu"')
            if new != text:
                edits.append(f"{rel}: device=\"cuda\" -> \"cpu\"")
            text, new = new, new.replace("\n@skip_no_cuda\n", "\n")
            if new != text:
                edits.append(f"{rel}: @skip_no_cuda dropped")
            text = new
        if peer == "verl" and not cuda and rel in spec["files"]:
            # verl's reference logprobs_from_logits flattens the labels on its flash-attn (CUDA)
            # path only; its CPU fallback needs them flat (labels (1, N), logits (N, V))
            old = "logprobs_from_logits(logits=logits, labels=labels, inplace_backward=False)"
            new = text.replace(old, old.replace("labels=labels", "labels=labels.reshape(-1)"))
            if new != text:
                edits.append(f"{rel}: logprobs_from_logits(labels=labels.reshape(-1)) (as verl's flash-attn path)")
            text = new
        d.write_text(text)
    return edits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", choices=sorted(PEERS), required=True)
    ap.add_argument("--tests", type=Path, required=True, help="folder with the peer's test files (git-ignored)")
    ap.add_argument("--peer-path", type=Path, nargs="+", required=True,
                    help="where the peer package (and its dependencies) are importable from")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter that runs the tests (tokamax: the JAX env, /work/main/.venv-jax/bin/python)")
    ap.add_argument("-k", default=None, help="pytest -k expression (a subset)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per test file")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    framework = "jax" if args.peer in JAX_PEERS else "torch"
    probe = ("import jax; print(jax.__version__, jax.default_backend())" if framework == "jax" else
             "import torch; print(torch.__version__, 'gpu' if torch.cuda.is_available() else 'cpu')")
    fw_version, backend = subprocess.run([args.python, "-c", probe], capture_output=True, text=True,
                                         check=True).stdout.split()
    cuda = backend == "gpu"
    work = Path(tempfile.mkdtemp(prefix=f"peer-tests-{args.peer}-"))
    edits = _copy_tests(args.peer, args.tests.resolve(), work, cuda)
    (work / "logitless_peer_alias.py").write_text(PEERS[args.peer]["plugin"])
    spec = PEERS[args.peer]
    if "driver" in spec:
        (work / spec["run"][0]).write_text(spec["driver"])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(work), str(ROOT / "src"), *(str(p.resolve()) for p in args.peer_path),
                                         env.get("PYTHONPATH", "")])
    if not cuda and framework == "torch":
        env.setdefault("TRITON_INTERPRET", "1")
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, internal, crashed, summaries = [], [], [], []
    for test_file in spec.get("run", spec["files"]):  # one process per file: a crash costs one file
        junit = work / (Path(test_file).stem + ".xml")
        cmd = [args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "logitless_peer_alias",
               f"--junitxml={junit}", "-o", "junit_family=xunit1", "-o", "junit_logging=system-out", test_file]
        if args.k:
            cmd += ["-k", args.k]
        print(" ".join(cmd), flush=True)
        try:
            proc = subprocess.run(cmd, cwd=work, env=env, timeout=args.timeout, capture_output=True, text=True)
            rc, tail = proc.returncode, proc.stdout[-1500:] + proc.stderr[-1500:]
        except subprocess.TimeoutExpired as exc:
            rc, tail = "timeout", str(exc.stdout or "")[-1500:]
        print(tail, flush=True)
        if not junit.exists():
            crashed.append({"file": test_file, "returncode": rc, "tail": tail[-800:]})
            continue
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            out = case.find("system-out")
            if out is not None:
                summaries += [ln for ln in (out.text or "").splitlines() if "comparisons close" in ln]
            if PEERS[args.peer]["internal"].search(name):
                internal.append(name)
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if case.find("skipped") is not None:
                counts["skipped"] += 1
            elif bad is not None:
                counts["failed" if bad.tag == "failure" else "errors"] += 1
                text = (bad.get("message") or "") + "\n" + (bad.text or "")
                lines = [ln for ln in text.splitlines() if re.search(
                    r"(Mismatch|Greatest|differ|Error|assert|Expected|diff|close)", ln, re.I)]
                failures.append({"test": name, "message": "\n".join(lines[:12])[:2000]})
            else:
                counts["passed"] += 1

    probe = f"import importlib.metadata as m; print(m.version({DIST[args.peer]!r}))"
    version = subprocess.run([args.python, "-c", probe],
                             env=env, capture_output=True, text=True).stdout.strip()
    if args.peer in ("cce", "verl"):  # their __version__ (the repository's; verl from source has no metadata)
        module = {"cce": "cut_cross_entropy", "verl": "verl"}[args.peer]
        version = subprocess.run([args.python, "-c", f"import {module} as c; print(c.__version__)"],
                                 env=env, capture_output=True, text=True).stdout.strip() or version
    date = datetime.date.today().isoformat()
    record = {
        "peer": args.peer, "peer_version": version,
        # without CUDA Liger's and CCE's Triton kernels run on the interpreter; the verl drop-in
        # takes logitless's PyTorch backend there, tokamax's tests run on XLA's CPU backend
        "device": "cuda" if cuda else ("cpu (Triton interpreter)" if args.peer in ("liger", "cce") else "cpu"),
        framework: fw_version, "date": date, "command": " ".join(sys.argv),
        "test_files": PEERS[args.peer]["files"], "k": args.k, "edits": edits,
        "env": {k: v for k, v in os.environ.items() if k.startswith("LOGITLESS_")}, "summaries": summaries,
        "counts": counts, "crashed_files": crashed, "peer_internal": internal, "failures": failures,
    }
    dev = "cuda" if cuda else "cpu"
    out = args.out or ROOT / "benchmarks" / "results" / f"peer-tests-{args.peer}-{dev}-{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{args.peer}: {counts} -> {out}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
