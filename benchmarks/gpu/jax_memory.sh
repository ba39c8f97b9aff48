#!/usr/bin/env bash
# The Mosaic path's memory on one H100 (issue 19, item 3): the six tokamax shapes,
# fwd+bwd time as a ratio of three GEMMs and XLA's compiled temporary bytes, for
# logitless-mosaic, logitless-xla and the GEMM unit (jax suite, no peers needed).
#   OUT=<dir> bash benchmarks/gpu/jax_memory.sh        (from the repo root)
#   SMOKE=1 OUT=<dir> bash benchmarks/gpu/jax_memory.sh  (CPU: the small shapes, xla only)
# Expected wall: ~3.5 min; hard cap 225 s (+ 5 s kill grace) <= 4 min.
# Writes to $OUT (<= 3 files): jax-memory.log, latest-jax-<GPU>.json/.md.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/jax_memory
if [ -n "$SMOKE" ]; then
    export JAX_PLATFORMS=cpu
    ARGS=(--cpu --methods gemm,logitless-xla --reps 2 --warmup 1 --no-errors)
else
    ARGS=(--methods gemm,logitless-mosaic,logitless-xla --reps 8 --warmup 2 --no-errors --method-seconds 40)
fi
[ -n "$SMOKE" ] || rm -f benchmarks/results/latest-jax-H*.json benchmarks/results/latest-jax-H*.md
echo "=== jax suite: mosaic vs xla, six tokamax shapes (cap 225 s) ==="
timeout -k 5 225 "$PY" -m logitless_bench --suite jax --max-minutes 3.6 "${ARGS[@]}" 2>&1 \
    | tee "$OUT/jax-memory.log" | grep -E "^  shape=|^Traceback|Error" | cut -c1-220
echo "bench exit: ${PIPESTATUS[0]} (130: partial, 124: killed)" | tee -a "$OUT/jax-memory.log"
for f in benchmarks/results/latest-jax-*.json benchmarks/results/latest-jax-*.md; do
    case "$f" in *sharded*) continue ;; esac
    [ -n "$SMOKE" ] || case "$f" in *-cpu.*) continue ;; esac
    [ -f "$f" ] && cp "$f" "$OUT/"
done
echo "=== summary (targets: f+b/3 GEMMs <= 1.40, temp <= 512 MiB; budget 256 MiB) ==="
md=$(ls -t "$OUT"/latest-jax-*.md 2>/dev/null | head -1)
[ -n "$md" ] && grep -E "^\|" "$md" | cut -d'|' -f2-8
exit 0
