#!/usr/bin/env bash
# GPU run of logitless.jax.linear_log_probs backends on ONE GPU (H100 by default).
# Parts are named by backend ("[triton]" here; the mosaic_gpu helper appends "[mosaic_gpu]").
#   [triton] 1. jax-triton from the carried wheels if it does not import (.whl/ or .peers/:
#               jax_triton-0.3.1-py3-none-any.whl, absl_py-2.5.1-py3-none-any.whl), versions;
#   [triton] 2. a smoke call (implementation="triton", entropy, fwd+bwd) vs float64, traceback if any;
#   [triton] 3. tests_jax/test_jax_log_probs_triton.py on the GPU (a subset: the GPU-only
#               cases, option mixes, special values, the xla agreement; cap 100 s);
#   [bench]  4. benchmarks/gpu/jax_log_probs_bench.py at the 3 RL shapes (bf16, T 0.7,
#               entropy): fwd and fwd+bwd ms of "triton" and "xla" vs one / three jnp GEMMs,
#               compile s, max |logp|, |H| error vs float64 (cap 120 s, partial table kept);
#   5. a summary table (last).
#   OUT=<dir> bash benchmarks/gpu/jax_log_probs.sh        (from the repo root)
# Expected wall: ~4 min (hard caps 40 + 100 + 120 s + kill grace). Writes 5 files to $OUT:
# jlp-setup.log, jlp-pytest.log, jlp-bench.log, jax-log-probs-<GPU>.json/.md.
# CPU smoke mode (SMOKE=1, or no GPU): the tests on Triton's interpreter (subset) and the
# bench's tiny CPU case (the triton rows are skipped there, with a note).
set +e
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/jax_log_probs}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
PY="${PYTHON:-python3}"
JT=/tmp/jt-peers
export PYTHONPATH="src:$JT${PYTHONPATH:+:$PYTHONPATH}"

