#!/usr/bin/env bash
# Vocab-parallel linear_jsd at the KL limits in one pass (the merge), and the KL-limit fused
# forward inside TRL's trainers (issue 23, session 8).
#   OUT=<dir> PARTS="tests probe trl" bash benchmarks/gpu/tp_jsd.sh   (from the repo root; one H100;
#                                                                   carry [".whl"]: trl, datasets, dill,
#                                                                   multiprocess wheels)
#   SMOKE=1 OUT=<dir> bash benchmarks/gpu/tp_jsd.sh                  (CPU: interpreter, tiny shapes)
# Parts (PARTS, default "tests probe trl"; each under its own cap, <= 540 s in all):
#   tests  tests/test_tensor_parallel_jsd.py, test_linear_jsd_column_sums.py (gloo on one GPU's machine; NCCL and the Triton
#          backend with >= 2 GPUs), tests/test_integrations_trl_gkd.py (CUDA trainer runs, the
#          bf16 KL-limit ones through the fused forward)                       <= 200 s
#   probe  benchmarks/probe_tp_jsd.py: one rank of TP=2 (V / 2 rows of both heads), merge vs
#          two passes vs the op without a group, beta 0 / 1 / 0.5, shapes A, B    <= 220 s
#   trl    benchmarks/trl_gkd_bench.py --beta 0 and --beta 1: GKDTrainer and
#          DistillationTrainer loss steps, TRL's own vs patch_gkd (bf16)        the rest
# Files under $OUT: tp-jsd-tests.log, probe.{log,json}, trl-beta{0,1}.{log,json,md}.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/tp_jsd /tmp/site
torch_caches tp_jsd
S=$(date +%s)
PARTS="${PARTS:-tests probe trl}"
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
left() { echo $(( 540 - ($(date +%s) - S) )); }
if ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import trl" >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
"$PY" -c "import trl, datasets, pyarrow; print('trl', trl.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)" 2>&1 | tail -1
if [ -n "$SMOKE" ]; then
    export TRITON_INTERPRET=1
    TESTS="tests/test_tensor_parallel_jsd.py"
    SMOKE_ARG="--smoke"
else
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.max.sm --format=csv 2>&1
    TESTS="tests/test_tensor_parallel_jsd.py tests/test_linear_jsd_column_sums.py tests/test_integrations_trl_gkd.py"
    SMOKE_ARG=""
fi

if has tests; then
    echo "== tests =="
    capped_pytest "$(( $(left) < 200 ? $(left) : 200 ))" "$OUT/tp-jsd-tests.log" tests $TESTS
fi
if has probe; then
    echo "== probe_tp_jsd =="
    cap=$(( $(left) < 220 ? $(left) : 220 ))
    timeout -k 5 "$cap" "$PY" benchmarks/probe_tp_jsd.py --shapes A,B --rounds 5 --budget-s $(( cap - 90 )) \
        --json "$OUT/probe.json" 2>&1 | grep -v "RuntimeWarning\|output = op\|return TensorHandle" | tee "$OUT/probe.log"
fi
if has trl; then
    for b in 0 1; do
        echo "== trl_gkd_bench --beta $b =="
        cap=$(( $(left) / (2 - b) ))
        [ "$cap" -lt 30 ] && { echo "no time left for beta $b"; continue; }
        timeout -k 5 "$cap" "$PY" benchmarks/trl_gkd_bench.py --beta "$b" --out "$OUT/trl-$b" $SMOKE_ARG \
            > "$OUT/trl-beta$b.log" 2>&1
        echo "exit $?"
        cp "$OUT/trl-$b/trl_gkd.json" "$OUT/trl-beta$b.json" 2>/dev/null
        cp "$OUT/trl-$b/trl_gkd.md" "$OUT/trl-beta$b.md" 2>/dev/null && cat "$OUT/trl-beta$b.md"
        rm -rf "$OUT/trl-$b"
    done
fi
echo "== summary =="
pytest_summary "$OUT"/tp-jsd-tests.log 2>/dev/null
echo "total $(( $(date +%s) - S )) s"
