#!/usr/bin/env bash
# Issue 23 item 3 (helper "hostjsd"): the fast-launch A/B in one process, and linear_jsd's
# forward timeline. One H100, ~3 min, at most 200 s (caps 70 + 80 + the rest of 195 s):
#   OUT=<dir> bash benchmarks/gpu/host_jsd.sh            (SMOKE=1: CPU smoke run, ~2 min)
# 1. probe_launch_ab.py at 512x4096x32000 and 1024x2048x32000, eager f+b and forward-only:
#    fast launch on (default) / on under an override / off (override(fast_launch=False)),
#    interleaved in 15 rounds in ONE process; host, GPU span, loop, do_bench-style, synced
#    times; gc counts; launches; bitwise; cProfile per mode       -> ab.log, ab.json
# 2. probe_jsd_timeline.py at jsd2's shapes (4096 x 4096<-8192 x 128256, 4096 x 2048<-2048 x
#    151936, 512 x 4096<-8192 x 128256), forward and f+b, launches through kernel[grid]
#    (before) vs the cached fast launch (after this branch): kernels in order, gaps, queue
#    delays, host-starved idle, host calls in the gaps, sync warnings, syncing runtime
#    calls; nvidia-smi SM clock / power sampled meanwhile  -> timeline.log, timeline-rows.log,
#    timeline.json, smi.csv
# 3. tests on CUDA (the time left): launch path + jsd fast launches + timeline reader, then
#    linear_jsd / jsd tests                                    -> tests.log
# A failing part does not stop the others; a summary is printed last. 7 files.
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env /tmp/host-jsd-out
torch_caches hostjsd
start=$(date +%s)
declare -A RC T
since() { echo $(( $(date +%s) - start )); }

if [ -n "$SMOKE" ]; then
    export TRITON_INTERPRET=1
    SM="--cpu-smoke"
    TESTS_A="tests/test_fast_launch_override.py tests/test_probe_timelines.py"
    TESTS_B="tests/test_linear_jsd_fused.py::test_eager_fast_path_is_bitwise_the_custom_op"
else
    SM=""
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.max.sm --format=csv,noheader 2>&1
    TESTS_A="tests/test_fast_launch_override.py tests/test_probe_timelines.py tests/test_linear_jsd_fused.py tests/test_host_overhead.py"
    TESTS_B="tests/test_linear_jsd.py tests/test_jsd_split_rows.py tests/test_linear_jsd_grad_in_forward.py tests/test_jsd.py tests/test_linear_jsd_tf32.py"
fi

echo "== 1. fast-launch A/B, one process (cap 70 s) [$(since) s]"
timeout -s INT -k 5 70 "$PY" benchmarks/probe_launch_ab.py $SM --shapes 512:4096:32000,1024:2048:32000 \
    --rounds 15 --k 20 --profile --json "$OUT/ab.json" > "$OUT/ab.log" 2>&1
RC[ab]=$?; T[ab]=$(since)

echo "== 2. linear_jsd timeline (cap 80 s) [$(since) s]"
SMI_PID=""
if [ -z "$SMOKE" ] && command -v nvidia-smi >/dev/null; then
    Q="timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu"
    nvidia-smi --query-gpu=clocks_event_reasons.active --format=csv >/dev/null 2>&1 && Q="$Q,clocks_event_reasons.active"
    nvidia-smi --query-gpu="$Q" --format=csv -lms 100 > "$OUT/smi.csv" 2>&1 &
    SMI_PID=$!
fi
timeout -s INT -k 5 80 "$PY" benchmarks/probe_jsd_timeline.py $SM --json "$OUT/timeline.json" \
    --log "$OUT/timeline-rows.log" 2>&1 | grep -vE "Warning|USDT|warnings.warn|TensorHandle" > "$OUT/timeline.log"
RC[timeline]=${PIPESTATUS[0]}; T[timeline]=$(since)
[ -n "$SMI_PID" ] && kill "$SMI_PID" 2>/dev/null

echo "== 3. tests [$(since) s]"
left=$(( 195 - $(since) ))
[ "$left" -gt 120 ] && left=120
if [ "$left" -gt 10 ]; then
    timeout -s INT -k 5 "$left" "$PY" -m pytest $TESTS_A -q -p no:cacheprovider -rs > "$OUT/tests.log" 2>&1
    RC[tests_launch]=$?
else
    echo "skipped: ${left} s left" > "$OUT/tests.log"; RC[tests_launch]=skipped
fi
T[tests_launch]=$(since)
left=$(( 195 - $(since) ))
if [ "$left" -gt 15 ]; then
    timeout -s INT -k 5 "$left" "$PY" -m pytest $TESTS_B -q -p no:cacheprovider -rs >> "$OUT/tests.log" 2>&1
    RC[tests_jsd]=$?
else
    echo "tests_jsd skipped: ${left} s left" >> "$OUT/tests.log"; RC[tests_jsd]="skipped (${left} s left)"
fi
T[tests_jsd]=$(since)

echo
echo "== summary (hostjsd: fast-launch A/B, linear_jsd timeline), $(since) s =="
printf '%-13s %-22s %s\n' part rc "done at (s)"
for k in ab timeline tests_launch tests_jsd; do printf '%-13s %-22s %s\n' "$k" "${RC[$k]}" "${T[$k]}"; done
echo "   (rc 124 / 130 / 2: cut off by its cap)"
echo "-- 1. A/B (ms, median over rounds [p10,p90] in ab.log): on = default, ovr = on under an override, off = kernel[grid]"
grep -E "^\{'device'" "$OUT/ab.log" | cut -c1-200
sed -n '/== A\/B summary/,$p' "$OUT/ab.log" | cut -c1-420
grep -E "^[0-9]+x[0-9]+x[0-9]+ +(fb|fwd) +(on|on_ovr|off) " "$OUT/ab.log" \
    | sed -E 's/^([^ ]+ +[^ ]+ +[^ ]+) .* \| (launches .*)$/   \1 \2/' | head -n 12
grep -E "^-- cProfile" "$OUT/ab.log"
grep -E "Error|Traceback" "$OUT/ab.log" | head -n 4
echo "-- 2. linear_jsd timeline (kgrid = every launch through kernel[grid], fast = cached launches)"
sed -n '/== jsd timeline summary/,$p' "$OUT/timeline.log"
echo "   largest gaps, 8k->4k forward (us before activity #; host-starved; what the host did):"
grep -A 6 -E "^llama-8k->4k fwd (kgrid|fast):" "$OUT/timeline.log" | grep -E "^llama|gap" | cut -c1-330 | head -n 14
grep -E "Error|Traceback" "$OUT/timeline.log" | head -n 4
if [ -s "$OUT/smi.csv" ]; then
    echo "   nvidia-smi during part 2, samples at >= 50% utilisation (SM MHz min/median/max, W max):"
    awk -F', ' 'NR>1 && $6+0>=50 {print $2+0, $4+0}' "$OUT/smi.csv" | sort -n | awk '{c[NR]=$1; if ($2>w) w=$2}
        END {if (NR) printf "   %d samples: SM %d / %d / %d MHz, power max %.0f W\n", NR, c[1], c[int((NR+1)/2)], c[NR], w}'
    awk -F', ' 'NR>1 && $6+0>=50 && NF>=7 {print $7}' "$OUT/smi.csv" | sort | uniq -c | sort -rn | head -n 3
fi
echo "-- 3. tests:"
grep -E "passed|failed|error|skipped|no tests ran" "$OUT/tests.log" | grep -vE "^(FAILED|ERROR)" | tail -n 4
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -n 12
echo "total $(since) s"
