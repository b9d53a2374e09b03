#!/usr/bin/env bash
# Generates the Python gRPC stubs of the data-plane API (proto/moe/v1/expert_layer.proto) into
# python/moe_runtime/_proto/ with Debian's protoc and grpc_python_plugin (tools/setup.sh installs
# both). The stubs are committed; tests/python:stubs_current_test regenerates them and fails
# when they differ from the proto. Usage: python/tools/gen_stubs.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-python/moe_runtime/_proto}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
protoc -I proto --python_out="$tmp" --grpc_python_out="$tmp" \
  --plugin=protoc-gen-grpc_python="$(command -v grpc_python_plugin)" proto/moe/v1/expert_layer.proto
mkdir -p "$out"
cp "$tmp/moe/v1/expert_layer_pb2.py" "$out/expert_layer_pb2.py"
# The grpc module imports the message module by its proto package path; inside this package it
# is moe_runtime._proto.
sed 's/^from moe\.v1 import expert_layer_pb2/from moe_runtime._proto import expert_layer_pb2/' \
  "$tmp/moe/v1/expert_layer_pb2_grpc.py" >"$out/expert_layer_pb2_grpc.py"
