#!/usr/bin/env bash
# GPU run of linear_log_probs(implementation="mosaic_gpu") (Pallas Mosaic GPU, SM90) and a
# check that the shared mosaic_lib left linear_cross_entropy's Mosaic kernels right.
# Usage (repo root, H100/H200): OUT=<dir> bash benchmarks/gpu/jax_log_probs_mosaic.sh
# CPU smoke of the script: SMOKE=1 OUT=/tmp/x bash benchmarks/gpu/jax_log_probs_mosaic.sh
# Expected wall time: ~4 min (tests <= 100 s, LCE subset <= 50 s, bench <= 110 s: hard caps).
# Writes to $OUT (6 files): summary.log (env, pytest results incl. failures, the table; read
# this first), pytest-lp.log, pytest-lce.log, bench.log, jax-log-probs-mosaic.{json,md}.
# TESTS_ONLY=1: steps 1-2 only (~2.5 min).
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env /tmp/jax-lp-mosaic-out
mkdir -p benchmarks/results
if [ -n "$SMOKE" ]; then T1=600; T2=5; T3=600; K="-k lowers or is_supported or empty"; BENCH="--smoke"
else T1=100; T2=50; T3=110; K=""; BENCH=""; fi

{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  jax_versions
} > "$OUT/summary.log" 2>&1
cat "$OUT/summary.log"

echo "== 1/3 tests: tests_jax/test_jax_log_probs_mosaic.py"
timeout $T1 $PY -m pytest tests_jax/test_jax_log_probs_mosaic.py -v -rs --tb=short -p no:cacheprovider ${K:+"$K"} \
  > "$OUT/pytest-lp.log" 2>&1
echo "pytest exit: $?"; tail -25 "$OUT/pytest-lp.log"

echo "== 2/3 linear_cross_entropy mosaic kernels after the mosaic_lib move (subset)"
timeout $T2 $PY -m pytest tests_jax/test_mosaic_gpu.py -q -rs --tb=short -p no:cacheprovider \
  -k "through_public_api or backward_matches or (forward_matches and n128v128s4lag2)" > "$OUT/pytest-lce.log" 2>&1
echo "pytest exit: $?"; tail -8 "$OUT/pytest-lce.log"

{ echo "== pytest results"
  grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest-lp.log" | tail -30
  grep -E "^E  " "$OUT/pytest-lp.log" | head -30
  grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest-lce.log" | tail -12; } >> "$OUT/summary.log" 2>&1
[ -n "$TESTS_ONLY" ] && { cat "$OUT/summary.log"; exit 0; }

echo "== 3/3 bench (RL shapes: mosaic_gpu vs xla vs jnp.dot; errors vs float64; temp memory)"
timeout $T3 $PY benchmarks/gpu/jax_log_probs_mosaic_bench.py --out "$OUT" $BENCH > "$OUT/bench.log" 2>&1
echo "bench exit: $?"; grep -E "FAILED|Error" "$OUT/bench.log" | head -10
[ -z "$SMOKE" ] && cp "$OUT"/jax-log-probs-mosaic.json "$OUT"/jax-log-probs-mosaic.md benchmarks/results/ 2>/dev/null

echo "== summary"
echo "lp tests:  $(grep -E '(passed|failed|error)' "$OUT/pytest-lp.log" | tail -1)"
echo "lce tests: $(grep -E '(passed|failed|error)' "$OUT/pytest-lce.log" | tail -1)"
tail -n +3 "$OUT/jax-log-probs-mosaic.md" >> "$OUT/summary.log" 2>/dev/null
cat "$OUT/summary.log"
