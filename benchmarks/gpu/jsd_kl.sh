#!/usr/bin/env bash
# linear_jsd's fused forward for the KL limits (beta 0 / 1, 16-bit; issue 23 item 1, session 7).
#   OUT=<dir> PARTS="tests probe tiles" bash benchmarks/gpu/jsd_kl.sh   (from the repo root; one H100)
#   SMOKE=1 OUT=<dir> bash benchmarks/gpu/jsd_kl.sh                     (CPU: interpreter, tiny shapes)
# Parts (PARTS, default "tests probe tiles"; each under its own cap, <= 560 s in all):
#   tests   tests/test_linear_jsd_kl_forward.py on CUDA (path taken, float64, odd sizes, splits vs
#           the chunked forward, a real split count)                                   <= 100 s
#   probe   benchmarks/probe_jsd_kl.py: fused vs chunked forward, interleaved rounds, shapes A
#           (8B <- 70B), B (2048 <- 2048, V 151936), C (0.5B <- 7B), D (A at 16k tokens); forward,
#           f+b, floor, peak memory, the cost model's predictions                       <= 300 s
#   tiles   probe_jsd_kl.py --tile-sweep: the fused forward under each of its TILES, A, B, C <= 130 s
#   stages  probe_jsd_kl.py --stages-fb: f+b at 3 / 4 / 5 stages (beta 1 fused, beta 0.5), A, B, C
#                                                                                        <= 200 s
#   groups  probe_jsd_kl.py --group-sweep: the same under row-block groups 4-32, A, B, D    <= 200 s
#   old     the other linear_jsd test files on CUDA (their beta 0 / 1 cases run the fused forward)
#   distill the distill suite (beta 0.5), logitless only, then bench compare against the last
#           recorded H100 run (benchmarks/results/latest-distill-H100.json)
# "old" and "distill" get what is left of 560 s (old first).
# Files under $OUT (<= 8 per call): jsd-kl-tests.log, probe.{log,json}, tiles.{log,json}, stages.{log,json},
# groups.{log,json}, jsd-kl-tests-old.log, distill.tgz.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/jsd_kl
torch_caches jsd_kl
S=$(date +%s)
PARTS="${PARTS:-tests probe tiles}"
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
left() { echo $(( 560 - ($(date +%s) - S) )); }
if [ -n "$SMOKE" ]; then
    export TRITON_INTERPRET=1
    TESTS_NEW="tests/test_linear_jsd_kl_forward.py::test_fused_forward_is_bitwise_repeatable"
    TESTS_OLD="tests/test_linear_jsd.py::test_module_matches_function"
    SHAPES="A"
    NPROC=""
else
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.max.sm --format=csv 2>&1
    TESTS_NEW="tests/test_linear_jsd_kl_forward.py"
    TESTS_OLD="tests/test_linear_jsd.py tests/test_linear_jsd_fused.py tests/test_linear_jsd_grad_in_forward.py tests/test_tensor_parallel_jsd.py"
    SHAPES="A,B,C,D"
    NPROC=""
    if $PY -c "import xdist" 2>/dev/null; then NPROC="-n 6"; fi
fi
echo "parts: $PARTS; pytest ${NPROC:-serial}"
quiet() { grep -vE "Warning|TensorHandle|op\(|USDT"; }

if has tests; then
    timeout -s INT -k 5 100 $PY -m pytest -q -rs -p no:cacheprovider $NPROC $TESTS_NEW > "$OUT/jsd-kl-tests.log" 2>&1
    echo "== tests exit $? at $(( $(date +%s) - S )) s"; quiet < "$OUT/jsd-kl-tests.log" | tail -n 8
fi
# probe NAME CAP TAIL ARGS...: probe_jsd_kl.py ARGS under a hard cap of CAP s (its rounds stop
# 40-60 s earlier), output to $OUT/NAME.{log,json}, the last TAIL lines shown.
probe() {
    local name="$1" cap="$2" lines="$3"
    shift 3
    timeout -s INT -k 5 "$cap" $PY benchmarks/probe_jsd_kl.py "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "== $name exit $? at $(( $(date +%s) - S )) s"; quiet < "$OUT/$name.log" | tail -n "$lines"
}
has probe && probe probe 300 40 --shapes $SHAPES --rounds 5 --budget-s 240
has tiles && probe tiles 130 30 --tile-sweep --shapes A,B,C --rounds 5 --budget-s 100
has stages && probe stages 200 24 --stages-fb --shapes A,B,C --rounds 4 --budget-s 160
has groups && probe groups 200 60 --group-sweep --shapes A,B,D --rounds 3 --budget-s 150
if has old; then
    cap=$(left); has distill && cap=$(( cap - 150 ))
    if [ "$cap" -gt 15 ]; then
        timeout -s INT -k 5 $cap $PY -m pytest -q -rs -p no:cacheprovider $NPROC $TESTS_OLD \
            > "$OUT/jsd-kl-tests-old.log" 2>&1
        echo "== old tests exit $? at $(( $(date +%s) - S )) s"; quiet < "$OUT/jsd-kl-tests-old.log" | tail -n 6
    else
        echo "old tests skipped (${cap} s left)" | tee "$OUT/jsd-kl-tests-old.log"
    fi
fi
if has distill && [ -z "$SMOKE" ]; then
    cap=$(left)
    mkdir -p "$OUT/d"
    timeout -s INT -k 5 $cap $PY -m logitless_bench --suite distill --methods logitless \
        --max-minutes "$($PY -c "print(round(max(0.5, ($cap - 40) / 60), 2))")" --out "$OUT/d" > "$OUT/d/distill.log" 2>&1
    echo "== distill exit $? at $(( $(date +%s) - S )) s"; grep "logitless" "$OUT/d/distill.log" | tail -n 6
    new=$(ls "$OUT"/d/latest-distill-*.json 2>/dev/null | head -1)
    if [ -n "$new" ]; then
        $PY -m logitless_bench compare benchmarks/results/latest-distill-H100.json "$new" > "$OUT/d/compare.txt" 2>&1
        tail -n 12 "$OUT/d/compare.txt"
    fi
    tar czf "$OUT/distill.tgz" -C "$OUT" d && rm -rf "$OUT/d"
fi
echo "wall $(( $(date +%s) - S )) s"
