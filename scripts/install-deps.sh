#!/usr/bin/env bash
# Installs the Debian 12 packages shardopt builds and tests with. Does nothing
# when they are all present, so `make` targets can call it every time.
set -euo pipefail

# Pinned where the build depends on the exact API: gRPC 1.51, protobuf 3.21,
# Abseil 20220623 (Debian 12's versions).
packages=(
  build-essential cmake ninja-build ccache
  pkg-config  # gRPC's CMake config finds re2 through it
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev
  libgtest-dev libgmock-dev
  # gRPC's CMake config calls find_package(OpenSSL) and its targets link
  # OpenSSL::SSL, so configuring fails without it (libgrpc-dev pulls it in).
  libssl-dev
  nlohmann-json3-dev
  libspdlog-dev  # the server's log (server/log.cc)
  prometheus     # tests/ops/prometheus_test.py scrapes a server with the real one
  python3-yaml   # tests/deploy reads the rendered manifests
  clang
  libclang-rt-14-dev  # clang's libFuzzer and sanitizer runtimes, for tests/fuzz (only recommended by clang)
  openssl  # tests/tls_test.cc makes its certificates with the openssl command
)
# The outside-reference test compares against torch.optim.AdamW.
if [[ "${SHARDOPT_WITH_TORCH:-1}" == 1 ]]; then
  packages+=(python3 python3-dev python3-numpy python3-torch python3-pytest python3-matplotlib
             python3-pip python3-setuptools python3-wheel pybind11-dev
             python3-grpcio)  # tests/python/proxy.py: byte-level gRPC proxies between client and server
fi

# tests/deploy: kubectl (for `kubectl kustomize`), and node with npm for the
# schema check (kubernetes-models, from package-lock.json). Debian's
# kubernetes-client, nodejs and npm, unless the machine has these commands
# already (another vendor's node package and Debian's npm do not mix).
command -v kubectl >/dev/null 2>&1 || packages+=(kubernetes-client)
command -v node >/dev/null 2>&1 || packages+=(nodejs)
command -v npm >/dev/null 2>&1 || packages+=(npm)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
[[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"

# Protobuf 3.21 and gRPC 1.51 are what the code is written against.
protoc --version | grep -q ' 3\.21\.' || { echo "install-deps: need protobuf 3.21, got $(protoc --version)" >&2; exit 1; }
