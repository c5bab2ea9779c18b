#!/usr/bin/env bash
# Add verl 0.9.1 to the Python 3.12 / megatron-core 0.19.2 test environment as a --target overlay
# (<venv>/verl-0.9.1, put first on PYTHONPATH by the test run), so that verl's Megatron engine can
# run a Gated DeltaNet hybrid on the one megatron-core release that serves them. verl's own pins
# (its [megatron] extra wants torch 2.11) are skipped: verl and the packages its engine, config and
# loss imports need, without dependencies, beside the environment's torch 2.13.0, megatron-core
# 0.19.2 and transformers. Usage: .ci/verl_overlay.sh .venv-py312   (prints the overlay path last)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:?usage: .ci/verl_overlay.sh <Python 3.12 venv with megatron-core 0.19.2>}
overlay="$venv/verl-0.9.1"
[ -d "$overlay/verl" ] || "$venv/bin/python" -m pip install -q --no-deps --target "$overlay" \
  verl==0.9.1 tensordict==0.10.0 pyvers omegaconf hydra-core antlr4-python3-runtime==4.9.3 \
  codetiming einops cloudpickle orjson importlib_metadata zipp ray==2.60.0 msgpack protobuf \
  requests urllib3 certifi charset-normalizer idna jsonschema jsonschema-specifications attrs \
  referencing rpds-py peft accelerate datasets multiprocess dill xxhash pandas psutil
echo "$overlay"
