#!/usr/bin/env bash
# Regenerates the committed gRPC code from proto/ with the pinned grpcio-tools. The output's runtime floors
# (protobuf >= 6.31.1, grpcio >= 1.76.0) are the floors pyproject.toml declares; see FACTS 9.
#
#   proto/generate.sh [OUT_DIR]      default OUT_DIR: daemon (writes OUT_DIR/rpc and OUT_DIR/etcd/rpc)
#
#   proto/tfelastic/v1/rendezvous.proto   -> daemon/rpc/        tfelastic's own protocol
#   proto/etcd/{mvccpb,etcdserverpb}/*.proto -> daemon/etcd/rpc/  the subset of etcd's v3 API that we use
#
# tests/test_proto_generated.py runs this into a temporary folder and fails if the committed code drifted.
set -euo pipefail
GRPCIO_TOOLS_VERSION=1.76.0
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/daemon}
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
  "$root/proto/tfelastic/v1/rendezvous.proto" "$root/proto/etcd/mvccpb/kv.proto" \
  "$root/proto/etcd/etcdserverpb/rpc.proto"
mkdir -p "$out/rpc" "$out/etcd/rpc"
# The generated modules import each other as top-level packages (tfelastic.v1, etcd.mvccpb); ours live inside
# tfelastic.daemon.rpc and tfelastic.daemon.etcd.rpc, so point the imports there.
sed -e 's/^from tfelastic\.v1 import rendezvous_pb2/from tfelastic.daemon.rpc import rendezvous_pb2/' \
  "$tmp/tfelastic/v1/rendezvous_pb2_grpc.py" > "$out/rpc/rendezvous_pb2_grpc.py"
cp "$tmp/tfelastic/v1/rendezvous_pb2.py" "$tmp/tfelastic/v1/rendezvous_pb2.pyi" "$out/rpc/"
cp "$tmp/etcd/mvccpb/kv_pb2.py" "$tmp/etcd/mvccpb/kv_pb2.pyi" "$out/etcd/rpc/"
for f in rpc_pb2.py rpc_pb2.pyi rpc_pb2_grpc.py; do
  sed -e 's/^from etcd\.mvccpb import kv_pb2/from tfelastic.daemon.etcd.rpc import kv_pb2/' \
      -e 's/^from etcd\.etcdserverpb import rpc_pb2/from tfelastic.daemon.etcd.rpc import rpc_pb2/' \
      "$tmp/etcd/etcdserverpb/$f" > "$out/etcd/rpc/$f"
done
