#!/usr/bin/env bash
# backend="helion" on the GPU (issue 44), from the repo root, under WALL s (default 530):
#   run(command="bash benchmarks/gpu/helion.sh", carry=[".probe"], timeout_s=600)
#     (helion 1.5.1 and its dependencies' wheels in .probe/wheels, or HELION_WHEELS=<dir>)
#   SMOKE=1 PYTHON=<python with helion> bash benchmarks/gpu/helion.sh     # the CPU path, tiny shapes
# Steps (PARTS, default "info tune bench tests"; benchmarks/helion_gpu.py says what each does):
#   info   versions, device, whether Helion runs (torch 2.11 needs runtime's shim: its warning is printed)
#   tune   Helion's autotuner on TUNE_KERNELS (ce_forward ce_dz at the lce shape, jsd_stats
#          jsd_dz at the distill one; bf16; TUNE_TOKENS to change the tokens), TUNE_BUDGET s each (30; the process is stopped at +45 s: then the
#          fastest config of its search log counts) -> $OUT/tune-*.json, autotune-*.csv, configs/<class>.json
#   bench  helion, helion-tuned (those configs) and triton at the lce, distill and rl anchors,
#          BENCH_SECONDS (120, plus compiles) -> $OUT/helion-h100.json
#   lowerings (not in the default PARTS) the lce kernels through Helion's CuTe and Pallas code generators
#   tests  tests/test_helion_backend.py then tests/test_helion.py on CUDA (what time is left,
#          interrupted with SIGINT so that pytest still prints its summary) -> $OUT/tests*.log
set +e
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p "$OUT"
PY=${PYTHON:-python3}
S=$(date +%s)
WALL=${WALL:-530}
left() { echo $(( WALL - ($(date +%s) - S) )); }
if [ -z "$SMOKE" ]; then
    WHEELS=${HELION_WHEELS:-.probe/wheels}
    if ls "$WHEELS"/helion-*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-deps --no-index --target /tmp/hl/site-packages "$WHEELS"/*.whl 2>&1 | tail -2
        export PYTHONPATH=/tmp/hl/site-packages
    fi
fi
export PYTHONPATH=$PWD/src:$PWD/benchmarks:$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -L 2>/dev/null
PARTS=${PARTS:-info tune bench tests}
for part in $PARTS; do
    echo "== $part at $(( $(date +%s) - S )) s"
    case $part in
    info) timeout -k 5 120 $PY benchmarks/helion_gpu.py info 2>&1 | tee "$OUT/info.log" | grep -v Warning ;;
    tune)
        B=${TUNE_BUDGET:-30}
        for k in ${TUNE_KERNELS:-ce_forward ce_dz jsd_stats jsd_dz}; do
            T=$(( B + ${TUNE_GRACE:-45} )); [ "$T" -gt "$(left)" ] && T=$(left)
            [ "$T" -lt 20 ] && { echo "tune $k: no time left"; continue; }
            timeout -k 5 "$T" $PY benchmarks/helion_gpu.py tune $k > "$OUT/tune-$k.log" 2>&1
            echo "tune $k: exit $? at $(( $(date +%s) - S )) s"
            grep -E '"(seconds|default_ms|tuned_ms|autotuner)"|Error|error' "$OUT/tune-$k.log" | tail -6
        done
        $PY benchmarks/helion_gpu.py merge 2>&1 | tail -3 ;;
    bench)
        export BENCH_SECONDS=${BENCH_SECONDS:-120}
        T=$(( BENCH_SECONDS + 90 )); [ "$T" -gt "$(left)" ] && T=$(left)
        timeout -k 5 -s INT "$T" $PY benchmarks/helion_gpu.py bench > "$OUT/bench.log" 2>&1
        echo "bench: exit $? at $(( $(date +%s) - S )) s"
        grep -v -i warn "$OUT/bench.log" | tail -16 ;;
    lowerings) timeout -k 5 300 $PY benchmarks/helion_gpu.py lowerings 2>&1 | grep -E "^(cute|pallas) " ;;
    tests)
        for f in tests/test_helion_backend.py tests/test_helion.py; do
            T=$(left); [ "$T" -lt 30 ] && { echo "$f: no time left"; continue; }
            log="$OUT/$(basename "$f" .py).log"
            timeout -k 10 -s INT "$T" $PY -m pytest "$f" -q -rfEs -p no:cacheprovider --durations=8 > "$log" 2>&1
            echo "$f: exit $? at $(( $(date +%s) - S )) s"
            grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|KeyboardInterrupt" "$log" | tail -15
        done ;;
    esac
done
echo "wall $(( $(date +%s) - S )) s; outputs: $(ls "$OUT" | tr '\n' ' ')"
