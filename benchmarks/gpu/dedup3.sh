#!/usr/bin/env bash
# Helper "dedup3" (shared set-up of the GPU scripts, JAX tests and probes; pure refactors of
# tests and scripts, no library code): proof on ONE GPU (nvidia-h100-x1 or nvidia-h200).
#   OUT=<dir> bash benchmarks/gpu/dedup3.sh          (from the repo root)
# Expected wall time: ~7-8 min (hard caps 40 + 40 + 150 + 120 + 60 + 60 + 45 s + kill grace).
# 1. the triton smoke calls of both ops (benchmarks/gpu/jax_triton_smoke.py)  -> $OUT/d3-setup.log
# 2. tests_jax on the GPU, the cases that run the shared helpers for real: the GPU-only
#    triton cases, the jax-triton compile (tests_jax/helpers.py), the Mosaic GPU log-prob
#    checks (check_log_probs, jit) and the LCE/log-prob checks at the option mixes
#                                                                            -> $OUT/d3-pytest.log
# 3. the three JAX bench scripts at a small shape through benchmarks/gpu/_jax_bench_common.py
#                                                                            -> $OUT/d3-bench.log
# 3 files come back (plus nothing else); a failing part does not stop the next.
# On a CPU (SMOKE=1 or no GPU) it runs as a smoke test of itself (interpreter subsets).
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/dedup3 /tmp/jt-peers
start=$(date +%s)

{
echo "=== setup ==="
jax_triton_setup /tmp/jt-peers
jax_versions
for op in linear_cross_entropy linear_log_probs; do
    echo "=== smoke: $op implementation='triton' fwd+bwd ==="
    timeout -k 5 40 "$PY" benchmarks/gpu/jax_triton_smoke.py $op
done
} 2>&1 | tee "$OUT/d3-setup.log" | grep -vE "^WARNING:absl"

ON_GPU=$(jax_on_gpu)
if [ "${SMOKE:-0}" = "1" ] || [ "$ON_GPU" != "1" ]; then
    echo "=== CPU smoke mode ==="
    SEL1=(-k "options_against and plain and float32")
    SEL2=(-k "empty or lowers or is_supported")
    BENCH_LP=(--cpu --max-seconds 20)
    BENCH_MOSAIC=(--smoke)
    SHAPES_MOSAIC=(--shapes tiny)
else
    SEL1=(-k "gpu_ or options_against or compile_through_jax_triton or jit_ or special_values")
    SEL2=()
    BENCH_LP=(--methods triton,xla --max-seconds 40)
    BENCH_MOSAIC=()
    SHAPES_MOSAIC=(--shapes small)
fi

echo "=== tests_jax on $( [ "$ON_GPU" = 1 ] && echo GPU || echo CPU ) (caps 150 + 120 s) ==="
: > "$OUT/d3-pytest.log"
capped_pytest 150 "$OUT/d3-pytest.log" triton tests_jax/test_jax_triton.py tests_jax/test_jax_log_probs_triton.py \
    tests_jax/test_linear_log_probs.py tests_jax/test_jax_linear_cross_entropy.py "${SEL1[@]}" --durations=6
capped_pytest 120 "$OUT/d3-pytest.log" mosaic tests_jax/test_jax_log_probs_mosaic.py "${SEL2[@]}" --durations=6

echo "=== bench scripts (caps 60 + 60 + 45 s) ==="
BOUT=/tmp/d3-bench-out
rm -rf "$BOUT"
{
echo "--- jax_log_probs_bench.py"
timeout -s INT -k 5 60 "$PY" benchmarks/gpu/jax_log_probs_bench.py --out "$BOUT" "${BENCH_LP[@]}"
echo "jax_log_probs_bench exit: $?"
echo "--- jax_log_probs_mosaic_bench.py"
timeout -s INT -k 5 60 "$PY" benchmarks/gpu/jax_log_probs_mosaic_bench.py --out "$BOUT" "${BENCH_MOSAIC[@]}" \
    $( [ "$ON_GPU" = 1 ] && echo "--shapes llama3.1-8b-8k" )
echo "jax_log_probs_mosaic_bench exit: $?"
echo "--- mosaic_bench.py"
timeout -s INT -k 5 45 "$PY" benchmarks/gpu/mosaic_bench.py --out "$BOUT" "${SHAPES_MOSAIC[@]}"
echo "mosaic_bench exit: $?"
} > "$OUT/d3-bench.log" 2>&1
grep -E "exit:|\] (ok|FAILED)|^Traceback" "$OUT/d3-bench.log" | cut -c1-200 | tail -30

echo "=== summary (dedup3) ==="
printf '| part | result |\n|---|---|\n'
printf '| smoke %s | %s |\n' linear_cross_entropy "$(grep -m1 -E '^smoke' "$OUT/d3-setup.log" | cut -c1-150)"
printf '| smoke %s | %s |\n' linear_log_probs "$(grep -E '^smoke' "$OUT/d3-setup.log" | sed -n 2p | cut -c1-150)"
while read -r line; do printf '| pytest | %s |\n' "$line"; done < <(grep -E "^pytest \(|^=+ .*(passed|failed)" "$OUT/d3-pytest.log")
while read -r line; do printf '| bench | %s |\n' "$line"; done < <(grep -E "_bench exit:" "$OUT/d3-bench.log")
printf '| failures | %s |\n' "$(grep -cE "^(FAILED|ERROR)" "$OUT/d3-pytest.log") tests, $(grep -c "FAILED (" "$OUT/d3-bench.log") bench cases"
echo "total $(( $(date +%s) - start )) s"
exit 0
