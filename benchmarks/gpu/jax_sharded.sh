#!/usr/bin/env bash
# logitless.jax at scale (issue 19), for the 2x H200 machine: the sharded tests on the GPUs
# (Mosaic kernels for real), then the jax-sharded suite at the llama3.1-8b shape, 8192
# tokens in all, data / tensor parallel (and 2-D when >= 4 devices).
#   OUT=<dir> bash benchmarks/gpu/jax_sharded.sh        (from the repo root)
#   SMOKE=1 OUT=<dir> bash benchmarks/gpu/jax_sharded.sh   (CPU smoke: 4 host devices, tiny shape)
# Expected wall: ~4-5 min; hard caps: tests 70 + 60 s + bench 200 s (+ kill grace) <= 5.8 min.
# Writes to $OUT (<= 5 files): jax-sharded-pytest.log, jax-sharded-bench.log,
# latest-jax-sharded-<GPU>.json/.md. A failing part does not stop the other.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/jax_sharded
BENCH_ARGS=()
if [ -n "$SMOKE" ]; then
    export XLA_FLAGS="--xla_force_host_platform_device_count=4" JAX_PLATFORMS=cpu
    BENCH_ARGS=(--cpu --reps 2 --warmup 1)
fi

"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/jax-sharded-pytest.log"

echo "=== tests_jax/test_jax_sharded.py on all devices: Mosaic, HLO, shard_map first (cap 70 s), then the rest (cap 60 s) ==="
FIRST="mosaic or hlo or shard_map or tokamax"
[ -n "$SMOKE" ] && FIRST="hlo or shard_map or lowers"
LOG="$OUT/jax-sharded-pytest.log"
TAIL=25 capped_pytest 70 "$LOG" first tests_jax/test_jax_sharded.py -k "$FIRST" --durations=6
[ -n "$SMOKE" ] || TAIL=25 capped_pytest 60 "$LOG" rest tests_jax/test_jax_sharded.py -k "not ($FIRST)" --durations=6

echo "=== jax-sharded suite: llama3.1-8b head, 8192 tokens, bf16 (cap 200 s) ==="
[ -n "$SMOKE" ] || rm -f benchmarks/results/latest-jax-sharded-*.json benchmarks/results/latest-jax-sharded-*.md
timeout -k 5 200 "$PY" -m logitless_bench --suite jax-sharded --max-minutes 3 "${BENCH_ARGS[@]}" 2>&1 \
    | tee "$OUT/jax-sharded-bench.log" | grep -E "^\[jax-sharded\]|^Traceback|Error" | cut -c1-240
echo "bench exit: ${PIPESTATUS[0]} (124: killed)" | tee -a "$OUT/jax-sharded-bench.log"
for f in benchmarks/results/latest-jax-sharded-*.json benchmarks/results/latest-jax-sharded-*.md; do
    [ -f "$f" ] && cp "$f" "$OUT/"
done

echo "=== summary ==="
pytest_summary "$LOG"
md=$(ls -t benchmarks/results/latest-jax-sharded-*.md 2>/dev/null | head -1)
[ -n "$md" ] && grep -E "^\||one device's" "$md" | cut -c1-260
exit 0
