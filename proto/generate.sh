#!/usr/bin/env bash
# Regenerates the committed gRPC code from proto/ with the pinned grpcio-tools.
#
#   proto/generate.sh [OUT_DIR]      default OUT_DIR: daemon (writes OUT_DIR/rpc and OUT_DIR/etcd/rpc)
#
#   proto/tfelastic/v1/rendezvous.proto   -> daemon/rpc/        tfelastic's own protocol
#   proto/etcd/{mvccpb,etcdserverpb}/*.proto -> daemon/etcd/rpc/  the subset of etcd's v3 API that we use
#
# Why 1.65.5: it is the newest grpcio-tools whose output imports on protobuf 4.x, which TensorFlow 2.16-2.19
# require (docs/install.md, "Protobuf and gRPC"); its output needs grpcio >= 1.65.5. grpcio-tools itself pins
# protobuf < 6, which TensorFlow 2.21 cannot share a virtual environment with, so this script runs it from a
# virtual environment of its own (build/grpcio-tools-VERSION, made on first use) unless $PYTHON already has it.
#
# tests/test_proto_generated.py runs this into a temporary folder and fails if the committed code drifted.
set -euo pipefail
GRPCIO_TOOLS_VERSION=1.65.5
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/daemon}
python=${PYTHON:-python3}
version_of_tools() {
  "$1" -c 'import importlib.metadata as m; print(m.version("grpcio-tools"))' 2>/dev/null || true
}
if [[ $(version_of_tools "$python") != "$GRPCIO_TOOLS_VERSION" ]]; then
  tools_venv=$root/build/grpcio-tools-$GRPCIO_TOOLS_VERSION
  if [[ $(version_of_tools "$tools_venv/bin/python") != "$GRPCIO_TOOLS_VERSION" ]]; then
    rm -rf "$tools_venv"
    "$python" -m venv "$tools_venv"
    if ! "$tools_venv/bin/python" -m pip install -q --only-binary=:all: "grpcio-tools==$GRPCIO_TOOLS_VERSION"; then
      echo "proto/generate.sh: cannot install grpcio-tools==$GRPCIO_TOOLS_VERSION into $tools_venv" \
           "(it has wheels for CPython 3.8-3.12 only; set PYTHON to such an interpreter)" >&2
      exit 1
    fi
  fi
  python=$tools_venv/bin/python
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
