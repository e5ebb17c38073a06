"""RemoteAdamW against a server started with --tokens_file: a trainer's
token steps its own jobs, given as an argument or through SHARDOPT_TOKEN;
no token, an unknown one, or a job outside the token's prefixes is refused
with the matching exception. (tests/auth_test.cc checks that a refused
call changes nothing.)"""
import pytest
import torch

import shardopt
import shardopt.torch
from servers import ServerProcess

TRAINER = "trainer-token-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"


@pytest.fixture
def server(server_binary, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice trainer {TRAINER} team-a/\nroot admin {ADMIN}\n")
    s = ServerProcess(server_binary, tmp_path, f"--tokens_file={tokens}")
    yield s
    s.stop()


def make(address, job, **kw):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
    opt = shardopt.torch.RemoteAdamW([("w", w)], servers=[address], job=job, lr=1e-2, max_attempts=1,
                                     rpc_timeout=10.0, **kw)
    return w, opt


def test_a_trainer_token_steps_its_jobs(server, job, monkeypatch):
    w, opt = make(server.address, "team-a/" + job, token=TRAINER)
    before = w.detach().clone()
    w.grad = torch.randn(300, dtype=torch.bfloat16)
    opt.step()
    assert not torch.equal(w.detach(), before)
    assert opt.state_dict()["state"]  # reading the state back is a trainer's right too
    with pytest.raises(shardopt.PermissionDenied, match="admin"):
        opt.drop()
    monkeypatch.setenv("SHARDOPT_TOKEN", TRAINER)
    w2, opt2 = make(server.address, "team-a/" + job)  # attaches with the token from the environment
    assert opt2.resumed_step == 1
    monkeypatch.setenv("SHARDOPT_TOKEN", TRAINER + "\n")  # a Secret's file, newline and all
    assert make(server.address, "team-a/" + job)[1].resumed_step == 1
    monkeypatch.setenv("SHARDOPT_TOKEN", ADMIN)
    make(server.address, "team-a/" + job)[1].drop()


def test_a_token_a_header_cannot_carry_is_refused_without_echoing_it(job):
    """gRPC aborts the process on such a header value, printing it."""
    with pytest.raises(shardopt.InvalidArgument) as refused:
        make("127.0.0.1:1", job, token=TRAINER[:8] + "\n" + TRAINER[8:])
    assert "character 9 is" in str(refused.value) and TRAINER[:8] not in str(refused.value)


def test_no_token_a_wrong_one_or_another_prefix_is_refused(server, job, monkeypatch):
    monkeypatch.delenv("SHARDOPT_TOKEN", raising=False)
    with pytest.raises(shardopt.Unauthenticated):
        make(server.address, "team-a/" + job)
    with pytest.raises(shardopt.Unauthenticated):
        make(server.address, "team-a/" + job, token="not-a-token-of-this-server")
    with pytest.raises(shardopt.PermissionDenied, match="prefixes"):
        make(server.address, "team-b/" + job, token=TRAINER)
