#!/usr/bin/env bash
# make demo: start a shardopt server on the CPU backend, run the demo trainer
# through it, then the PyTorch demo (examples/torch_demo.py), stop the server.
set -euo pipefail
build=${1:-build}
dir=$(mktemp -d)
"$build/server/shardopt-server" --host=127.0.0.1 --port=0 --port_file="$dir/port" --device=cpu 2>"$dir/server.log" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 200); do
  [[ -s "$dir/port" ]] && break
  kill -0 $server 2>/dev/null || { cat "$dir/server.log" >&2; exit 1; }
  sleep 0.05
done
[[ -s "$dir/port" ]] || { echo "demo: server did not start" >&2; cat "$dir/server.log" >&2; exit 1; }
echo "demo: shardopt-server on 127.0.0.1:$(cat "$dir/port") ($(grep -o 'device="[^"]*"' "$dir/server.log" | head -1))"
"$build/examples/demo_trainer" --server="127.0.0.1:$(cat "$dir/port")" --csv=demo_curves.csv
# The PyTorch demo against the same server: shardopt.torch.RemoteAdamW against
# torch.optim.AdamW on bf16 params (Debian's torch is in /usr/bin/python3).
PYTHONPATH="$build/python" /usr/bin/python3 "$(dirname "$0")/../examples/torch_demo.py" --server="127.0.0.1:$(cat "$dir/port")" \
  --png=demo_torch.png
