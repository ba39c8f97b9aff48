#!/usr/bin/env bash
# Helper "dedup" (shared helpers for duplicated code; pure refactors): proof on the GPU.
#   OUT=<dir> bash benchmarks/gpu/dedup.sh            (repo root; nvidia-h100-x1 or nvidia-h200)
# The tree before the change travels as .baseline/src, carried (git-ignored):
#   mkdir -p .baseline && git archive aba7a87 src | tar -x -C .baseline
# Expected wall time: ~6-8 min (each part under its own timeout; a failing part does not
# stop the next; without .baseline the comparisons are skipped with a message).
# 1. benchmarks/check_bitwise.py: every op/backend/budget/strategy (linear_log_probs
#    included), .baseline/src vs src, bit for bit, at GPU sizes        -> $OUT/bitwise.log
# 2. benchmarks/check_kernel_asm.py: the Triton kernels' sm_90 PTX, .baseline vs src
#                                                                       -> $OUT/asm.log
# 3. pytest on the GPU: the shared helpers and the ops they serve        -> $OUT/pytest.log
# 4. with >= 2 GPUs: the TP tests over NCCL (tests/_distributed.py)      -> $OUT/tp.log
# 4 files come back. On a CPU it runs as a smoke test (interpreter sizes).
set -u
. benchmarks/gpu/prelude.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-dedup}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-dedup}
start=$(date +%s)
bitwise="skipped (no .baseline/src)"; asm="skipped (no .baseline/src)"
if [ -d .baseline/src ]; then
  {
    echo "== bitwise: .baseline/src vs src"
    PYTHONPATH=.baseline/src timeout 240 python3 benchmarks/check_bitwise.py save /tmp/dedup-before.pt
    PYTHONPATH=src timeout 240 python3 benchmarks/check_bitwise.py save /tmp/dedup-after.pt
    python3 benchmarks/check_bitwise.py compare /tmp/dedup-before.pt /tmp/dedup-after.pt
  } 2>&1 | grep -v Warning | tee "$OUT/bitwise.log" | tail -n 5
  bitwise=$(grep -E "cases bitwise" "$OUT/bitwise.log" | tail -n 1)
  {
    echo "== PTX (sm_90): .baseline/src vs src"
    PYTHONPATH=.baseline/src TRITON_CACHE_DIR=/tmp/triton-asm-before timeout 150 \
      python3 benchmarks/check_kernel_asm.py save /tmp/dedup-asm-before.json
    PYTHONPATH=src TRITON_CACHE_DIR=/tmp/triton-asm-after timeout 150 \
      python3 benchmarks/check_kernel_asm.py save /tmp/dedup-asm-after.json
    python3 benchmarks/check_kernel_asm.py compare /tmp/dedup-asm-before.json /tmp/dedup-asm-after.json
  } > "$OUT/asm.log" 2>&1
  tail -n 1 "$OUT/asm.log"
  asm=$(tail -n 1 "$OUT/asm.log")
fi
echo "== pytest (GPU)"
PYTHONPATH=src timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/test_shared_helpers.py \
  tests/test_linear_log_probs.py tests/test_linear_cross_entropy.py -x 2>&1 | tee "$OUT/pytest.log" | tail -n 8
tp="skipped (fewer than 2 GPUs)"
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] 2>/dev/null; then
  echo "== TP tests (NCCL)"
  PYTHONPATH=src timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_tensor_parallel.py \
    tests/test_tensor_parallel_log_probs.py tests/test_tensor_parallel_jsd.py 2>&1 | tee "$OUT/tp.log" | tail -n 6
  tp=$(grep -E "passed|failed" "$OUT/tp.log" | tail -n 1)
fi
echo "== summary"
printf '| check | result |\n|---|---|\n'
printf '| bitwise (check_bitwise) | %s |\n' "$bitwise"
printf '| PTX sm_90 (check_kernel_asm) | %s |\n' "$asm"
printf '| pytest helpers + LCE + LLP | %s |\n' "$(grep -E "passed|failed" "$OUT/pytest.log" | tail -n 1)"
printf '| TP tests | %s |\n' "$tp"
echo "total $(( $(date +%s) - start )) s"
