#!/usr/bin/env bash
# Runs a command under an NVIDIA MPS control daemon of its own (private pipe and log
# directories, so only the command's processes use it), stopped when the command ends:
# co-located engine and rank processes then share the GPU without context switches.
#   bench/gpu/with_mps.sh bench/gpu/device_rows.sh
set -uo pipefail
dir="$(mktemp -d /tmp/mps.XXXXXX)"
export CUDA_MPS_PIPE_DIRECTORY="$dir/pipe" CUDA_MPS_LOG_DIRECTORY="$dir/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "with_mps: nvidia-cuda-mps-control -d failed"; exit 1; }
trap 'echo quit | nvidia-cuda-mps-control; rm -rf "$dir"' EXIT
"$@"
