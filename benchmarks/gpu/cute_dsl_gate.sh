#!/usr/bin/env bash
# The CuTe DSL (nvidia-cutlass-dsl >= 4.7) path and its gate on the H100, from the worktree's root.
#   WITH the DSL (after `. .dsl2/install.sh`, shared/tools/cute-dsl-carry.sh):  OUT=<dir> bash benchmarks/gpu/cute_dsl_gate.sh dsl
#   WITHOUT it (PYTHONPATH cleared of the DSL):                                OUT=<dir> bash benchmarks/gpu/cute_dsl_gate.sh plain
# dsl: check_dsl_gate.py --expect cute (planner's choice, CuTe taken, numbers vs Triton) <= 100 s;
#      pytest tests/test_cute_{forward_gpu,planning,partials,gate}.py                    <= 250 s.
# plain: check_dsl_gate.py --expect fallback (no CuTe launch, one warning, Triton's numbers bitwise) <= 100 s.
set +e
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD${PYTHONPATH:+:$PYTHONPATH}
S=$(date +%s)
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "$1" in
dsl)
    python3 -c "from logitless.planning import cute; print('dsl', cute.dsl_version(), 'problem', cute.dsl_problem())"
    timeout -k 5 100 python3 benchmarks/check_dsl_gate.py --expect cute --json "$OUT/gate-dsl.json" 2>&1 \
        | tail -n 25
    echo "gate exit ${PIPESTATUS[0]} at $(( $(date +%s) - S )) s"
    timeout -k 5 250 python3 -m pytest tests/test_cute_forward_gpu.py tests/test_cute_planning.py \
        tests/test_cute_partials.py tests/test_cute_gate.py -q -p no:cacheprovider > "$OUT/tests.log" 2>&1
    echo "tests exit $? at $(( $(date +%s) - S )) s"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -20
    ;;
plain)
    export PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD
    python3 -c "from logitless.planning import cute; print('dsl', cute.dsl_version(), 'problem', cute.dsl_problem())"
    timeout -k 5 100 python3 benchmarks/check_dsl_gate.py --expect fallback --json "$OUT/gate-plain.json" 2>&1 \
        | tail -n 25
    echo "gate exit ${PIPESTATUS[0]} at $(( $(date +%s) - S )) s"
    ;;
esac
echo "wall $(( $(date +%s) - S )) s"
