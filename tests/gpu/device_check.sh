#!/usr/bin/env bash
# The one command run on a GPU machine (docs/design.md, section 12, "Where
# there is no GPU").
# That machine has CUDA, NCCL and PyTorch but no gRPC, GoogleTest, absl or network,
# so the binaries come prebuilt in device-bundle/ (tests/gpu/make_bundle.sh,
# run on a development machine). Runs, each under a time limit and all within
# DEVICE_CHECK_SECONDS (420: about 7 minutes with the summary; a step's limit
# is cut to what is left of it, and a step with nothing left is recorded as
# timed out):
#   - the GPU tests: CUDA parity, sticky error, resume, availability, and the
#     node group's NCCL collective (one rank per GPU);
#   - the kernel benchmark against copy bandwidth and, where torch with CUDA
#     is present, torch's fused AdamW for comparison (these first, so that a
#     hang later cannot cost their figures);
#   - the integration tests service_test, durability_test (less its export
#     test, which needs the development machine's paths) and crash_test
#     against real shardopt-server processes on --device=cuda
#     (SHARDOPT_TEST_DEVICE), which compare the served bits with the
#     reference and with uninterrupted runs;
#   - tests/python under this machine's torch, CUDA params included, against
#     servers on --device=cuda, when the bundle holds the extension for its
#     Python (else recorded as absent, with why);
#   - shardopt-bench e2e, whole steps through an in-process server on the
#     CPU (this machine's cores) and on the GPU.
# Writes into $OUT (or ./device-out) kernel_bench.json, torch_fused_adamw.json,
# e2e_cpu.json, e2e_cuda.json and summary.json (every step and every test's
# result, with the failures' messages). Prints one JSON line, the summary's
# gist. Exits 0 when every step passed.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
bundle=${SHARDOPT_BUNDLE:-$root/device-bundle}
out=${OUT:-./device-out}
elements=${KERNEL_BENCH_ELEMENTS:-268435456}  # 2^28
budget=${DEVICE_CHECK_SECONDS:-420}
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

# step NAME LIMIT_S COMMAND...: stdout and stderr to $logs, the result to
# $logs/steps. The limit shrinks to what is left of the budget; a step with
# nothing left is not run, and recorded as timed out with limit 0.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - SECONDS))
  ((limit > left)) && limit=$left
  if ((limit <= 0)); then
    echo "$name 124 0 0" >>"$logs/steps"
    return
  fi
  local start=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >"$logs/$name.stdout" 2>"$logs/$name.stderr"
  echo "$name $? $((SECONDS - start)) $limit" >>"$logs/steps"
}

# NCCL is this machine's own (make_bundle.sh leaves it out): the system's,
# CUDA's, or the one PyTorch ships. Put first on the library path that every
# launch mode below uses.
nccl_dir=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 / {print $NF; exit}' | xargs -r dirname)
for d in /usr/local/cuda/lib64 \
  $(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0] + "/lib")' 2>/dev/null); do
  [[ -z $nccl_dir && -e $d/libnccl.so.2 ]] && nccl_dir=$d
done
[[ -n $nccl_dir ]] && export LD_LIBRARY_PATH=$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# How bundled binaries start here: with this machine's libstdc++, else the
# bundle's, else also the bundle's C library and loader.
launch=()
launch_mode=none
if [[ -f $bundle/bin/cuda_availability_test && ! -x $bundle/bin/cuda_availability_test ]]; then
  # A copy that lost the execute bits.
  cp -r "$bundle" "$logs/bundle" && chmod -R u+x "$logs/bundle/bin" "$logs/bundle/lib-glibc" && bundle=$logs/bundle
