"""The documents name things that exist.

Scans README.md, docs/*.md and the docstrings of every module under src/ and of the benchmark
package (benchmarks/logitless_bench/, its own distribution) for

- repository paths (``src/...``, ``benchmarks/...``, ``tests/...``, ``tests_jax/...``,
  ``docs/...``, ``scripts/...``) and relative markdown links: the file or folder must exist
  (a path with a placeholder such as ``<device>`` or ``*`` needs its literal folder);
- dotted names starting with ``logitless.`` or ``logitless_bench.``: the module must exist
  and the rest must be an attribute of it. Resolved by importing the module (then getattr);
  where that import needs a framework this Python lacks (jax on the torch side, the CuTe
  DSL, ...) the name is resolved from the source instead: the module file, then a top-level
  definition, assignment or import of that name (one level into a class).

Also: the README's Layout section lists exactly the layers of tests/test_layering.py, and
its results table is what ``scripts/readme_table.py`` generates from the committed JSON.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
#: The folder of the benchmark package (``logitless_bench``, the ``logitless-bench`` distribution).
BENCH = ROOT / "benchmarks"

#: Documents not scanned, each with its reason.
SKIP_DOCS = {
    "docs/history.md": "lists deleted files on purpose (each one `git show` away)",
}

#: Paths and names another branch adds: not checked here; drop them once merged.
PENDING: dict = {
    # branch topk (the PyTorch linear_topk_kl, merged with jax-ops)
    "logitless.formulas.topk_kl": "topk", "logitless.linear_topk_kl": "topk",
}

PATH_RE = re.compile(r"(?<![\w/.\-~$])((?:src|benchmarks|tests_jax|tests|docs|scripts)/[\w./<>*{},\-]*[\w>*}/])")
NAME_RE = re.compile(r"(?<![\w.])(logitless(?:_bench)?(?:\.[A-Za-z_]\w*)+)")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")


def _documents():
    docs = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    return [p for p in docs if p.relative_to(ROOT).as_posix() not in SKIP_DOCS]


def _docstrings():
    """(where, text) of every module, class and function docstring under src/ and of the
    benchmark package."""
    out = []
    for path in sorted(SRC.rglob("*.py")) + sorted((BENCH / "logitless_bench").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    line = getattr(node, "lineno", 1)
                    out.append((f"{path.relative_to(ROOT).as_posix()}:{line}", doc))
    return out


def _texts():
    texts = [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in _documents()]
    return texts + _docstrings()


def _path_exists(ref: str) -> bool:
    ref = ref.rstrip("/.")
    if any(c in ref for c in "<*{"):  # a template: its literal folder must exist
        literal = re.split(r"[<*{]", ref, maxsplit=1)[0]
        folder = literal if literal.endswith("/") else literal.rsplit("/", 1)[0]
        return (ROOT / folder).is_dir()
    return (ROOT / ref).exists()


def _module_file(module: str):
    base = (BENCH if module.split(".")[0] == "logitless_bench" else SRC).joinpath(*module.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.exists():
            return cand
    return None


def _defined_in_source(path: Path, attrs: list[str]) -> bool:
    """``attrs[0]`` is defined at the top level of ``path`` (``attrs[1]`` one level into it)."""
    tree = ast.parse(path.read_text())

    def names(body):
        found = {}
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            found[n.id] = None
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    found[(a.asname or a.name).split(".")[0]] = None
            elif isinstance(node, (ast.If, ast.Try)):
                inner = node.body + getattr(node, "orelse", []) + [
                    s for h in getattr(node, "handlers", []) for s in h.body]
                found.update(names(inner))
        return found

    top = names(tree.body)
    if attrs[0] not in top:
        return False
    if len(attrs) == 1:
        return True
    node = top[attrs[0]]
    return isinstance(node, ast.ClassDef) and attrs[1] in names(node.body)


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):  # the longest prefix that is a module file
        module = ".".join(parts[:i])
        if _module_file(module) is not None:
            break
    else:
        return False
    rest = parts[i:]
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:  # an optional framework this Python lacks: read the source
        if (exc.name or "").split(".")[0] in ("logitless", "logitless_bench"):
            return False
        return not rest or _defined_in_source(_module_file(module), rest)
    for attr in rest:
        if not hasattr(obj, attr):
            # a submodule not imported by its package, or a name defined only in the source
            return _defined_in_source(_module_file(module), rest)
        obj = getattr(obj, attr)
    return True


def _missing():
    paths, names, links = [], [], []
    for where, text in _texts():
        for ref in PATH_RE.findall(text):
            if ref not in PENDING and not _path_exists(ref):
                paths.append(f"{where}: {ref}")
        for name in NAME_RE.findall(text):
            if name not in PENDING and not _resolves(name):
                names.append(f"{where}: {name}")
        if where.endswith(".md"):
            base = (ROOT / where).parent
            for target in LINK_RE.findall(text):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue
                file = target.split("#", 1)[0]
                rel = (base / file).resolve().relative_to(ROOT).as_posix() if file else where
                if rel not in PENDING and not (ROOT / rel).exists():
                    links.append(f"{where}: ({target})")
    return paths, names, links


@pytest.fixture(scope="module")
def missing():
    sys.path.insert(0, str(ROOT))
    try:
        return _missing()
    finally:
        sys.path.remove(str(ROOT))


def test_repository_paths_exist(missing):
    paths, _, _ = missing
    assert not paths, "paths named in the docs or docstrings that do not exist:\n" + "\n".join(paths)


def test_dotted_names_resolve(missing):
    _, names, _ = missing
    assert not names, "logitless names in the docs or docstrings that do not resolve:\n" + "\n".join(names)


def test_markdown_links_resolve(missing):
    _, _, links = missing
    assert not links, "relative links to files that do not exist:\n" + "\n".join(links)


#: ``_name.attr`` / ``_name.py`` in a docstring: a private module of an older layout unless a
#: module of that name exists or the same file binds the name (an import alias).
PRIVATE_RE = re.compile(r"(?<![\w.>}])(_[a-z][a-z0-9_]*)(?:\.py\b|\.(?=[A-Za-z_]))")


def test_no_private_module_names_of_an_older_layout():
    stems = {p.stem for p in [*SRC.rglob("*.py"), *(BENCH / "logitless_bench").rglob("*.py")]}
    stale = []
    for where, text in _docstrings():
        source = (ROOT / where.split(":")[0]).read_text()
        for name in PRIVATE_RE.findall(text):
            bound = rf"\bas {name}\b|import {name}\b|^\s*{name} = |def {name}\b|class {name}\b"
            if name in stems or re.search(bound, source, re.M):
                continue
            stale.append(f"{where}: {name}")
    assert not stale, "docstrings naming modules that do not exist:\n" + "\n".join(stale)


def test_the_checks_catch_stale_references():
    """The resolvers reject what a stale reference looks like (a planted bug must fail)."""
    assert not _path_exists("src/logitless/_cost_model.py")
    assert not _path_exists("benchmarks/probe_gluon.py")
    assert _path_exists("benchmarks/results/latest-<suite>-<device>.json")
    assert not _resolves("logitless._plans.forced_strategy")
    assert not _resolves("logitless.planning.cost_model.NoSuchThing")
    assert not _resolves("logitless.bench")
    assert _resolves("logitless.planning.cost_model.DeviceModel")
    assert _resolves("logitless.jax.linear_cross_entropy")
    assert _resolves("logitless_bench.shapes.MODEL_SHAPES")
    found = NAME_RE.findall("see ``logitless.ops.linear_jsd.api.linear_jsd``. And logitless::lce_forward.")
    assert found == ["logitless.ops.linear_jsd.api.linear_jsd"]
    assert PRIVATE_RE.findall("see ``_plans.WAVES``, _loss_math.py, not ``_helper``") == ["_plans", "_loss_math"]
    assert PATH_RE.findall("(`src/logitless/planning/plans.py`), and benchmarks/gpu/.") == [
        "src/logitless/planning/plans.py", "benchmarks/gpu/"]


# --------------------------------------------------------------------------- README


def _layout_block(readme: str) -> list[str]:
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("    ")]


def test_readme_layout_lists_the_layers():
    """Every layer folder of tests/test_layering.py is listed under src/logitless/ in the
    README's Layout, and every folder listed there is a layer (or the JAX side)."""
    from tests.test_layering import LAYERS

    expected = set()
    for layer, _ in LAYERS:
        expected.add({"options": "options.py", "package": "__init__.py", "tools": "tune.py"}.get(layer, layer + "/"))
    listed = set()
    inside = False
    for line in _layout_block((ROOT / "README.md").read_text()):
        if line.startswith("    src/logitless/"):
            inside = True
            continue
        if inside and line.startswith("      ") and not line.startswith("       "):
            listed.add(line.split()[0])
        elif inside and not line.startswith("       "):
            inside = False
    listed.discard("jax/")  # the JAX side: its own stack beside the torch layers
    assert listed == expected, (sorted(expected - listed), sorted(listed - expected))
    for entry in listed:
        path = SRC / "logitless" / entry.replace("<op>", "")
        assert path.exists(), entry


