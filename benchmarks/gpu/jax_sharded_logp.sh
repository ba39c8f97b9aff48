#!/usr/bin/env bash
# logitless.jax.linear_log_probs at scale (issue 20 item 3), for the 2x H200 machine: the
# sharded log-prob tests on the GPUs, then the jax-sharded suite's log-prob rows at the
# llama3.1-8b shape (8192 tokens in all, bf16): the op on ONE GPU (global shape), then data
# and tensor parallel over both GPUs (automatic backend and "xla"), against XLA with the logits.
#   OUT=<dir> bash benchmarks/gpu/jax_sharded_logp.sh          (from the repo root)
#   SMOKE=1 OUT=<dir> bash benchmarks/gpu/jax_sharded_logp.sh  (CPU smoke: 4 host devices, tiny shape)
# Expected wall: ~3-4 min; hard caps: tests 60 + 80 s + bench 120 s (+ kill grace) <= 4.4 min.
# Writes to $OUT (<= 4 files): jax-sharded-logp-pytest.log, jax-sharded-logp-bench.log,
# latest-jax-sharded-logp-<GPU>.json/.md. A failing part does not stop the other.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/jax_sharded_logp
BENCH_ARGS=()
FIRST="hlo or bench or shard_map or gpu_backend"
REST="not ($FIRST) and not (explicit and plain)"
if [ -n "$SMOKE" ]; then
    export XLA_FLAGS="--xla_force_host_platform_device_count=4" JAX_PLATFORMS=cpu
    BENCH_ARGS=(--cpu --reps 2 --warmup 1)
    REST="vmap"
fi
LOG="$OUT/jax-sharded-logp-pytest.log"

"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$LOG"

echo "=== tests_jax/test_jax_log_probs_sharded.py on all devices: HLO, bench smoke, shard_map (cap 60 s) ==="
TAIL=20 capped_pytest 60 "$LOG" first tests_jax/test_jax_log_probs_sharded.py -k "$FIRST" --durations=4
echo "=== the rest: values and gradients vs unsharded and float64 (cap 80 s) ==="
TAIL=20 capped_pytest 80 "$LOG" rest tests_jax/test_jax_log_probs_sharded.py -k "$REST" --durations=4

echo "=== jax-sharded suite, log-prob rows: llama3.1-8b head, 8192 tokens, bf16 (cap 120 s) ==="
[ -n "$SMOKE" ] || rm -f benchmarks/results/latest-jax-sharded-logp-*.json benchmarks/results/latest-jax-sharded-logp-*.md
timeout -k 5 120 "$PY" -m logitless_bench --suite jax-sharded --name jax-sharded-logp --modes data,tensor \
    --methods logp-xla-logits,logp,logp-xla --max-minutes 1.6 "${BENCH_ARGS[@]}" 2>&1 \
    | tee "$OUT/jax-sharded-logp-bench.log" | grep -E "^\[jax-sharded\]|^Traceback|Error" | cut -c1-240
echo "bench exit: ${PIPESTATUS[0]} (124: killed)" | tee -a "$OUT/jax-sharded-logp-bench.log"
for f in benchmarks/results/latest-jax-sharded-logp-*.json benchmarks/results/latest-jax-sharded-logp-*.md; do
    [ -f "$f" ] && cp "$f" "$OUT/"
done

echo "=== summary ==="
pytest_summary "$LOG"
md=$(ls -t benchmarks/results/latest-jax-sharded-logp-*.md 2>/dev/null | head -1)
[ -n "$md" ] && grep -E "^\||one device's" "$md" | cut -c1-260
exit 0
