"""The library's layering, read from the source (AST; nothing is imported or run).

Layers are folders; a module imports only its own layer and the layers below it (the
table ``LAYERS``, bottom first); an op never imports another op's modules; nothing
imports the benchmark package; the JAX side never imports torch or triton, the torch
side never imports jax; and no module imports itself through a cycle (imports inside
functions count: a lazy import hides a cycle, it does not remove it), in the library
nor anywhere in the repository (the benchmark package, the benchmark scripts, the
tests: ``repository_graph``).

A new folder joins by adding one line to ``LAYERS`` (a new op under ops/ needs nothing).
This file imports neither torch nor jax (only its conftest does).
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "logitless"

#: (layer, module patterns), bottom first: a module may import modules of its own layer
#: and of the layers above it in this list. "*" is one dotted name part or more.
LAYERS = [
    ("options", ["logitless.options"]),
    ("formulas", ["logitless.formulas", "logitless.formulas.*"]),
    ("planning", ["logitless.planning", "logitless.planning.*"]),
    ("triton_lib", ["logitless.triton_lib", "logitless.triton_lib.*"]),
    ("cute_lib", ["logitless.cute_lib", "logitless.cute_lib.*"]),
    ("helion_lib", ["logitless.helion_lib", "logitless.helion_lib.*"]),
    # vocab-parallel glue shared by every op (groups, merge collectives, DTensor): the ops
    # call it, and ops/common's input checks ask it what a DTensor is
    ("distributed", ["logitless.distributed", "logitless.distributed.*"]),
    ("ops/common", ["logitless.ops", "logitless.ops.common", "logitless.ops.common.*"]),
    ("ops/<op>", ["logitless.ops.*"]),
    ("transformers", ["logitless.transformers", "logitless.transformers.*"]),
    ("integrations", ["logitless.integrations", "logitless.integrations.*"]),
    ("package", ["logitless"]),
    # command-line tools that call the public ops (the opt-in tile tuner)
    ("tools", ["logitless.tune"]),
]

#: The JAX side: its own stack, beside the torch layers. It may import these (and the
#: framework-free modules of planning, those that import none of FRAMEWORKS; and the
#: torch-free Triton kernels of triton_lib, for its "triton" backend: JAX_TRITON).
JAX_SIDE = ["logitless.jax", "logitless.jax.*"]
JAX_MAY_IMPORT = ["logitless", "logitless.options", "logitless.jax", "logitless.jax.*"]
TORCH_FRAMEWORKS = {"torch", "triton", "helion"}
#: The JAX modules that may import triton (and torch-free triton_lib modules): the "triton" backend.
JAX_TRITON = ["logitless.jax.ops.common.triton", "logitless.jax.ops.*.triton_backend",
              "logitless.jax.ops.*.triton_kernels"]
JAX_FRAMEWORKS = {"jax", "jaxlib"}

#: Packages the library must never import.
FORBIDDEN = {"logitless_bench"}

#: Known breaches, each with its reason; the lead decides where the module moves.
#: (importer, imported) -> reason.
EXCEPTIONS: dict[tuple[str, str], str] = {}

#: Folders whose subfolders are ops that never import each other.
OP_FOLDERS = ["logitless.ops", "logitless.jax.ops"]
SHARED_OP_FOLDERS = {"common"}


def _matches(module: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def discover(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    modules = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement of the module, anywhere in
    it; a name imported from a package is the submodule when there is one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in known else target, node.lineno))
    return found


def layer_of(module: str) -> int:
    """Index in LAYERS of the layer whose matching pattern is the most specific (the
    longest before any "*": ops.common.x is ops/common, not ops/<op>)."""
    best, best_len = None, -1
    for i, (_, patterns) in enumerate(LAYERS):
        for p in patterns:
            if _matches(module, [p]) and len(p.split("*")[0]) > best_len:
                best, best_len = i, len(p.split("*")[0])
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its folder to LAYERS")
    return best


def op_of(module: str):
    """(op folder, op name) of a module inside an op's folder, else None."""
    for folder in OP_FOLDERS:
        if module.startswith(folder + "."):
            name = module[len(folder) + 1:].split(".")[0]
            if name not in SHARED_OP_FOLDERS and name != "ops":
                return folder, name
    return None


def graph(src: Path = SRC) -> dict[str, list[tuple[str, int]]]:
    modules = discover(src)
    return {m: imports_of(m, p, set(modules)) for m, p in modules.items()}


