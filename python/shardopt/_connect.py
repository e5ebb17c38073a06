"""Where RemoteAdamW connects: its servers (a list, or a StatefulSet's
pattern with num_servers) and its TLS files, checked as the constructor
takes them."""
import collections.abc
import os

from . import _C
from ._errors import InvalidArgument


def _read_pem(path, what):
    """A PEM file's bytes, or b"" for None. An empty file is refused: passed
    on as empty it would mean no TLS at all, and the trainer would talk
    plaintext (its token in the clear) to a server it meant to verify. The
    bytes go to the C++ client as they are, which refuses what is not PEM
    text (a DER file) or not a usable certificate or key."""
    if path is None:
        return b""
    with open(path, "rb") as f:
        pem = f.read()
    if not pem.strip():
        raise InvalidArgument(f"{what} {os.fspath(path)!r} is empty: TLS needs its PEM text")
    return pem


def _servers(servers, num_servers):
    if not isinstance(servers, str) and not isinstance(servers, collections.abc.Iterable):
        raise TypeError(f"servers must be a list of 'host:port', one 'host:port' or a pattern with {{i}}, not "
                        f"{type(servers).__name__} {servers!r}")
    pattern = isinstance(servers, str) and "{i}" in servers
    if num_servers is not None and not pattern:
        # It would be ignored, and a job meant for several servers would run on those listed.
        raise ValueError(f"num_servers={num_servers!r} is for a pattern with {{i}}; servers={servers!r} is none")
    if isinstance(servers, str):
        if pattern:
            if not num_servers:
                raise ValueError(f"servers={servers!r} is a pattern: give num_servers too")
            return _C.expand_server_pattern(servers, num_servers)
        return [servers]
    servers = list(servers)
    if not servers:
        raise ValueError("no servers given")
    repeated = sorted({s for s in servers if servers.count(s) > 1})
    if repeated:
        raise ValueError(f"servers {repeated} appear more than once; each server holds its own share of the job")
    return servers
