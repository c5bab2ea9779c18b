#!/usr/bin/env bash
# Runs README's commands as a newcomer would: in a fresh clone of this repository (its committed
# files only), the bash blocks README marks `<!-- ci: NAME -->`, every line as written, with ENV's
# bin first on PATH (its pip, python3 and prefix-sharing), so that CI reuses the environments it
# builds anyway. One change to the lines: pip's `--index-url URL` is dropped, because CI's machine
# reaches only the package index, and its pip takes the same CPU wheel from its local wheel folder.
# The blocks' `pip install -e` points ENV at the clone; on exit it is pointed back here.
#   bash .ci/readme.sh ENV BLOCK...      e.g. bash .ci/readme.sh .ci/venv setup first-run
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
env_dir=$(cd "${1:?usage: .ci/readme.sh ENV BLOCK...}" && pwd)
shift
clone=$(mktemp -d)
restore() {
  "$env_dir/bin/python" -m pip install -q --no-deps -e "$root" >/dev/null
  rm -rf "$clone"
}
trap restore EXIT
git clone -q "$root" "$clone"
for block in "$@"; do
  lines=$(awk -v mark="<!-- ci: $block -->" '
    $0 == mark { found = 1; next }
    found && /^```bash$/ { inside = 1; next }
    inside && /^```$/ { exit }
    inside { print }' "$clone/README.md" | sed -E 's/ --index-url [^ ]+//')
  [ -n "$lines" ] || { echo "readme.sh: README has no bash block marked <!-- ci: $block -->" >&2; exit 2; }
  echo "== README block $block"
  (cd "$clone" && PATH="$env_dir/bin:$PATH" VIRTUAL_ENV="$env_dir" bash -euxo pipefail -c "$lines")
done
