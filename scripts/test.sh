#!/usr/bin/env bash
# Install and run every test, in two environments (jax 0.11.2 needs Python >= 3.12, the
# CPU torch 2.13.0 wheel exists for 3.11 here, and the JAX side must work without torch):
#   .venv      python3 (3.11) + torch 2.13.0 CPU + ".[test]" + benchmarks/ (logitless-bench)
#              -> python -m pytest tests (the README's main-job command installs into this .venv too)
#   .venv-jax  Python 3.12 (pyenv or python3.12), ".[jax-test]", no torch; benchmarks/ with --no-deps
#              (its JAX suites need no torch) -> python -m pytest tests_jax
#   .venv-newest  the newest releases a user gets (torch, triton, transformers; scripts/test_newest.sh)
#              -> the version-sensitive subset of tests/
# Exits 0 only if all three ran tests and passed. Extra arguments go to the first two pytest runs.
# Override the interpreters with PYTHON_TORCH=... / PYTHON_JAX=...
#
# bash scripts/test.sh --quick: "did my install work" in a few minutes: builds .venv only and
# runs QUICK below (the op contract of every op on the torch backend, one Triton-interpreter
# case of each fused op family, the docs' paths and names); extra arguments go to that pytest run.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/pip_retry.sh  # pip_install: retries a download that breaks off; find_py312

QUICK=(tests/test_op_contract.py tests/test_docs.py
       tests/test_linear_cross_entropy.py::test_interpreter_launches_give_the_user_no_numpy_warnings
       -k "not triton or linear_cross_entropy-plain-torch.float32-triton or numpy_warnings")

status=0
py_torch="${PYTHON_TORCH:-python3}"
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi

echo "=== PyTorch tests: $py_torch -> .venv (torch 2.13.0) ==="
if [ ! -x .venv/bin/python ]; then "$py_torch" -m venv .venv || exit 1; fi
pip_install .venv/bin/python --upgrade pip
if pip_install .venv/bin/python "torch==2.13.0" -e ".[test]" -e benchmarks; then
    if [ $quick -eq 1 ]; then
        .venv/bin/python -m pytest "${QUICK[@]}" -q "$@"
        rc=$?
        [ $rc -eq 0 ] && echo "quick check passed (the full suites: bash scripts/test.sh)" || echo "quick check FAILED"
        exit $rc
    fi
    .venv/bin/python -m pytest tests "$@"
    rc=$?
    echo "PyTorch tests: exit $rc"
    [ $rc -eq 0 ] || status=1
else
    echo "PyTorch environment: install failed"; status=1
    [ $quick -eq 1 ] && exit 1
fi

py_jax="$(find_py312)" || { echo "no Python >= 3.12 found for the JAX tests (set PYTHON_JAX)"; exit 1; }
echo "=== JAX tests: $py_jax -> .venv-jax (jax 0.11.2, no torch) ==="
if [ ! -x .venv-jax/bin/python ]; then "$py_jax" -m venv .venv-jax || exit 1; fi
pip_install .venv-jax/bin/python --upgrade pip
if pip_install .venv-jax/bin/python -e ".[jax-test]" && pip_install .venv-jax/bin/python --no-deps -e benchmarks; then
    .venv-jax/bin/python -m pytest tests_jax "$@"
    rc=$?
    echo "JAX tests: exit $rc"
    [ $rc -eq 0 ] || status=1
else
    echo "JAX environment: install failed"; status=1
fi

bash scripts/test_newest.sh || status=1

[ $status -eq 0 ] && echo "all tests passed (PyTorch, JAX, newest releases)" || echo "FAILED (see above)"
exit $status
