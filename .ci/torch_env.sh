#!/usr/bin/env bash
# Build the newest-torch environment: .venv-torch215 beside the project (Python 3.11), torch 2.15.0,
# then the project and what its release checks need (megatron-core 0.16.1, pytest, hypothesis;
# not the whole test extra: the lane runs tests/megatron_ext only). These machines' pip caps torch at
# the release on their disk (pip's global.constraint); this environment's installs replace that
# with .ci/torch215-constraints.txt. torch 2.15 from the package index is the CUDA build (a ~540 MB
# wheel, ~5.3 GB installed with its CUDA libraries), which runs on CPU: 80 s to install here
# (2026-12-06, nothing cached). Usage: .ci/torch_env.sh   (prints the venv path last)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-torch215
export PIP_CONSTRAINT=$PWD/.ci/torch215-constraints.txt
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.15.0
"$venv/bin/python" -m pip install -q -e . megatron-core==0.16.1 pytest hypothesis
echo "$venv"
