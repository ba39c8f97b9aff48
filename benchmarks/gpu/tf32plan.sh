#!/usr/bin/env bash
# Issue 23 item 2 (helper "tf32plan"): fp32 at matmul precision "high": the planner picks
# pre-rounded operands (scratch buffers) or rounding in the kernels' registers with the
# cost model (plans.tf32_choice); this checks it on the GPU.
#   OUT=<dir> bash benchmarks/gpu/tf32plan.sh          (from the repo root; <= 150 s on an H100)
#   SMOKE=1 OUT=<dir> bash benchmarks/gpu/tf32plan.sh  (CPU: the tests on the interpreter + a tiny probe)
# 1. tests/test_tf32_plan_choice.py + tests/test_tf32_prerounded.py on CUDA (the choice at
#    the suite's shapes on an emulated H100, forward/backward on one path, tuned tiles per
#    path; both forced paths bitwise equal on the GPU) -> $OUT/tf32plan-pytest.log (cap 55 s)
# 2. benchmarks/probe_tf32plan.py: the precision suite's three shapes at the default budget
#    (+ 2048x2048x32000 at 1 GiB, 512x4096x128256), forward and forward+backward: the planner's default vs
#    forced pre-rounded vs forced in-kernel, the cost model's predictions, the losses
#    bitwise equal -> $OUT/tf32plan-probe.log, $OUT/probe-tf32plan-*.json (cap 80 s)
# Files in $OUT (<= 8): tf32plan-gpu.txt, tf32plan-pytest.log, tf32plan-probe.log,
# probe-tf32plan-*.json. A failing part does not stop the other. Summary table last.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/tf32plan
torch_caches tf32plan
start=$(date +%s)

if [ -n "$SMOKE" ]; then
    echo "smoke mode (CPU)" | tee "$OUT/tf32plan-gpu.txt"
    TAIL=8 capped_pytest 400 "$OUT/tf32plan-pytest.log" "tf32plan" -q \
        tests/test_tf32_plan_choice.py tests/test_tf32_prerounded.py -k "not lower_alike"
    timeout -k 5 120 "$PY" benchmarks/probe_tf32plan.py --smoke --out "$OUT" 2>&1 \
        | grep -v "Warning\|TensorHandle\|output = op" | tee "$OUT/tf32plan-probe.log" | tail -n 3
else
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/tf32plan-gpu.txt"
    echo "== tests (CUDA) =="
    XDIST=""
    "$PY" -c "import xdist" 2>/dev/null && XDIST="-n 4"
    # shellcheck disable=SC2086
    TAIL=12 capped_pytest 55 "$OUT/tf32plan-pytest.log" "tf32plan" -q $XDIST \
        tests/test_tf32_plan_choice.py tests/test_tf32_prerounded.py
    echo "tests took $(( $(date +%s) - start )) s"
    echo "== probe: planner's path vs forced paths (fp32 'high') =="
    timeout -k 5 80 "$PY" benchmarks/probe_tf32plan.py --out "$OUT" --budget-s 55 2>&1 \
        | tee "$OUT/tf32plan-probe.log" | grep -v "^===\|^shape\|^wrote" | tail -n 10
    echo "probe: exit ${PIPESTATUS[0]} (124: cut off at 80 s)" | tee -a "$OUT/tf32plan-probe.log"
fi

echo "total $(( $(date +%s) - start )) s; files in $OUT:"
ls "$OUT"
echo "== summary: tests =="
pytest_summary "$OUT/tf32plan-pytest.log"
echo "== summary: planner's choice (ms, x TF32 GEMMs; ok = chosen path the faster or within 3%) =="
sed -n '/^=== tf32plan/,$p' "$OUT/tf32plan-probe.log"
