#!/usr/bin/env bash
# Shell functions the GPU scripts share. Source it from the repo root, after `cd`:
#   cd "$(dirname "$0")/../.."; . benchmarks/gpu/lib.sh
# It defines functions only (nothing runs at source time); each says what it sets.
# (prelude.sh is the other shared piece: the peers' wheels and the torch-side versions.)

# gpu_env DEFAULT_OUT [DIR...]: the environment of a GPU script. OUT (default DEFAULT_OUT,
# created), PY (${PYTHON:-python3}), src/ first on PYTHONPATH and the DIRs last (e.g. where
# jax_triton_setup installs), unbuffered output, JAX allocating on demand (torch shares the
# GPU), NVLink multicast off (NCCL and torch symmetric memory). Call it at the top level.
gpu_env() {
    OUT="${OUT:-$1}"
    shift
    mkdir -p "$OUT"
    export OUT PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
    export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
    local d
    for d in "$@"; do PYTHONPATH="$PYTHONPATH:$d"; done
    PY="${PYTHON:-python3}"
}

# jax_triton_setup DIR: jax-triton importable. If jax_triton does not import, the carried
# wheels (.whl/ or .peers/: jax_triton-*.whl, absl_py-*.whl) are installed into DIR
# (offline, no deps); without them it says which rows will suffer. DIR must be on
# PYTHONPATH already (gpu_env DEFAULT_OUT DIR): this may run in a subshell (a `{ } | tee`).
jax_triton_setup() {
    local dir="$1" wheels
    "$PY" -c "import jax_triton" >/dev/null 2>&1 && return 0
    wheels=$(ls .whl/jax_triton-*.whl .whl/absl_py-*.whl .peers/jax_triton-*.whl .peers/absl_py-*.whl 2>/dev/null)
    if [ -n "$wheels" ]; then
        # shellcheck disable=SC2086
        "$PY" -m pip install -q --no-deps --no-index --no-compile --target "$dir" $wheels 2>&1 | tail -2
    else
        echo "no jax_triton wheel in .whl/ or .peers/: the triton rows will fail or be skipped"
    fi
}

# jax_versions: prints "devices: ..." (kind, compute capability, SMs) and "versions: ..."
# of jax, jaxlib, triton, jax_triton, absl (MISSING with the reason where one fails).
jax_versions() {
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
}

# jax_on_gpu: prints 1 when jax's default device is a GPU, else 0.
jax_on_gpu() {
    "$PY" -c "import jax; print(int(jax.devices()[0].platform == 'gpu'))" 2>/dev/null || echo 0
}

# capped_pytest CAP LOG LABEL PYTEST_ARGS...: pytest -v under a hard cap of CAP s (SIGINT,
# then a kill 5 s later), the whole output appended to LOG, the screen showing the last
# ${TAIL:-30} lines but PASSED ones; then "pytest (LABEL) exit: N" into both.
capped_pytest() {
    local cap="$1" log="$2" label="$3"
    shift 3
    timeout -s INT -k 5 "$cap" "$PY" -m pytest "$@" -v -ra -p no:cacheprovider 2>&1 \
        | tee -a "$log" | grep -vE " PASSED|^WARNING:absl" | tail -"${TAIL:-30}"
    echo "pytest${label:+ ($label)} exit: ${PIPESTATUS[0]} (2 or 124: cut off at $cap s)" | tee -a "$log"
}

# torch_caches NAME: this script's own torch.compile and Triton caches (/tmp/inductor-NAME,
# /tmp/triton-NAME): a shared cache can replay a graph of an older custom-op signature.
torch_caches() {
    export TORCHINDUCTOR_CACHE_DIR="/tmp/inductor-$1" TRITON_CACHE_DIR="/tmp/triton-$1"
}

# pytest_summary LOG...: the failures and the result lines of pytest logs.
pytest_summary() {
    grep -hE "^(FAILED|ERROR)|passed|failed" "$@" | tail -15
}

# verl_kernels: VERL_PATH ("" or "/tmp/verl-stub:", to put before PYTHONPATH) such that
# verl.utils.kernel.linear_cross_entropy imports: verl itself if installed, else its kernel
# files from the first of $VERL_KERNEL_DIR, /tmp/peers, .peers holding verl/utils/kernel/*.py,
# with a stub verl/utils/device.py (verl's own __init__ pulls in ray & co).
verl_kernels() {
    VERL_PATH=""
    python3 -c "import verl.utils.kernel.linear_cross_entropy" >/dev/null 2>&1 && return 0
    local d
    for d in "$VERL_KERNEL_DIR" /tmp/peers .peers; do
        if [ -n "$d" ] && ls "$d"/verl/utils/kernel/*.py >/dev/null 2>&1; then
            rm -rf /tmp/verl-stub && mkdir -p /tmp/verl-stub/verl/utils/kernel
            cp "$d"/verl/utils/kernel/*.py /tmp/verl-stub/verl/utils/kernel/
            touch /tmp/verl-stub/verl/__init__.py /tmp/verl-stub/verl/utils/__init__.py
            cat > /tmp/verl-stub/verl/utils/device.py <<'PY'
import torch
is_cuda_available = torch.cuda.is_available()
def is_npu_available(): return False
def get_device_name(): return "cuda"
def get_torch_device(): return torch.cuda
def get_device_id(): return torch.cuda.current_device()
def get_nccl_backend(): return "nccl"
def get_device_capability(device_id=0): return torch.cuda.get_device_capability(device_id)
PY
            VERL_PATH="/tmp/verl-stub:"
            echo "verl kernel files from $d"
            return 0
        fi
    done
}

# cute_dsl_env: the CuTe DSL (nvidia-cutlass-dsl 4.2.1) importable in a GPU script. Unless
# cutlass.cute imports already, or SMOKE is set (CPU runs bring a Python with the DSL through
# PYTHON_CUTE), it unpacks the carried tarball .cute/nvidia_cutlass_dsl-*.tar.xz (carry
# [".cute"]; docs/cute_dsl.md says how it is made) into /tmp/cute-dsl. Sets PYC (the Python
# for DSL-only scripts: ${PYTHON_CUTE:-$PY}), the DSL's packages last on PYTHONPATH and
# CUTE_DSL_ARCH=sm_90a. Call after `gpu_env DEFAULT_OUT /tmp/cute-dsl`.
cute_dsl_env() {
    local dir=/tmp/cute-dsl
    PYC="${PYTHON_CUTE:-$PY}"
    if [ -z "$SMOKE" ] && ! "$PY" -c "import cutlass.cute" 2>/dev/null; then
        mkdir -p "$dir" && tar xJf .cute/nvidia_cutlass_dsl-*.tar.xz -C "$dir"
    fi
    export PYTHONPATH="$PYTHONPATH:$dir/nvidia_cutlass_dsl/python_packages" CUTE_DSL_ARCH=sm_90a
}
