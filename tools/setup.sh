#!/usr/bin/env bash
# Installs every Debian package the build and the tests need. Idempotent: a second run
# installs nothing. Works offline against Debian's mirror; no other downloads.
set -euo pipefail

PKGS=(
  bazel-bootstrap bazel-rules-java
  build-essential pkg-config git python3
  python3-grpcio python3-protobuf python3-numpy python3-pytest python3-pip python3-setuptools python3-yaml
  protobuf-compiler libprotobuf-dev libprotoc-dev
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc
  libabsl-dev libspdlog-dev libfmt-dev
  prometheus-cpp-dev libucx-dev libsqlite3-dev libssl-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  nlohmann-json3-dev
  clang-format
  prometheus curl openssl systemd
)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq || true
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "setup: all packages present"
fi

# Switch on the CUDA targets where nvcc exists (written to an untracked rc file).
top="$(cd "$(dirname "$0")/.." && pwd)"
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "build --config=cuda" > "$top/.bazelrc.local"
  echo "setup: nvcc found, CUDA targets enabled (.bazelrc.local)"
else
  : > "$top/.bazelrc.local"
fi
