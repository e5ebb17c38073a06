"""Data parallelism without DDP: two trainer processes, each on half of every
batch, against one process with the summed gradient; and two that resume from
a state dict under torch.distributed, sending it once between them."""
import os
import re
import socket
import subprocess
import sys
import urllib.request

import pytest
import torch

from shardopt.torch import RemoteAdamW
from models import BATCH, batch, make_model, param_groups, same_bits
from servers import ServerProcess
from workers import digest

torch.set_num_threads(1)
HERE = os.path.dirname(__file__)
STEPS = 30


def train_summed_halves(model, opt, first):
    """Steps first ... first+STEPS-1 in one process, world_size 1: the two
    halves' gradients summed in fp32 by accumulating backward passes (as the
    servers sum the ranks' in rank order), then halved (exact), as the
    servers average over 2 ranks. The params' digest after each step."""
    digests = []
    half = BATCH // 2
    for step in range(first, first + STEPS):
        tokens, targets = batch(step)
        opt.zero_grad()
        for r in range(2):
            model(tokens[r * half:(r + 1) * half], targets[r * half:(r + 1) * half]).backward()
        for p in model.parameters():
            p.grad.mul_(0.5)
        opt.step()
        digests.append(digest(model))
    return digests


def assert_ranks_match(outs, digests, model):
    """Both ranks' params equal each other after every step, and the one
    process's (its digests after each step, and `model` at the end)."""
    results = [torch.load(out) for out in outs]
    assert results[0]["digests"] == results[1]["digests"], "the ranks' params differ after some step"
    assert results[0]["digests"] == digests
    for name, p in model.state_dict().items():
        assert same_bits(results[0]["model"][name], p), name


def test_two_ranks_equal_one_process_with_the_summed_gradient(servers, job, tmp_path):
    """Rank 1's model starts from another seed: rank 0's values are the
    job's, and rank 1 takes them from the servers (as DDP broadcasts rank
    0's), so both train as one process from rank 0's values does."""
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, os.path.join(HERE, "workers.py"), "dp", "--servers", ",".join(servers),
                               "--job", f"{job}-dp", "--rank", str(r), "--world_size", "2", "--steps", str(STEPS),
                               "--out", str(outs[r])]) for r in range(2)]
    try:
        assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            p.kill()

    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3)
    digests = train_summed_halves(model, opt, 1)
    opt.drop()
    assert_ranks_match(outs, digests, model)


