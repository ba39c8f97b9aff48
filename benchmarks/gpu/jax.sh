#!/usr/bin/env bash
# GPU run of the JAX side, second round (helper "jaxfix"): tests_jax (all, no -x), then the
# jax benchmark suite (six shapes, smallest first; gemm, logitless-xla, xla-logits,
# tokamax-chunked, logitless-mosaic), bounded in time.
#   OUT=<dir> bash benchmarks/gpu/jax.sh        (from the repo root)
# Expected wall: ~6.5-7 min; hard caps: tests 150 s + bench 270 s (+ 5 s kill grace each)
# + peer install ~20 s => <= 7.5 min.
# Writes to $OUT (5-6 files): jax-pytest.log, jax-bench.log, latest-jax-<GPU>.json/.md/.png.
# The bench saves its files after every row and starts no work in the last ~15 s of
# --max-minutes, so a cut-off run still leaves a table (marked partial).
set +e
cd "$(dirname "$0")/../.."
. benchmarks/gpu/lib.sh
gpu_env .out/jax

# Peers (tokamax and its deps) from .peers/, plus the xprof stub tokamax imports at load.
PEERS="${PEERS:-/tmp/peers}"
if ls .peers/*.whl >/dev/null 2>&1 && [ ! -e "$PEERS/.done" ]; then
    "$PY" -m pip install -q --no-deps --no-index --no-compile --target "$PEERS" .peers/*.whl 2>&1 | tail -2
    touch "$PEERS/.done"
fi
mkdir -p "$PEERS/xprof/cli"
[ -f "$PEERS/xprof/__init__.py" ] || touch "$PEERS/xprof/__init__.py" "$PEERS/xprof/cli/__init__.py"
[ -f "$PEERS/xprof/cli/tools.py" ] || echo "get_kernel_stats_tool = lambda *a, **k: None" > "$PEERS/xprof/cli/tools.py"
export PYTHONPATH="src:$PEERS"

"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/jax-pytest.log"

echo "=== tests_jax on the GPU (cap 150 s) ==="
# The Mosaic kernels (never run on hardware before) first, so a cut-off run has them.
# -v: a test that hangs (a kernel deadlock) is named in the log; SIGINT at the cap: pytest
# still prints its summary; --durations: where the time went.
timeout -s INT -k 5 150 "$PY" -m pytest tests_jax/test_mosaic_gpu.py tests_jax/test_jax_bench.py \
    tests_jax/test_jax_linear_cross_entropy.py -v -ra -p no:cacheprovider --durations=12 2>&1 \
    | tee -a "$OUT/jax-pytest.log" | grep -vE " PASSED|^WARNING:absl" | tail -40
echo "pytest exit: ${PIPESTATUS[0]} (2 or 124: cut off at 150 s)" | tee -a "$OUT/jax-pytest.log"

echo "=== jax benchmark suite (cap 270 s) ==="
rm -f benchmarks/results/latest-jax-H*.json benchmarks/results/latest-jax-H*.md benchmarks/results/latest-jax-H*.png
timeout -k 5 270 "$PY" -m logitless_bench --suite jax --max-minutes 4.25 --method-seconds 45 2>&1 \
    | tee "$OUT/jax-bench.log" | grep -E "^  shape=|UserWarning|^Traceback|^[A-Za-z.]*Error" | cut -c1-220
echo "bench exit: ${PIPESTATUS[0]} (130: partial, 124: killed)" | tee -a "$OUT/jax-bench.log"
for f in benchmarks/results/latest-jax-*.json benchmarks/results/latest-jax-*.md benchmarks/results/latest-jax-*.png; do
    case "$f" in *-cpu.*) continue ;; esac
    [ -f "$f" ] && cp "$f" "$OUT/"
done

echo "=== summary ==="
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/jax-pytest.log" | tail -25
md=$(ls -t benchmarks/results/latest-jax-*.md 2>/dev/null | grep -v -- "-cpu" | head -1)
[ -n "$md" ] && grep -vE "^#|^Ratios|^jax " "$md" | grep -v "^$" | cut -d'|' -f2-12
exit 0
