#!/usr/bin/env bash
# One benchmark suite on a GPU machine: the suite's GPU tests, then the suite itself.
#   OUT=<dir> bash benchmarks/gpu/suite.sh SUITE [more python -m logitless_bench options]
# SUITE is one of `python -m logitless_bench --suite` (benchmarks/logitless_bench/cli.py): lce ce precision
# models distill rl grpo tp train jax jax-sharded. Environment:
#   MINUTES  the suite's --max-minutes (default 6; rows not reached are skipped, files still written;
#            0: the tests only)
#   TEST_S   the tests' time cap in seconds (default 150; 0 skips the tests)
#   PYTHON_JAX  the interpreter of the jax suites (default python3)
#   SMOKE=1  a CPU run of the script (--quick / --cpu, a few tests): checks the script, not the GPU
# Writes $OUT/<suite>-pytest.log, $OUT/<suite>-bench.log and latest-<suite>-<device>.{json,md}
# (into $OUT and benchmarks/results/, where `python -m logitless_bench compare` and the README's
# table read them). tp wants >= 2 GPUs (kind nvidia-h200-x2), jax-sharded all local devices.
set +e
cd "$(dirname "$0")/../.."
SUITE="${1:?usage: bash benchmarks/gpu/suite.sh SUITE [options]}"
shift
. benchmarks/gpu/prelude.sh
export TORCHINDUCTOR_CACHE_DIR="/tmp/inductor-$SUITE" TRITON_CACHE_DIR="/tmp/triton-$SUITE"
PY=python3
case "$SUITE" in jax|jax-sharded) PY="${PYTHON_JAX:-python3}" ;; esac
case "$SUITE" in
  lce)         TESTS="tests/test_linear_cross_entropy.py tests/test_cost_model.py" ;;
  ce)          TESTS="tests/test_cross_entropy.py" ;;
  precision)   TESTS="tests/test_precision.py tests/test_tf32_prerounded.py" ;;
  models)      TESTS="tests/test_cost_model.py tests/test_bench_compare.py tests/test_regret.py" ;;
  distill)     TESTS="tests/test_jsd.py tests/test_linear_jsd.py tests/test_linear_jsd_kl_forward.py" ;;
  rl)          TESTS="tests/test_linear_log_probs.py tests/test_log_probs.py tests/test_integrations_verl.py" ;;
  grpo)        TESTS="tests/test_bench_grpo.py tests/test_integrations_trl_grpo.py" ;;
  tp)          TESTS="tests/test_tensor_parallel.py tests/test_tensor_parallel_jsd.py tests/test_tensor_parallel_log_probs.py
                    tests/test_tensor_parallel_truncated.py tests/test_fsdp.py tests/test_bench_tp.py" ;;
  train)       TESTS="tests/test_transformers.py tests/test_transformers_families.py tests/test_training_loops.py" ;;
  jax)         TESTS="tests_jax/test_mosaic_gpu.py tests_jax/test_jax_bench.py tests_jax/test_jax_linear_cross_entropy.py" ;;
  jax-sharded) TESTS="tests_jax/test_jax_sharded.py tests_jax/test_jax_log_probs_sharded.py
                    tests_jax/test_truncated_log_probs_sharded.py tests_jax/test_weight_layout.py
                    tests_jax/test_jax_bench.py tests_jax/test_linear_jsd.py::test_sharded_on_gpus
                    tests_jax/test_linear_topk_kl.py::test_mosaic_gpu_sharded_on_gpus
                    tests_jax/test_linear_topk_kl.py::test_mosaic_gpu_sharded_hv_on_gpus" ;;
  *) echo "unknown suite '$SUITE' (see python -m logitless_bench -h)"; exit 2 ;;
esac
case "$SUITE" in rl|tp) verl_kernels && export PYTHONPATH="$VERL_PATH$PYTHONPATH" ;; esac
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>/dev/null | tail -n +2
if [ "${TEST_S:-150}" != 0 ]; then
  echo "== tests: $TESTS (cap ${TEST_S:-150} s) =="
  SEL=()
  [ -n "$SMOKE" ] && SEL=(-x --maxfail=1 -k "not gpu")
  timeout -s INT -k 5 "${TEST_S:-150}" "$PY" -m pytest -q -rs -p no:cacheprovider $TESTS "${SEL[@]}" \
      > "$OUT/$SUITE-pytest.log" 2>&1
  echo "pytest exit ${PIPESTATUS[0]} (124: cut off) after $(( $(date +%s) - start )) s"
  grep -hE "^(FAILED|ERROR)|passed|failed" "$OUT/$SUITE-pytest.log" | tail -n 12
fi
[ "${MINUTES:-6}" = 0 ] && exit 0   # MINUTES=0: the tests only
echo "== python -m logitless_bench --suite $SUITE =="
ARGS=(--suite "$SUITE" --out "$OUT")
if [ -n "$SMOKE" ]; then
  case "$SUITE" in train|grpo|jax|jax-sharded) ARGS+=(--cpu) ;; *) ARGS+=(--quick --cpu) ;; esac
else
  ARGS+=(--max-minutes "${MINUTES:-6}")
fi
timeout -k 10 $(( ${MINUTES:-6} * 60 + 90 )) "$PY" -m logitless_bench "${ARGS[@]}" "$@" > "$OUT/$SUITE-bench.log" 2>&1
echo "bench exit $? (130: partial, 124: killed) after $(( $(date +%s) - start )) s"
grep -E "^Traceback|Error" "$OUT/$SUITE-bench.log" | tail -n 5
rm -f "$OUT"/"$SUITE"-*-20*.json "$OUT"/"$SUITE"-*-20*.md "$OUT"/"$SUITE"-*-20*.png   # dated copies duplicate latest-*
if [ -z "$SMOKE" ]; then
  mkdir -p benchmarks/results
  for f in "$OUT"/latest-"$SUITE"-*.json "$OUT"/latest-"$SUITE"-*.md; do [ -f "$f" ] && cp "$f" benchmarks/results/; done
fi
for f in "$OUT"/latest-"$SUITE"-*.md; do [ -f "$f" ] && grep -E "^\|" "$f" | head -n 20; done
echo "total $(( $(date +%s) - start )) s"
