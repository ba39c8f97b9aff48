#!/usr/bin/env bash
# Issue 17's GPU proof, one call: the refactored tree gives bit for bit the outputs of the
# tree before the refactor (benchmarks/check_bitwise.py: every op, backend, budget and
# strategy), then the PyTorch test suite on the GPU. The tree before the refactor travels as
# .baseline/src (git archive <commit> src | tar -x -C .baseline; git-ignored, carried).
#   OUT=<dir> bash benchmarks/gpu/refactor_check.sh
set -u
. benchmarks/gpu/prelude.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor TRITON_CACHE_DIR=/tmp/triton
{
  echo "== bitwise: before the refactor (.baseline/src) vs after (src)"
  PYTHONPATH=.baseline/src timeout 300 python3 benchmarks/check_bitwise.py save /tmp/before.pt
  PYTHONPATH=src timeout 300 python3 benchmarks/check_bitwise.py save /tmp/after.pt
  python3 benchmarks/check_bitwise.py compare /tmp/before.pt /tmp/after.pt
} 2>&1 | grep -v Warning | tee "$OUT/bitwise.log"
echo "== pytest tests (GPU)"
timeout "${PYTEST_TIMEOUT:-330}" python3 -m pytest tests -q -p no:cacheprovider -n 8 --timeout 300 \
  2>&1 | tee "$OUT/pytest-torch.log" | tail -25
