"""Run a peer's OWN test files against logitless's drop-ins, and record pass/fail counts.

    python benchmarks/peer_tests.py --peer liger --tests /tmp/peer-tests/liger \\
        --peer-path /tmp/peers/site [-k EXPR] [--out benchmarks/results/peer-tests-liger-cpu-DATE.json]
    python benchmarks/peer_tests.py --peer cce --tests /tmp/peer-tests/cce \\
        --peer-path /tmp/peers/cce-main

--tests: a folder with the peer's test files, fetched from its repository into a
git-ignored place (never committed): for Liger, its ``test/`` package (``test/utils.py``,
``test/conftest.py``, ``test/transformers/test_{cross_entropy,fused_linear_cross_entropy,
jsd,fused_linear_jsd}.py``); for cut-cross-entropy, its ``tests/test_cce_loss_{forward,
backward}.py``. --peer-path: where the peer package itself is importable from (an
installed wheel, ``pip install --no-deps --target``, or the repository's source): the
tests import its helpers (Liger's ``infer_device``, CCE's ``softcapping``/``compute_z_loss``).

How the drop-ins replace the peer: a pytest plugin, loaded before the test modules,
imports the peer and sets its public loss names (modules, functions, ``*Function``
classes, ``CrossEntropyOutput``) to ours (``logitless.integrations.liger`` / ``.cce``),
so every ``from liger_kernel... import X`` in a test gets our X. Assertions and
tolerances are unchanged. Tests that exercise only the peer's internals (Liger's Triton
kernel called directly) still run the peer's code; they are listed under
``peer_internal`` in the record. One edit, for cut-cross-entropy on a machine without
CUDA only: its tests hard-code ``device="cuda"`` and a ``skip_no_cuda`` mark; in a copy
of them "cuda" becomes "cpu" and the mark is dropped (reported as ``edits``).

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
}


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
        if peer == "cce" and not cuda and rel in spec["files"]:
            new = text.replace('device="cuda"', 'device="cpu"').replace("\n@skip_no_cuda\n", "\n")
            if new != text:
                edits.append(f"{rel}: device=\"cuda\" -> \"cpu\", @skip_no_cuda dropped")
            text = new
        d.write_text(text)
    return edits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", choices=sorted(PEERS), required=True)
    ap.add_argument("--tests", type=Path, required=True, help="folder with the peer's test files (git-ignored)")
    ap.add_argument("--peer-path", type=Path, required=True, help="where the peer package is importable from")
    ap.add_argument("-k", default=None, help="pytest -k expression (a subset)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per test file")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import torch

    cuda = torch.cuda.is_available()
    work = Path(tempfile.mkdtemp(prefix=f"peer-tests-{args.peer}-"))
    edits = _copy_tests(args.peer, args.tests.resolve(), work, cuda)
    (work / "logitless_peer_alias.py").write_text(PEERS[args.peer]["plugin"])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(work), str(ROOT / "src"), str(args.peer_path.resolve()),
                                         env.get("PYTHONPATH", "")])
    if not cuda:
        env.setdefault("TRITON_INTERPRET", "1")
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, internal, crashed = [], [], []
    for test_file in PEERS[args.peer]["files"]:  # one process per file: a crash costs one file
        junit = work / (Path(test_file).stem + ".xml")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "logitless_peer_alias",
               f"--junitxml={junit}", "-o", "junit_family=xunit1", test_file]
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

    version = subprocess.run([sys.executable, "-c", "import importlib.metadata as m, sys; "
                              f"print(m.version({'liger-kernel' if args.peer == 'liger' else 'cut-cross-entropy'!r}))"],
                             env=env, capture_output=True, text=True).stdout.strip()
    if args.peer == "cce":
        version = subprocess.run([sys.executable, "-c", "import cut_cross_entropy as c; print(c.__version__)"],
                                 env=env, capture_output=True, text=True).stdout.strip() or version
    date = datetime.date.today().isoformat()
    record = {
        "peer": args.peer, "peer_version": version, "device": "cuda" if cuda else "cpu (Triton interpreter)",
        "torch": torch.__version__, "date": date, "command": " ".join(sys.argv),
        "test_files": PEERS[args.peer]["files"], "k": args.k, "edits": edits,
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
