#!/usr/bin/env bash
# Static checks: ruff, and mypy --strict over the installed layout. mypy cannot follow the editable install's
# package-dir mapping (daemon/ -> tfelastic.daemon), so it reads a tree of symlinks in build/typecheck.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
cd "$root"
"$py" -m ruff check .
tree=$root/build/typecheck
rm -rf "$tree" && mkdir -p "$tree/tfelastic"
ln -s "$root/daemon" "$tree/tfelastic/daemon"
ln -s "$root/trainer" "$tree/tfelastic/trainer"
(cd "$tree" && "$py" -m mypy --config-file "$root/pyproject.toml" -p tfelastic.daemon -p tfelastic.trainer)
MYPYPATH="$tree" "$py" -m mypy tests bench
