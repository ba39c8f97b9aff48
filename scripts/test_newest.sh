#!/usr/bin/env bash
# The PyTorch side under the newest releases a user gets today (pinned as tested in the
# `test-newest` extra of pyproject.toml: torch 2.15.0, triton 3.9.0, transformers 5.23.0,
# megatron-core 0.19.2, torchtitan 0.3.0, ...), on the version-sensitive surface and the
# frameworks that need Python >= 3.12 (the full suite stays on the `test` extra's versions,
# scripts/test.sh):
#   .venv-newest  Python 3.12 + ".[test-newest]" + benchmarks/ (logitless-bench)  -> the subset of tests/ below
# PIP_CONSTRAINT=/dev/null: a pip config that caps torch below 2.15 (this machine's
# /etc/xdg/pip) is overridden for this install only; other pip settings (indexes) still apply.
# Extra arguments go to pytest. Override the interpreter with PYTHON_NEWEST=...
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/pip_retry.sh  # pip_install: retries a download that breaks off; find_py312

py="${PYTHON_NEWEST:-$(find_py312)}" || { echo "no Python >= 3.12 found for the newest releases (set PYTHON_NEWEST)"; exit 1; }
echo "=== newest releases: $py -> .venv-newest ==="
if [ ! -x .venv-newest/bin/python ]; then "$py" -m venv .venv-newest || exit 1; fi
export PIP_CONSTRAINT=/dev/null
pip_install .venv-newest/bin/python --upgrade pip
pip_install .venv-newest/bin/python -e ".[test-newest]" -e benchmarks || { echo "install failed"; exit 1; }
.venv-newest/bin/python -m pip freeze | grep -iE '^(torch|triton|transformers|trl|peft|accelerate|helion)=='

status=0
run() { .venv-newest/bin/python -m pytest -q -p no:cacheprovider "$@" || status=1; }
# The op contract: every test on the torch backend, and each op's plain and all-options case
# (fp32) on the Triton interpreter.
run tests/test_op_contract.py -k "(torch and not triton) or (triton and (plain or all) and float32)" "$@"
# torch's F.linear_cross_entropy patch; tl.sort / tl.topk (truncated log-probs' candidates);
# Helion on the CPU; the HF patch (source check, every family against the unpatched model,
# PaliGemma 2's soft-cap); TRL's trainers through logitless; torch.compile(fullgraph=True) of the
# truncated / batch-invariant custom ops; megatron-core's GPTModel through
# logitless.integrations.megatron (gloo ranks: TP, SP, CP, MTP).
run tests/test_torch_api.py tests/test_truncated_log_probs.py::test_triton_candidates_kernel_against_topk \
    tests/test_helion_backend.py tests/test_transformers.py tests/test_transformers_families.py \
    tests/test_integrations_trl.py tests/test_integrations_trl_head.py tests/test_integrations_trl_sft.py \
    tests/test_compile_truncated.py tests/test_fast_launch.py "$@"
# Megatron Core's GPTModel and HybridModel and torchtitan's trainer through logitless, against their
# own losses (one process, TP / SP / CP / FSDP2 over gloo; FSDP2 in each layout of the head).
run tests/test_integrations_megatron.py tests/test_integrations_torchtitan.py "$@"
echo "newest-releases subset: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status
