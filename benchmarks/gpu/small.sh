#!/usr/bin/env bash
# Issue 23 item 3 (small shapes: host overhead and launch count), one H100, ~3-4 min (caps 90+45+120 s):
#   OUT=<dir> bash benchmarks/gpu/small.sh            (SMOKE=1: CPU smoke run, tiny)
# 1. probe_overhead.py at 512/1024/2048 tokens: eager f+b, host ms/call, kernel count,
#    CUDA graph (and graph == eager bitwise)                   -> $OUT/overhead.log, probe-overhead-*.json
# 2. probe_host.py: ATen ops + Triton launches per f+b, host ms with no-op kernels (CPU
#    tensors, interpreter launches replaced by no-ops)        -> $OUT/host.log, host.json
# 3. the op tests that cover the change on CUDA (fused epilogues, memoised plans, LCE
#    ops, CUDA-graph/training-loop tests, precision)          -> $OUT/tests.log
# A failing part does not stop the others; a summary table is printed last.
set +e
cd "$(dirname "$0")/../.."
if [ -z "$SMOKE" ]; then
  . benchmarks/gpu/prelude.sh
else
  export OUT=${OUT:-/tmp/small-smoke}; mkdir -p "$OUT"; export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-small TRITON_CACHE_DIR=/tmp/triton-small
PY=${PY:-python3}
declare -A RC
start=$(date +%s)

if [ -z "$SMOKE" ]; then
  timeout -k 10 90 $PY benchmarks/probe_overhead.py --out "$OUT" \
      --shapes 512:4096:32000,1024:4096:128256,2048:2048:128256 2>&1 \
      | grep -v Warning > "$OUT/overhead.log"
  RC[overhead]=${PIPESTATUS[0]}
else
  echo "smoke: probe_overhead needs a GPU" > "$OUT/overhead.log"; RC[overhead]=skipped
fi
echo "overhead done [$(( $(date +%s) - start )) s]"

TOKENS=512,1024,2048; [ -n "$SMOKE" ] && TOKENS=64
timeout -k 10 45 env TRITON_INTERPRET=1 $PY benchmarks/probe_host.py --tokens $TOKENS --reps 20 \
    --json "$OUT/host.json" > "$OUT/host.log" 2>&1
RC[host]=$?
echo "host probe done [$(( $(date +%s) - start )) s]"

TESTS="tests/test_host_overhead.py tests/test_linear_cross_entropy.py tests/test_linear_log_probs.py tests/test_training_loops.py tests/test_precision.py tests/test_tuned.py"
[ -n "$SMOKE" ] && TESTS="tests/test_host_overhead.py"
NPROC=""; [ -z "$SMOKE" ] && $PY -c "import xdist" 2>/dev/null && NPROC="-n 4"
timeout -s INT -k 10 120 $PY -m pytest $TESTS -q $NPROC -p no:cacheprovider -rs > "$OUT/tests.log" 2>&1
RC[tests]=$?
echo "tests done [$(( $(date +%s) - start )) s]"

echo
echo "== summary (issue 23 item 3), $(( $(date +%s) - start )) s =="
printf '%-10s %s\n' part rc
for k in overhead host tests; do printf '%-10s %s\n' "$k" "${RC[$k]}"; done
echo "-- probe_overhead (eager / host / kernels / CUDA graph)"
grep -E "GEMMs" "$OUT/overhead.log" | cut -c1-220
echo "-- probe_host (ATen ops + Triton launches per f+b)"
grep -A 20 "^op " "$OUT/host.log" | grep -v "^$"
echo "-- tests: $(tail -n 1 "$OUT/tests.log")"
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -n 10
