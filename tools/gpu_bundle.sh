#!/usr/bin/env bash
# Builds the gpu-tagged tests and benchmarks, the processes of a local cluster and moe-rankd's
# CUDA backend (libmoe_cuda.so) here (Debian 12, nvcc) and bundles them with the non-system
# shared libraries they need into dist/gpu, for a GPU machine without Bazel or the
# Debian libraries (Ubuntu 24.04, CUDA 13): run there with LD_LIBRARY_PATH=dist/gpu/lib.
# CUDA's own libraries (cudart, cuBLAS, NCCL) come from the GPU machine's CUDA installation.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGETS=(//tests/kernels:cuda_kernels_test //tests/transport:nccl_transport_test //tests/transport:nccl_executor_test
  //bench/gpu:expert_layer_bench //bench/gpu:a2a_bench //bench/gpu:cpp_device_rows //bench:eplb_bench //bench:api_overhead_bench
  //bench:checkpoint_load_bench //bench:step_host_bench //bench:cluster_step_bench //server:moe-rankd //server:libmoe_cuda.so //server:engine_driver //control:moectl //control/controller:moe-controller)
# GPU_TARGETS="//a:b //c:d" bundles just those (a kernels-only call: cuda_kernels_test and
# expert_layer_bench build in a fraction of the full list's time on the 2-core build machine).
if [ -n "${GPU_TARGETS:-}" ]; then read -r -a TARGETS <<<"$GPU_TARGETS"; fi
bazel build --config=gpu "${TARGETS[@]}"
out=dist/gpu
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for t in "${TARGETS[@]}"; do
  path="bazel-bin/$(echo "${t#//}" | tr ':' '/')"
  cp "$path" "$out/bin/"
  ldd "$path" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libgcc_s.so*|libstdc++.so*|ld-linux*) ;;
      libcuda.so*|libcudart.so*|libcublas.so*|libcublasLt.so*|libnccl.so*) ;;
      *) cp -L "$lib" "$out/lib/" ;;
    esac
  done
done
chmod -R u+w "$out"
strip "$out"/bin/*  # symbols only: what runs is the same, the carried tree smaller
du -sh "$out"
ls "$out/lib"
# PACK=1 also writes dist/pack.tgz of all of dist/ (this bundle, dist/wheels, variants under
# dist/gpu/*): the device tool carries at most 64 MiB of tree and carry paths together, which
# the unpacked bundle with the wheels passes. Carry "dist/pack.tgz" and run
# `tar xzf dist/pack.tgz && ...` there.
if [ "${PACK:-0}" = 1 ]; then
  rm -f dist/pack.tgz
  tar czf /tmp/moe_pack.$$.tgz dist && mv /tmp/moe_pack.$$.tgz dist/pack.tgz
  ls -la dist/pack.tgz
fi
