#!/usr/bin/env bash
# Builds what tests/gpu/device_check.sh runs on a GPU machine, which has CUDA,
# NCCL and PyTorch but no gRPC, GoogleTest, absl or network: the GPU test
# binaries, the kernel benchmark, and the server, the CLI, three integration
# tests and shardopt-bench that run it on the GPU end to end, with CUDA linked
# statically; the Python package with its extension built for that machine's
# Python; and next to them every shared library they need but the driver's
# and NCCL (the machine's own are used). libstdc++ (lib-cxx/) and the C
# library with its loader (lib-glibc/) travel too, used only where the
# machine's own are too old; manifest.json says what was built from what.
#
#   tests/gpu/make_bundle.sh   # -> device-bundle/{bin,lib,lib-cxx,lib-glibc,python,manifest.json}
#
# BUILD_DIR (default build-cuda; the extension goes to BUILD_DIR-python),
# JOBS (default 2) and DEVICE_PYTHON tune the build.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${BUILD_DIR:-$root/build-cuda}
bundle=$root/device-bundle
# Each target with its place in the build tree.
binaries=(tests/gpu/cuda_parity_test tests/gpu/cuda_sticky_error_test tests/gpu/cuda_resume_test
  tests/gpu/cuda_availability_test tests/gpu/nccl_collective_test tests/gpu/cuda_kernel_bench
  server/shardopt-server client/shardopt bench/shardopt-bench tests/service_test tests/durability_test tests/crash_test)

cmake -S "$root" -B "$build" -G Ninja -DSHARDOPT_CUDA=ON -DSHARDOPT_BUILD_BENCH=ON >/dev/null
ninja -C "$build" -j "${JOBS:-2}" "${binaries[@]##*/}"

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib"
for b in "${binaries[@]}"; do
  cp "$build/$b" "$bundle/bin/"
done

# The Python package, its extension built for the GPU machine's Python
# (DEVICE_PYTHON, by default a python3.12 on PATH, as there: torch 2.x on
# 3.12), so that device_check.sh runs tests/python there, test_cuda.py's CUDA
# params included. Left out, with a note, where no such Python is here.
device_python=${DEVICE_PYTHON:-}
for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  [[ -z $device_python ]] || break
  # The interpreter itself: a pyenv shim on PATH may not run 3.12.
  device_python=$("$candidate" -c 'import sys; print(sys.executable)' 2>/dev/null) || device_python=
done
if [[ -n $device_python ]]; then
  cmake -S "$root" -B "$build-python" -G Ninja -DSHARDOPT_PYTHON="$device_python" -DSHARDOPT_CUDA=OFF \
    -DSHARDOPT_BUILD_TESTS=OFF -DSHARDOPT_BUILD_BENCH=OFF >/dev/null
  ninja -C "$build-python" -j "${JOBS:-2}" shardopt_py
  # The sources and this Python's extension only: not one built earlier for
  # another interpreter, nor bytecode.
  suffix=$("$device_python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  mkdir -p "$bundle/python/shardopt"
  cp "$build-python/python/shardopt/"*.py "$build-python/python/shardopt/_C$suffix" "$bundle/python/shardopt/"
else
  echo "make_bundle: no python3.12 here (DEVICE_PYTHON), so the Python tests stay out of the bundle" >&2
fi
shopt -s nullglob  # no Python package: no extension in the list
shared=("$bundle"/bin/* "$bundle"/python/shardopt/*.so)
shopt -u nullglob

# Not `ldd | grep -q`: under pipefail, ldd dying on the pipe grep closed
# early would read as "nothing missing".
deps=$(ldd "${shared[@]}" 2>&1)
if grep -q "not found" <<<"$deps"; then
  printf '%s\n' "$deps" >&2
  echo "make_bundle: a library is missing here" >&2
  exit 1
fi
# The driver's libcuda, which the static CUDA runtime opens at run time, is
# the GPU machine's. The rest travels: absl in lib/; libstdc++ in lib-cxx/ and
# the C library with its loader in lib-glibc/, for device_check.sh to fall
# back on when the machine's own are too old.
mkdir -p "$bundle/lib-cxx" "$bundle/lib-glibc"
{
  ldd "${shared[@]}" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
  ldd "${shared[@]}" | awk '$1 ~ /^\/.*ld-linux/ {n = split($1, p, "/"); print p[n], $1}'
  # libcuda links these; in lib-glibc mode they must match the bundled libc.
  for lib in libdl.so.2 librt.so.1 libpthread.so.0; do
    echo "$lib $(ldconfig -p | awk -v l="$lib" '$1 == l && /x86-64/ {print $NF; exit}')"
  done
} | sort -u | while read -r name path; do
  case "$name" in
    # NCCL is the GPU machine's too: at 208 MB it is more than a device run
    # can carry, and device_check.sh finds the machine's own.
    libcuda.so.* | libnccl.so.*) ;;
    libc.so.* | libm.so.* | libdl.so.* | librt.so.* | libpthread.so.* | ld-linux*) cp -L "$path" "$bundle/lib-glibc/$name" ;;
    libstdc++.so.* | libgcc_s.so.*) cp -L "$path" "$bundle/lib-cxx/$name" ;;
    *) cp -L "$path" "$bundle/lib/$name" ;;
  esac
done

# The newest glibc symbol version the binaries, the extension and lib/ need:
# the GPU machine's glibc must be at least that, or lib-glibc/ is used.
glibc=$(objdump -T "${shared[@]}" "$bundle"/lib/* | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)
glibcxx=$(objdump -T "${shared[@]}" "$bundle"/lib/* | grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -1)
cat >"$bundle/manifest.json" <<JSON
{"commit": "$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)",
 "dirty": $(git -C "$root" diff --quiet HEAD 2>/dev/null && echo false || echo true),
 "built": "$(date -u +%Y-%m-%dT%H:%M:%SZ)",
 "glibc_required": "${glibc#GLIBC_}",
 "glibcxx_required": "${glibcxx#GLIBCXX_}",
 "cuda_architectures": "$(grep -o 'code=\[\?[a-z_0-9,]*' "$build/build.ninja" | grep -o '[a-z]*_[0-9]*' | sort -u | paste -sd' ')"}
JSON
echo "make_bundle: $(du -sh "$bundle" | cut -f1) in $bundle; bin/ and lib/ need glibc ${glibc#GLIBC_}, ${glibcxx}"
