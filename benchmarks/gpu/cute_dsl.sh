#!/usr/bin/env bash
# Issue 23 item 1: is the CuTe DSL route runnable on the lent GPU? (~30 s)
#   OUT=<dir> bash benchmarks/gpu/cute_dsl.sh
# Needs the nvidia-cutlass-dsl 4.2.1 wheel (62 MB, one file: fits the 64 MiB carry alone) in .cute/
# (git-ignored; carry [".cute"]):
#   pip download --no-deps --python-version 3.12 --only-binary=:all: \
#       --platform manylinux_2_28_x86_64 -d .cute nvidia-cutlass-dsl==4.2.1
# The device image has its other dependencies (cuda-bindings, typing-extensions, numpy).
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/cute /tmp/cute-dsl
T=/tmp/cute-dsl
if ! "$PY" -c "import cutlass.cute" 2>/dev/null; then
    "$PY" -m pip install -q --no-deps --no-index --no-compile --target $T .cute/nvidia_cutlass_dsl-*.whl 2>&1 | tail -2
fi
export PYTHONPATH="$PYTHONPATH:$T/nvidia_cutlass_dsl/python_packages"
"$PY" -m pip show cuda-bindings 2>/dev/null | grep -E "^(Name|Version)"
timeout -k 5 120 "$PY" benchmarks/probe_cute_dsl.py 2>&1 | tail -n 30 | tee "$OUT/cute-dsl.log"
echo "probe exit: ${PIPESTATUS[0]}"