{
echo "=== [triton] setup ==="
if ! "$PY" -c "import jax_triton" >/dev/null 2>&1; then
    wheels=$(ls .whl/jax_triton-*.whl .whl/absl_py-*.whl .peers/jax_triton-*.whl .peers/absl_py-*.whl 2>/dev/null)
    if [ -n "$wheels" ]; then
        # shellcheck disable=SC2086
        "$PY" -m pip install -q --no-deps --no-index --no-compile --target "$JT" $wheels 2>&1 | tail -2
    else
        echo "no jax_triton wheel in .whl/ or .peers/: the triton rows will fail or be skipped"
    fi
fi
"$PY" - <<'PY'
import importlib
out = []
for m in ("jax", "jaxlib", "triton", "jax_triton", "absl"):
    try:
        out.append(f"{m} {getattr(importlib.import_module(m), '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001
        out.append(f"{m} MISSING ({type(exc).__name__}: {str(exc)[:120]})")
import jax
d = jax.devices()[0]
print("devices:", jax.devices(), "| kind:", getattr(d, "device_kind", "?"),
      "| cc:", getattr(d, "compute_capability", "-"), "| SMs:", getattr(d, "core_count", "-"))
print("versions:", ", ".join(out))
PY
echo "=== [triton] smoke: linear_log_probs implementation='triton' fwd+bwd ==="
timeout -k 5 40 "$PY" - <<'PY'
import time, traceback
import jax, jax.numpy as jnp, numpy as np
from logitless.jax import linear_log_probs
from logitless.jax.ops.linear_log_probs import api
from logitless.jax.ops.linear_log_probs.reference import linear_log_probs_reference as ref
try:
    rng = np.random.default_rng(0)
    n, h, v = (300, 128, 5003) if jax.devices()[0].platform == "gpu" else (20, 16, 101)  # CPU: the interpreter
    x = jnp.asarray(rng.standard_normal((n, h)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v, h)) / 8, jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    print("automatic choice:", api.choose_backend(None, (n, h), (v, h), jnp.bfloat16, None, False))
    kw = dict(temperature=0.7, entropy=True, softcap=30.0)
    loss = lambda x, w: sum(jnp.sum(o) for o in linear_log_probs(x, w, t, implementation="triton", **kw))
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    t0 = time.time()
    val, (dx, dw) = jax.block_until_ready(f(x, w))
    lp, hh = linear_log_probs(x, w, t, implementation="triton", **kw)
    with jax.enable_x64(True):
        x64, w64 = jnp.asarray(np.asarray(x, np.float64)), jnp.asarray(np.asarray(w, np.float64))
        r = lambda x, w: ref(x, w, t, temperature=0.7, softcap=30.0)
        rlp, rh = r(x64, w64)
        rdx, rdw = jax.grad(lambda x, w: sum(jnp.sum(o) for o in r(x, w)), argnums=(0, 1))(x64, w64)
    err = lambda a, b: float(np.abs(np.asarray(a, np.float64) - np.asarray(b)).max())
    print(f"smoke ok in {time.time() - t0:.1f} s: |logp err| {err(lp, rlp):.2e} |H err| {err(hh, rh):.2e} "
          f"dx err {err(dx, rdx):.2e} dw err {err(dw, rdw):.2e} (max |dw| {float(np.abs(rdw).max()):.2e})")
except Exception:
    traceback.print_exc()
    print("smoke FAILED")
PY
echo "smoke exit: $?"
} 2>&1 | tee "$OUT/jlp-setup.log" | grep -vE "^WARNING:absl"

ON_GPU=$("$PY" -c "import jax; print(int(jax.devices()[0].platform == 'gpu'))" 2>/dev/null)
if [ "${SMOKE:-0}" = "1" ] || [ "$ON_GPU" != "1" ]; then
    echo "=== CPU smoke mode ==="
    SEL=(-k "special_values or automatic or merge_splits or gpu_ or budgets")
    BENCH=(--cpu --max-seconds 30)
else
    SEL=(-k "gpu_ or (options_against and all) or special_values or one_output or matches_the_xla or automatic or three_dimensional or bitwise or budgets")
    BENCH=(--max-seconds 75)
fi

echo "=== [triton] tests_jax/test_jax_log_probs_triton.py on $( [ "$ON_GPU" = 1 ] && echo GPU || echo CPU ) (cap 100 s) ==="
timeout -s INT -k 5 100 "$PY" -m pytest tests_jax/test_jax_log_probs_triton.py "${SEL[@]}" \
    -v -ra -p no:cacheprovider --durations=8 2>&1 \
    | tee "$OUT/jlp-pytest.log" | grep -vE " PASSED|^WARNING:absl" | tail -30
echo "pytest exit: ${PIPESTATUS[0]} (2 or 124: cut off at 100 s)" | tee -a "$OUT/jlp-pytest.log"

echo "=== [bench] RL shapes: jnp GEMMs, logitless triton and xla (cap 120 s) ==="
BOUT=/tmp/jlp-bench-out
rm -rf "$BOUT"
timeout -s INT -k 5 120 "$PY" benchmarks/gpu/jax_log_probs_bench.py --methods triton,xla --out "$BOUT" "${BENCH[@]}" 2>&1 \
    | tee "$OUT/jlp-bench.log" | grep -E "^shape=|Error|^Traceback" | cut -c1-220
echo "bench exit: ${PIPESTATUS[0]} (124/130: cut off, partial table kept)" | tee -a "$OUT/jlp-bench.log"
for f in "$BOUT"/jax-log-probs-*; do
    [ -f "$f" ] && cp "$f" "$OUT/"
done

echo "=== summary (jax linear_log_probs) ==="
grep -E "^smoke|automatic choice|versions:|devices:" "$OUT/jlp-setup.log"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/jlp-pytest.log" | tail -15
md=$(ls -t "$OUT"/jax-log-probs-*.md 2>/dev/null | head -1)
[ -n "$md" ] && grep -E "^\| (shape|---)|GEMMs|logitless-" "$md" | cut -d'|' -f2-11
exit 0
