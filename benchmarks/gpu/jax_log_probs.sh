#!/usr/bin/env bash
# GPU run of logitless.jax.linear_log_probs backends on ONE GPU (H100 by default).
# Parts are named by backend ("[triton]" here; the mosaic_gpu helper appends "[mosaic_gpu]").
#   [triton] 1. jax-triton from the carried wheels if it does not import (.whl/ or .peers/:
#               jax_triton-0.3.1-py3-none-any.whl, absl_py-2.5.1-py3-none-any.whl), versions;
#   [triton] 2. a smoke call (implementation="triton", entropy, fwd+bwd) vs float64, traceback if any;
#   [triton] 3. tests_jax/test_jax_log_probs_triton.py on the GPU (a subset: the GPU-only
#               cases, option mixes, special values, the xla agreement; cap 100 s);
#   [bench]  4. benchmarks/gpu/jax_log_probs_bench.py at the 3 RL shapes (bf16, T 0.7,
#               entropy): fwd and fwd+bwd ms of "triton" and "xla" vs one / three jnp GEMMs,
#               compile s, max |logp|, |H| error vs float64 (cap 120 s, partial table kept);
#   5. a summary table (last).
#   OUT=<dir> bash benchmarks/gpu/jax_log_probs.sh        (from the repo root)
# Expected wall: ~4 min (hard caps 40 + 100 + 120 s + kill grace). Writes 5 files to $OUT:
# jlp-setup.log, jlp-pytest.log, jlp-bench.log, jax-log-probs-<GPU>.json/.md.
# CPU smoke mode (SMOKE=1, or no GPU): the tests on Triton's interpreter (subset) and the
# bench's tiny CPU case (the triton rows are skipped there, with a note).
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/jax_log_probs /tmp/jt-peers

{
echo "=== [triton] setup ==="
jax_triton_setup /tmp/jt-peers
jax_versions
echo "=== [triton] smoke: linear_log_probs implementation='triton' fwd+bwd ==="
timeout -k 5 40 "$PY" benchmarks/gpu/jax_triton_smoke.py linear_log_probs
echo "smoke exit: $?"
} 2>&1 | tee "$OUT/jlp-setup.log" | grep -vE "^WARNING:absl"

ON_GPU=$(jax_on_gpu)
if [ "${SMOKE:-0}" = "1" ] || [ "$ON_GPU" != "1" ]; then
    echo "=== CPU smoke mode ==="
    SEL=(-k "special_values or automatic or merge_splits or gpu_ or budgets")
    BENCH=(--cpu --max-seconds 30)
else
    SEL=(-k "gpu_ or (options_against and all) or special_values or one_output or matches_the_xla or automatic or three_dimensional or bitwise or budgets")
    BENCH=(--max-seconds 75)
fi

echo "=== [triton] tests_jax/test_jax_log_probs_triton.py on $( [ "$ON_GPU" = 1 ] && echo GPU || echo CPU ) (cap 100 s) ==="
: > "$OUT/jlp-pytest.log"
capped_pytest 100 "$OUT/jlp-pytest.log" "" tests_jax/test_jax_log_probs_triton.py "${SEL[@]}" --durations=8

echo "=== [bench] RL shapes: jnp GEMMs, logitless triton and xla (cap 120 s) ==="
BOUT=/tmp/jlp-bench-out
rm -rf "$BOUT"
timeout -s INT -k 5 120 "$PY" benchmarks/gpu/jax_log_probs_bench.py --methods triton,xla --out "$BOUT" "${BENCH[@]}" 2>&1 \
    | tee "$OUT/jlp-bench.log" | grep -E "^shape=|Error|^Traceback" | cut -c1-220
echo "bench exit: ${PIPESTATUS[0]} (124/130: cut off, partial table kept)" | tee -a "$OUT/jlp-bench.log"
for f in "$BOUT"/jax-log-probs-*; do
    [ -f "$f" ] && cp "$f" "$OUT/"
done

echo "=== summary (jax linear_log_probs) ==="
grep -E "^smoke|automatic choice|versions:|devices:" "$OUT/jlp-setup.log"
pytest_summary "$OUT/jlp-pytest.log"
md=$(ls -t "$OUT"/jax-log-probs-*.md 2>/dev/null | head -1)
[ -n "$md" ] && grep -E "^\| (shape|---)|GEMMs|logitless-" "$md" | cut -d'|' -f2-11
exit 0
