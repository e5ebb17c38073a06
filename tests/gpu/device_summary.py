#!/usr/bin/env python3
"""Writes device_check.sh's summary.json (and kernel_bench.json) from its step
logs; exits 0 when every step passed."""
import argparse
import json
import os
import platform
import subprocess


def tail(path, chars=3000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def command(*argv):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable: {e}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--logs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--launch-mode", required=True)
    args = ap.parse_args()

    steps = []
    steps_file = os.path.join(args.logs, "steps")
    if os.path.exists(steps_file):
        with open(steps_file) as f:
            for line in f:
                name, rc, seconds, limit = line.split()
                steps.append({"name": name, "rc": int(rc), "seconds": int(seconds), "limit_seconds": int(limit),
                              "timed_out": int(rc) in (124, 137),
                              "stdout_tail": tail(os.path.join(args.logs, name + ".stdout")),
                              "stderr_tail": tail(os.path.join(args.logs, name + ".stderr"))})

    # The benchmark prints one JSON object; anything else becomes an error record.
    bench = next((s for s in steps if s["name"] == "kernel_bench"), None)
    if bench is not None:
        try:
            result = json.loads(bench["stdout_tail"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            result = {"error": "no JSON from cuda_kernel_bench", "rc": bench["rc"], "stderr": bench["stderr_tail"]}
        with open(os.path.join(args.out, "kernel_bench.json"), "w") as f:
            json.dump(result, f, indent=1)

    manifest = {}
    try:
        with open(os.path.join(args.bundle, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        manifest = {"error": f"no bundle manifest ({e}); run tests/gpu/make_bundle.sh on a development machine"}

    ok = args.launch_mode != "none" and bool(steps) and all(s["rc"] == 0 for s in steps)
    summary = {
        "ok": ok,
        "launch_mode": args.launch_mode,
        "launch_log": tail(os.path.join(args.logs, "launch.log")),
        "bundle": manifest,
        "machine": {
            "host": platform.node(),
            "glibc": " ".join(platform.libc_ver()),
            "nvidia_smi": command("nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.memory",
                                  "--format=csv,noheader"),
        },
        "steps": steps,
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({"ok": ok, "launch_mode": args.launch_mode,
                      "steps": {s["name"]: s["rc"] for s in steps}}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