def _internal(name: str, modules) -> str | None:
    """The package module that an import of ``name`` loads last (its longest prefix)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def violations(src: Path = SRC) -> list[str]:
    """Every breach of the rules in the module docstring, as readable lines."""
    g = graph(src)
    out = []
    framework_free = {m for m, imps in g.items()
                      if not any(i.split(".")[0] in TORCH_FRAMEWORKS | JAX_FRAMEWORKS for i, _ in imps)}
    torch_free = {m for m, imps in g.items() if not any(i.split(".")[0] == "torch" for i, _ in imps)}
    for module, imps in g.items():
        jax_side = _matches(module, JAX_SIDE)
        for name, line in imps:
            where = f"{module}:{line} imports {name}"
            top = name.split(".")[0]
            if top in FORBIDDEN:
                out.append(f"{where}: the library never imports {top}")
            if jax_side and top in TORCH_FRAMEWORKS and not (top == "triton" and _matches(module, JAX_TRITON)):
                out.append(f"{where}: the JAX side never imports torch/triton")
            if not jax_side and top in JAX_FRAMEWORKS:
                out.append(f"{where}: the torch side never imports jax")
            target = _internal(name, g)
            if target is None or target == module:
                continue
            if jax_side:
                allowed = _matches(target, JAX_MAY_IMPORT) or (
                    _matches(target, ["logitless.planning.*"]) and target in framework_free) or (
                    _matches(module, JAX_TRITON) and _matches(target, ["logitless.triton_lib.*"])
                    and target in torch_free)
                if not allowed:
                    out.append(f"{where}: the JAX side imports only options, framework-free planning and jax/*")
            elif _matches(target, JAX_SIDE):
                if module != PACKAGE:
                    out.append(f"{where}: the torch side never imports logitless.jax")
            elif layer_of(target) > layer_of(module) and (module, target) not in EXCEPTIONS:
                out.append(f"{where}: layer {LAYERS[layer_of(module)][0]} imports the higher layer "
                           f"{LAYERS[layer_of(target)][0]}")
            mine, theirs = op_of(module), op_of(target)
            if theirs is not None and mine is not None and mine != theirs:
                out.append(f"{where}: op {mine[1]} imports another op's module")
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(g)]
    return out


def cycles(g) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    edges = {m: sorted({t for name, _ in imps if (t := _internal(name, g)) and t != m}) for m, imps in g.items()}
    return components(edges)


def components(edges: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module of ``edges`` (module ->
    the modules it imports), each as a closed path of its sorted members (Tarjan)."""
    # A module's package __init__ runs before it: importing a.b.c imports a and a.b.
    # That edge is implicit; only written imports are followed here.
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp) + [sorted(comp)[0]])

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


# ------------------------------------------------------------------ the whole repository

REPO = SRC.parent
#: Packages of the repository, by the folder that holds them (imported by dotted name).
PACKAGES = [(SRC, "logitless"), (REPO / "benchmarks", "logitless_bench"), (REPO, "tests"), (REPO, "tests_jax")]
#: Folders of scripts run as ``python benchmarks/x.py``: each puts its own folder on
#: sys.path, so its modules import each other by bare name (a few also add another of
#: these folders; a bare name is looked up in its own folder first, then in the others).
SCRIPT_FOLDERS = [REPO / "benchmarks", REPO / "benchmarks" / "gpu"]

#: Import cycles known and owned elsewhere, each with its reason: the sorted members of the
#: cycle -> reason. An entry whose cycle is gone must be removed (test below).
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


def repository_graph(repo: Path = REPO) -> dict[str, list[str]]:
    """Module -> the repository's modules it imports (module-level and function-level
    imports alike), over every package of ``PACKAGES`` and every script of
    ``SCRIPT_FOLDERS``; scripts are named by their path, e.g. ``benchmarks/probe_regret``."""
    files: dict[str, Path] = {}
    for root, package in PACKAGES:
        root = repo / root.relative_to(REPO)
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    packages = set(files)
    folders = [repo / f.relative_to(REPO) for f in SCRIPT_FOLDERS]
    scripts: dict[str, Path] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.py")):
            scripts[path.relative_to(repo).with_suffix("").as_posix()] = path

    def script_named(name: str, folder: Path):
        for f in [folder] + [f for f in folders if f != folder]:
            key = (f / name).relative_to(repo).as_posix()
            if key in scripts:
                return key
        return None

    edges = {}
    for module, path in {**files, **scripts}.items():
        is_script = module in scripts
        targets = set()
        for name, _ in imports_of(module if not is_script else "_script", path, packages):
            target = _internal(name, packages)
            if target is None and is_script:
                target = script_named(name.split(".")[0], path.parent)
            if target is not None and target != module:
                targets.add(target)
        edges[module] = sorted(targets)
    return edges


