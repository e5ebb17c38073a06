"""A real Prometheus (Debian's) scrapes a shardopt-server that a trainer
steps; the test then asks Prometheus's HTTP API for a rate and a histogram
quantile of the server's metrics, and checks the exposition's names and
types. Skips (exit 77) with a message where the prometheus binary is missing.

Prometheus runs deploy/prometheus/prometheus.yml, its alerting rules loaded,
with one change: Debian's Prometheus has no Kubernetes discovery, so the
`shardopt` job's pods come from a file holding the labels that discovery
gives a pod's ports (the server's metrics port, and its gRPC port, which the
job's relabelling must drop), and the shipped relabelling picks the target.

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

import yaml

DEPLOY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy", "prometheus")


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


def start_on_free_ports(what, count, command, ready, log, seconds):
    """Starts command(ports) on `count` ports picked free, and waits until
    ready(ports) holds. A port picked free can be taken by another test's
    server before this process binds it (ctest runs tests side by side); the
    process then exits, or another server answers, so a try whose process
    has exited is made again on new ports, three times at most."""
    for attempt in range(3):
        ports = [free_port() for _ in range(count)]
        proc = subprocess.Popen(command(ports), stdout=subprocess.DEVNULL, stderr=open(log, "w"))

        def up():
            if proc.poll() is not None:
                return "exited"
            return ready(ports) and "ready"
        try:
            if wait_for(what, up, seconds) == "ready":
                return proc, ports
        except AssertionError:
            proc.kill()
            proc.wait()
            raise
        print(f"{what}: exited on ports {ports} (taken meanwhile?), trying new ones; its log:\n" + open(log).read())
    raise AssertionError(f"{what}: exited on three sets of free ports")


def query(prom, expr):
    body = json.loads(get(f"http://127.0.0.1:{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert body["status"] == "success", body
    return body["data"]["result"]


def write_config(tmp, ports):
    """deploy/prometheus's configuration, scraping every second, its pods
    from a file: one target per named container port of pod shardopt-0, as
    Kubernetes discovery gives them."""
    with open(os.path.join(DEPLOY, "prometheus.yml")) as f:
        config = yaml.safe_load(f)
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [os.path.join(DEPLOY, r) for r in config["rule_files"]]
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "shardopt")
    assert [list(sd) for sd in job.pop("kubernetes_sd_configs")] == [["role"]], "pod discovery, as documented"
    pods = [{"targets": [f"127.0.0.1:{port}"],
             "labels": {"__meta_kubernetes_namespace": "training", "__meta_kubernetes_pod_name": "shardopt-0",
                        "__meta_kubernetes_pod_label_app_kubernetes_io_name": "shardopt",
                        "__meta_kubernetes_pod_container_port_name": name}} for name, port in ports.items()]
    with open(f"{tmp}/pods.json", "w") as f:
        json.dump(pods, f)
    job["file_sd_configs"] = [{"files": [f"{tmp}/pods.json"]}]
    with open(f"{tmp}/prometheus.yml", "w") as f:
        yaml.safe_dump(config, f)


def main():
    server_bin, trainer_bin = sys.argv[1], sys.argv[2]
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        print("SKIP: no prometheus binary (Debian package 'prometheus'; scripts/install-deps.sh installs it)")
        return 77
    tmp = tempfile.mkdtemp(prefix="shardopt-prom-")
    procs = []
    try:
        server, (grpc_port, metrics_port) = start_on_free_ports(
            "the metrics endpoint", 2,
            lambda ports: [server_bin, "--host=127.0.0.1", f"--port={ports[0]}", "--device=cpu",
                           f"--metrics_port={ports[1]}"],
            lambda ports: "shardopt_build_info" in get(f"http://127.0.0.1:{ports[1]}/metrics"), f"{tmp}/server.log", 20)
        procs.append(server)
        text = get(f"http://127.0.0.1:{metrics_port}/metrics")
        # Names and types by Prometheus's conventions.
        for line in ("# TYPE shardopt_commits_total counter", "# TYPE shardopt_apply_seconds histogram",
                     "# TYPE shardopt_memory_budget_bytes gauge", "shardopt_build_info{version="):
            assert line in text, line
        write_config(tmp, {"metrics": metrics_port, "grpc": grpc_port})
        prom, (prom_port,) = start_on_free_ports(
            "prometheus ready", 1,
            lambda ports: [prometheus, f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/data",
                           f"--web.listen-address=127.0.0.1:{ports[0]}"],
            lambda ports: "Ready" in get(f"http://127.0.0.1:{ports[0]}/-/ready"), f"{tmp}/prometheus.log", 60)
        procs.append(prom)
        # The trainer steps two jobs for a while; it drops them at its end.
        trainer = subprocess.Popen([trainer_bin, f"--server=127.0.0.1:{grpc_port}", "--steps=100000",
                                    "--print_every=1000000", f"--csv={tmp}/curves.csv"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(trainer)
        up = wait_for("the target up", lambda: query(prom_port, 'up{job="shardopt"} == 1'), 30)
        # One target: the gRPC port's was dropped by the shipped relabelling.
        targets = json.loads(get(f"http://127.0.0.1:{prom_port}/api/v1/targets"))["data"]["activeTargets"]
        assert [t["labels"] for t in targets] == [{"instance": f"127.0.0.1:{metrics_port}", "job": "shardopt",
                                                    "namespace": "training", "pod": "shardopt-0"}], targets
        assert up[0]["metric"]["pod"] == "shardopt-0", up
        rules = json.loads(get(f"http://127.0.0.1:{prom_port}/api/v1/rules"))["data"]["groups"]
        assert any(r["name"] == "ShardoptServerDown" for g in rules for r in g["rules"]), rules
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