def received_init_bytes(metrics_port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    found = re.search(r'^shardopt_received_bytes_total\{[^}]*method="init"[^}]*\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_with_metrics(binary, workdir):
    """A server and its --metrics_port, picked free. Another test's process
    may bind that port first (a server listening on port 0 may be given it),
    and the server then exits, "Address already in use": it is started again
    on a new port, three times at most, as prometheus_test does."""
    for attempt in range(3):
        port = free_port()
        try:
            return ServerProcess(binary, workdir, f"--metrics_port={port}"), port
        except RuntimeError as e:
            if attempt == 2 or "Address already in use" not in str(e):
                raise


def test_ranks_joined_by_torch_distributed_load_a_state_dict_once_between_them(server_binary, servers, job,
                                                                                tmp_path):
    """Two ranks under torch.distributed (gloo) resume from a saved state dict
    with load_state_dict(shared=True): each sends half of it, they meet at a
    barrier, and they train on as one process with the summed gradient does,
    bitwise. The server takes the
    model's values and the state once (16 B a param: the fp32 params at
    construction, then master, m and v), not once per rank (28 B a param)."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-first", lr=1e-3)
    for step in range(1, STEPS + 1):
        tokens, targets = batch(step)
        opt.zero_grad()
        model(tokens, targets).backward()
        opt.step()
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint)
    opt.drop()

    server, metrics_port = server_with_metrics(server_binary, tmp_path)
    try:
        before = received_init_bytes(metrics_port)
        outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
        ranks = [subprocess.Popen([sys.executable, os.path.join(HERE, "workers.py"), "resume_dp", "--servers",
                                   server.address, "--job", f"{job}-dp", "--rank", str(r), "--world_size", "2",
                                   "--store", str(tmp_path / "store"), "--checkpoint", str(checkpoint), "--first",
                                   str(STEPS + 1), "--steps", str(STEPS), "--out", str(outs[r])]) for r in range(2)]
        try:
            assert [p.wait(timeout=120) for p in ranks] == [0, 0]
        finally:
            for p in ranks:
                p.kill()
        received = received_init_bytes(metrics_port) - before
    finally:
        server.stop()
    params = sum(p.numel() for p in model.parameters())
    assert 16 * params <= received < 17 * params, f"{received / params:.2f} B a param"

    saved = torch.load(checkpoint)
    ref = make_model(seed=99)
    ref.load_state_dict(saved["model"])
    opt = RemoteAdamW(param_groups(ref), servers=servers, job=f"{job}-ref", lr=1e-3)
    opt.load_state_dict(saved["optimizer"])
    digests = train_summed_halves(ref, opt, STEPS + 1)
    opt.drop()
    assert_ranks_match(outs, digests, ref)


def failed_shared_loads(servers, job, tmp_path, checkpoints, *extra):
    """Two resume_dp ranks whose load_state_dict(shared=True) must fail:
    each one's error, once both have exited 3."""
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, os.path.join(HERE, "workers.py"), "resume_dp", "--servers",
                               ",".join(servers), "--job", job, "--rank", str(r), "--world_size", "2",
                               "--store", str(tmp_path / "store"), "--checkpoint", checkpoints, "--steps", "1",
                               "--out", str(outs[r]), *extra]) for r in range(2)]
    try:
        assert [p.wait(timeout=60) for p in ranks] == [3, 3]
    finally:
        for p in ranks:
            p.kill()
    return [torch.load(out)["error"] for out in outs]


def test_a_rank_that_cannot_send_its_share_fails_every_rank_at_once(servers, job, tmp_path):
    """load_state_dict(shared=True) where rank 1 cannot send its share (an
    injected failure): rank 1 raises its error, and rank 0 raises
    FailedPrecondition naming rank 1 and that error. With a barrier instead,
    rank 0 got gloo's "connection closed" once rank 1's process exited, and
    would wait until torch.distributed's timeout (30 minutes by default) for
    a rank 1 that caught its error and lived on."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-first", lr=1e-3)
    tokens, targets = batch(1)
    model(tokens, targets).backward()
    opt.step()
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint)
    opt.drop()

    errors = failed_shared_loads(servers, f"{job}-dp", tmp_path, str(checkpoint), "--fail_rank", "1")
    assert errors[1] == "RuntimeError: injected: this rank's share cannot be sent"
    assert errors[0].startswith("FailedPrecondition:"), errors[0]
    assert "load_state_dict(shared=True): rank 1 could not send its share (RuntimeError: injected" in errors[0]


def test_ranks_loading_different_state_dicts_with_shared_are_refused_alike(servers, job, tmp_path):
    """load_state_dict(shared=True) with rank 0 given step 1's state dict and
    rank 1 step 2's: each sent its share of its own, and the servers held a
    mix of the two, unsaid. Now every rank raises ValueError before anything
    of them is sent."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-first", lr=1e-3)
    checkpoints = []
    for step in (1, 2):
        opt.zero_grad()
        model(*batch(step)).backward()
        opt.step()
        checkpoints.append(tmp_path / f"step{step}.pt")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoints[-1])
    opt.drop()

    for error in failed_shared_loads(servers, f"{job}-dp", tmp_path, ",".join(map(str, checkpoints))):
        assert error.startswith("ValueError: load_state_dict(shared=True): rank 1 loads another state than rank 0"), \
            error
    with pytest.warns(UserWarning, match="held initial values from an earlier launch"):  # the ranks' own
        opt = RemoteAdamW(param_groups(make_model()), servers=servers, job=f"{job}-dp", lr=1e-3, world_size=2,
                          barrier_timeout=20)
    assert set(opt._client.adam_steps()) == {0}, "some of a state dict was sent"
    opt.drop()