def test_readme_results_table_is_generated():
    """The table between the README's markers is what scripts/readme_table.py makes from
    the committed JSON (run ``python scripts/readme_table.py --write`` after a new run)."""
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "scripts" / "readme_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    readme = (ROOT / "README.md").read_text()
    assert mod.BEGIN in readme and mod.END in readme
    assert mod.render(readme, mod.table()) == readme
    assert "| llama3.1-8b (4096, 4096, 128256) |" in mod.table()


def test_the_house_stays_small():
    """The size limits of issue 35: README <= 250 lines, docs/ <= 3,000, benchmarks/ (code) <=
    6,000 (the scripts and GPU tools, not the benchmark package benchmarks/logitless_bench/); no
    dated session logs in docs/."""
    root = ROOT
    count = lambda files: sum(len(f.read_text().splitlines()) for f in files)  # noqa: E731
    assert count([root / "README.md"]) <= 250
    assert count(sorted((root / "docs").rglob("*.md"))) <= 3000
    code = [f for f in (root / "benchmarks").rglob("*") if f.suffix in (".py", ".sh") and "results" not in f.parts]
    assert count([f for f in code if "logitless_bench" not in f.parts]) <= 6000
    dated = [f.name for f in (root / "docs").rglob("*.md") if re.search(r"20\d\d-\d\d-\d\d", f.name)]
    assert not dated, dated


