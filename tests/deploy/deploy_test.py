"""deploy/ validated offline, as make test runs it on a machine with no
Docker daemon and no Kubernetes API server:

  render      every overlay renders with `kubectl kustomize`, and the
              rendered objects agree with each other and with the flags:
              probe, container, Service, NetworkPolicy and scrape ports are
              the flags' ports; every path a flag names is on a volume; image
              tags are the project's version; the security context; the
              grace period covers the SIGTERM checkpoint write;
  schemas     every rendered object validates against the Kubernetes schemas
              (npm kubernetes-models, pinned in package-lock.json) with no
              unknown fields, and each of several broken objects fails;
  dockerfiles every stage's base is pinned, the images run as non-root, what
              they copy is a target the build makes, the flags they pass
              exist, and the CPU image's packages hold every library the
              binaries link; a broken Dockerfile fails each check;
  drift       shardopt-server starts with the exact argv of each rendered pod
              (the image's ENTRYPOINT, then the container's args with its
              ConfigMap flagfile and $(VAR)s resolved; paths mapped to temp
              dirs with real certificates and tokens; only --host, --port,
              --health_port and --metrics_port are overridden, appended, to
              loopback aliases and free ports), one server per replica on
              127.0.{i}.1, the StatefulSet's shardopt-{i}.shardopt; the CLI
              reaches each through that pattern (NOT_FOUND for an unknown
              job), a wrong token or a missing client certificate is refused,
              the plaintext health port answers SERVING as kubelet's gRPC
              probe asks, /metrics answers, and SIGTERM exits 0.

usage: deploy_test.py CHECK REPO_ROOT BUILD_DIR SHARDOPT_SERVER SHARDOPT_CLI"""
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

OVERLAYS = ["cpu-dev", "gpu"]
DOCKERFILES = ["Dockerfile", "Dockerfile.gpu"]

# The grace period's inputs (deploy/base/statefulset.yaml and
# deploy/overlays/gpu/gpu.yaml say where each comes from).
CHECKPOINT_WRITE_BYTES_PER_S = 1.65e9  # README, "Durability"
SHARED_VOLUME_FACTOR = 4               # a shared RWX volume, slower than that disk
DRAIN_AND_START_S = 48                 # an apply in flight (up to 20 s), the write's start, gRPC's 5 s shutdown,
                                       # the wait for a scrape after a failed checkpoint (--drain_failure_wait_seconds)
GPU_MEMORY_BYTES = 150e9               # an H200 as the driver counts it
STATE_FRACTION = 12 / 18               # fp32 p, m, v of the 18 B/param charged


def render(repo, overlay):
    out = subprocess.run(["kubectl", "kustomize", os.path.join(repo, "deploy", "overlays", overlay)],
                         capture_output=True, text=True)
    assert out.returncode == 0, f"kubectl kustomize {overlay}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def only(objects, kind):
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def project_version(repo):
    text = open(os.path.join(repo, "CMakeLists.txt")).read()
    return re.search(r"project\(\s*shardopt\s+VERSION\s+([\d.]+)", text).group(1)


def quantity(text):
    """A Kubernetes quantity ("64Gi", "500m", "8") as a number."""
    m = re.fullmatch(r"([\d.]+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|K|M|G|T|P|E)?", str(text))
    assert m, f"not a quantity: {text}"
    scale = {None: 1, "m": 1e-3, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}[m.group(2)]
    return float(m.group(1)) * scale


# ---- the images ----

def dockerfile(repo, name):
    return open(os.path.join(repo, "deploy", name)).read()


def image_of(text):
    """The image name a Dockerfile builds (its OCI title label)."""
    return re.search(r'org\.opencontainers\.image\.title="([^"]+)"', text).group(1)


def entrypoint(text):
    lines = re.findall(r"^ENTRYPOINT (.*)$", text, re.M)
    assert lines, "no ENTRYPOINT"
    return json.loads(lines[-1])


