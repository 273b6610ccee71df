#!/usr/bin/env bash
# The test command (README.md, .ci/run): sets up everything a fresh machine needs, then runs the static checks
# and the whole suite. Idempotent: a second run reuses the virtual environment.
#
#   bash tests/run.sh [PYTEST ARGS...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

# System tools the integration tests use: ip (network namespaces), openssl (TLS certificates), promtool
# (Debian's prometheus package: checks the /metrics exposition) and etcd (the etcd rendezvous of issue 10).
missing=()
command -v ip >/dev/null || missing+=(iproute2)
command -v openssl >/dev/null || missing+=(openssl)
command -v promtool >/dev/null || missing+=(prometheus)
command -v etcd >/dev/null || missing+=(etcd-server)
command -v etcdctl >/dev/null || missing+=(etcd-client)
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
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[trainer-cpu,dev]'

bash tests/lint.sh
exec .venv/bin/python -m pytest -ra -p no:cacheprovider "$@"
