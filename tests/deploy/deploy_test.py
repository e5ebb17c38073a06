"""deploy/ validated offline, as make test runs it on a machine with no
Docker daemon and no Kubernetes API server:

  render      every overlay renders with `kubectl kustomize`;
  schemas     every rendered object validates against the Kubernetes schemas
              (npm kubernetes-models, pinned in package-lock.json), and a
              deliberately broken object fails;
  dockerfiles every stage's base is pinned, the images run as non-root, and
              what they copy and the flags they pass exist; a broken
              Dockerfile fails;
  drift       shardopt-server starts with the exact args of each rendered pod
              spec (its ConfigMap flagfile, paths mapped to temp dirs with
              real certificates and tokens; --host, --port, --health_port and
              --metrics_port overridden to loopback aliases and free ports),
              one server per replica on 127.0.{i}.1, and the CLI reaches each
              through that pattern (the StatefulSet's shardopt-{i}.shardopt).

usage: deploy_test.py CHECK REPO_ROOT BUILD_DIR SHARDOPT_SERVER SHARDOPT_CLI"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

OVERLAYS = ["cpu-dev", "gpu"]


def render(repo, overlay):
    out = subprocess.run(["kubectl", "kustomize", os.path.join(repo, "deploy", "overlays", overlay)],
                         capture_output=True, text=True)
    assert out.returncode == 0, f"kubectl kustomize {overlay}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def node_modules(repo, build):
    """kubernetes-models installed from the lock file into the build tree, once."""
    where = os.path.join(build, "tests", "deploy", "npm")
    if not os.path.isdir(os.path.join(where, "node_modules", "kubernetes-models")):
        os.makedirs(where, exist_ok=True)
        for f in ("package.json", "package-lock.json"):
            shutil.copy(os.path.join(repo, "tests", "deploy", f), where)
        out = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=where, capture_output=True, text=True)
        assert out.returncode == 0, f"npm ci: {out.stderr}"
    return where


def validate(repo, build, objects):
    where = node_modules(repo, build)
    shutil.copy(os.path.join(repo, "tests", "deploy", "validate.mjs"), where)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(objects, f)
    out = subprocess.run(["node", os.path.join(where, "validate.mjs"), f.name], capture_output=True, text=True)
    os.unlink(f.name)
    return out.returncode, out.stdout + out.stderr


def check_render(repo, build):
    for overlay in OVERLAYS:
        objects = render(repo, overlay)
        kinds = sorted(o["kind"] for o in objects)
        print(overlay, kinds)
        for kind in ("ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "Service", "StatefulSet"):
            assert kind in kinds, (overlay, kind)
        sts = statefulset(objects)
        pod = sts["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert "grpc" in c["readinessProbe"] and "grpc" in c["livenessProbe"]
        assert c["resources"]["limits"]["memory"] == c["resources"]["requests"]["memory"]
        if overlay == "gpu":
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert "PersistentVolumeClaim" in kinds
            claim = [v for v in pod["volumes"] if v["name"] == "checkpoints"][0]["persistentVolumeClaim"]["claimName"]
            pvc = [o for o in objects if o["kind"] == "PersistentVolumeClaim"][0]
            assert pvc["metadata"]["name"] == claim and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
            assert pod["affinity"]["podAntiAffinity"]
        else:
            assert sts["spec"]["replicas"] == 1
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
            assert [v for v in pod["volumes"] if v["name"] == "checkpoints"][0].get("emptyDir") is not None
            assert "PersistentVolumeClaim" not in kinds
    print("PASS render")


def check_schemas(repo, build):
    for overlay in OVERLAYS:
        rc, out = validate(repo, build, render(repo, overlay))
        print(out, end="")
        assert rc == 0, f"{overlay} does not validate"
    broken = statefulset(render(repo, "gpu"))
    broken["spec"]["replicas"] = "two"
    del broken["spec"]["template"]["spec"]["containers"][0]["name"]
    rc, out = validate(repo, build, [broken])
    print(out, end="")
    assert rc != 0 and "INVALID" in out, "a broken StatefulSet passed validation"
    print("PASS schemas")


def statefulset(objects):
    return [o for o in objects if o["kind"] == "StatefulSet"][0]


# ---- Dockerfiles ----

def dockerfile_problems(path, repo, server_flags):
    text = open(path).read()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    problems = []
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?", text, re.M)
    if not stages:
        problems.append("no FROM")
    for image, _ in stages:
        image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), image)
        if ":" not in image or image.endswith(":latest") or "$" in image:
            problems.append(f"base image {image} is not pinned to a version")
    final = text[text.rfind("\nFROM "):]
    users = re.findall(r"^USER (\S+)", final, re.M)
    if not users or users[-1].split(":")[0] in ("0", "root"):
        problems.append("the final stage does not switch to a non-root USER")
    # What it copies from the build must be a target the build makes.
    cmake = "".join(open(os.path.join(root, f)).read() for root, _, files in os.walk(repo)
                    for f in files if f == "CMakeLists.txt" and "/build" not in root and "node_modules" not in root)
    for copied in re.findall(r"/src/build/\S+/([\w-]+)", text):
        if not re.search(rf"add_executable\({re.escape(copied)}\b", cmake):
            problems.append(f"copies {copied}, which no add_executable builds")
    for flag in re.findall(r'"--(\w+)', " ".join(re.findall(r"^ENTRYPOINT (.*)$", text, re.M))):
        if flag not in server_flags:
            problems.append(f"ENTRYPOINT passes --{flag}, which shardopt-server lacks")
    return problems


def server_flag_names(server):
    out = subprocess.run([server, "--helpfull"], capture_output=True, text=True)
    return set(re.findall(r"^\s+--(\w+)", out.stdout, re.M))


def check_dockerfiles(repo, server):
    flags = server_flag_names(server)
    assert {"port", "auto_requires_gpu", "metrics_port"} <= flags, flags
    files = [os.path.join(repo, "deploy", f) for f in ("Dockerfile", "Dockerfile.gpu")]
    for path in files:
        problems = dockerfile_problems(path, repo, flags)
        assert not problems, f"{path}: {problems}"
    assert os.path.exists(os.path.join(repo, ".dockerignore"))
    # The checks catch what they are for.
    with tempfile.TemporaryDirectory() as d:
        bad = os.path.join(d, "Dockerfile")
        text = open(files[0]).read().replace("FROM debian:12.8-slim", "FROM debian:latest")
        text = text.replace("USER 65532:65532", "USER root").replace("/client/shardopt ", "/client/shardoptx ")
        text = text.replace('"--port=50051"', '"--port=50051", "--no_such_flag"')
        open(bad, "w").write(text)
        problems = dockerfile_problems(bad, repo, flags)
        print("broken Dockerfile:", problems)
        assert len(problems) == 4, problems
    print("PASS dockerfiles")


# ---- flag drift ----

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_pki(d, replicas):
    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    sans = ",".join([f"IP:127.0.{i}.1" for i in range(replicas)] + [f"DNS:shardopt-{i}.shardopt" for i in range(replicas)])
    open(f"{d}/server.ext", "w").write(f"subjectAltName={sans}\n")
    open(f"{d}/client.ext", "w").write("extendedKeyUsage=clientAuth\n")
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=drift-ca")
    for who in ("server", "client"):
        run("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
            "-extfile", f"{who}.ext", "-out", f"{who}.crt")


def check_drift(repo, server, cli):
    token = "drift-trainer-token-0123456789"
    for overlay in OVERLAYS:
        objects = render(repo, overlay)
        sts = statefulset(objects)
        pod = sts["spec"]["template"]["spec"]
        c = pod["containers"][0]
        replicas = sts["spec"]["replicas"]
        tmp = tempfile.mkdtemp(prefix=f"shardopt-drift-{overlay}-")
        procs = []
        try:
            # Each mount of the pod spec becomes a temp dir with what the cluster would put there.
            paths = {}
            configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
            volumes = {v["name"]: v for v in pod["volumes"]}
            for m in c["volumeMounts"]:
                local = os.path.join(tmp, m["name"])
                os.makedirs(local)
                paths[m["mountPath"]] = local
                v = volumes[m["name"]]
                if "secret" in v and v["secret"]["secretName"] == "shardopt-tls":
                    make_pki(local, replicas)
                    for a, b in (("server.crt", "tls.crt"), ("server.key", "tls.key")):
                        shutil.copy(os.path.join(local, a), os.path.join(local, b))
                elif "secret" in v and v["secret"]["secretName"] == "shardopt-tokens":
                    open(os.path.join(local, "tokens"), "w").write(f"drift trainer {token} *\n")
            def mapped(text):
                for where in sorted(paths, key=len, reverse=True):
                    text = text.replace(where, paths[where])
                return text
            for m in c["volumeMounts"]:
                v = volumes[m["name"]]
                if "configMap" in v:
                    for key, value in configmaps[v["configMap"]["name"]]["data"].items():
                        open(os.path.join(paths[m["mountPath"]], key), "w").write(mapped(value))
            env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
            args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], mapped(a)) for a in c.get("args", [])]
            port, health, metrics = free_port(), free_port(), free_port()
            for i in range(replicas):
                # Only the addresses are overridden: one loopback alias per pod.
                argv = [server, *args, f"--host=127.0.{i}.1", f"--port={port}", f"--health_port={health}",
                        f"--metrics_port={metrics}"]
                procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                              stderr=open(os.path.join(tmp, f"server-{i}.log"), "w")))
            tls = paths.get("/etc/shardopt/tls")
            client_flags = []
            if tls:
                client_flags = [f"--tls_ca={tls}/ca.crt", f"--tls_cert={tls}/client.crt", f"--tls_key={tls}/client.key"]
            if "/etc/shardopt/tokens" in paths:
                open(os.path.join(tmp, "token"), "w").write(token)
                client_flags.append(f"--token_file={os.path.join(tmp, 'token')}")
            pattern = f"127.0.{{i}}.1:{port}"  # shardopt-{i}.shardopt:50051
            for i in range(replicas):
                address = pattern.replace("{i}", str(i))
                deadline = time.time() + 30
                while True:
                    assert procs[i].poll() is None, (
                        f"{overlay}: shardopt-server exited {procs[i].returncode} on the manifest's flags: "
                        + open(os.path.join(tmp, f"server-{i}.log")).read())
                    out = subprocess.run([cli, f"--server={address}", *client_flags, "describe", "drift-probe"],
                                         capture_output=True, text=True, timeout=30)
                    if "NOT_FOUND" in out.stdout + out.stderr:
                        break
                    assert time.time() < deadline, f"{overlay}: {address}: {out.stdout} {out.stderr}"
                    time.sleep(0.3)
                body = urllib.request.urlopen(f"http://127.0.{i}.1:{metrics}/metrics", timeout=5).read().decode()
                assert "shardopt_build_info" in body
            print(f"{overlay}: {replicas} servers took the manifest's flags; the CLI reached each through {pattern}")
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=30)
            shutil.rmtree(tmp, ignore_errors=True)
    print("PASS drift")


def main():
    check, repo, build, server, cli = sys.argv[1:6]
    for tool in ("kubectl", "node", "npm", "openssl"):
        assert shutil.which(tool), f"{tool} is missing: scripts/install-deps.sh installs it"
    {"render": lambda: check_render(repo, build),
     "schemas": lambda: check_schemas(repo, build),
     "dockerfiles": lambda: check_dockerfiles(repo, server),
     "drift": lambda: check_drift(repo, server, cli)}[check]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
