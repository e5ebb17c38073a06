"""RemoteAdamW over TLS and mutual TLS, with certificates made by the openssl
command for the run: the same training step through a server that speaks
only TLS, and the refusals of a client without the CA or the certificate."""
import subprocess

import pytest
import torch

import shardopt
import shardopt.torch
from servers import ServerProcess

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    run("req", "-x509", *EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test-ca")
    for who, ext in (("server", "server.ext"), ("client", "client.ext")):
        run("req", *EC, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", ext, "-out", f"{who}.pem")
    return d


def one_step(address, job, **tls):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
    opt = shardopt.torch.RemoteAdamW([("w", w)], servers=[address], job=job, lr=1e-2, max_attempts=1,
                                     rpc_timeout=10.0, **tls)
    before = w.detach().clone()
    w.grad = torch.randn(300, dtype=torch.bfloat16)
    opt.step()
    assert not torch.equal(w.detach(), before)


def test_a_tls_server_trains_trainers_that_trust_its_ca_and_refuses_plaintext(server_binary, certs, tmp_path, job):
    server = ServerProcess(server_binary, tmp_path, f"--tls_cert={certs / 'server.pem'}",
                           f"--tls_key={certs / 'server.key'}")
    try:
        one_step(server.address, job, tls_ca=str(certs / "ca.pem"))
        with pytest.raises(shardopt.Unavailable):
            one_step(server.address, job + "-plain")
    finally:
        server.stop()


def test_a_mutual_tls_server_needs_the_trainers_certificate(server_binary, certs, tmp_path, job):
    server = ServerProcess(server_binary, tmp_path, f"--tls_cert={certs / 'server.pem'}",
                           f"--tls_key={certs / 'server.key'}", f"--tls_client_ca={certs / 'ca.pem'}")
    try:
        one_step(server.address, job, tls_ca=str(certs / "ca.pem"), tls_cert=str(certs / "client.pem"),
                 tls_key=str(certs / "client.key"))
        with pytest.raises(shardopt.Unavailable):
            one_step(server.address, job + "-anonymous", tls_ca=str(certs / "ca.pem"))
    finally:
        server.stop()


def test_an_empty_or_binary_tls_file_is_refused_not_taken_as_no_tls(server_binary, certs, tmp_path, job):
    """An empty tls_ca read as "" would mean plaintext: against a plaintext
    server the step would succeed, the token in the clear. A DER file is not
    PEM text."""
    server = ServerProcess(server_binary, tmp_path)  # plaintext
    try:
        (tmp_path / "empty.pem").write_bytes(b"")
        with pytest.raises(shardopt.InvalidArgument, match="tls_ca .*empty.pem.* is empty"):
            one_step(server.address, job, tls_ca=str(tmp_path / "empty.pem"))
        subprocess.run(["openssl", "x509", "-in", str(certs / "ca.pem"), "-outform", "DER", "-out",
                        str(tmp_path / "ca.der")], check=True, capture_output=True)
        with pytest.raises(shardopt.InvalidArgument, match="not PEM text"):
            one_step(server.address, job, tls_ca=str(tmp_path / "ca.der"))
    finally:
        server.stop()


def test_a_key_that_is_not_the_certificates_is_refused_before_any_server_is_asked(certs, job):
    """Not Unavailable at the first step, as if the server were down: the
    address is one nobody listens on, so only a check at construction can
    answer InvalidArgument."""
    with pytest.raises(shardopt.InvalidArgument, match="does not match the client certificate"):
        one_step("127.0.0.1:1", job, tls_ca=str(certs / "ca.pem"), tls_cert=str(certs / "client.pem"),
                 tls_key=str(certs / "server.key"))
