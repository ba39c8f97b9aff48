#!/usr/bin/env bash
# GPU run of the JAX "triton" backend (issue 22) on ONE GPU (H100 by default):
#   1. jax-triton from the carried wheels if it does not import (.whl/ or .peers/:
#      jax_triton-0.3.1-py3-none-any.whl, absl_py-2.5.1-py3-none-any.whl), versions;
#   2. a one-line smoke call (implementation="triton", fwd+bwd) with its traceback if any;
#   3. tests_jax/test_jax_triton.py + the triton cases of tests_jax/test_jax_options.py on
#      the GPU (cap 110 s; the xla cases are CI's);
#   4. `python -m logitless_bench --suite jax --methods gemm,logitless-triton` at the six
#      tokamax shapes (fwd / 1 GEMM, fwd+bwd / 3 GEMMs, temp bytes, loss error vs float64;
#      cap 140 s, partial table kept when cut off);
#   5. a summary table.
#   OUT=<dir> bash benchmarks/gpu/jax_triton.sh        (from the repo root)
# Expected wall: ~4.5-5 min (hard caps 40 + 110 + 140 s + 15 s of kill grace). Writes 5
# files to $OUT: jt-setup.log, jt-pytest.log, jt-bench.log, jax-triton-<GPU>.json/.md.
# CPU smoke mode (SMOKE=1, or no GPU): the tests on Triton's interpreter (subset) and the
# bench's CPU shapes (the triton rows are skipped there, with a note).
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/jax_triton /tmp/jt-peers

{
echo "=== setup ==="
jax_triton_setup /tmp/jt-peers
jax_versions
echo "=== smoke: implementation='triton' fwd+bwd ==="
timeout -k 5 40 "$PY" benchmarks/gpu/jax_triton_smoke.py linear_cross_entropy
echo "smoke exit: $?"
} 2>&1 | tee "$OUT/jt-setup.log" | grep -vE "^WARNING:absl"

ON_GPU=$(jax_on_gpu)
if [ "${SMOKE:-0}" = "1" ] || [ "$ON_GPU" != "1" ]; then
    echo "=== CPU smoke mode: interpreter tests (subset) ==="
    SEL=(-k "not options_against and not class_weight_against")
    BENCH=(--cpu --quick --methods gemm,logitless-triton,logitless-xla --max-minutes 1)
else
    SEL=(-k "test_jax_triton or triton")
    BENCH=(--methods gemm,logitless-triton --max-minutes 2.25 --method-seconds 40)
fi

echo "=== tests_jax (triton backend + options) on $( [ "$ON_GPU" = 1 ] && echo GPU || echo CPU ) (cap 110 s) ==="
: > "$OUT/jt-pytest.log"
capped_pytest 110 "$OUT/jt-pytest.log" "" tests_jax/test_jax_triton.py tests_jax/test_jax_options.py "${SEL[@]}" --durations=8

echo "=== jax suite: gemm + logitless-triton (cap 140 s) ==="
BOUT=/tmp/jt-bench-out
rm -rf "$BOUT"
timeout -k 5 140 "$PY" -m logitless_bench --suite jax "${BENCH[@]}" --out "$BOUT" 2>&1 \
    | tee "$OUT/jt-bench.log" | grep -E "^  shape=|skip|Skip|^Traceback|^[A-Za-z.]*Error" | cut -c1-220
echo "bench exit: ${PIPESTATUS[0]} (130: partial, 124: killed)" | tee -a "$OUT/jt-bench.log"
for f in "$BOUT"/latest-jax-*.json "$BOUT"/latest-jax-*.md; do
    [ -f "$f" ] && cp "$f" "$OUT/$(basename "$f" | sed 's/^latest-jax-/jax-triton-/')"
done

echo "=== summary ==="
grep -E "^smoke|automatic choice|versions:|devices:" "$OUT/jt-setup.log"
pytest_summary "$OUT/jt-pytest.log"
md=$(ls -t "$OUT"/jax-triton-*.md 2>/dev/null | head -1)
[ -n "$md" ] && grep -E "^\| (shape|---)|gemm|logitless-triton|logitless-xla" "$md" | cut -d'|' -f2-12
exit 0