def step_on_threads(opts):
    """Each optimizer's step() on a thread of its own (each waits for the
    others' pushes): the shardopt.Error each raised, or None."""
    import threading

    import shardopt
    errors = [None] * len(opts)

    def step(r):
        try:
            opts[r].step()
        except shardopt.Error as e:
            errors[r] = e
    threads = [threading.Thread(target=step, args=(r,)) for r in range(len(opts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_ranks_stepping_with_different_lrs_are_refused_alike_and_nothing_moves(servers, job):
    """Two ranks whose step() used different lrs each had their commit applied
    by whichever of the two servers it reached first: the step torn across
    servers, and every later retry refused. Now each push says how its rank
    will commit, and both ranks are refused on every server, nothing applied;
    once they agree, the step applies. Both ranks are in this process, on
    threads (each step() waits for the other's push)."""
    import shardopt
    models = [make_model(), make_model()]
    opts = [RemoteAdamW(param_groups(m), servers=servers, job=job, lr=lr, rank=r, world_size=2, barrier_timeout=20)
            for r, (m, lr) in enumerate(zip(models, [1e-2, 2e-2]))]
    before = [p.detach().clone() for p in models[0].parameters()]
    for m in models:
        m(*batch(1)).backward()
    for error in step_on_threads(opts):
        assert isinstance(error, shardopt.FailedPrecondition), error
        assert "pushed step 1 to be applied differently (rank 0 pushed it with lr 0.01, rank 1 with lr 0.02)" in str(error)
    for m in models:
        for p, q in zip(m.parameters(), before):
            assert same_bits(p, q)
    for g in opts[1].param_groups:
        g["lr"] = 1e-2
    # The rank that changed first: its retry's push says its settings anew
    # before any commit asks (a commit of rank 0's first could still find
    # the old ones, and be refused again, as the README says).
    opts[1].step()
    opts[0].step()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert same_bits(p, q), name
    assert not all(same_bits(p, q) for p, q in zip(models[0].parameters(), before))
    opts[0].drop()


def test_a_rank_that_goes_on_to_the_next_batch_after_a_failed_step_is_told(servers, job, caplog):
    """After a failed step() the loop must call it again with the same
    gradients: the servers keep the failed attempt's sealed push and ignore
    a retry's. An outside probe's rank 0 went on to the next batch instead;
    its step() returned OK with its new gradients ignored, and nothing said
    so. It is said now, on the retry that brings other gradients, and the
    ranks still end bitwise alike (both applied the first attempt's)."""
    import logging

    import shardopt
    models = [make_model(), make_model()]
    opts = [RemoteAdamW(param_groups(m), servers=servers, job=job, lr=lr, rank=r, world_size=2, barrier_timeout=20)
            for r, (m, lr) in enumerate(zip(models, [1e-2, 2e-2]))]
    for m in models:
        m(*batch(1)).backward()
    errors = step_on_threads(opts)
    assert all(isinstance(e, shardopt.FailedPrecondition) for e in errors), errors
    for g in opts[1].param_groups:
        g["lr"] = 1e-2
    models[0].zero_grad()
    models[0](*batch(2)).backward()  # rank 0 goes on to the next batch
    with caplog.at_level(logging.WARNING, logger="shardopt"):
        opts[1].step()
        assert not [r for r in caplog.records if "retried with other gradients" in r.getMessage()]
        opts[0].step()
    said = [r.getMessage() for r in caplog.records if "retried with other gradients" in r.getMessage()]
    assert said == ["step 1 is retried with other gradients than its attempt that failed: servers that took that "
                    "attempt's push keep its gradients, and ignore these. After a failed step(), call it again with "
                    "the same gradients, not the next batch's"], said
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert same_bits(p, q), name
