"""Generated gRPC stubs of proto/moe/v1/expert_layer.proto (python/tools/gen_stubs.sh)."""
