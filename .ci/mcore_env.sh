#!/usr/bin/env bash
# Build the Python 3.12 test environment: .venv-py312 beside the project, torch 2.13.0 first, then
# the project with its test extra (which resolves megatron-core 0.19.2 on Python 3.12). The
# releases 0.17.1 and 0.18.2 are added as --target overlays (.venv-py312/mcore-<release>) that a
# test run puts first on PYTHONPATH: their wheels declare the same dependencies as 0.19.2's, so one
# environment serves all three. Usage: .ci/mcore_env.sh   (prints the venv path last)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-py312
python312=$(PYENV_VERSION=3.12.1 command -v python3.12 2>/dev/null || true)
[ -n "$python312" ] || { echo "mcore_env.sh: python3.12 not found" >&2; exit 2; }
[ -x "$venv/bin/python" ] || PYENV_VERSION=3.12.1 "$python312" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q -e '.[test]'
for release in 0.17.1 0.18.2; do
  overlay="$venv/mcore-$release"
  [ -d "$overlay/megatron" ] || "$venv/bin/python" -m pip install -q --no-deps --target "$overlay" \
    "megatron-core==$release"
done
echo "$venv"