def dockerfile_for_image(repo, image):
    name = image.rsplit(":", 1)[0]
    for f in DOCKERFILES:
        if image_of(dockerfile(repo, f)) == name:
            return dockerfile(repo, f)
    raise AssertionError(f"no deploy/Dockerfile* builds image {name}")


# ---- flags as the pod gives them ----

def pod_parts(objects):
    sts = only(objects, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1, "one container per pod"
    return sts, pod, pod["containers"][0]


def mount_of(container, path):
    """The volumeMount that holds `path`, and the path inside it."""
    best = None
    for m in container.get("volumeMounts", []):
        root = m["mountPath"].rstrip("/")
        if (path == root or path.startswith(root + "/")) and (best is None or len(root) > len(best[0]["mountPath"])):
            best = (m, os.path.relpath(path, root))
    return best


def configmap_file(objects, pod, container, path):
    """The text a ConfigMap volume puts at `path`, or None."""
    found = mount_of(container, path)
    if not found:
        return None
    m, key = found
    volume = {v["name"]: v for v in pod["volumes"]}[m["name"]]
    if "configMap" not in volume:
        return None
    cm = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"]]
    assert cm, f"the volume {m['name']} names ConfigMap {volume['configMap']['name']}, which is not rendered"
    assert key in cm[0].get("data", {}), f"ConfigMap {volume['configMap']['name']} has no key {key}"
    return cm[0]["data"][key]


def env_of(container, replica):
    """The container's environment as the kubelet would set it, for pod
    shardopt-<replica>: plain values, and plausible values for the
    downward API (resource limits as the resources say)."""
    env = {}
    resources = container.get("resources", {})
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
            continue
        ref = e.get("valueFrom", {})
        if "resourceFieldRef" in ref:
            r = ref["resourceFieldRef"]
            kind, what = r["resource"].split(".", 1)
            value = resources.get(kind, {}).get(what)
            if value is None and kind == "limits":
                # No limit: the kubelet gives the node's allocatable, at least the request.
                value = resources.get("requests", {}).get(what)
            assert value is not None, f"env {e['name']}: {r['resource']} is not set in the container's resources"
            env[e["name"]] = str(math.ceil(quantity(value) / quantity(r.get("divisor", "1"))))
        elif "fieldRef" in ref:
            env[e["name"]] = {"metadata.name": f"shardopt-{replica}", "metadata.namespace": "default",
                              "status.podIP": f"127.0.{replica}.1", "spec.nodeName": "node"}[ref["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"env {e['name']}: the test does not know how to resolve {ref}")
    return env


def pod_argv(repo, objects, replica=0):
    """The server's argv in the pod: the image's ENTRYPOINT (the container
    sets no command, so it stays), then the args with $(VAR) resolved as the
    kubelet does. A $(VAR) with no such variable is left as written, as the
    kubelet leaves it, and fails here."""
    _, _, c = pod_parts(objects)
    assert "command" not in c, "the container must not set command: it would drop the image's ENTRYPOINT flags"
    env = env_of(c, replica)
    args = []
    for a in c.get("args", []):
        resolved = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a)
        assert not re.search(r"\$\(\w+\)", resolved), f"arg {a}: no such environment variable"
        args.append(resolved)
    return entrypoint(dockerfile_for_image(repo, c["image"])) + args


def flags_of(objects, argv):
    """name -> value (the last one given, as absl takes it), with each
    --flagfile read from its ConfigMap; and the list of flagfile paths."""
    _, pod, c = pod_parts(objects)
    flags, flagfiles = {}, []

    def take(items):
        for a in items:
            m = re.fullmatch(r"--(\w+)(?:=(.*))?", a)
            assert m, f"not a flag: {a!r}"
            name, value = m.group(1), m.group(2) if m.group(2) is not None else "true"
            if name == "flagfile":
                for path in value.split(","):
                    text = configmap_file(objects, pod, c, path)
                    assert text is not None, f"--flagfile={path} is not a ConfigMap key mounted in the pod"
                    flagfiles.append(path)
                    take([line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")])
            else:
                flags[name] = value

    take(argv[1:])
    return flags, flagfiles


# ---- render ----

def check_render(repo, build):
    version = project_version(repo)
    for f in DOCKERFILES:
        default = re.search(r"^ARG VERSION=(\S+)", dockerfile(repo, f), re.M)
        assert default and default.group(1) == version, f"deploy/{f}: ARG VERSION is not {version} (CMakeLists.txt)"
    for overlay in OVERLAYS:
        objects = render(repo, overlay)
        kinds = sorted(o["kind"] for o in objects)
        print(overlay, kinds)
        for kind in ("ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "Service", "StatefulSet"):
            assert kind in kinds, (overlay, kind)
        sts, pod, c = pod_parts(objects)
        labels = sts["spec"]["template"]["metadata"]["labels"]

        def selects(selector):
            return all(labels.get(k) == v for k, v in selector.items())

        assert selects(sts["spec"]["selector"]["matchLabels"])
        # The image: the project's version, built by one of deploy/'s Dockerfiles.
        image, tag = c["image"].rsplit(":", 1)
        assert tag == version, f"{overlay}: image {c['image']} is not tagged {version}"
        text = dockerfile_for_image(repo, c["image"])
        argv = pod_argv(repo, objects)
        flags, _ = flags_of(objects, argv)

        # Security: non-root (the image's uid), read-only root, no privilege, no capabilities.
        sec, csec = pod.get("securityContext", {}), c.get("securityContext", {})
        assert sec.get("runAsNonRoot") is True
        uid = re.findall(r"^USER (\d+)", text, re.M)[-1]
        assert str(sec.get("runAsUser", csec.get("runAsUser"))) == uid, f"{overlay}: runAsUser is not the image's {uid}"
        assert csec.get("readOnlyRootFilesystem") is True
        assert csec.get("allowPrivilegeEscalation") is False
        assert csec.get("capabilities", {}).get("drop") == ["ALL"]

        # Ports: the flags' ports are the container's, the probes', the Service's, the policy's, the scrape's.
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports.get("grpc") == int(flags["port"]), (ports, flags["port"])
        assert ports.get("health") == int(flags["health_port"]), (ports, flags.get("health_port"))
        assert ports.get("metrics") == int(flags["metrics_port"]), (ports, flags.get("metrics_port"))
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == int(flags["health_port"]), f"{probe} is not on --health_port"
        annotations = sts["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true"
        assert annotations.get("prometheus.io/port") == flags["metrics_port"]
        assert annotations.get("prometheus.io/path") == "/metrics"
        # deploy/prometheus's scrape job keeps the pods of this label, at this port's name.
        with open(os.path.join(repo, "deploy", "prometheus", "prometheus.yml")) as f:
            scrape = next(j for j in yaml.safe_load(f)["scrape_configs"] if j["job_name"] == "shardopt")
        label, port_name = scrape["relabel_configs"][0]["regex"].split(";")
        assert labels.get("app.kubernetes.io/name") == label and port_name in ports, (labels, ports, label, port_name)
        svc = only(objects, "Service")
        assert svc["metadata"]["name"] == sts["spec"]["serviceName"] and svc["spec"]["clusterIP"] == "None"
        assert selects(svc["spec"]["selector"])
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            assert target in ports or target in ports.values(), f"Service port {p} has no container port"
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]}.get("grpc") == int(flags["port"])
        policy = only(objects, "NetworkPolicy")
        assert selects(policy["spec"]["podSelector"]["matchLabels"])
        allowed = {p["port"]: rule for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        assert set(allowed) == {int(flags["port"]), int(flags["metrics_port"])}, allowed
        trainers = [f.get("podSelector", {}).get("matchLabels") for f in allowed[int(flags["port"])]["from"]]
        assert trainers == [{"shardopt.io/role": "trainer"}], trainers
        assert selects(only(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])

        # Paths: every file or directory a flag names is on a volume (the root is read-only).
        for name in ("checkpoint_dir", "tls_cert", "tls_key", "tls_client_ca", "tokens_file"):
            if flags.get(name):
                found = mount_of(c, flags[name])
                assert found, f"{overlay}: --{name}={flags[name]} is on no volume (the root filesystem is read-only)"
                assert bool(found[0].get("readOnly")) == (name != "checkpoint_dir"), (name, found[0])
        assert flags.get("checkpoint_dir") == "/var/lib/shardopt/checkpoints"

        # Transport: TLS with client certificates and tokens, except cpu-dev (--insecure, said so).
        if overlay == "cpu-dev":
            assert flags.get("insecure") == "true" and not flags.get("tls_cert")
        else:
            assert "insecure" not in flags and flags.get("tls_cert") and flags.get("tls_client_ca")
            assert flags.get("tokens_file")

        # Threads: one per requested core (the default would count the node's).
        res = c["resources"]
        assert flags.get("threads") == str(math.ceil(quantity(res["requests"]["cpu"]))), flags.get("threads")

        # Memory: Guaranteed QoS, and the budget from the cgroup limit.
        assert res["limits"]["memory"] == res["requests"]["memory"]
        assert flags.get("memory_limit") == "auto", "--memory_limit=auto reads limits.memory from the cgroup"
        limit = quantity(res["limits"]["memory"])
        budget = limit - max(256 * 2**20, limit / 8)  # what auto leaves (server/memory_budget.cc)

        # The grace period covers the SIGTERM checkpoint of the most state the server can hold.
        gpu = "nvidia.com/gpu" in res.get("limits", {})
        state = STATE_FRACTION * (GPU_MEMORY_BYTES if gpu else budget)
        need = SHARED_VOLUME_FACTOR * state / CHECKPOINT_WRITE_BYTES_PER_S + DRAIN_AND_START_S
        grace = pod.get("terminationGracePeriodSeconds", 30)
        print(f"  {overlay}: at most {state / 1e9:.1f} GB of state: grace {grace} s, needs {need:.0f} s")
        assert grace >= need, f"{overlay}: terminationGracePeriodSeconds {grace} < {need:.0f} s"

        # gRPC's own buffers are not charged: they sit in the headroom the
        # budget leaves, at most one message of each stream the server serves,
        # and they may take three quarters of it: the rest is the binary and
        # its threads, the restore's and the checkpoint writer's buffers,
        # connections' own buffers and the allocator's slack.
        streams = int(flags.get("max_streams", 4096))
        message = int(flags.get("max_message_bytes", 8 << 20))
        assert 0 < streams * message <= 0.75 * (limit - budget), \
            f"{overlay}: --max_streams={streams} of {message} B messages is over 3/4 of the {limit - budget:.0f} B headroom"

        volumes = {v["name"]: v for v in pod["volumes"]}
        checkpoints = volumes[mount_of(c, flags["checkpoint_dir"])[0]["name"]]
        if overlay == "gpu":
            assert res["limits"]["nvidia.com/gpu"] == 1 and res["requests"]["nvidia.com/gpu"] == 1
            assert "--auto_requires_gpu" in argv and flags.get("device") == "auto", argv
            claim = checkpoints["persistentVolumeClaim"]["claimName"]
            pvc = only(objects, "PersistentVolumeClaim")
            assert pvc["metadata"]["name"] == claim and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
            assert "volumeClaimTemplates" not in sts["spec"], "one shared claim, not one per pod"
            anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert anti[0]["topologyKey"] == "kubernetes.io/hostname" and selects(anti[0]["labelSelector"]["matchLabels"])
            assert sts["spec"]["replicas"] > 1
        else:
            assert sts["spec"]["replicas"] == 1
            assert "nvidia.com/gpu" not in res.get("limits", {})
            assert "--auto_requires_gpu" not in argv and flags.get("device") == "cpu"
            assert checkpoints.get("emptyDir") is not None
            assert "PersistentVolumeClaim" not in kinds
    print("PASS render")


# ---- schemas ----

def node_modules(repo, build):
    """kubernetes-models installed from the lock file into the build tree, once."""
    where = os.path.join(build, "tests", "deploy", "npm")
    lock = os.path.join(repo, "tests", "deploy", "package-lock.json")
    stamp = os.path.join(where, "node_modules", ".package-lock.json")
    if not os.path.exists(stamp) or os.path.getmtime(stamp) < os.path.getmtime(lock):
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


def check_schemas(repo, build):
    for overlay in OVERLAYS:
        rc, out = validate(repo, build, render(repo, overlay))
        print(out, end="")
        assert rc == 0, f"{overlay} does not validate"
    # Each broken object alone must fail.
    objects = render(repo, "gpu")
    sts = only(objects, "StatefulSet")

    def broken(change, obj=sts):
        obj = json.loads(json.dumps(obj))
        change(obj)
        return obj

    def container(o):
        return o["spec"]["template"]["spec"]["containers"][0]

    cases = {
        "replicas: \"two\"": broken(lambda o: o["spec"].update(replicas="two")),
        "a container without a name": broken(lambda o: container(o).pop("name")),
        "no selector": broken(lambda o: o["spec"].pop("selector")),
        "a probe port by name (gRPC probes take numbers)": broken(lambda o: container(o)["readinessProbe"]["grpc"].update(port="health")),
        "a misspelt readOnlyRootFilesystem": broken(lambda o: container(o)["securityContext"].update(
            readOnlyRootFilesytem=container(o)["securityContext"].pop("readOnlyRootFilesystem"))),
        "a misspelt terminationGracePeriodSeconds": broken(lambda o: o["spec"]["template"]["spec"].update(
            terminationGracePeriodSecond=o["spec"]["template"]["spec"].pop("terminationGracePeriodSeconds"))),
        "a Service port that is not a number": broken(lambda o: o["spec"]["ports"][0].update(port="grpc"),
                                                      only(objects, "Service")),
        "an unknown kind": broken(lambda o: o.update(kind="StatefulSets")),
    }
    for what, obj in cases.items():
        rc, out = validate(repo, build, [obj])
        print(f"broken ({what}): {out.strip()}")
        assert rc != 0 and "INVALID" in out, f"a StatefulSet with {what} passed validation"
    print("PASS schemas")


# ---- Dockerfiles ----

def dpkg_owners(paths):
    """path -> the installed Debian package that ships it (merged /usr or
    not), in one dpkg call; paths no package ships are left out."""
    candidates = {}
    for path in paths:
        real = os.path.realpath(path)
        for c in (path, real, re.sub(r"^/usr/lib/", "/lib/", real), re.sub(r"^/lib/", "/usr/lib/", path)):
            candidates.setdefault(c, path)
    out = subprocess.run(["dpkg", "-S", *candidates], capture_output=True, text=True)
    owners = {}
    for line in out.stdout.splitlines():
        package, _, shipped = line.partition(": ")
        if shipped in candidates:
            owners.setdefault(candidates[shipped], package.split(",")[0].split(":")[0].strip())
    return owners


def dpkg_closure(packages):
    """The packages and everything they depend on, from this machine's dpkg
    database (apt-cache for what is not installed here)."""
    seen, todo = set(), set(packages)
    while todo:
        seen |= todo
        out = subprocess.run(["dpkg-query", "-W", "-f=${Package}\t${Depends}, ${Pre-Depends}\n", *sorted(todo)],
                             capture_output=True, text=True)
        deps = {}
        for line in out.stdout.splitlines():
            name, _, d = line.partition("\t")
            deps[name] = d
        for p in todo - set(deps):
            out = subprocess.run(["apt-cache", "depends", "--no-recommends", "--no-suggests", p],
                                 capture_output=True, text=True)
            deps[p] = ", ".join(re.findall(r"Depends: <?([\w.+-]+)>?", out.stdout))
        found = set()
        for d in deps.values():
            for alternatives in d.split(","):
                for alt in alternatives.split("|"):
                    name = re.sub(r"\(.*?\)|:\w+", "", alt).strip()
                    if name:
                        found.add(name)
        todo = found - seen
    return seen


def runtime_packages(text):
    final = text[text.rfind("\nFROM "):]
    m = re.search(r"apt-get install((?:[^&]|\\\n)*)", final)
    return [w for w in re.split(r"[\s\\]+", m.group(1)) if w and not w.startswith("-")] if m else []


def library_problems(text, binaries):
    """Each library the binaries link must come from the final stage's
    packages or their dependencies (Debian images only)."""
    packages = runtime_packages(text)
    if not packages:
        return ["the final stage installs no runtime packages"]
    closure = dpkg_closure(packages)
    problems = []
    out = subprocess.run(["ldd", *binaries], capture_output=True, text=True, check=True).stdout
    # The CPU image builds with SHARDOPT_CUDA=OFF; a build here may link CUDA's.
    libs = sorted(lib for lib in set(re.findall(r"=> (/\S+)", out)) if not lib.startswith("/usr/local/cuda"))
    owners = dpkg_owners(libs)
    for lib in libs:
        owner = owners.get(lib)
        if owner is None:
            problems.append(f"{lib} is from no Debian package")
        elif owner not in closure:
            problems.append(f"{lib} is in {owner}, which the runtime stage does not install")
    return problems


def dockerfile_problems(path, repo, server_flags, binaries=None):
    text = open(path).read()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    problems = []
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?", text, re.M)
    if len(stages) < 2:
        problems.append("not multi-stage")
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
    if binaries:
        problems += library_problems(text, binaries)
    return problems


def server_flag_names(server):
    out = subprocess.run([server, "--helpfull"], capture_output=True, text=True)
    return set(re.findall(r"^\s+--(\w+)", out.stdout, re.M))


def check_dockerfiles(repo, server, cli):
    flags = server_flag_names(server)
    assert {"port", "auto_requires_gpu", "metrics_port", "health_port"} <= flags, flags
    files = [os.path.join(repo, "deploy", f) for f in DOCKERFILES]
    for path in files:
        # The CPU image is Debian's: its packages are checked against this
        # Debian machine's. The GPU image copies what the binaries link.
        problems = dockerfile_problems(path, repo, flags, [server, cli] if path.endswith("/Dockerfile") else None)
        assert not problems, f"{path}: {problems}"
    ignored = open(os.path.join(repo, ".dockerignore")).read().split()
    for must in (".git", "build", "**/node_modules"):
        assert must in ignored, f".dockerignore lacks {must}"
    # The checks catch what they are for.
    with tempfile.TemporaryDirectory() as d:
        bad = os.path.join(d, "Dockerfile")
        text = open(files[0]).read()
        for old, new in (("FROM debian:12.8-slim", "FROM debian:latest"), ("USER 65532:65532", "USER root"),
                         ("/client/shardopt ", "/client/shardoptx "),
                         ('"--port=50051"', '"--port=50051", "--no_such_flag"'), (" libspdlog1.10", "")):
            assert old in text, f"the broken-Dockerfile case needs {old!r} in deploy/Dockerfile"
            text = text.replace(old, new)
        open(bad, "w").write(text)
        problems = dockerfile_problems(bad, repo, flags, [server, cli])
        print("broken Dockerfile:", problems)
        assert len(problems) == 5, problems
        assert any("libspdlog" in p for p in problems), problems
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


def grpc_health_check(host, port, timeout=5.0):
    """What kubelet's gRPC probe does: grpc.health.v1.Health/Check over
    plaintext HTTP/2. Returns the response's status (1 SERVING, 2
    NOT_SERVING), or None when there is no response message."""
    def frame(kind, flags, stream, payload=b""):
        return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

    def literal(name, value):  # HPACK literal without indexing, new name, no Huffman coding
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value

    headers = b"".join(literal(n, v) for n, v in (
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/grpc.health.v1.Health/Check"),
        (b":authority", f"{host}:{port}".encode()), (b"content-type", b"application/grpc"), (b"te", b"trailers")))
    with socket.create_connection((host, port), timeout=timeout) as s:
        # The preface, SETTINGS, HEADERS (END_HEADERS), DATA (END_STREAM):
        # an empty HealthCheckRequest, as the probe sends for service "".
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0) + frame(1, 4, 1, headers) +
                  frame(0, 1, 1, b"\x00\x00\x00\x00\x00"))
        buf, data = b"", b""

        def read(n):
            nonlocal buf
            while len(buf) < n:
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError("the health port closed the connection")
                buf += chunk
            out, buf = buf[:n], buf[n:]
            return out

        while True:
            head = read(9)
            length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
            stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
            payload = read(length)
            if kind == 4 and not flags & 1:
                s.sendall(frame(4, 1, 0))  # SETTINGS ACK
            elif kind == 6 and not flags & 1:
                s.sendall(frame(6, 1, 0, payload))  # PING ACK
            elif kind in (3, 7):
                raise ConnectionError(f"the health port reset the call (frame type {kind})")
            elif stream == 1 and kind == 0:
                data += payload
            if stream == 1 and kind in (0, 1) and flags & 1:  # END_STREAM
                break
    if len(data) < 5:
        return None
    message = data[5:5 + int.from_bytes(data[1:5], "big")]
    return message[1] if message[:1] == b"\x08" else 0


def check_drift(repo, server, cli):
    token = "drift-trainer-token-0123456789"
    for overlay in OVERLAYS:
        objects = render(repo, overlay)
        sts, pod, c = pod_parts(objects)
        replicas = sts["spec"]["replicas"]
        grace = pod.get("terminationGracePeriodSeconds", 30)
        tmp = tempfile.mkdtemp(prefix=f"shardopt-drift-{overlay}-")
        procs = []
        try:
            # Each mount of the pod spec becomes a temp dir holding what the cluster would put there.
            paths = {}
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
                elif "secret" in v:
                    raise AssertionError(f"the test does not know what Secret {v['secret']['secretName']} holds")

            def mapped(text):
                for where in sorted(paths, key=len, reverse=True):
                    text = text.replace(where, paths[where])
                return text

            for m in c["volumeMounts"]:
                v = volumes[m["name"]]
                if "configMap" in v:
                    cm = only([o for o in objects if o["kind"] == "ConfigMap"
                               and o["metadata"]["name"] == v["configMap"]["name"]], "ConfigMap")
                    for key, value in cm["data"].items():
                        open(os.path.join(paths[m["mountPath"]], key), "w").write(mapped(value))

            port, health, metrics = free_port(), free_port(), free_port()
            logs = [os.path.join(tmp, f"server-{i}.log") for i in range(replicas)]

            def launch(extra):
                started = []
                for i in range(replicas):
                    # The pod's argv with its paths mapped; appended, and so
                    # winning: only the addresses, one loopback alias per pod.
                    argv = [mapped(a) for a in pod_argv(repo, objects, i)]
                    argv = [server, *argv[1:], *extra, f"--host=127.0.{i}.1", f"--port={port}",
                            f"--health_port={health}", f"--metrics_port={metrics}"]
                    started.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(logs[i], "w")))
                return started

            tls = paths.get("/etc/shardopt/tls")
            client_tls = [f"--tls_ca={tls}/ca.crt", f"--tls_cert={tls}/client.crt", f"--tls_key={tls}/client.key"] if tls else []
            client_token = []
            if "/etc/shardopt/tokens" in paths:
                open(os.path.join(tmp, "token"), "w").write(token)
                open(os.path.join(tmp, "wrong-token"), "w").write("not-the-drift-token-0123456789")
                client_token = [f"--token_file={os.path.join(tmp, 'token')}"]

            def describe(address, flags):
                out = subprocess.run([cli, f"--server={address}", *flags, "describe", "drift-probe"],
                                     capture_output=True, text=True, timeout=30)
                return out.stdout + out.stderr

            pattern = f"127.0.{{i}}.1:{port}"  # shardopt-{i}.shardopt:50051
            extra, note = [], ""
            procs = launch(extra)
            for i in range(replicas):
                address = pattern.replace("{i}", str(i))
                deadline = time.time() + 30
                while True:
                    if procs[i].poll() is not None:
                        log = open(logs[i]).read()
                        assert procs[i].returncode != 2, f"{overlay}: shardopt-server rejected the manifest's flags: {log}"
                        # The GPU image's --auto_requires_gpu with no GPU here: a loud exit 1. An
                        # explicit --device=cpu after it must still start, on the same flags.
                        if "--auto_requires_gpu" in procs[i].args and not extra and procs[i].returncode == 1 \
                                and "no usable GPU" in log:
                            note = f" (no GPU here: --device=auto exited 1 as --auto_requires_gpu asks, then ran with --device=cpu)"
                            for p in procs:
                                p.terminate()
                                p.wait(timeout=30)
                            extra = ["--device=cpu"]
                            procs = launch(extra)
                            continue
                        raise AssertionError(f"{overlay}: shardopt-server exited {procs[i].returncode}: {log}")
                    out = describe(address, client_tls + client_token)
                    if "NOT_FOUND" in out:
                        break
                    assert time.time() < deadline, f"{overlay}: {address}: {out}"
                    time.sleep(0.3)
                # What else the cluster relies on, on each replica.
                if client_token:
                    out = describe(address, client_tls + [f"--token_file={os.path.join(tmp, 'wrong-token')}"])
                    assert "UNAUTHENTICATED" in out, f"{overlay}: a wrong token was not refused: {out}"
                    out = describe(address, client_tls)
                    assert "UNAUTHENTICATED" in out, f"{overlay}: no token was not refused: {out}"
                if tls:
                    out = describe(address, client_tls[:1] + client_token)
                    assert "NOT_FOUND" not in out, f"{overlay}: a client without a certificate got through mutual TLS"
                    out = describe(address, client_token)
                    assert "NOT_FOUND" not in out, f"{overlay}: a plaintext client reached a TLS server"
                status = grpc_health_check(f"127.0.{i}.1", health)
                assert status == 1, f"{overlay}: the health port answered {status}, not SERVING"
                body = urllib.request.urlopen(f"http://127.0.{i}.1:{metrics}/metrics", timeout=5).read().decode()
                assert "shardopt_build_info" in body
            # SIGTERM, as the kubelet stops a pod: each server writes its jobs'
            # checkpoints (none here) and exits 0 within the grace period.
            started = time.time()
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for i, p in enumerate(procs):
                rc = p.wait(timeout=grace)
                assert rc == 0, f"{overlay}: SIGTERM: exit {rc}: {open(logs[i]).read()}"
            refused = (["a wrong or no token"] if client_token else []) + \
                      (["no client certificate", "plaintext"] if tls else [])
            print(f"{overlay}: {replicas} servers took the pod's argv {pod_argv(repo, objects)}{note}; the CLI reached "
                  f"each through {pattern}" + (f" and was refused with {', '.join(refused)}" if refused else "") +
                  f"; health SERVING; SIGTERM exit 0 in {time.time() - started:.1f} s")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
            shutil.rmtree(tmp, ignore_errors=True)
    print("PASS drift")


def main():
    check, repo, build, server, cli = sys.argv[1:6]
    for tool in ("kubectl", "node", "npm", "openssl"):
        assert shutil.which(tool), f"{tool} is missing: scripts/install-deps.sh installs it"
    {"render": lambda: check_render(repo, build),
     "schemas": lambda: check_schemas(repo, build),
     "dockerfiles": lambda: check_dockerfiles(repo, server, cli),
     "drift": lambda: check_drift(repo, server, cli)}[check]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
