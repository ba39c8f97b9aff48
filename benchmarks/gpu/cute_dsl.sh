#!/usr/bin/env bash
# Issue 23 item 1: is the CuTe DSL route runnable on the lent GPU? (~30 s)
#   OUT=<dir> bash benchmarks/gpu/cute_dsl.sh
# Needs nvidia-cutlass-dsl 4.2.1 in .cute/ (git-ignored; carry [".cute"]): the wheel (62 MB) plus the
# checkout exceed the 64 MiB carry, so carry its unpacked files as an xz tarball (43 MB):
#   pip download --no-deps --python-version 3.12 --only-binary=:all: \
#       --platform manylinux_2_28_x86_64 -d /tmp/w nvidia-cutlass-dsl==4.2.1
#   pip install --no-deps --target /tmp/c /tmp/w/*.whl
#   (cd /tmp/c && tar cf - nvidia_cutlass_dsl | xz -T2 -9) > .cute/nvidia_cutlass_dsl-4.2.1.tar.xz
# The device image has its other dependencies (cuda-bindings, typing-extensions, numpy).
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/cute /tmp/cute-dsl
cute_dsl_env
"$PY" -m pip show cuda-bindings 2>/dev/null | grep -E "^(Name|Version)"
timeout -k 5 120 "$PY" benchmarks/probe_cute_dsl.py 2>&1 | tail -n 30 | tee "$OUT/cute-dsl.log"
echo "probe exit: ${PIPESTATUS[0]}"
