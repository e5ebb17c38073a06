#!/usr/bin/env bash
# pip install --no-build-isolation of the Python package into a scratch
# directory (offline: only what Debian ships), then import it from there.
#   pip_install_test.sh PYTHON PACKAGE_DIR SCRATCH
set -euo pipefail
python=$1 package=$2 scratch=$3
rm -rf "$scratch"
mkdir -p "$scratch"
PIP_NO_INDEX=1 "$python" -m pip install --no-build-isolation --no-deps --no-index --target "$scratch/site" "$package"
cd "$scratch"
PYTHONPATH="$scratch/site" "$python" - <<'PY'
import os
import shardopt
import shardopt.torch
assert os.path.dirname(shardopt.__file__).endswith("site/shardopt"), shardopt.__file__
assert shardopt.expand_server_pattern("s-{i}.s:1", 2) == ["s-0.s:1", "s-1.s:1"]
print("imported", shardopt.__file__, "and", shardopt._C.__file__)
PY
# The extension takes tensors' addresses; it must not link libtorch.
if ldd "$scratch"/site/shardopt/_C*.so | grep -i torch; then
  echo "pip_install_test: the extension links libtorch" >&2
  exit 1
fi