fi
if [[ -x $bundle/bin/cuda_availability_test ]]; then
  host_path=${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  candidates=(
    "system-libstdc++|env LD_LIBRARY_PATH=$bundle/lib$host_path"
    "bundled-libstdc++|env LD_LIBRARY_PATH=$bundle/lib:$bundle/lib-cxx$host_path"
    "bundled-glibc|$bundle/lib-glibc/ld-linux-x86-64.so.2 --library-path $bundle/lib:$bundle/lib-cxx:$bundle/lib-glibc$host_path"
  )
  for candidate in "${candidates[@]}"; do
    read -r -a cmd <<<"${candidate#*|}"
    # service_test also needs lib/'s gRPC, protobuf and OpenSSL.
    if "${cmd[@]}" "$bundle/bin/cuda_availability_test" --gtest_list_tests >"$logs/launch.log" 2>&1 &&
      "${cmd[@]}" "$bundle/bin/service_test" --gtest_list_tests >>"$logs/launch.log" 2>&1; then
      launch=("${cmd[@]}")
      launch_mode=${candidate%%|*}
      break
    fi
  done
fi

if [[ $launch_mode != none ]]; then
  mkdir -p "$logs/gtest"
  for t in cuda_availability_test cuda_parity_test cuda_sticky_error_test cuda_resume_test nccl_collective_test; do
    case $t in
      cuda_parity_test) limit=120 ;;
      nccl_collective_test) limit=30 ;;
      *) limit=20 ;;
    esac
    step "$t" "$limit" "${launch[@]}" "$bundle/bin/$t" --gtest_output="json:$logs/gtest/$t.json"
  done
  # The figures next, so that a hang in the longer steps below cannot cost them.
  step kernel_bench 40 "${launch[@]}" "$bundle/bin/cuda_kernel_bench" --elements="$elements" --iterations=20
fi
# torch runs with this machine's own libraries, never the bundle's. It exits
# 3 where there is no torch with CUDA, which the summary reports as absent.
step torch_fused_adamw 45 python3 "$here/torch_fused_adamw_bench.py" --elements="$elements" --iterations=20 \
  --out="$out/torch_fused_adamw.json"

if [[ $launch_mode != none ]]; then
  # The integration tests start their servers (and the Python tests the CLI)
  # through these wrappers, in the same launch mode. durability_test's export
  # test is left out: it runs the CLI and a torch reader from the development
  # machine's paths.
  for b in shardopt-server shardopt; do
    printf '#!/usr/bin/env bash\nexec %s "$@"\n' "$(printf '%q ' "${launch[@]}" "$bundle/bin/$b")" >"$logs/$b"
    chmod +x "$logs/$b"
  done
  on_gpu=(env SHARDOPT_TEST_DEVICE=cuda SHARDOPT_TEST_SERVER_BINARY="$logs/shardopt-server")
  step service_test_on_cuda 120 "${on_gpu[@]}" "${launch[@]}" "$bundle/bin/service_test" \
    --gtest_output="json:$logs/gtest/service_test_on_cuda.json"
  step durability_test_on_cuda 60 "${on_gpu[@]}" "${launch[@]}" "$bundle/bin/durability_test" \
    --gtest_filter=-DurabilityTest.ExportWritesMastersTorchReadsBitwiseAndImportStartsAJobFromThem \
    --gtest_output="json:$logs/gtest/durability_test_on_cuda.json"
  step crash_test_on_cuda 60 "${on_gpu[@]}" "${launch[@]}" "$bundle/bin/crash_test" \
    --gtest_output="json:$logs/gtest/crash_test_on_cuda.json"
  # The Python package's tests under this machine's torch (2.x, with CUDA:
  # test_cuda.py's CUDA params), when the bundle has the extension built for
  # its Python, against servers on the GPU (make test runs them on the CPU).
  # python3 runs on this machine's C library, which bundled-glibc mode means
  # is too old for the extension.
  if [[ ! -d $bundle/python/shardopt ]]; then
    echo "no extension in the bundle: make_bundle.sh found no Python 3.12" >"$logs/python_absent"
  elif [[ $launch_mode == bundled-glibc ]]; then
    echo "this machine's C library is older than the extension needs" >"$logs/python_absent"
  else
    py_libs=$bundle/lib
    [[ $launch_mode == bundled-libstdc++ ]] && py_libs+=:$bundle/lib-cxx
    step python_tests_on_cuda 200 env SHARDOPT_TEST_DEVICE=cuda PYTHONPATH="$bundle/python" \
      SHARDOPT_SERVER="$logs/shardopt-server" SHARDOPT_CLI="$logs/shardopt" \
      LD_LIBRARY_PATH="$py_libs$host_path" python3 -m pytest -q -p no:cacheprovider -rfEs \
      --junitxml="$logs/pytest.xml" "$root/tests/python"
  fi
  # Issue 11's step against its ceilings, 64M params as on the development
  # machine: here the update has 16 cores, or the GPU, beside the transport.
  step e2e_cpu 60 "${launch[@]}" "$bundle/bin/shardopt-bench" e2e --params=67108864 --steps=5
  step e2e_cuda 60 "${launch[@]}" "$bundle/bin/shardopt-bench" e2e --params=67108864 --steps=5 --device=cuda
fi

python3 "$here/device_summary.py" --logs="$logs" --out="$out" --bundle="$bundle" --launch-mode="$launch_mode" \
  --seconds="$SECONDS"
