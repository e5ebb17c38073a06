"""A real Prometheus (Debian's) scrapes a shardopt-server that a trainer
steps; the test then asks Prometheus's HTTP API for a rate and a histogram
quantile of the server's metrics, and checks the exposition's names and
types. Skips (exit 77) with a message where the prometheus binary is missing.

usage: prometheus_test.py SHARDOPT_SERVER DEMO_TRAINER"""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_for(what, fn, seconds):
    deadline = time.time() + seconds
    last = None
    while time.time() < deadline:
        try:
            last = fn()
            if last:
                return last
        except Exception as e:  # not up yet
            last = e
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {seconds} s (last: {last!r})")


def query(prom, expr):
    body = json.loads(get(f"http://127.0.0.1:{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert body["status"] == "success", body
    return body["data"]["result"]


def main():
    server_bin, trainer_bin = sys.argv[1], sys.argv[2]
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        print("SKIP: no prometheus binary (Debian package 'prometheus'; scripts/install-deps.sh installs it)")
        return 77
    tmp = tempfile.mkdtemp(prefix="shardopt-prom-")
    grpc_port, metrics_port, prom_port = free_port(), free_port(), free_port()
    procs = []
    try:
        server = subprocess.Popen([server_bin, "--host=127.0.0.1", f"--port={grpc_port}", "--device=cpu",
                                   f"--metrics_port={metrics_port}"], stderr=open(f"{tmp}/server.log", "w"))
        procs.append(server)
        text = wait_for("the metrics endpoint", lambda: get(f"http://127.0.0.1:{metrics_port}/metrics"), 20)
        # Names and types by Prometheus's conventions.
        for line in ("# TYPE shardopt_commits_total counter", "# TYPE shardopt_apply_seconds histogram",
                     "# TYPE shardopt_memory_budget_bytes gauge", "shardopt_build_info{version="):
            assert line in text, line
        with open(f"{tmp}/prometheus.yml", "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                    "scrape_configs:\n  - job_name: shardopt\n    static_configs:\n"
                    f"      - targets: ['127.0.0.1:{metrics_port}']\n")
        prom = subprocess.Popen([prometheus, f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/data",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/prometheus.log", "w"))
        procs.append(prom)
        wait_for("prometheus ready", lambda: "Ready" in get(f"http://127.0.0.1:{prom_port}/-/ready"), 60)
        # The trainer steps two jobs for a while; it drops them at its end.
        trainer = subprocess.Popen([trainer_bin, f"--server=127.0.0.1:{grpc_port}", "--steps=100000",
                                    "--print_every=1000000", f"--csv={tmp}/curves.csv"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(trainer)
        wait_for("the target up", lambda: query(prom_port, 'up{job="shardopt"} == 1'), 30)
        rate = wait_for("a commit rate", lambda: [r for r in query(prom_port, "rate(shardopt_commits_total[5s])")
                                                  if float(r["value"][1]) > 0], 40)
        quantile = wait_for("an apply-time median", lambda: [
            r for r in query(prom_port, "histogram_quantile(0.5, rate(shardopt_apply_seconds_bucket[5s]))")
            if r["value"][1] not in ("NaN", "+Inf")], 30)
        in_bytes = wait_for("bytes in", lambda: [r for r in query(prom_port, "rate(shardopt_received_bytes_total[5s])")
                                                 if float(r["value"][1]) > 0], 30)
        for r in rate + quantile + in_bytes:
            print(r["metric"], r["value"][1])
        # The series' own job label meets the scrape's: Prometheus keeps it as
        # exported_job (README, "Operations").
        jobs = {r["metric"].get("exported_job") for r in rate}
        assert "demo-fp32-state" in jobs, jobs
        assert 0 < float(quantile[0]["value"][1]) < 60, quantile
        print("PASS: Prometheus scraped the server and answered a rate and a histogram quantile")
        return 0
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
