#!/usr/bin/env bash
# Build the verl test environment for one supported verl version: .venv-verl<digits> beside the
# project (e.g. .venv-verl091), torch 2.13.0 (CPU) first so no later requirement pulls a CUDA
# build, then verl and the megatron-core / transformers releases that version needs (0.9.1: the
# project's verl extra), then this project without dependencies. Usage: .ci/verl_env.sh 0.9.1   (prints the venv path last)
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: .ci/verl_env.sh <verl version: 0.9.1>}
case "$version" in
  # 0.9.1: the project's verl extra (setup.cfg: verl, TransferQueue - its v1 trainer's batch
  # store - and uvicorn, fastapi, openai, msgspec - its rollout server layer), which README's
  # trainer demo installs too.
  0.9.1) deps=(-e '.[verl]' pytest hypothesis) ;;
  # 0.8.0: transformers 4.x; verl's imports need the server and data packages below; mbridge is
  # the vanilla-mbridge route 0.8.0 builds its model with (not a dependency of verl's wheel).
  0.8.0) deps=(verl==0.8.0 megatron-core==0.16.1 'transformers<5' 'pyarrow<22' 'datasets<5' uvicorn
               fastapi cachetools einops openai msgspec mbridge==0.15.1 pytest hypothesis) ;;
  *) echo "verl_env.sh: no environment recipe for verl $version" >&2; exit 2 ;;
esac
venv=.venv-verl${version//./}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q "${deps[@]}"
"$venv/bin/python" -m pip install -q -e . --no-deps
echo "$venv"
