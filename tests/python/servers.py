"""shardopt-server processes for the Python tests."""
import contextlib
import ctypes
import os
import signal
import subprocess
import time


def die_with_parent():
    """Runs in the child before exec: if the test process is killed (a ctest
    timeout), the kernel kills the child too, so no server outlives it."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# --device=cpu, unless SHARDOPT_TEST_DEVICE names another: the GPU machine's
# check (tests/gpu/device_check.sh) runs these tests against servers on cuda.
DEVICE = os.environ.get("SHARDOPT_TEST_DEVICE") or "cpu"


class ServerProcess:
    def __init__(self, binary, workdir, *args):
        self.binary, self.workdir, self.args = binary, str(workdir), list(args)
        self.start()

    def start(self):
        port_file = os.path.join(self.workdir, "port")
        if os.path.exists(port_file):
            os.unlink(port_file)
        self.log = os.path.join(self.workdir, "server.log")
        port = [f"--port={self.port}"] if getattr(self, "port", None) else ["--port=0"]
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [self.binary, "--host=127.0.0.1", *port, f"--port_file={port_file}", f"--device={DEVICE}", *self.args],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        give_up = time.monotonic() + 20
        while time.monotonic() < give_up:
            if os.path.exists(port_file):  # written whole, then renamed into place
                with open(port_file) as f:
                    self.port = int(f.read())
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.stop()
        with open(self.log) as f:
            raise RuntimeError(f"shardopt-server did not start listening within 20 s:\n{f.read()}")

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    def stop(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)


@contextlib.contextmanager
def checkpointing_servers(binary, tmp_path, count=2):
    """`count` servers sharing one --checkpoint_dir under tmp_path; yields
    the processes and the directory, and stops them after."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    procs = []
    try:
        for i in range(count):
            (tmp_path / f"s{i}").mkdir()
            procs.append(ServerProcess(binary, tmp_path / f"s{i}", f"--checkpoint_dir={directory}"))
        yield procs, directory
    finally:
        for p in procs:
            p.stop()
