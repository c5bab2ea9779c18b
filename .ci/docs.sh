#!/usr/bin/env bash
# Builds the documentation site with warnings as errors (broken links, unknown references and
# docstrings that do not parse all fail). The API reference is read from the sources statically
# (griffe), so neither torch nor the project is installed.
#   bash .ci/docs.sh            # builds .ci/venv-docs, then the site into a temporary folder
#   bash .ci/docs.sh VENV       # reuses (or builds) the virtual environment VENV
set -euo pipefail
export NO_MKDOCS_2_WARNING=1
cd "$(dirname "$0")/.."
venv=${1:-.ci/venv-docs}
if [ ! -x "$venv/bin/mkdocs" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q mkdocs==1.6.1 mkdocs-material==9.8.1 \
    mkdocstrings==1.0.8 mkdocstrings-python==2.0.11 mkdocs-autorefs==1.4.5 griffe==2.4.1 \
    pymdown-extensions==13.1
fi
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$venv/bin/mkdocs" build --strict --site-dir "$site"
