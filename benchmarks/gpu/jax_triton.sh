#!/usr/bin/env bash
# GPU run of the JAX "triton" backend (issue 22) on ONE GPU (H100 by default):
#   1. jax-triton from the carried wheels if it does not import (.whl/ or .peers/:
#      jax_triton-0.3.1-py3-none-any.whl, absl_py-2.5.1-py3-none-any.whl), versions;
#   2. a one-line smoke call (implementation="triton", fwd+bwd) with its traceback if any;
#   3. tests_jax/test_jax_triton.py + the triton cases of tests_jax/test_jax_options.py on
#      the GPU (cap 110 s; the xla cases are CI's);
#   4. `python -m logitless_bench --suite jax --methods gemm,logitless-triton` at the six
#      tokamax shapes (fwd / 1 GEMM, fwd+bwd / 3 GEMMs, temp bytes, loss error vs float64;
#      cap 140 s, partial table kept when cut off);
#   5. a summary table.
#   OUT=<dir> bash benchmarks/gpu/jax_triton.sh        (from the repo root)
# Expected wall: ~4.5-5 min (hard caps 40 + 110 + 140 s + 15 s of kill grace). Writes 5
# files to $OUT: jt-setup.log, jt-pytest.log, jt-bench.log, jax-triton-<GPU>.json/.md.
# CPU smoke mode (SMOKE=1, or no GPU): the tests on Triton's interpreter (subset) and the
# bench's CPU shapes (the triton rows are skipped there, with a note).
set +e
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/jax_triton}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
PY="${PYTHON:-python3}"
JT=/tmp/jt-peers
export PYTHONPATH="src:$JT${PYTHONPATH:+:$PYTHONPATH}"

{
echo "=== setup ==="
if ! "$PY" -c "import jax_triton" >/dev/null 2>&1; then
    wheels=$(ls .whl/jax_triton-*.whl .whl/absl_py-*.whl .peers/jax_triton-*.whl .peers/absl_py-*.whl 2>/dev/null)
    if [ -n "$wheels" ]; then
        # shellcheck disable=SC2086
        "$PY" -m pip install -q --no-deps --no-index --no-compile --target "$JT" $wheels 2>&1 | tail -2
    else
        echo "no jax_triton wheel in .whl/ or .peers/: the triton rows will be skipped"
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
echo "=== smoke: implementation='triton' fwd+bwd ==="
timeout -k 5 40 "$PY" - <<'PY'
import time, traceback
import jax, jax.numpy as jnp, numpy as np
from logitless.jax import linear_cross_entropy
from logitless.jax.ops.linear_cross_entropy import api
from logitless.jax.ops.linear_cross_entropy.reference import linear_cross_entropy_ref
try:
    rng = np.random.default_rng(0)
    n, h, v = (300, 128, 5003) if jax.devices()[0].platform == "gpu" else (20, 16, 101)  # CPU: the interpreter
    x = jnp.asarray(rng.standard_normal((n, h)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v, h)) / 8, jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    print("automatic choice:", api.choose_backend(None, (n, h), (v, h), jnp.bfloat16, None, False))
    f = jax.jit(jax.value_and_grad(lambda x, w: linear_cross_entropy(x, w, t, implementation="triton"), argnums=(0, 1)))
    t0 = time.time()
    loss, (dx, dw) = jax.block_until_ready(f(x, w))
    ref, _, (rdx, rdw, _) = linear_cross_entropy_ref(x, w, t)
    print(f"smoke ok in {time.time() - t0:.1f} s: loss {float(loss):.6f} ref {ref:.6f} |err| {abs(float(loss) - ref):.2e}"
          f" dx err {np.abs(np.asarray(dx, np.float64) - rdx).max():.2e} dw err {np.abs(np.asarray(dw, np.float64) - rdw).max():.2e}")
except Exception:
    traceback.print_exc()
    print("smoke FAILED")
PY
echo "smoke exit: $?"
} 2>&1 | tee "$OUT/jt-setup.log" | grep -vE "^WARNING:absl"

ON_GPU=$("$PY" -c "import jax; print(int(jax.devices()[0].platform == 'gpu'))" 2>/dev/null)
if [ "${SMOKE:-0}" = "1" ] || [ "$ON_GPU" != "1" ]; then
    echo "=== CPU smoke mode: interpreter tests (subset) ==="
    SEL=(-k "not options_against and not class_weight_against")
    BENCH=(--cpu --quick --methods gemm,logitless-triton,logitless-xla --max-minutes 1)
else
    SEL=(-k "test_jax_triton or triton")
    BENCH=(--methods gemm,logitless-triton --max-minutes 2.25 --method-seconds 40)
fi

echo "=== tests_jax (triton backend + options) on $( [ "$ON_GPU" = 1 ] && echo GPU || echo CPU ) (cap 110 s) ==="
timeout -s INT -k 5 110 "$PY" -m pytest tests_jax/test_jax_triton.py tests_jax/test_jax_options.py "${SEL[@]}" \
    -v -ra -p no:cacheprovider --durations=8 2>&1 \
    | tee "$OUT/jt-pytest.log" | grep -vE " PASSED|^WARNING:absl" | tail -30
echo "pytest exit: ${PIPESTATUS[0]} (2 or 124: cut off at 110 s)" | tee -a "$OUT/jt-pytest.log"

echo "=== jax suite: gemm + logitless-triton (cap 140 s) ==="
BOUT=/tmp/jt-bench-out
rm -rf "$BOUT"
timeout -k 5 140 "$PY" -m logitless_bench --suite jax "${BENCH[@]}" --out "$BOUT" 2>&1 \
    | tee "$OUT/jt-bench.log" | grep -E "^  shape=|skip|Skip|^Traceback|^[A-Za-z.]*Error" | cut -c1-220
echo "bench exit: ${PIPESTATUS[0]} (130: partial, 124: killed)" | tee -a "$OUT/jt-bench.log"
for f in "$BOUT"/latest-jax-*.json "$BOUT"/latest-jax-*.md; do
    [ -f "$f" ] && cp "$f" "$OUT/$(basename "$f" | sed 's/^latest-jax-/jax-triton-/')"
done

echo "=== summary ==="
grep -E "^smoke|automatic choice|versions:|devices:" "$OUT/jt-setup.log"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/jt-pytest.log" | tail -15
md=$(ls -t "$OUT"/jax-triton-*.md 2>/dev/null | head -1)
[ -n "$md" ] && grep -E "^\| (shape|---)|gemm|logitless-triton|logitless-xla" "$md" | cut -d'|' -f2-12
exit 0
