"""Fixtures: real shardopt-server processes on 127.0.0.1 (ephemeral ports,
--device=cpu or SHARDOPT_TEST_DEVICE's), killed when the tests end.

The ctest entry (tests/python/CMakeLists.txt) sets SHARDOPT_SERVER to the
server binary and PYTHONPATH to the build's python/ directory. Without them
the tests fail: they never skip for lack of a server.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from servers import ServerProcess  # noqa: E402


@pytest.fixture(scope="session")
def server_binary():
    path = os.environ.get("SHARDOPT_SERVER")
    if not path or not os.access(path, os.X_OK):
        pytest.fail("set SHARDOPT_SERVER to the shardopt-server binary (ctest does)")
    return path


@pytest.fixture(scope="session")
def servers(server_binary, tmp_path_factory):
    """Two servers, so every job is split over both (ZeRO-style)."""
    procs = [ServerProcess(server_binary, tmp_path_factory.mktemp(f"server{i}")) for i in range(2)]
    yield [p.address for p in procs]
    for p in procs:
        p.stop()


@pytest.fixture
def job(request):
    """A job name of its own for every test (and every parametrization)."""
    return f"{request.node.name}-{os.getpid()}"
