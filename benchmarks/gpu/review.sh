#!/usr/bin/env bash
# Issue 23 leftovers (helper "review"): the dlogits kernels' W offset moved into
# triton_lib/tile_io.recomputed_tile (sm_90 PTX identical on the CPU), bench compare
# judging forward/backward/step each, the shared JAX bench timing.
#   OUT=<dir> bash benchmarks/gpu/review.sh          (repo root; <= 120 s on an H100)
#   SMOKE=1 OUT=<dir> bash benchmarks/gpu/review.sh  (CPU: interpreter, tiny shapes, ~2 min)
# Parts (each under a hard `timeout`, capped by what is left of a 116 s budget; a
# failing part does not stop the others):
# 1. tests/test_bench_compare.py (compare on synthetic and recorded JSON)  -> review-compare-tests.log
# 2. CUDA tests of the refactored kernels: tests/test_tf32_prerounded.py, the fp32 'high'
#    tests of tests/test_precision.py, tests/test_linear_cross_entropy.py and
#    tests/test_linear_log_probs.py (bf16, fp16, fp32; torch.compile cases left out for
#    time)                                                              -> review-pytest.log
# 3. bf16 speed, same harness as the recorded run: the lce suite at llama3.1-8b
#    (logitless, default budget) and `compare` against
#    benchmarks/results/lce-issue23-H100-2026-11-23.json   -> review-bench.log, review-lce.json, review-compare.md
# 4. benchmarks/probe_review.py: fwd and fwd+bwd of linear_cross_entropy and
#    linear_log_probs at 4096 x 4096 x 128256, bf16 and fp32 'high' (W_CHUNK kernels),
#    x one GEMM, fp32 vs the recorded probe-tf32 run   -> review-probe.log, review-probe-H100.json
# Files in $OUT (<= 8): review-gpu.txt and the seven above.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/review
torch_caches review
start=$(date +%s)
BUDGET=${BUDGET:-116}
# cap WANT: WANT seconds (x3 in SMOKE mode: the interpreter on a shared CPU), or what is
# left of the budget (at least 5)
cap() {
    local want="$1" left=$(( BUDGET - ($(date +%s) - start) ))
    [ -n "$SMOKE" ] && want=$(( want * 3 ))
    [ "$left" -lt "$want" ] && echo $(( left > 5 ? left : 5 )) || echo "$want"
}
XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n 8"

if [ -n "$SMOKE" ]; then
    echo "smoke mode (CPU: Triton's interpreter, tiny shapes)" | tee "$OUT/review-gpu.txt"
    BUDGET=${SMOKE_BUDGET:-600}
    TESTS=(tests/test_tf32_prerounded.py tests/test_linear_log_probs.py)
    KEXPR="test_fp32_every_option and triton and (plain or all) or test_16bit and triton and plain or prerounded_3d"
    BENCH=(--cpu --warmup 1 --reps 2)
    PROBE=(--smoke)
else
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/review-gpu.txt"
    TESTS=(tests/test_tf32_prerounded.py tests/test_precision.py tests/test_linear_cross_entropy.py
           tests/test_linear_log_probs.py)
    KEXPR="not cpu_torch_backend and not float64 and not compile"
    BENCH=(--shapes llama3.1-8b --warmup 2 --reps 5)
    PROBE=()
fi

echo "== 1. compare tests =="
timeout -k 5 "$(cap 15)" $PY -m pytest -q -p no:cacheprovider tests/test_bench_compare.py -k "not models_suite_cpu" \
    > "$OUT/review-compare-tests.log" 2>&1
echo "compare tests exit $? at $(( $(date +%s) - start )) s"

echo "== 2. kernel tests =="
# shellcheck disable=SC2086
timeout -s INT -k 5 "$(cap 55)" $PY -m pytest -q -rfEs -p no:cacheprovider $XDIST "${TESTS[@]}" -k "$KEXPR" \
    > "$OUT/review-pytest.log" 2>&1
echo "kernel tests exit $? (124/130: cut off) at $(( $(date +%s) - start )) s"

echo "== 3. lce suite (bf16) + compare with the recorded run =="
rm -rf "$OUT/bench"
timeout -k 5 "$(cap 22)" $PY -m logitless_bench --suite lce --no-peers --budgets default --no-errors "${BENCH[@]}" \
    --out "$OUT/bench" > "$OUT/review-bench.log" 2>&1
echo "lce suite exit $? at $(( $(date +%s) - start )) s"
NEW=$(ls "$OUT"/bench/latest-lce-*.json 2>/dev/null | head -n 1)
OLD=benchmarks/results/lce-issue23-H100-2026-11-23.json
[ -n "$SMOKE" ] && OLD="$NEW"  # (CPU shapes: the file against itself, to run the command)
if [ -n "$NEW" ]; then
    cp "$NEW" "$OUT/review-lce.json"
    timeout -k 5 "$(cap 10)" $PY -m logitless_bench compare "$OLD" "$NEW" --out "$OUT/review-compare.md" \
        >> "$OUT/review-bench.log" 2>&1
    echo "compare exit $?"
fi
rm -rf "$OUT/bench"

echo "== 4. probe (fwd, fwd+bwd; bf16, fp32 'high') =="
timeout -k 5 "$(cap 28)" $PY benchmarks/probe_review.py --out "$OUT" "${PROBE[@]}" > "$OUT/review-probe.log" 2>&1
echo "probe exit $? at $(( $(date +%s) - start )) s"

echo
echo "total $(( $(date +%s) - start )) s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
echo "== summary: compare tests =="
tail -n 2 "$OUT/review-compare-tests.log"
echo "== summary: kernel tests (CUDA: LCE, log-probs, tf32 pre-rounded, precision) =="
grep -E "^(FAILED|ERROR)" "$OUT/review-pytest.log" | head -n 15
grep -E "passed|failed|error|no tests ran" "$OUT/review-pytest.log" | tail -n 2
echo "== summary: bf16 lce vs the recorded run (new/old ratios of run units; noisy = spread too large) =="
if [ -f "$OUT/review-compare.md" ]; then
    sed -n '/^## Regressions/,/^## Top improvements/p' "$OUT/review-compare.md" | grep -v "^## Top" | grep -v "^$" \
        | head -n 16
    sed -n '/^## Every compared row/,$p' "$OUT/review-compare.md" | grep -v "^$" | head -n 8
else
    tail -n 5 "$OUT/review-bench.log"
fi
echo "== summary: probe =="
sed -n '/^=== dlogits refactor/,$p' "$OUT/review-probe.log"
grep -E "Error|error" "$OUT/review-probe.log" | head -n 5
