"""Triton's CPU interpreter for callers without torch (the JAX "triton" backend on CPU).

Why it is in the library: a user's JAX call with ``implementation="triton"`` on a machine
without a GPU runs the Triton kernels here (never automatically: "xla" is the automatic
choice there), in a process where ``TRITON_INTERPRET`` was not set when triton was
imported, so Triton's own interpreter cannot run them as they are: the kernel modules and
triton.language's ``@triton.jit`` helpers are compiled-mode functions, an interpreted
kernel can only call interpreted helpers, and the interpreter patches triton.language's
builtins at each launch without undoing them (harmless when the whole process interprets,
fatal to a kernel compiled later in the same process). Everything below is what such a run
needs, nothing more. It rests on the interpreter's internals (``InterpretedFunction``,
``_LangPatchScope.set_attr``, the launcher's view of a tensor that ``HostArray``
mimics), so it is used only with the Triton releases in ``SUPPORTED`` (``usable``, asked by
``logitless.jax.ops.common.triton.is_supported``): with another release the JAX "triton"
backend is not offered on the CPU (one ``InterpreterWarning``; "xla" runs the same ops).

Pieces, framework-free (numpy only):

``interpreted_modules(names)``
    Fresh copies of Triton kernel modules whose ``@triton.jit`` functions are
    interpreted, as if imported under ``TRITON_INTERPRET=1``, without touching the
    modules already imported (the compiled kernels stay compiled in the same process).
    ``names`` are imported in order with each earlier copy visible to the later ones'
    absolute imports (``from logitless.triton_lib.ce_math import ...``), because an
    interpreted kernel can only call interpreted helpers; each is preceded by the
    ``logitless.triton_lib`` modules it imports (read from its source, recursively)
    that ``names`` leave out, so a kernel module that starts using another helper
    module needs no change in its callers' lists. The real ``sys.modules`` entries
    are restored afterwards. Cached per tuple of names.

``HostArray(ndarray)``
    A numpy array as the interpreter's launcher expects a tensor (``data_ptr``,
    ``dtype``, storage): it reads and writes the array's memory in place, so outputs
    are numpy arrays allocated by the caller. Arrays must be C-contiguous.

``usable()``
    Whether the installed Triton is a release of ``SUPPORTED`` (decided once per process;
    one ``InterpreterWarning`` when not).

Cost: the interpreter runs every program of the grid in Python with numpy block
operations: fine for tests at tiny shapes, far too slow for real ones.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import re
import sys
import threading
import warnings

import numpy as np
import triton

#: Triton releases (major, minor), both ends included, whose interpreter internals this
#: module was checked against (tests_jax/test_jax_triton.py, test_jax_log_probs_triton.py;
#: the jax-test extra's triton pin).
SUPPORTED = ((3, 6), (3, 6))


class InterpreterWarning(UserWarning):
    """The installed Triton is outside ``SUPPORTED``: the JAX "triton" backend is off on the CPU."""


def supported(version: str) -> bool:
    """Whether a Triton version string (``triton.__version__``) is in ``SUPPORTED``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return m is not None and SUPPORTED[0] <= (int(m.group(1)), int(m.group(2))) <= SUPPORTED[1]


@functools.cache
def usable() -> bool:
    """``supported(triton.__version__)``, warning once (``InterpreterWarning``) when not."""
    if supported(triton.__version__):
        return True
    lo, hi = (".".join(map(str, v)) for v in SUPPORTED)
    warnings.warn(f"logitless: Triton {triton.__version__} is outside the releases whose CPU interpreter the JAX "
                  f"'triton' backend was checked against ({lo} to {hi}); that backend is off on the CPU "
                  "(implementation='xla' computes the same)", InterpreterWarning, stacklevel=2)
    return False

_LOCK = threading.Lock()
_CACHE: dict = {}

#: numpy dtype name -> Triton's name of the pointer's element type.
_TRITON_DTYPES = {
    "bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8", "bool": "i1",
}


#: The package whose modules ``interpreted_modules`` adds as dependencies (not this one).
_HELPERS = "logitless.triton_lib."


def _spec(name: str):
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module named {name!r}")
    return spec


