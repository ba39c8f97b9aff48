#!/usr/bin/env bash
# Issue 12: the fused kernels' scheduling options (grouped order, flattened pipeline,
# bulk dz stores, persistent dlogits).   OUT=<dir> bash benchmarks/gpu/schedule.sh
# 1. LCE, training-loop, planner and tuner tests on CUDA     -> $OUT/schedule-pytest.log
# 2. probe_schedule.py --quick: plain vs shipped schedule, 8 shapes
#                                                            -> $OUT/probe-schedule-quick-<dev>.json
# 3. probe_overhead.py: host overhead and CUDA graphs         -> $OUT/probe-overhead-<dev>.json
# (PROBE=full runs every variant instead of --quick.)
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/prelude.sh
start=$(date +%s)
timeout 200 python3 -m pytest -q -n 8 -rs tests/test_linear_cross_entropy.py tests/test_training_loops.py \
    tests/test_cost_model.py tests/test_tuned.py tests/test_precision.py 2>&1 | tee "$OUT/schedule-pytest.log" | tail -n 8
echo "tests took $(( $(date +%s) - start )) s"
timeout 120 python3 benchmarks/probe_overhead.py --out "$OUT" 2>&1 | tee "$OUT/probe-overhead.log" | grep -v "^{"
left=$(( ${SCHEDULE_LIMIT:-570} - ($(date +%s) - start) ))
timeout $left python3 benchmarks/probe_schedule.py --out "$OUT" $([ "$PROBE" = full ] || echo --quick) \
    ${SHAPES:+--shapes $SHAPES} 2>&1 | tee "$OUT/probe-schedule.log" | grep -v "^{"
echo "total $(( $(date +%s) - start )) s"
