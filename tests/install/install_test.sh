#!/usr/bin/env bash
# The installed package works for a project outside the tree: installs the
# build to a temporary prefix, builds tests/install/consumer against it with
# find_package(shardopt), and runs it against the installed shardopt-server
# on 127.0.0.1 (an ephemeral port), then reads the job back with the
# installed CLI. The README's client block is compiled into the consumer.
#   install_test.sh CMAKE BUILD_DIR CONSUMER_SOURCE_DIR GENERATOR CXX_COMPILER [COMPILER_LAUNCHER]
set -euo pipefail
cmake=$1 build=$2 consumer=$3 generator=$4 cxx=$5 launcher=${6:-}
dir=$(mktemp -d)
server=
cleanup() {
  [[ -n $server ]] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
prefix=$dir/prefix

"$cmake" --install "$build" --prefix "$prefix" >"$dir/install.log" || { cat "$dir/install.log"; exit 1; }
for f in bin/shardopt-server bin/shardopt include/shardopt/client.h share/shardopt/proto/shardopt/v1/optimizer.proto \
         share/shardopt/proto/shardopt/v1/checkpoint.proto; do
  [[ -e "$prefix/$f" ]] || { echo "FAIL: the install has no $f"; exit 1; }
done

# README.md's "Using the client" block, without its #include lines, which
# consumer/readme_snippet.cc has.
awk '/^## Using the client/ { section = 1 } section && /^```cpp/ { block = 1; next }
     block && /^```/ { exit } block && !/^#include/' "$consumer/../../../README.md" >"$dir/readme_snippet.inc"
grep -q 'client->Step(' "$dir/readme_snippet.inc" || { echo "FAIL: no client block in README.md"; exit 1; }

"$cmake" -S "$consumer" -B "$dir/consumer" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DSHARDOPT_README_SNIPPET="$dir/readme_snippet.inc" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$cxx" ${launcher:+-DCMAKE_CXX_COMPILER_LAUNCHER="$launcher"}
"$cmake" --build "$dir/consumer"

"$prefix/bin/shardopt-server" --host=127.0.0.1 --port=0 --port_file="$dir/port" --device=cpu 2>"$dir/server.log" &
server=$!
for _ in $(seq 400); do
  [[ -s "$dir/port" ]] && break
  kill -0 "$server" 2>/dev/null || { echo "FAIL: shardopt-server exited"; cat "$dir/server.log"; exit 1; }
  sleep 0.05
done
[[ -s "$dir/port" ]] || { echo "FAIL: shardopt-server did not listen within 20 s"; cat "$dir/server.log"; exit 1; }
address=127.0.0.1:$(cat "$dir/port")

"$dir/consumer/consumer" "$address"
"$prefix/bin/shardopt" --server="$address" describe install-test | tee "$dir/describe.json"
grep -q '"step": "1"' "$dir/describe.json" || { echo "FAIL: the installed CLI does not see the job at step 1"; exit 1; }
"$prefix/bin/shardopt" --server="$address" drop install-test
