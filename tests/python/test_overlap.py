"""overlap=True pushes gradients while backward runs; the result is bitwise
that of overlap=False."""
import weakref

import pytest
import torch

import shardopt
from shardopt.torch import RemoteAdamW
from models import batch, make_model, param_groups, same_bits, train

torch.set_num_threads(1)
STEPS = 30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_overlap_is_bitwise_equal(servers, job, dtype):
    plain, overlapped = make_model(dtype=dtype), make_model(dtype=dtype)
    a = RemoteAdamW(param_groups(plain), servers=servers, job=f"{job}-plain", lr=1e-3, max_grad_norm=1.0)
    b = RemoteAdamW(param_groups(overlapped), servers=servers, job=f"{job}-overlap", lr=1e-3, max_grad_norm=1.0,
                    overlap=True)
    losses_a = train(plain, a, STEPS)
    losses_b = train(overlapped, b, STEPS)
    assert losses_a == losses_b
    for (name, p), q in zip(plain.named_parameters(), overlapped.parameters()):
        assert same_bits(p, q), name
    assert a.last_decision.grad_norm == b.last_decision.grad_norm
    a.drop()
    b.drop()


def test_push_starts_during_backward(servers, job):
    """By the time backward returns, the push is already running; a param
    that forward does not use gets no gradient and is skipped, as without
    overlap."""
    model = make_model()
    model.unused = torch.nn.Parameter(torch.ones(8))
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3, overlap=True)
    tokens, targets = batch(1)
    opt.zero_grad()
    model(tokens, targets).backward()
    assert opt._client.pushing()
    with pytest.raises(shardopt.FailedPrecondition, match="a push is running"):
        opt.state_dict()  # the client is the push's until step()
    opt.step()
    assert not opt._client.pushing()
    assert model.unused.grad is None and torch.equal(model.unused, torch.ones(8))
    steps = opt._client.adam_steps()
    assert steps[_index(opt, model.unused)] == 0 and max(steps) == 1
    opt.drop()


def test_a_gradient_let_go_during_the_push_is_held_until_it_ends(servers, job):
    """The push reads each marked gradient by address on a thread of its
    own; a gradient the trainer lets go of meanwhile (here p.grad = None;
    or the whole optimizer, dropped after backward raised) is held until
    the push ends, not freed under it."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3, overlap=True)
    tokens, targets = batch(1)
    model(tokens, targets).backward()
    assert opt._client.pushing()
    p = next(model.parameters())
    grad = weakref.ref(p.grad)
    p.grad = None
    assert grad() is not None, "freed while the push may read it"
    opt.step()
    assert grad() is None, "still held after the push ended"
    opt.drop()


def _index(opt, param):
    return next(k for k, p in enumerate(p for g in opt.param_groups for p in g["params"]) if p is param)


def test_second_backward_before_step_is_refused_and_zero_grad_recovers(servers, job):
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3, overlap=True)
    initial = [p.detach().clone() for p in model.parameters()]
    tokens, targets = batch(1)
    model(tokens, targets).backward()
    with pytest.raises(RuntimeError, match="second gradient before step"):
        model(tokens, targets).backward()
    opt.zero_grad()  # the pushed step is completed as a skip: nothing moves
    assert opt.job_step == 1
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), initial))
    train(model, opt, 2, first=2)
    assert opt.job_step == 3
    opt.drop()
