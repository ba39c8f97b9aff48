#!/usr/bin/env bash
# GPU run of the "mosaic_gpu" JAX backend (Pallas Mosaic GPU kernels, SM90).
# Usage (repo root, H100): OUT=<dir> bash benchmarks/gpu/mosaic.sh
# Expected wall time: ~4-5 min (tests ~1.5 min incl. kernel compiles, bench ~2-3 min);
# hard caps 200 s + 270 s (timeouts), so < 8 min even if a kernel hangs.
# Writes to $OUT: mosaic-pytest.log, mosaic-bench.log, mosaic-bench.json, mosaic-bench.md,
# mosaic-env.log (copies of the JSON/markdown also in benchmarks/results/).
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env /tmp/mosaic-out
mkdir -p benchmarks/results

{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  jax_versions 2>&1
} | tee "$OUT/mosaic-env.log"

echo "== 1/2 tests (tests_jax/test_mosaic_gpu.py on the GPU)"
timeout 200 $PY -m pytest tests_jax/test_mosaic_gpu.py -v -rs --tb=long -p no:cacheprovider 2>&1 \
  | tee "$OUT/mosaic-pytest.log" | tail -60
echo "pytest exit: ${PIPESTATUS[0]}"

echo "== 2/2 bench (forward/backward vs jnp.dot, errors vs float64)"
timeout 270 $PY benchmarks/gpu/mosaic_bench.py --out benchmarks/results --shapes llama3.1-8b,gemma3-4b 2>&1 \
  | tee "$OUT/mosaic-bench.log"
echo "bench exit: ${PIPESTATUS[0]}"
cp benchmarks/results/mosaic-bench.json benchmarks/results/mosaic-bench.md "$OUT/" 2>/dev/null
echo "== summary"
grep -E "passed|failed|error" "$OUT/mosaic-pytest.log" | tail -3
cat "$OUT/mosaic-bench.md" 2>/dev/null
