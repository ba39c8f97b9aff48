#!/usr/bin/env bash
# Opt-in (not in scripts/test.sh, CI's 90 minutes): the axolotl plugin
# (logitless.integrations.axolotl) in axolotl's own environment. axolotl pins its own
# transformers, TRL, PEFT and accelerate and pulls in many services, so it gets its own
# venv, .venv-axolotl (Python 3.11, the CPU torch 2.13.0 wheel, axolotl 0.19.0 with
# --no-deps plus what its config loading, dataset preparation and train() import), and
# tests/test_integrations_axolotl.py runs there: axolotl's load_cfg loads the plugin from a
# YAML plugins: list, and axolotl's train() runs 2 SFT steps on a tiny random Llama on the
# CPU with the plugin and without (same losses; logitless' loss called every step).
# ~10 min to build (once), ~3 min to run on 2 cores. Extra arguments go to pytest.
# Override the interpreter with PYTHON_AXOLOTL=...
# AXOLOTL=0.21: axolotl 0.21.0 (current) with its pins instead, in .venv-axolotl021 (~8 min to run):
# it declares Python >= 3.12, where PyPI has only CUDA builds of torch 2.13-2.14, so it is
# installed with --ignore-requires-python beside the CPU torch 2.13.0 on Python 3.11.
set -uo pipefail
cd "$(dirname "$0")/.."
. scripts/pip_retry.sh  # pip_install: retries a download that breaks off

py="${PYTHON_AXOLOTL:-python3.11}"
if [ "${AXOLOTL:-0.19}" = 0.21 ]; then
  venv=.venv-axolotl021
  # axolotl 0.21.0's pins for what its plugin, config, data and trainer paths import.
  pins=("transformers==5.20.1" "peft==0.21.2" "accelerate==1.15.0" "trl==1.14.1" "datasets==5.0.1" "pydantic==2.13.5"
        "tokenizers==0.23.3" "typer==0.25.1" "mistral-common==1.12.0" "kernels>=0.17.2,<0.18")
  axolotl=("axolotl==0.21.0" --ignore-requires-python)
else
  venv=.venv-axolotl
  # axolotl 0.19.0's pins for what its plugin, config, data and trainer paths import.
  pins=("transformers==5.16.1" "peft==0.20.0" "accelerate==1.13.0" "trl==1.9.0" "datasets==4.8.4" "pydantic==2.12.5"
        tokenizers kernels)
  axolotl=("axolotl==0.19.0")
fi
echo "=== axolotl: $py -> $venv ==="
if [ ! -x $venv/bin/python ]; then "$py" -m venv $venv || exit 1; fi
pip_install $venv/bin/python "torch==2.13.0" || { echo "torch install failed"; exit 1; }
pip_install $venv/bin/python "${pins[@]}" "PyYAML==6.0.3" "packaging==26.0" "posthog==6.7.11" \
  "python-dotenv==1.0.1" addict fire colorama einops pillow numba bitsandbytes fastcore evaluate wandb \
  triton pytest || { echo "install failed"; exit 1; }
pip_install $venv/bin/python --no-deps "${axolotl[@]}" "axolotl-contribs-lgpl==0.0.7" "axolotl-contribs-mit==0.0.6" \
  || { echo "axolotl install failed"; exit 1; }
pip_install $venv/bin/python --no-deps -e . || { echo "logitless install failed"; exit 1; }
$venv/bin/python -m pip freeze | grep -iE '^(torch|transformers|trl|peft|accelerate|axolotl)=='
HF_HUB_OFFLINE=1 AXOLOTL_DO_NOT_TRACK=1 DO_NOT_TRACK=1 \
  $venv/bin/python -m pytest -q -p no:cacheprovider tests/test_integrations_axolotl.py -rs "$@"