def _with_dependencies(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` in order, each preceded by the ``logitless.triton_lib`` modules its
    source imports (recursively, depth first) that are not already in the list."""
    out: list[str] = []
    seen: set[str] = set()

    def visit(name: str):
        if name in seen:
            return
        seen.add(name)
        origin = _spec(name).origin
        if origin and origin.endswith(".py"):
            with open(origin, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=origin)
            for node in ast.walk(tree):
                mods = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                for m in mods:
                    if m.startswith(_HELPERS) and m != __name__:
                        visit(m)
        out.append(name)

    for n in names:
        visit(n)
    return tuple(out)


def interpreted_modules(names: tuple[str, ...]) -> dict:
    """{name: interpreted copy} of the modules ``names`` and of the ``logitless.triton_lib``
    modules they import (see the module docstring)."""
    names = tuple(names)
    with _LOCK:
        if names in _CACHE:
            return _CACHE[names]
        names_given, names = names, _with_dependencies(names)
        saved = {n: sys.modules.get(n) for n in names}
        copies = {}
        try:
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = True
                for n in names:
                    spec = _spec(n)
                    mod = importlib.util.module_from_spec(spec)
                    sys.modules[n] = mod  # later copies import this one
                    spec.loader.exec_module(mod)
                    copies[n] = mod
        finally:
            for n, m in saved.items():
                if m is None:
                    sys.modules.pop(n, None)
                else:
                    sys.modules[n] = m
        _CACHE[names_given] = copies
        return copies


#: Modules of triton.language whose own @triton.jit helpers (tl.cdiv, tl.sum's combine
#: function, ...) kernels call: they were compiled-mode functions at triton's import.
_LANGUAGE_MODULES = ("triton.language", "triton.language.standard")
_LANGUAGE_COPIES: dict = {}


@contextlib.contextmanager
def interpreted_language():
    """While inside: triton.language's @triton.jit helpers are interpreted copies (as
    under TRITON_INTERPRET=1 at triton's import); restored on exit. Hold it around an
    interpreted launch; a kernel compiled by another thread meanwhile would see the
    copies, so the launch also holds this module's lock."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    try:  # imported lazily by the launcher; its import must see the real helpers
        importlib.import_module("triton.experimental.gluon")
    except ImportError:
        pass
    import triton.runtime.interpreter as interp

    missing = object()
    with _LOCK:
        saved = []
        # The interpreter patches triton.language's builtins at each launch and again at
        # each nested @jit call, whose patches it never undoes (harmless when the whole
        # process interprets): record every first original and restore them all on exit,
        # so that kernels compiled later in this process see the real triton.language.
        first_seen: dict = {}
        set_attr = interp._LangPatchScope.set_attr

        def recording_set_attr(scope, obj, attr, value):
            first_seen.setdefault((id(obj), attr), (obj, attr, getattr(obj, attr, missing)))
            set_attr(scope, obj, attr, value)

        interp._LangPatchScope.set_attr = recording_set_attr
        try:
            for name in _LANGUAGE_MODULES:
                mod = importlib.import_module(name)
                for attr, val in list(vars(mod).items()):
                    if isinstance(val, JITFunction):
                        key = (name, attr)
                        if key not in _LANGUAGE_COPIES:
                            _LANGUAGE_COPIES[key] = InterpretedFunction(val.fn)
                        saved.append((mod, attr, val))
                        setattr(mod, attr, _LANGUAGE_COPIES[key])
            with np.errstate(all="ignore"):  # the kernels' inf/NaN lanes, as on a GPU (as launch.run_kernel does)
                yield
        finally:
            interp._LangPatchScope.set_attr = set_attr
            for obj, attr, val in first_seen.values():
                if val is missing:
                    if attr in vars(obj):
                        delattr(obj, attr)
                else:
                    setattr(obj, attr, val)
            for mod, attr, val in saved:
                setattr(mod, attr, val)


class _Storage:
    def __init__(self, arr: np.ndarray):
        self.arr = arr

    def data_ptr(self) -> int:
        return self.arr.ctypes.data

    def cpu(self):
        return self

    def copy_(self, other) -> None:
        """Host memory: the interpreter already wrote in place."""


class HostArray:
    """A C-contiguous numpy array, as the interpreter's launcher sees a tensor."""

    def __init__(self, arr: np.ndarray):
        if not arr.flags.c_contiguous:
            raise ValueError("HostArray needs a C-contiguous array")
        self.arr = arr
        self.dtype = _TRITON_DTYPES[arr.dtype.name]

    def data_ptr(self) -> int:
        return self.arr.ctypes.data

    def untyped_storage(self) -> _Storage:
        return _Storage(self.arr)

    def new_empty(self, *args, **kwargs) -> HostArray:
        return HostArray(self.arr)

    def set_(self, *args) -> HostArray:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.arr.shape

    def stride(self):
        return tuple(s // self.arr.itemsize for s in self.arr.strides)
