#!/usr/bin/env bash
# Issue 23 item 1: the CuTe DSL forward as a library backend (src/logitless/cute_lib) on the H100 (<= 540 s).
#   OUT=<dir> bash benchmarks/gpu/cutelib.sh            (carry [".cute"]: the DSL tarball, as cute_forward.sh)
#   SMOKE=1 OUT=<dir> bash benchmarks/gpu/cutelib.sh    (CPU: compile check of the library kernel
#       configurations + the CPU tests + the bench harness; PYTHON_CUTE=a Python 3.12 with the DSL
#       importable (no torch needed), PYTHON=a Python with torch)
# Parts (each under its own hard cap; a failing part does not stop the others):
#   1. check_lib_compile.py: sm_90a PTX/ptxas checks of 13 library configurations      <= 90 s
#   2. pytest tests/test_cute_{planning,partials,forward_gpu}.py (GPU: raw partials, grouped order, kept columns, CuTe vs
#      float64 / Triton, probe hook, graph capture, torch.compile)  <= 320 s (~110 tests: 116 s + 104 s serial on the H100, session 6)
#   3. bench_cutelib.py: forward-only CE and log-probs, CuTe vs Triton vs cuBLAS interleaved, 8 shapes <= 115 s
# Files under $OUT (5): cutelib-compile.{log,json}, cutelib-tests.log, cutelib-bench.{log,json}
# (the bench JSON is also copied to benchmarks/results/cutelib_forward_h100.json on the GPU run).
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/cutelib /tmp/cute-dsl
torch_caches cutelib
cute_dsl_env
S=$(date +%s)
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" 2>&1 | tail -1
"$PY" -c "from logitless.planning.cute import dsl_importable; print('cutlass.cute importable:', dsl_importable())" 2>&1 | tail -1

timeout -k 5 90 "$PYC" benchmarks/cute/check_lib_compile.py --json "$OUT/cutelib-compile.json" \
    > "$OUT/cutelib-compile.log" 2>&1
echo "compile check exit: $?"

TAIL=25 capped_pytest 320 "$OUT/cutelib-tests.log" "cute tests" tests/test_cute_planning.py tests/test_cute_partials.py tests/test_cute_forward_gpu.py

if [ -n "$SMOKE" ]; then
    TRITON_INTERPRET=1 timeout -k 5 60 "$PY" benchmarks/cute/bench_cutelib.py --smoke \
        --json "$OUT/cutelib-bench.json" > "$OUT/cutelib-bench.log" 2>&1
else
    timeout -k 5 115 "$PY" benchmarks/cute/bench_cutelib.py --json "$OUT/cutelib-bench.json" \
        > "$OUT/cutelib-bench.log" 2>&1
fi
echo "bench exit: $? (124: cut off)"
if [ -z "$SMOKE" ] && [ -s "$OUT/cutelib-bench.json" ]; then
    mkdir -p benchmarks/results && cp "$OUT/cutelib-bench.json" benchmarks/results/cutelib_forward_h100.json
fi
echo "wall: $(( $(date +%s) - S )) s"
echo "== compile check"; grep -A12 "^     H " "$OUT/cutelib-compile.log" || tail -c 1500 "$OUT/cutelib-compile.log"
echo "== tests"; grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$OUT/cutelib-tests.log" | tail -30
echo "== bench (x cuBLAS x@W.T bf16; * = the CuTe row fell back to Triton)"
grep -A10 "N x H x V" "$OUT/cutelib-bench.log" || tail -c 2000 "$OUT/cutelib-bench.log"
grep -h "maxdiff\|_error" "$OUT/cutelib-bench.log" | "$PY" -c "
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    print(r['n'], r['h'], r['v'], {k: (v if isinstance(v, str) else round(v, 6)) for k, v in r.items()
          if k.endswith('maxdiff') or k.endswith('_error')})
" 2>/dev/null
