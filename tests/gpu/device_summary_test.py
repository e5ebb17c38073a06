"""device_summary.py decides whether a run of device_check.sh on a GPU machine
passed, from the logs the script leaves: these cases give it such logs, made
here, and check its verdict, its exit code and what it reports. No GPU is
needed, so it runs in every build (ctest label unit)."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SUMMARY = os.path.join(HERE, "device_summary.py")

KERNEL = {"elements_per_second": 2.0e11, "copy_bytes_per_second": 4.0e12, "fraction_of_roofline": 0.9}
TORCH = {"elements_per_second": 1.0e11, "copy_bytes_per_second": 4.0e12, "fraction_of_roofline": 0.7,
         "op": "torch._fused_adamw_"}
E2E = {"device": "cuda:0 (test)", "step_seconds": 0.2, "echo_seconds": 0.1, "kernel_seconds": 0.01,
       "fraction_of_echo": 0.5, "fraction_of_serial_ceiling": 0.55, "server_phases_seconds": {"apply": 0.01}}


def gtest_report(passed=(), failed=(), skipped=()):
    """A --gtest_output=json report of one suite, Suite."""
    tests = [{"name": n, "result": "COMPLETED"} for n in passed]
    tests += [{"name": n, "result": "COMPLETED", "failures": [{"failure": f"{n} broke"}]} for n in failed]
    tests += [{"name": n, "result": "SKIPPED"} for n in skipped]
    return {"tests": len(tests), "failures": len(failed), "testsuites": [{"name": "Suite", "testsuite": tests}]}


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.python.test_a" name="test_ok"/>
<testcase classname="tests.python.test_a" name="test_bad"><failure message="assert 1 == 2"/>
<error message="teardown broke"/></testcase>
<testcase classname="tests.python.test_a" name="test_cuda"><skipped message="no CUDA device"/></testcase>
<testcase classname="tests.python.test_a" name="test_ok2"/>
</testsuite></testsuites>"""


class Run:
    """A device_check.sh run's logs, bundle manifest and $OUT, in a scratch
    directory, and device_summary.py's answer over them."""

    def __init__(self, root):
        self.logs, self.out, self.bundle = (os.path.join(root, d) for d in ("logs", "out", "bundle"))
        for d in (self.logs, os.path.join(self.logs, "gtest"), self.out, self.bundle):
            os.makedirs(d)
        with open(os.path.join(self.bundle, "manifest.json"), "w") as f:
            json.dump({"commit": "abc", "dirty": False}, f)

    def step(self, name, rc, stdout="", stderr=""):
        with open(os.path.join(self.logs, "steps"), "a") as f:
            f.write(f"{name} {rc} 1 20\n")
        for stream, text in (("stdout", stdout), ("stderr", stderr)):
            with open(os.path.join(self.logs, f"{name}.{stream}"), "w") as f:
                f.write(text)

    def gtest(self, name, report):
        with open(os.path.join(self.logs, "gtest", name + ".json"), "w") as f:
            json.dump(report, f)

    def write(self, path, text):
        with open(os.path.join(self.logs, path), "w") as f:
            f.write(text)

    def summarize(self, launch_mode="system-libstdc++"):
        done = subprocess.run([sys.executable, SUMMARY, f"--logs={self.logs}", f"--out={self.out}",
                               f"--bundle={self.bundle}", f"--launch-mode={launch_mode}", "--seconds=99"],
                              capture_output=True, text=True, timeout=60)
        with open(os.path.join(self.out, "summary.json")) as f:
            return done.returncode, json.loads(done.stdout), json.load(f)


