#!/usr/bin/env bash
# Opt-in (not in scripts/test.sh, CI's 90 minutes): the frameworks whose real packages are too
# heavy or too pinned for CI's environments, each against its own loss on the CPU.
#   bash scripts/test_frameworks.sh [torchtitan] [openrlhf] [nemo] [llamafactory]   (default: all four)
# torchtitan    .venv-newest (scripts/test_newest.sh's; built here if absent): torchtitan 0.3.0's own trainer
#               with and without the override, one rank / FSDP2 / TP=2 on gloo (tests/test_torchtitan_trainer.py,
#               ~5 min on 2 cores)
# openrlhf, nemo  .venv-frameworks (Python 3.12, the test-newest pins, transformers 5.18.0 as NeMo Automodel 0.7
#               pins it; openrlhf 0.11.2 and nemo-automodel 0.7.0 with --no-deps: their CUDA-only dependencies,
#               deepspeed, flash-attn, vLLM, Ray, megatron-fsdp, quack, are not what the tests import), ~1.5 min
# llamafactory  .venv-llamafactory (Python 3.11, the CPU torch 2.13.0, llamafactory 0.9.5 with --no-deps and its
#               pins: transformers 5.6.0, trl 0.24.0, peft 0.18.1, accelerate 1.11.0, datasets 4.0.0), ~1.5 min
# Each venv takes ~5-15 min to build once. Extra arguments after -- go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/pip_retry.sh  # pip_install: retries a download that breaks off; find_py312

legs=() pytest_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --) shift; pytest_args=("$@"); break ;;
        torchtitan|openrlhf|nemo|llamafactory) legs+=("$1") ;;
        *) echo "unknown leg $1 (torchtitan, openrlhf, nemo, llamafactory)"; exit 2 ;;
    esac
    shift
done
[ ${#legs[@]} -gt 0 ] || legs=(torchtitan openrlhf nemo llamafactory)
py312="${PYTHON_NEWEST:-$(find_py312)}" || { echo "no Python >= 3.12 found (set PYTHON_NEWEST)"; exit 1; }
export PIP_CONSTRAINT=/dev/null   # as scripts/test_newest.sh: torch 2.15 past this machine's pip cap

venv_newest() {
    [ -x .venv-newest/bin/python ] || "$py312" -m venv .venv-newest || return 1
    pip_install .venv-newest/bin/python -e ".[test-newest]" -e benchmarks
}
venv_frameworks() {
    [ -x .venv-frameworks/bin/python ] || "$py312" -m venv .venv-frameworks || return 1
    pip_install .venv-frameworks/bin/python -e ".[test-newest]" && \
    pip_install .venv-frameworks/bin/python "transformers==5.18.0" "datasets>=4" pyyaml einops pylatexenc && \
    pip_install .venv-frameworks/bin/python --no-deps "openrlhf==0.11.2" "nemo-automodel==0.7.0"
}
venv_llamafactory() {
    [ -x .venv-llamafactory/bin/python ] || "${PYTHON_LLAMAFACTORY:-python3.11}" -m venv .venv-llamafactory || return 1
    pip_install .venv-llamafactory/bin/python "torch==2.13.0" "transformers==5.6.0" "trl==0.24.0" "peft==0.18.1" \
        "accelerate==1.11.0" "datasets==4.0.0" "tyro<0.9.0" omegaconf pyyaml pydantic fire einops sentencepiece \
        tiktoken scipy pandas protobuf safetensors matplotlib av pytest && \
    pip_install .venv-llamafactory/bin/python --no-deps "llamafactory==0.9.5" -e .
}

status=0
run() {   # run LEG VENV TESTFILE
    echo "=== $1: $2 -> $3 ==="
    "venv_${2#.venv-}" || { echo "$1: install failed"; status=1; return; }
    PYTHONPATH="$PWD/src" "$2/bin/python" -m pytest -q -p no:cacheprovider -rs "$3" "${pytest_args[@]}" || status=1
}
for leg in "${legs[@]}"; do
    case "$leg" in
        torchtitan) run torchtitan .venv-newest tests/test_torchtitan_trainer.py ;;
        openrlhf) run openrlhf .venv-frameworks tests/test_integrations_openrlhf.py ;;
        nemo) run nemo .venv-frameworks tests/test_integrations_nemo_automodel.py ;;
        llamafactory) run llamafactory .venv-llamafactory tests/test_integrations_llamafactory.py ;;
    esac
done
echo "frameworks (${legs[*]}): $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status