# --------------------------------------------------------------------------- code blocks

#: Documents whose every Python block says on its first line whether it runs pasted alone on a
#: CPU (``# runs on a CPU``: run here, in a fresh interpreter with nothing else) or what it needs
#: instead (``# needs ...``: a GPU, a framework's trainer, a checkpoint, another block's tensors).
#: docs/megatron.md's CPU block runs in tests/test_integrations_megatron.py (it needs megatron-core).
PASTED_DOCS = ("docs/rl.md", "docs/transformers.md", "docs/torchtitan.md")
RUNS, NEEDS = "# runs on a CPU", "# needs "


def _python_blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), flags=re.S)


def test_python_blocks_say_whether_they_run_pasted_alone():
    unmarked = [f"{doc} block {i}: {block.splitlines()[0]!r}" for doc in PASTED_DOCS
                for i, block in enumerate(_python_blocks(doc)) if not block.startswith((RUNS, NEEDS))]
    assert not unmarked, f"Python blocks whose first line is neither {RUNS!r} nor {NEEDS!r}...:\n" + "\n".join(unmarked)


@pytest.mark.parametrize("doc,index", [(doc, i) for doc in PASTED_DOCS
                                       for i, block in enumerate(_python_blocks(doc)) if block.startswith(RUNS)])
def test_cpu_blocks_run_pasted_alone(doc, index):
    import subprocess

    block = _python_blocks(doc)[index]
    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(block))
                if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in
                (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
    missing = sorted(m for m in imported if m and importlib.util.find_spec(m) is None)
    if missing:
        pytest.skip(f"{doc} block {index} imports {missing}, not installed here")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(SRC)
    done = subprocess.run([sys.executable, "-c", block], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, f"{doc} block {index} failed pasted alone:\n{done.stderr[-3000:]}"