class DeviceSummaryTest(unittest.TestCase):
    def setUp(self):
        self.scratch = tempfile.TemporaryDirectory()
        self.run_ = Run(self.scratch.name)

    def tearDown(self):
        self.scratch.cleanup()

    def passing_run(self):
        r = self.run_
        r.step("cuda_parity_test", 0)
        r.gtest("cuda_parity_test", gtest_report(passed=["A", "B"], skipped=["NeedsTwoGpus"]))
        r.step("kernel_bench", 0, stdout="ptxas noise\n" + json.dumps(KERNEL) + "\n")
        r.step("torch_fused_adamw", 0)
        with open(os.path.join(r.out, "torch_fused_adamw.json"), "w") as f:
            json.dump(TORCH, f)
        r.step("e2e_cuda", 0, stdout=json.dumps(E2E) + "\n")
        r.step("python_tests_on_cuda", 0)
        r.write("pytest.xml", JUNIT.replace('<failure message="assert 1 == 2"/>\n<error message="teardown broke"/>', ""))
        return r

    def test_every_step_passing_is_ok_and_the_figures_are_reported(self):
        rc, gist, summary = self.passing_run().summarize()
        self.assertEqual(rc, 0)
        self.assertTrue(gist["ok"])
        self.assertEqual(gist["steps"], {"cuda_parity_test": 0, "kernel_bench": 0, "torch_fused_adamw": 0,
                                         "e2e_cuda": 0, "python_tests_on_cuda": 0})
        # Skips are named, not hidden; they do not fail the run.
        self.assertEqual(gist["not_passed"], {"cuda_parity_test": ["Suite.NeedsTwoGpus"],
                                              "python_tests_on_cuda": ["tests.python.test_a.test_cuda"]})
        self.assertEqual(summary["kernel"]["elements_per_second"], 2.0e11)
        self.assertEqual(summary["kernel"]["vs_torch_fused_adamw"], 2.0)
        self.assertEqual(summary["e2e"]["e2e_cuda"]["fraction_of_echo"], 0.5)
        with open(os.path.join(self.run_.out, "kernel_bench.json")) as f:
            self.assertEqual(json.load(f), KERNEL)
        self.assertEqual(summary["python_tests"], "run")
        self.assertEqual(summary["tests"]["cuda_parity_test"]["tests"], 3)

    def test_a_failed_step_fails_the_run_and_its_tests_say_why(self):
        r = self.passing_run()
        r.step("service_test_on_cuda", 1, stderr="a server did not start")
        r.gtest("service_test_on_cuda", gtest_report(passed=["A"], failed=["Bitwise"]))
        rc, gist, summary = r.summarize()
        self.assertEqual(rc, 1)
        self.assertFalse(gist["ok"])
        self.assertEqual(gist["not_passed"]["service_test_on_cuda"], ["Suite.Bitwise"])
        failed = summary["tests"]["service_test_on_cuda"]["not_passed"][0]
        self.assertEqual(failed["failures"], ["Bitwise broke"])
        step = next(s for s in summary["steps"] if s["name"] == "service_test_on_cuda")
        self.assertEqual(step["stderr_tail"], "a server did not start")

    def test_a_timed_out_step_fails_the_run(self):
        r = self.passing_run()
        r.step("crash_test_on_cuda", 124)
        rc, gist, summary = r.summarize()
        self.assertEqual(rc, 1)
        step = next(s for s in summary["steps"] if s["name"] == "crash_test_on_cuda")
        self.assertTrue(step["timed_out"])

    def test_a_pytest_case_with_a_failure_and_an_error_is_one_failed_test(self):
        r = self.passing_run()
        r.write("pytest.xml", JUNIT)
        _, gist, summary = r.summarize()
        python = summary["tests"]["python_tests_on_cuda"]
        self.assertEqual((python["tests"], python["failures"]), (4, 1))
        bad = python["not_passed"][0]
        self.assertEqual(bad["test"], "tests.python.test_a.test_bad")
        self.assertEqual(bad["failures"], ["assert 1 == 2", "teardown broke"])

    def test_torch_without_cuda_is_absent_not_failed(self):
        r = self.run_
        r.step("cuda_parity_test", 0)
        r.step("torch_fused_adamw", 3)
        rc, gist, _ = r.summarize()
        self.assertEqual(rc, 0)
        self.assertEqual(gist["torch_fused_adamw"], "absent")

    def test_python_tests_left_out_say_why(self):
        r = self.run_
        r.step("cuda_parity_test", 0)
        r.write("python_absent", "no extension in the bundle\n")
        rc, gist, _ = r.summarize()
        self.assertEqual(rc, 0)
        self.assertEqual(gist["python_tests"], "absent: no extension in the bundle")

    def test_a_benchmark_without_json_is_an_error_record(self):
        r = self.run_
        r.step("kernel_bench", 1, stdout="", stderr="no usable GPU")
        rc, _, _ = r.summarize()
        self.assertEqual(rc, 1)
        with open(os.path.join(r.out, "kernel_bench.json")) as f:
            record = json.load(f)
        self.assertEqual(record["error"], "no JSON from kernel_bench")
        self.assertEqual(record["stderr"], "no usable GPU")

    def test_no_bundle_binary_that_starts_is_not_ok(self):
        rc, gist, _ = self.passing_run().summarize(launch_mode="none")
        self.assertEqual(rc, 1)
        self.assertFalse(gist["ok"])


if __name__ == "__main__":
    unittest.main()
