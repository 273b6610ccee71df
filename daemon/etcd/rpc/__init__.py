"""The subset of etcd v3 API code, generated from proto/etcd by proto/generate.sh."""
