#!/usr/bin/env bash
# GPU run of the JAX side (helper "jax"): tests_jax on the GPU, then the jax benchmark suite.
#   OUT=<dir> bash benchmarks/gpu/jax.sh        (from the repo root; expected wall ~7 min, hard cap ~8.5)
# Writes to $OUT: jax-pytest.log, jax-bench.log, latest-jax-<GPU>.json/.md/.png (at most 5 files).
# JAX would preallocate 75% of the GPU at first use: XLA_PYTHON_CLIENT_PREALLOCATE=false makes it
# allocate on demand (the benchmark's temp-memory column comes from XLA's compiled memory analysis,
# not from the allocator, so this does not change it).
set +e
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/jax}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="${PYTHON:-python3}"

# Peers (tokamax and its deps) from .peers/, plus the xprof stub tokamax imports at load.
PEERS="${PEERS:-/tmp/peers}"
if ls .peers/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-deps --no-index --target "$PEERS" .peers/*.whl 2>&1 | tail -2
fi
mkdir -p "$PEERS/xprof/cli"
[ -f "$PEERS/xprof/__init__.py" ] || touch "$PEERS/xprof/__init__.py" "$PEERS/xprof/cli/__init__.py"
[ -f "$PEERS/xprof/cli/tools.py" ] || echo "get_kernel_stats_tool = lambda *a, **k: None" > "$PEERS/xprof/cli/tools.py"
export PYTHONPATH="src:$PEERS"

"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/jax-pytest.log"

echo "=== tests_jax on the GPU (cap 170 s) ==="
timeout 170 "$PY" -m pytest tests_jax -q -ra 2>&1 | tee -a "$OUT/jax-pytest.log" | tail -15

echo "=== jax benchmark suite (cap 300 s) ==="
timeout 300 "$PY" -m logitless.bench --suite jax --max-minutes 4.2 2>&1 | tee "$OUT/jax-bench.log" | grep -v "^WARNING:absl" | tail -3
for f in benchmarks/results/latest-jax-*.json benchmarks/results/latest-jax-*.md benchmarks/results/latest-jax-*.png; do
    case "$f" in *-cpu.*) continue ;; esac
    [ -f "$f" ] && cp "$f" "$OUT/"
done

echo "=== summary ==="
grep -E "passed|failed|error" "$OUT/jax-pytest.log" | tail -2
md=$(ls -t benchmarks/results/latest-jax-*.md 2>/dev/null | grep -v -- "-cpu" | head -1)
[ -n "$md" ] && grep -E "^\|" "$md" | cut -d'|' -f2-9
exit 0
