#!/usr/bin/env bash
# The test command (README.md, .ci/run): sets up everything a fresh machine needs, then runs the static checks
# and the whole suite. Idempotent: a second run reuses the virtual environment, and reinstalls nothing unless
# pyproject.toml or the interpreter changed. docs/testing.md says how the suite is organised.
#
#   bash tests/run.sh [PYTEST ARGS...]           the whole suite (what CI runs)
#   bash tests/run.sh --quick [PYTEST ARGS...]   the inner loop: lint, the unit tests and the integration tests
#                                                marked quick, in under 3 minutes
#
# TFELASTIC_TEST_WORKERS sets how many pytest-xdist workers share the machine (default below; 0: no xdist).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

quick=0
if [[ ${1:-} == --quick ]]; then
  quick=1
  shift
fi

# System tools the integration tests use: ip (network namespaces), openssl (TLS certificates), promtool
# (Debian's prometheus package: checks the /metrics exposition), etcd (the etcd rendezvous) and a headless
# Chromium (Debian's chromium-headless-shell, ~10 s to install: renders report --html's page).
missing=()
command -v ip >/dev/null || missing+=(iproute2)
command -v openssl >/dev/null || missing+=(openssl)
command -v promtool >/dev/null || missing+=(prometheus)
command -v etcd >/dev/null || missing+=(etcd-server)
command -v etcdctl >/dev/null || missing+=(etcd-client)
command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null || missing+=(chromium-headless-shell)
[[ -x /lib/systemd/systemd ]] || missing+=(systemd)  # the hermetic systemd of tests/integration/test_systemd.py
if ((${#missing[@]})); then
  if [[ $(id -u) == 0 ]]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  else
    echo "tests/run.sh: missing ${missing[*]}; the tests that need them will be skipped" >&2
  fi
fi

python=${PYTHON:-python3}
if ! "$python" -c 'import ensurepip' 2>/dev/null && [[ $(id -u) == 0 ]]; then  # Debian splits venv out
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
fi
if [[ ! -x .venv/bin/python ]]; then
  "$python" -m venv .venv
fi
# What the install depends on: the declared packages and extras, the interpreter, and where this checkout is (an
# editable install points at it). The same stamp and a working import: nothing to install.
stamp=.venv/.tfelastic-install
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1) $(.venv/bin/python -c 'import sys; print(sys.version)') $root"
installed() {
  [[ -f $stamp && $(cat "$stamp") == "$wanted" ]] && .venv/bin/python - "$root" <<'EOF' 2>/dev/null
import pathlib, sys
import pytest, xdist, tfelastic.daemon  # noqa: F401 (the test tools and the package import)
sys.exit(not pathlib.Path(tfelastic.daemon.__file__).resolve().is_relative_to(pathlib.Path(sys.argv[1]).resolve()))
EOF
}
if ! installed; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[trainer-cpu,dev]'
  echo "$wanted" >"$stamp"
fi

bash tests/lint.sh

# Most integration tests wait (for agents, trainers, timeouts) more than they compute: four workers keep two
# cores busy (30 min here, against 34 min with three: docs/testing.md). Tests that cannot share the machine
# (network namespaces, the hermetic systemd, fixed ports) run in one group, one after another (tests/conftest.py).
workers=${TFELASTIC_TEST_WORKERS:-4}
parallel=()
if ((workers > 0)); then
  parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
fi
if ((quick)); then
  # The unit tests, and the integration tests marked quick: seconds each, and together they cross every layer
  # once (the CLI, the coordinator's limits, the RPC fuzzers, TLS, a worker process, real agents on the counter).
  exec .venv/bin/python -m pytest -ra -p no:cacheprovider "${parallel[@]}" -m "not integration or quick" "$@"
fi
exec .venv/bin/python -m pytest -ra -p no:cacheprovider "${parallel[@]}" "$@"
