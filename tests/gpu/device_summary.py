#!/usr/bin/env python3
"""Writes device_check.sh's summary.json (and kernel_bench.json, e2e_cpu.json,
e2e_cuda.json) from its step logs, and prints its gist as one JSON line: each
step's exit code, the tests that failed or skipped, the kernel's and torch's
fused AdamW speed against copy bandwidth, and the e2e steps against their
ceilings. Exits 0 when every step passed; torch's benchmark may instead be
absent (exit 3: no torch with CUDA on the machine)."""
import argparse
import json
import os
import platform
import subprocess
from xml.etree import ElementTree


def tail(path, chars=3000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def speed(result):
    """The figures to compare from a benchmark's JSON, or what went wrong."""
    if not result:
        return None
    keys = ("elements_per_second", "copy_bytes_per_second", "fraction_of_roofline", "op", "error", "absent")
    return {k: result[k] for k in keys if k in result}


BENCHES = ("kernel_bench", "e2e_cpu", "e2e_cuda")
E2E_KEYS = ("device", "step_seconds", "echo_seconds", "kernel_seconds", "fraction_of_echo",
            "fraction_of_serial_ceiling", "fraction_of_sequential_ceiling", "server_phases_seconds", "error")


def gtest_results(folder):
    """Each test binary's counts, and every test that did not pass with why."""
    results = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        report = load(os.path.join(folder, name))
        if not report:
            continue
        not_passed = []
        for suite in report.get("testsuites", []):
            for test in suite.get("testsuite", []):
                failures = [f.get("failure", "")[:1500] for f in test.get("failures", [])]
                if failures or test.get("result") == "SKIPPED":
                    not_passed.append({"test": f"{suite['name']}.{test['name']}", "result": test.get("result"),
                                       "failures": failures})
        results[name.removesuffix(".json")] = {"tests": report.get("tests"), "failures": report.get("failures"),
                                                "not_passed": not_passed}
    return results


def pytest_results(path):
    """The same for pytest's JUnit XML: counts, and every test that did not pass."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    not_passed, total, failed = [], 0, 0
    for case in root.iter("testcase"):
        total += 1
        # A failure and an error of one case (a teardown after a failed
        # body) count as one failed test.
        problems = [e for kind in ("failure", "error", "skipped") for e in case.findall(kind)]
        if not problems:
            continue
        failed += any(e.tag != "skipped" for e in problems)
        not_passed.append({"test": f"{case.get('classname')}.{case.get('name')}", "result": problems[0].tag,
                           "failures": [(e.get("message") or "")[:1500] for e in problems]})
    return {"tests": total, "failures": failed, "not_passed": not_passed}


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
    ap.add_argument("--seconds", type=int, required=True)
    args = ap.parse_args()

    steps = []
    steps_file = os.path.join(args.logs, "steps")
    if os.path.exists(steps_file):
        with open(steps_file) as f:
            for line in f:
                name, rc, seconds, limit = line.split()
                steps.append({"name": name, "rc": int(rc), "seconds": int(seconds), "limit_seconds": int(limit),
                              "timed_out": int(rc) in (124, 137),
                              "skipped_for_time": int(limit) == 0,
                              "stdout_tail": tail(os.path.join(args.logs, name + ".stdout")),
                              "stderr_tail": tail(os.path.join(args.logs, name + ".stderr"))})

    # Each benchmark prints one JSON object; anything else becomes an error record.
    for bench in (s for s in steps if s["name"] in BENCHES):
        try:
            result = json.loads(bench["stdout_tail"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            result = {"error": f"no JSON from {bench['name']}", "rc": bench["rc"], "stderr": bench["stderr_tail"]}
        with open(os.path.join(args.out, bench["name"] + ".json"), "w") as f:
            json.dump(result, f, indent=1)
    tests = gtest_results(os.path.join(args.logs, "gtest"))
    python_tests = pytest_results(os.path.join(args.logs, "pytest.xml"))
    if python_tests is not None:
        tests["python_tests_on_cuda"] = python_tests
    python_absent = tail(os.path.join(args.logs, "python_absent")).strip()

    manifest = {}
    try:
        with open(os.path.join(args.bundle, "manifest.json")) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        manifest = {"error": f"no bundle manifest ({e}); run tests/gpu/make_bundle.sh on a development machine"}

    def absent(s):  # torch's benchmark on a machine without torch with CUDA
        return s["name"] == "torch_fused_adamw" and s["rc"] == 3

    torch_absent = any(absent(s) for s in steps)
    ok = args.launch_mode != "none" and bool(steps) and all(s["rc"] == 0 or absent(s) for s in steps)
    kernel = speed(load(os.path.join(args.out, "kernel_bench.json")))
    torch = speed(load(os.path.join(args.out, "torch_fused_adamw.json")))
    e2e = {}
    for name in ("e2e_cpu", "e2e_cuda"):
        result = load(os.path.join(args.out, name + ".json"))
        if result:
            e2e[name] = {k: result[k] for k in E2E_KEYS if k in result}
    if kernel and torch and "elements_per_second" in kernel and "elements_per_second" in torch:
        kernel["vs_torch_fused_adamw"] = round(kernel["elements_per_second"] / torch["elements_per_second"], 3)
    summary = {
        "ok": ok,
        "seconds": args.seconds,
        "launch_mode": args.launch_mode,
        "launch_log": tail(os.path.join(args.logs, "launch.log")),
        "bundle": manifest,
        "machine": {
            "host": platform.node(),
            "glibc": " ".join(platform.libc_ver()),
            "nvidia_smi": command("nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.memory",
                                  "--format=csv,noheader"),
        },
        "kernel": kernel,
        "torch_fused_adamw": "absent" if torch_absent else torch,
        "e2e": e2e,
        "python_tests": f"absent: {python_absent}" if python_absent else "run",
        "tests": tests,
        "steps": steps,
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({"ok": ok, "seconds": args.seconds, "launch_mode": args.launch_mode,
                      "steps": {s["name"]: s["rc"] for s in steps},
                      "not_passed": {k: [t["test"] for t in v["not_passed"]] for k, v in tests.items() if v["not_passed"]},
                      "python_tests": summary["python_tests"],
                      "kernel": kernel, "torch_fused_adamw": summary["torch_fused_adamw"],
                      "e2e": {k: {f: v.get(f) for f in ("device", "step_seconds", "fraction_of_echo",
                                                       "fraction_of_serial_ceiling", "error")}
                              for k, v in e2e.items()}}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
