#!/usr/bin/env bash
# Regenerates daemon/rpc/ from proto/ with the pinned grpcio-tools. The output's runtime floors
# (protobuf >= 6.31.1, grpcio >= 1.76.0) are the floors pyproject.toml declares; see FACTS 9.
#
#   proto/generate.sh [OUT_DIR]      default OUT_DIR: daemon/rpc
#
# tests/test_proto_generated.py runs this into a temporary folder and fails if the committed code drifted.
set -euo pipefail
GRPCIO_TOOLS_VERSION=1.76.0
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/daemon/rpc}
python=${PYTHON:-python3}
have=$("$python" -c 'import importlib.metadata as m; print(m.version("grpcio-tools"))' 2>/dev/null || true)
if [[ $have != "$GRPCIO_TOOLS_VERSION" ]]; then
  echo "proto/generate.sh: needs grpcio-tools==$GRPCIO_TOOLS_VERSION (found: ${have:-none});" \
       "install it with: pip install grpcio-tools==$GRPCIO_TOOLS_VERSION" >&2
  exit 1
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$python" -m grpc_tools.protoc -I "$root/proto" \
  --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  "$root/proto/tfelastic/v1/rendezvous.proto"
mkdir -p "$out"
# The generated stub imports the messages as a top-level `tfelastic.v1` package; ours live inside
# tfelastic.daemon.rpc, so point the import there.
sed -e 's/^from tfelastic\.v1 import rendezvous_pb2/from tfelastic.daemon.rpc import rendezvous_pb2/' \
  "$tmp/tfelastic/v1/rendezvous_pb2_grpc.py" > "$out/rendezvous_pb2_grpc.py"
cp "$tmp/tfelastic/v1/rendezvous_pb2.py" "$tmp/tfelastic/v1/rendezvous_pb2.pyi" "$out/"