def test_no_import_cycle_in_the_repository():
    """No cycle among the modules of the library, the benchmark package, the benchmark
    scripts and the tests (imports inside functions count), besides KNOWN_CYCLES."""
    found = {tuple(c[:-1]): c for c in components(repository_graph())}
    new = [" -> ".join(c) for key, c in found.items() if key not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(new)
    gone = [key for key in KNOWN_CYCLES if key not in found]
    assert not gone, f"KNOWN_CYCLES lists cycles that are gone (remove them): {gone}"


def test_a_planted_repository_cycle_is_found(tmp_path):
    """The repository check can fail: a lazy import from a script folder's module back
    into a script that imports it, and one from timing back into runner (which imports
    timing) in the benchmark package."""
    import shutil

    for root, package in PACKAGES:
        shutil.copytree(root / package, tmp_path / root.relative_to(REPO) / package)
    for folder in SCRIPT_FOLDERS:
        shutil.copytree(folder, tmp_path / folder.relative_to(REPO), dirs_exist_ok=True)
    common = tmp_path / "benchmarks" / "_probe_common.py"
    common.write_text(common.read_text() + "\n\ndef _f():\n    import probe_regret\n")
    timing = tmp_path / "benchmarks" / "logitless_bench" / "timing.py"
    timing.write_text(timing.read_text() + "\n\ndef _g():\n    from logitless_bench import runner\n")
    found = [set(c) for c in components(repository_graph(tmp_path))]
    assert any({"benchmarks/_probe_common", "benchmarks/probe_regret"} <= c for c in found), found
    assert any({"logitless_bench.timing", "logitless_bench.runner"} <= c for c in found), found


def test_every_module_is_in_a_layer():
    for module in discover():
        if not _matches(module, JAX_SIDE):
            layer_of(module)


def test_exceptions_are_still_needed():
    """An exception whose import is gone is removed from the table."""
    g = graph()
    for importer, imported in EXCEPTIONS:
        assert any(_internal(name, g) == imported for name, _ in g.get(importer, [])), (importer, imported)


def test_layering_holds():
    found = violations()
    assert not found, "\n".join(found)


PLANTS = {
    "upward": ("logitless/formulas/_plant.py", "from logitless.ops.common import validate\n", "higher layer"),
    "distributed-upward": ("logitless/distributed/_plant.py",
                           "def f():\n    from logitless.ops.common import validate\n",
                           "higher layer"),
    "planning-imports-package": ("logitless/planning/_plant.py", "def f():\n    import logitless\n", "higher layer"),
    "other-op": ("logitless/ops/jsd/_plant.py", "from logitless.ops.linear_jsd import api\n",
                 "another op's module"),
    "bench": ("logitless/planning/_plant.py", "import logitless_bench\n", "never imports logitless_bench"),
    "torch-in-jax": ("logitless/jax/_plant.py", "def f():\n    import torch\n", "JAX side never imports torch"),
    "jax-in-torch": ("logitless/ops/common/_plant.py", "import jax.numpy\n", "torch side never imports jax"),
    "jax-imports-ops": ("logitless/jax/_plant.py", "from logitless.ops.common import validate\n",
                        "JAX side imports only"),
    "cycle": ("logitless/options.py", None, "import cycle"),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_violation_is_found(plant, tmp_path):
    """The check can fail: a copy of the source with one planted violation."""
    import shutil

    shutil.copytree(SRC / PACKAGE, tmp_path / PACKAGE)
    rel, code, message = PLANTS[plant]
    path = tmp_path / rel
    if code is None:  # a lazy import closing a cycle: options -> formulas.common -> options
        code = path.read_text() + "\n\ndef _f():\n    from logitless.formulas import common\n"
        (tmp_path / "logitless/formulas/common.py").write_text(
            (tmp_path / "logitless/formulas/common.py").read_text() + "\nfrom logitless import options\n")
    path.write_text(code)
    found = violations(tmp_path)
    assert any(message in v for v in found), found
