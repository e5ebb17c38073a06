"""Errors a Python user understands: each is a shardopt.Error subclass with
the status code and the message naming the server."""
import os
import socket
import subprocess
import sys
import string
import time

import numpy as np
import pytest
import torch

import shardopt
from shardopt.torch import RemoteAdamW
from models import batch, make_model, param_groups, train
from servers import ServerProcess, checkpointing_servers

torch.set_num_threads(1)


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


def test_unreachable_server_names_the_address_within_the_deadline(servers, job):
    address = f"127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(shardopt.Unavailable) as err:
        RemoteAdamW(make_model().parameters(), servers=[servers[0], address], job=job, rpc_timeout=2.0,
                    max_attempts=2)
    elapsed = time.monotonic() - started
    assert address in str(err.value) and address in err.value.message
    assert "(2 attempts;" in err.value.message and "once the server is back" in err.value.message
    assert err.value.code == "UNAVAILABLE" and err.value.code_value == 14
    assert isinstance(err.value, ConnectionError)
    assert elapsed < 10, f"took {elapsed:.1f} s"


def test_changed_params_are_refused(servers, job):
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job)
    with pytest.raises(shardopt.ParamsChanged):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    train(model, opt, 1)
    opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.ones(3)))
    with pytest.raises(shardopt.ParamsChanged) as err:
        train(model, opt, 1, first=2)
    assert err.value.code == "FAILED_PRECONDITION"
    opt.param_groups[0]["params"].pop()
    model.head.weight.data = torch.zeros(3, 3)
    with pytest.raises(shardopt.ParamsChanged, match="head.weight"):
        opt.step()
    opt.drop()


def test_changed_hyperparameters_are_refused(servers, job):
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job)
    opt.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(shardopt.InvalidArgument, match="only lr may change"):
        train(model, opt, 1)
    opt.drop()


def test_an_eps_written_again_as_the_same_float32_is_no_change(servers, job):
    """The servers hold eps as a float32: 1e-8 read back from a float32
    tensor (numpy's float32(1e-8) is the same), set into the group between
    steps, is the eps they hold, though as a double it is not 1e-8; so it
    steps on, and a state dict saved with it loads into a job of 1e-8."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, eps=1e-8)
    train(model, opt, 1)
    for g in opt.param_groups:
        g["eps"] = torch.tensor(1e-8, dtype=torch.float32).item()
    assert opt.param_groups[0]["eps"] != 1e-8
    train(model, opt, 1)
    saved = opt.state_dict()
    opt.drop()
    other = RemoteAdamW(param_groups(make_model()), servers=servers, job=f"{job}-loaded", eps=1e-8)
    other.load_state_dict(saved)
    other.drop()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=["fp16", "fp64"])
def test_unsupported_dtype(servers, job, dtype):
    model = make_model().to(dtype)
    with pytest.raises(shardopt.UnsupportedDtype, match="bfloat16 and torch.float32") as err:
        RemoteAdamW(model.named_parameters(), servers=servers, job=job)
    assert isinstance(err.value, TypeError) and str(dtype) in str(err.value)


def test_only_empty_params_are_refused_before_any_server_is_asked(job):
    with pytest.raises(ValueError, match="zero elements"):
        RemoteAdamW([torch.nn.Parameter(torch.empty(0))], servers=["127.0.0.1:1"], job=job)


def test_mismatched_world_size(servers, job):
    first = RemoteAdamW(make_model().named_parameters(), servers=servers, job=job)
    with pytest.raises(shardopt.AlreadyExists) as err:
        RemoteAdamW(make_model().named_parameters(), servers=servers, job=job, rank=0, world_size=2)
    assert err.value.code == "ALREADY_EXISTS"
    assert any(s in err.value.message for s in servers)
    first.drop()


def test_server_errors_carry_code_and_message(servers, job):
    """A job dropped by another trainer: the next step gets the servers'
    NOT_FOUND, naming the job and the server."""
    model = make_model()
    opt = RemoteAdamW(model.named_parameters(), servers=servers, job=job)
    train(model, opt, 1)
    RemoteAdamW(make_model().named_parameters(), servers=servers, job=job).drop()
    tokens, targets = batch(2)
    model(tokens, targets).backward()
    with pytest.raises(shardopt.NotFound) as err:
        opt.step()
    assert err.value.code == "NOT_FOUND" and job in err.value.message
    assert any(s in err.value.message for s in servers)
    assert isinstance(err.value, LookupError)


def test_a_trainer_left_running_never_steps_the_job_made_again_under_its_name(servers, job):
    """Dropped by another trainer and made again by a new run: the old
    trainer's next step is NOT_FOUND, and the new run's job stays as it was
    (it used to take the old trainer's push as its next step)."""
    old_model = make_model()
    old = RemoteAdamW(old_model.named_parameters(), servers=servers, job=job)
    train(old_model, old, 2)
    RemoteAdamW(make_model().named_parameters(), servers=servers, job=job).drop()
    new_model = make_model(seed=5)
    new = RemoteAdamW(new_model.named_parameters(), servers=servers, job=job)
    train(new_model, new, 2)
    assert_refused_and_the_job_kept(old_model, old, shardopt.NotFound, "made again", new_model, new)


def assert_refused_and_the_job_kept(refused_model, refused, error, match, model, opt):
    """refused.step() after a backward raises `error`; opt's job keeps its
    step (as its servers say) and masters, goes on, and is dropped."""
    step = opt.job_step
    masters = [opt.master(p).clone() for p in model.parameters()]
    tokens, targets = batch(7)
    refused_model(tokens, targets).backward()
    with pytest.raises(error, match=match):
        refused.step()
    assert [s.step for s in opt.describe()] == [step] * len(opt.describe())
    assert all(torch.equal(opt.master(p), m) for p, m in zip(model.parameters(), masters))
    train(model, opt, 1, first=step + 1)
    assert opt.job_step == step + 1
    opt.drop()


def test_two_live_trainers_that_forgot_their_ranks_are_told_so(servers, job):
    """Two processes constructed with the default rank=0, world_size=1 on
    one job: the second to step is refused (its push was taken for a retry
    of the other's, its gradients dropped, and its step said ok), and the
    job keeps the other's steps alone."""
    first_model, second_model = make_model(), make_model()
    first = RemoteAdamW(first_model.named_parameters(), servers=servers, job=job)
    second = RemoteAdamW(second_model.named_parameters(), servers=servers, job=job)
    train(first_model, first, 1)
    assert_refused_and_the_job_kept(second_model, second, shardopt.FailedPrecondition, "another trainer", first_model,
                                    first)


def test_a_state_dict_of_another_step_than_the_servers_is_refused(servers, job):
    model = make_model()
    opt = RemoteAdamW(model.named_parameters(), servers=servers, job=job)
    train(model, opt, 1)
    earlier = opt.state_dict()
    train(model, opt, 1, first=2)
    earlier["param_groups"][0]["lr"] = 0.5
    with pytest.raises(shardopt.FailedPrecondition, match=r"the job is at step 2 .* Adam step 1 in it, 2 on the"):
        opt.load_state_dict(earlier)
    assert opt.param_groups[0]["lr"] != 0.5
    opt.drop()


def test_server_pattern_expands():
    assert shardopt.expand_server_pattern("shardopt-{i}.shardopt:50051", 2) == [
        "shardopt-0.shardopt:50051", "shardopt-1.shardopt:50051"]
    with pytest.raises(shardopt.InvalidArgument):
        shardopt.expand_server_pattern("no-pattern:50051", 2)


@pytest.mark.parametrize("servers", ["127.0.0.1:1", ["127.0.0.1:1", "127.0.0.1:2"]])
def test_num_servers_without_a_pattern_is_refused_not_ignored(job, servers):
    """It would be ignored: a job meant for four servers would run on those listed."""
    with pytest.raises(ValueError, match="num_servers=4 is for a pattern"):
        RemoteAdamW([torch.nn.Parameter(torch.ones(3))], servers=servers, num_servers=4, job=job)


@pytest.mark.parametrize("key", ["amsgrad", "maximize", "state_precision"])
def test_a_group_asking_for_what_the_servers_do_not_do_is_refused(servers, job, key):
    """amsgrad or maximize in a group, or an unknown state precision, is
    refused at construction, before a job is made: never trained as plain
    AdamW."""
    model = make_model()
    groups = param_groups(model)
    groups[0][key] = "fp16" if key == "state_precision" else True
    error = ValueError if key == "state_precision" else shardopt.InvalidArgument
    with pytest.raises(error, match=key):
        RemoteAdamW(groups, servers=servers, job=job, lr=1e-3)


@pytest.mark.parametrize("kwargs", [dict(lr=-1.0), dict(lr=float("nan")), dict(eps=-1e-8), dict(betas=(1.0, 0.999)),
                                    dict(betas=(0.9, -0.1)), dict(weight_decay=-0.1)],
                         ids=["lr", "lr-nan", "eps", "beta1", "beta2", "weight_decay"])
def test_bad_hyperparameters_are_refused_at_construction_as_torch_refuses_them(job, kwargs):
    """torch.optim.AdamW's ValueError, with its message, before any server is
    asked (none listens at port 1)."""
    params = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError) as theirs:
        torch.optim.AdamW(params, **kwargs)
    with pytest.raises(ValueError) as ours:
        RemoteAdamW(params, servers=["127.0.0.1:1"], job=job, **kwargs)
    assert str(theirs.value) in str(ours.value)


def test_eps_zero_which_torch_takes_is_refused_before_any_server_is_asked(job):
    """The servers refuse eps = 0 (a zero gradient's update would be 0/0):
    a ValueError here, not a server's InvalidArgument after connecting."""
    with pytest.raises(ValueError, match=r"Invalid epsilon value: 0.0 \(must be > 0\)"):
        RemoteAdamW([torch.nn.Parameter(torch.ones(3))], servers=["127.0.0.1:1"], job=job, eps=0.0)


@pytest.mark.parametrize("eps,why", [(1e-50, "rounds to 0"), (1e39, "must be finite"), (float("inf"), "must be finite")])
def test_an_eps_the_servers_float32_cannot_hold_is_refused_before_any_server_is_asked(job, eps, why):
    """torch takes it; as the float32 the servers hold it is 0 or inf. The
    reason given is the one that holds (an infinite eps was refused as not
    "> 0")."""
    torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], eps=eps)
    with pytest.raises(ValueError, match=rf"Invalid epsilon value: .* \({why} as the float32 the servers hold\)"):
        RemoteAdamW([torch.nn.Parameter(torch.ones(3))], servers=["127.0.0.1:1"], job=job, eps=eps)


@pytest.mark.parametrize("where", ["lr", "beta1", "group lr"])
def test_an_lr_or_beta_tensor_of_more_than_one_element_is_refused_naming_it(job, where):
    """A one-element tensor is taken as torch takes it; a longer one was
    refused by torch's own "only one element tensors can be converted",
    which names neither the argument nor the group."""
    params = [torch.nn.Parameter(torch.ones(3))]
    two = torch.tensor([1e-3, 2e-3])
    kwargs = {"lr": dict(lr=two), "beta1": dict(betas=(two, 0.999)), "group lr": {}}[where]
    groups = [{"params": params, "lr": two}] if where == "group lr" else params
    name = "betas\\[0\\]" if where == "beta1" else "lr"
    with pytest.raises(ValueError, match=rf"{name} must be a number or a one-element tensor, not a tensor of 2"):
        RemoteAdamW(groups, servers=["127.0.0.1:1"], job=job, **kwargs)


@pytest.mark.parametrize("betas", [(0.9, 0.99, 0.1), (0.9,), 0.9, torch.tensor(0.9), np.array([0.9, 0.99, 0.1])],
                         ids=["three", "one", "number", "0-d tensor", "numpy three"])
def test_betas_that_are_not_a_pair_are_refused_naming_them(job, betas):
    """torch takes three betas (it reads two, and its step fails on the
    third); here it is a ValueError naming betas, before any server is
    asked, in the constructor and in a group."""
    params = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match="betas must be a pair"):
        RemoteAdamW(params, servers=["127.0.0.1:1"], job=job, betas=betas)
    with pytest.raises(ValueError, match="group 0: betas must be a pair"):
        RemoteAdamW([{"params": params, "betas": betas}], servers=["127.0.0.1:1"], job=job)


@pytest.mark.parametrize("betas", [torch.tensor([0.8, 0.99]), np.array([0.8, 0.99])], ids=["tensor", "numpy"])
def test_betas_as_an_array_of_two_step_as_torchs_do(servers, job, betas):
    """torch takes a 1-D tensor or numpy array of two as betas; an outside
    probe's numpy pair was refused "must be a pair". The steps are bitwise
    those of its elements given as a tuple of floats (a float32 tensor's
    0.8 is not 0.8), and torch's within fp32 rounding."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    q = torch.nn.Parameter(p.detach().clone())
    r = torch.nn.Parameter(p.detach().clone())
    opt = RemoteAdamW([p], servers=servers, job=job, betas=betas, lr=1e-2)
    as_floats = RemoteAdamW([r], servers=servers, job=f"{job}-floats", betas=tuple(float(b) for b in betas), lr=1e-2)
    ref = torch.optim.AdamW([q], betas=betas, lr=1e-2, foreach=False)
    for _ in range(3):
        g = torch.randn(64)
        p.grad, q.grad, r.grad = g.clone(), g.clone(), g.clone()
        opt.step()
        as_floats.step()
        ref.step()
    assert torch.equal(p.detach().view(torch.int32), r.detach().view(torch.int32))
    assert (p - q).abs().max().item() < 1e-6
    opt.drop()
    as_floats.drop()


def test_betas_made_three_by_the_loop_are_refused_naming_them(servers, job):
    p = torch.nn.Parameter(torch.ones(3))
    opt = RemoteAdamW([p], servers=servers, job=job)
    opt.param_groups[0]["betas"] = (0.9, 0.999, 0.5)
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="group 0: betas must be a pair"):
        opt.step()
    opt.drop()


def test_frozen_params_of_any_kind_are_left_out_and_a_job_that_held_them_is_told_so(servers, job):
    """A frozen param the servers could not hold (fp16, a tensor subclass as
    a quantized base is, one on meta) is left out of the job and taken. A job
    made with a param trainable is refused to an optimizer that froze it,
    saying why (the settings' difference alone named only "param.1")."""
    class Quantized(torch.Tensor):
        pass

    trainable = torch.nn.Parameter(torch.ones(3))
    frozen = [torch.ones(3, dtype=torch.float16), torch.ones(3).as_subclass(Quantized), torch.empty(3, device="meta")]
    opt = RemoteAdamW([trainable] + frozen, servers=servers, job=job)
    trainable.grad = torch.ones(3)
    opt.step()
    assert opt.job_step == 1
    opt.drop()
    both = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))]
    made = RemoteAdamW(both, servers=servers, job=f"{job}-both")
    both[1].requires_grad_(False)
    with pytest.raises(shardopt.AlreadyExists, match="requires_grad=False here \\('param.1'\\) are not in this job"):
        RemoteAdamW(both, servers=servers, job=f"{job}-both")
    made.drop()


@pytest.mark.parametrize("max_grad_norm", [-1.0, float("nan"), float("inf")])
def test_a_bad_max_grad_norm_is_refused_at_construction(job, max_grad_norm):
    with pytest.raises(ValueError, match="max_grad_norm"):
        RemoteAdamW([torch.nn.Parameter(torch.ones(3))], servers=["127.0.0.1:1"], job=job, max_grad_norm=max_grad_norm)


def test_an_lr_made_invalid_between_steps_is_refused_before_anything_is_pushed(servers, job):
    model = make_model()
    opt = RemoteAdamW(model.named_parameters(), servers=servers, job=job)
    train(model, opt, 1)
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="Invalid learning rate"):
        train(model, opt, 1, first=2)
    assert opt.job_step == 1
    opt.param_groups[0]["lr"] = 1e-3
    train(model, opt, 1, first=2)
    assert opt.job_step == 2
    opt.drop()


def test_torch_adamw_keywords_are_taken_and_kept_in_the_groups(servers, job):
    model = make_model()
    opt = RemoteAdamW(model.named_parameters(), servers=servers, job=job, amsgrad=False, maximize=False,
                      foreach=None, fused=None)
    for g in opt.param_groups:
        assert g["amsgrad"] is False and g["maximize"] is False and g["capturable"] is False
    train(model, opt, 1)
    # Set after construction, each is refused at the next step, not ignored
    # (capturable, differentiable and state_precision were ignored before),
    # and verify_state says that the state is not held as the group asks.
    for key, value in (("maximize", True), ("capturable", True), ("differentiable", True),
                       ("state_precision", "bf16")):
        before = opt.param_groups[0].get(key)
        opt.param_groups[0][key] = value
        with pytest.raises(shardopt.InvalidArgument, match=key):
            train(model, opt, 1, first=2)
        if key == "state_precision":
            with pytest.raises(shardopt.FailedPrecondition, match="state_precision 'bf16'"):
                opt.verify_state()
        opt.param_groups[0][key] = before
    opt.param_groups[0].pop("state_precision")
    opt.verify_state()
    assert opt.job_step == 1
    opt.drop()
    for kwargs, error in ((dict(amsgrad=True), shardopt.InvalidArgument), (dict(capturable=True), ValueError),
                          (dict(differentiable=True), ValueError)):
        with pytest.raises(error):
            RemoteAdamW(make_model().parameters(), servers=["127.0.0.1:1"], job=job, **kwargs)


def test_misuses_torch_refuses_or_that_would_train_otherwise_are_refused(job):
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        RemoteAdamW(p, servers=["127.0.0.1:1"], job=job)
    # torch would step a param listed twice twice; the servers hold it once.
    # Unnamed, it is called as its job would call it.
    with pytest.raises(ValueError, match="lists param 'param.0' again"):
        RemoteAdamW([p, p], servers=["127.0.0.1:1"], job=job)
    with pytest.raises(ValueError, match="more than once"):
        RemoteAdamW([p], servers=["127.0.0.1:1", "127.0.0.1:1"], job=job)
    # pybind's own TypeError only listed the extension's signatures.
    with pytest.raises(TypeError, match="world_size must be an int, not float 2.0"):
        RemoteAdamW([p], servers=["127.0.0.1:1"], job=job, rank=1, world_size=2.0)
    # torch refuses a set: its order, which names unnamed params on the
    # servers, differs between processes.
    q = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(TypeError, match="not a set"):
        RemoteAdamW({p, q}, servers=["127.0.0.1:1"], job=job)
    with pytest.raises(TypeError, match="not a set"):
        RemoteAdamW([{"params": {p, q}}], servers=["127.0.0.1:1"], job=job)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(job=None), TypeError, "job must be the job's name, a non-empty str, not NoneType"),
    (dict(job=123), TypeError, "job must be the job's name"),
    (dict(servers=None), TypeError, "servers must be a list of 'host:port'"),
    (dict(rpc_timeout=-1), ValueError, "rpc_timeout must be a finite number of seconds, at least 0.001, not -1"),
    (dict(rpc_timeout=float("inf")), ValueError, "rpc_timeout must be a finite number of seconds"),
    (dict(rpc_timeout=1e-4), ValueError, "rpc_timeout must be .* at least 0.001"),
    (dict(rpc_timeout="60"), TypeError, "rpc_timeout must be a number of seconds, not str"),
    (dict(barrier_timeout=0), ValueError, "barrier_timeout must be .* at least 0.001, not 0"),
    (dict(barrier_timeout=float("inf")), ValueError, "barrier_timeout must be a finite number of seconds"),
    (dict(chunk_bytes=-1), ValueError, "chunk_bytes must be at least 0"),
    (dict(max_grad_norm="1"), TypeError, "max_grad_norm must be a number"),
    (dict(checkpoint_every=-1), ValueError, "checkpoint_every must be at least 0"),
    (dict(restore_step=-2), ValueError, "restore_step must be at least 0"),
    (dict(world_size=0), ValueError, "world_size must be at least 1, not 0"),
    (dict(max_attempts=0), ValueError, "max_attempts must be at least 1, not 0"),
    (dict(overlap="yes"), TypeError, "overlap must be True or False, not str"),
    (dict(lr="1e-3"), TypeError, "lr must be a number, not str"),
    # Finite, but the servers' update constants overflow their float32:
    # refused at the first step, after backward, before.
    (dict(lr=1e39), ValueError, "Invalid learning rate: 1e.39 .*finite as a float"),
    (dict(lr=3.3e38), ValueError, "Invalid learning rate: 3.3e.38 .*step size lr / \\(1 - beta1\\)"),
    (dict(lr=1e30, weight_decay=1e10), ValueError, "Invalid learning rate: 1e.30 .*decay 1 - lr \\* weight_decay"),
])
def test_bad_arguments_are_refused_naming_the_argument(job, kwargs, error, match):
    """Each used to reach the extension: pybind's list of its signatures,
    an OverflowError of infinity, rpc_timeout spoken of in milliseconds, or
    a barrier_timeout under a millisecond taken as the servers' default."""
    args = dict(servers=["127.0.0.1:1"], job=job)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        RemoteAdamW([torch.nn.Parameter(torch.ones(3))], **args)


def test_max_grad_norm_none_means_no_clipping(servers, job):
    p = torch.nn.Parameter(torch.ones(3))
    opt = RemoteAdamW([p], servers=servers, job=job, max_grad_norm=None)
    assert opt.max_grad_norm == 0.0
    p.grad = torch.full((3,), 1e6)
    opt.step()
    assert opt.last_decision.gscale == 1.0
    opt.drop()


def test_tensor_subclasses_are_refused_before_anything_is_sent(job):
    """A DTensor (FSDP2, tensor parallelism) is a tensor subclass whose
    memory holds a shard, not the param; torch 1.13 has none, so a subclass
    of our own stands for it."""
    class Sharded(torch.Tensor):
        pass

    p = torch.ones(3).as_subclass(Sharded).requires_grad_()
    with pytest.raises(shardopt.InvalidArgument, match="is a Sharded, a tensor subclass"):
        RemoteAdamW([p], servers=["127.0.0.1:1"], job=job)


def assert_no_job_was_made(servers, job):
    """The servers hold no job `job`: one with other params is made under its
    name (an existing one would be AlreadyExists)."""
    RemoteAdamW([torch.nn.Parameter(torch.ones(5))], servers=servers, job=job).drop()


@pytest.mark.parametrize("case", ["one-tensors-data", "overlapping-views", "transposed-view", "expanded"])
def test_params_sharing_memory_are_refused_before_anything_is_sent(servers, job, case):
    """Two Parameters over the same memory used to get a master each, and the
    memory then held one of them where torch applies both updates to it;
    now they are refused, naming both, before the job is made. So is an
    expanded param, whose elements share memory (its job used to be made,
    and its first step failed in torch's copy)."""
    buffer = torch.randn(4, 4)
    first, second = {"one-tensors-data": lambda: (buffer, buffer),
                     "overlapping-views": lambda: (buffer[:2], buffer[1:3]),
                     "transposed-view": lambda: (buffer[:, :1], buffer.t()[0]),
                     "expanded": lambda: (buffer[:1, :1].expand(4, 4), torch.randn(3))}[case]()
    a, b = torch.nn.Parameter(first), torch.nn.Parameter(second)
    says = "param 'a' overlaps itself" if case == "expanded" else "params 'a' and 'b' share memory"
    with pytest.raises(ValueError, match=says):
        RemoteAdamW([("a", a), ("b", b)], servers=servers, job=job)
    assert_no_job_was_made(servers, job)


@pytest.mark.parametrize("grad", ["shorter-view", "one-element", "longer", "same-numel-other-shape"])
def test_a_gradient_not_of_its_params_shape_is_refused_and_nothing_moves(servers, job, grad):
    """`p.grad.data = other` skips torch's shape check. The push read the
    param's numel elements from `other`'s memory: a shorter gradient's
    neighbours were applied, or the read ran past its end."""
    model = make_model()
    opt = RemoteAdamW(model.named_parameters(), servers=servers, job=job)
    train(model, opt, 1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    state_before = opt.state_dict()["state"]
    opt.zero_grad()
    model(*batch(2)).backward()
    w = model.head.weight
    backing = torch.full((2 * w.numel(),), 7.0)
    w.grad.data = {"shorter-view": lambda: backing[:w.numel() - 1], "one-element": lambda: torch.ones(1),
                   "longer": lambda: backing, "same-numel-other-shape": lambda: torch.ones(w.numel())}[grad]()
    with pytest.raises(shardopt.InvalidArgument, match=r"param 'head.weight' has a gradient of shape .* not the param's"):
        opt.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    after = opt.state_dict()["state"]
    for k, v in state_before.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(after[k][key]), torch.as_tensor(v[key])), (k, key)
    train(model, opt, 1, first=2)  # a right gradient steps again
    opt.drop()


def test_params_on_the_meta_device_are_refused_before_anything_is_sent(servers, job):
    """A meta param used to fail in torch's copy of its (absent) values, with
    its job made on the servers already."""
    model = make_model().to("meta")
    with pytest.raises(shardopt.InvalidArgument, match="is on meta; RemoteAdamW takes params on the CPU or a CUDA"):
        RemoteAdamW(model.named_parameters(), servers=servers, job=job)
    assert_no_job_was_made(servers, job)


def test_describe_shows_each_servers_fields(servers, job):
    opt = RemoteAdamW(make_model().named_parameters(), servers=servers, job=job)
    states = opt.describe()
    assert [s.address for s in states] == list(servers)
    for s in states:
        assert repr(s).startswith(f"ServerState(address='{s.address}'") and f"state_bytes={s.state_bytes}" in repr(s)
    opt.drop()


def test_the_optimizer_cannot_be_pickled_or_copied(servers, job):
    """It holds connections: a copy would fail later, and torch.save(opt)
    would keep none of the state. state_dict() is what to save."""
    import copy
    import pickle
    opt = RemoteAdamW(make_model().named_parameters(), servers=servers, job=job)
    for copier in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="state_dict"):
            copier(opt)
    opt.drop()


def test_values_swapped_in_through_data_are_noticed(servers, job):
    """`p.data = other` gives the param other values without bumping its
    version counter: the optimizer notices the new storage."""
    model = make_model()
    opt = RemoteAdamW(model.named_parameters(), servers=servers, job=job)
    train(model, opt, 1)
    model.head.weight.data = model.head.weight.detach().clone() * 2
    with pytest.raises(shardopt.ParamsChanged, match="head.weight"):
        train(model, opt, 1, first=2)
    opt.drop()


def test_of_params_swapped_out_and_back_only_those_changed_are_named(servers, job, monkeypatch):
    """An EMA swapped in and out gives every param new storage: each is
    compared with its master, read many at once (here at most about 40 KB
    at a time, which leaves the last few params a call of their own), and
    only the params whose values differ are refused."""
    monkeypatch.setattr(shardopt._checks, "_HOST_BATCH_BYTES", 40000)
    model = make_model()
    opt = RemoteAdamW(model.named_parameters(), servers=servers, job=job)
    train(model, opt, 1)
    named = list(model.named_parameters())
    kept = {name: p.detach().clone() for name, p in named}
    for name, p in named:
        p.data = kept[name].clone()
    changed = [named[len(named) // 2][0], named[-1][0]]
    for name in changed:
        dict(named)[name].data += 1
    with pytest.raises(shardopt.ParamsChanged) as err:
        train(model, opt, 1, first=2)
    assert sorted(n for n, _ in named if f"'{n}'" in str(err.value)) == sorted(changed), str(err.value)
    for name in changed:
        dict(named)[name].data = kept[name].clone()
    train(model, opt, 1, first=2)  # swapped back: the same values, taken
    opt.drop()


def job_directory(checkpoints, job):
    """The job's directory under --checkpoint_dir: its name %-escaped but
    for letters, digits, '-', '_' and '.' (README, "Durability")."""
    kept = set(string.ascii_letters + string.digits + "-_.")
    return checkpoints / "".join(c if c in kept else "".join(f"%{b:02X}" for b in c.encode()) for c in job)


def backward_with_a_failing_checkpoint(servers, checkpoints, job, overlap):
    """A model after one backward, and its optimizer with checkpoint_every=1,
    whose checkpoints all fail: the job's directory is a file."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, overlap=overlap, checkpoint_every=1)
    job_directory(checkpoints, job).write_text("not a directory")
    tokens, targets = batch(0)
    model(tokens, targets).backward()
    return model, opt


def test_checkpoint_every_on_servers_without_a_checkpoint_dir_is_refused_at_construction(servers, job):
    """Rank 0 takes the checkpoints: each would fail after its step was
    applied. The refusal leaves no job behind (an outside probe found the
    job it had made still there, so a constructor with other settings was
    refused AlreadyExists). describe() says which servers have a
    --checkpoint_dir."""
    with pytest.raises(shardopt.FailedPrecondition, match="checkpoint_every is 5, but server .* has no --checkpoint_dir"):
        RemoteAdamW([torch.nn.Parameter(torch.ones(3))], servers=servers, job=job, checkpoint_every=5)
    opt = RemoteAdamW([torch.nn.Parameter(torch.ones(3))], servers=servers, job=job, weight_decay=0.25)
    assert all(not s.checkpoint_dir for s in opt.describe())
    assert "checkpoint_dir=False" in repr(opt.describe()[0])
    opt.drop()


def test_resume_false_refuses_another_runs_job_and_resume_true_a_fresh_one(servers, job):
    """resume=False: a new run never takes over a job another run left at a
    later step (it attached, and its params were replaced by that run's).
    resume=True: a resume never starts from step 0, and leaves no job."""
    with pytest.raises(TypeError, match="resume must be None, True or False"):
        RemoteAdamW(make_model().parameters(), servers=servers, job=job, resume="yes")
    with pytest.raises(shardopt.InvalidArgument, match="give one or the other"):  # a restore is a resume
        RemoteAdamW(make_model().parameters(), servers=servers, job=job, resume=False, restore_step=2)
    with pytest.raises(shardopt.FailedPrecondition, match="is at step 0"):
        RemoteAdamW(make_model().parameters(), servers=servers, job=job, resume=True)
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, resume=False)
    train(model, opt, 2)
    with pytest.raises(shardopt.FailedPrecondition, match="is at step 2"):
        RemoteAdamW(param_groups(make_model()), servers=servers, job=job, resume=False)
    again = RemoteAdamW(param_groups(make_model()), servers=servers, job=job, resume=True)
    assert again.resumed_step == 2
    opt.drop()


def test_a_relaunch_whose_param_was_transposed_is_refused(servers, job):
    """A relaunch of a changed model under the job's name: a param of the
    same numel in another shape would take the job's state in the wrong
    order (it attached, silently). The shape is part of the job."""
    opt = RemoteAdamW([("w", torch.nn.Parameter(torch.randn(64, 128)))], servers=servers, job=job)
    with pytest.raises(shardopt.AlreadyExists, match=r"shape\[0\]: 64 -> 128"):
        RemoteAdamW([("w", torch.nn.Parameter(torch.randn(128, 64)))], servers=servers, job=job)
    RemoteAdamW([("w", torch.nn.Parameter(torch.randn(64, 128)))], servers=servers, job=job)  # the same: attaches
    opt.drop()


def test_servers_on_separate_checkpoint_directories_are_refused_at_construction(server_binary, tmp_path, job):
    """Each server with a --checkpoint_dir of its own (every pod its own
    volume): no checkpoint of the job could complete, and a restart of the
    servers would lose it. Rank 0's constructor raises FailedPrecondition
    naming both servers, and leaves no job behind."""
    procs = []
    try:
        for i in range(2):
            (tmp_path / f"s{i}").mkdir()
            procs.append(ServerProcess(server_binary, tmp_path / f"s{i}", f"--checkpoint_dir={tmp_path / f's{i}' / 'ck'}"))
        addresses = [p.address for p in procs]
        with pytest.raises(shardopt.FailedPrecondition) as err:
            RemoteAdamW(make_model().parameters(), servers=addresses, job=job)
        assert "different checkpoint directories" in err.value.message
        assert all(a in err.value.message for a in addresses)
        for p in procs:
            assert job not in subprocess.run([os.environ["SHARDOPT_CLI"], f"--server={p.address}", "list"],
                                             capture_output=True, text=True, check=True).stdout
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_whose_checkpoint_fails_says_it_was_applied(server_binary, tmp_path, job, overlap):
    """checkpoint_every whose checkpoint fails: step() raises the
    checkpoint's error, saying that the step was applied and must not be
    repeated (the way out of a failed step() is otherwise to call it again,
    which here would apply the next step with the same gradients)."""
    with checkpointing_servers(server_binary, tmp_path) as (procs, checkpoints):
        model, opt = backward_with_a_failing_checkpoint([p.address for p in procs], checkpoints, job, overlap)
        with pytest.raises(shardopt.Error) as err:
            opt.step()
        assert "step 1 was applied" in err.value.message and "do not call step() again" in err.value.message
        assert "Not a directory" in err.value.message  # the server's own reason follows
        assert opt.job_step == 1
        opt.drop()


def test_zero_grad_whose_skip_checkpoint_fails_still_zeroes(server_binary, tmp_path, job):
    """overlap=True: zero_grad() after a backward completes the pushed step
    as a skip; with checkpoint_every whose checkpoint fails it raises the
    checkpoint's error saying the step was applied, and the gradients are
    zeroed all the same (left, the next backward would add to them and push
    the sum)."""
    with checkpointing_servers(server_binary, tmp_path) as (procs, checkpoints):
        model, opt = backward_with_a_failing_checkpoint([p.address for p in procs], checkpoints, job, overlap=True)
        with pytest.raises(shardopt.Error) as err:
            opt.zero_grad()
        assert "step 1 was applied" in err.value.message
        assert opt.job_step == 1
        assert all(p.grad is None for p in model.parameters())
        opt.drop()


# A process forked after the optimizer stepped: gRPC's threads are the
# parent's, so the child's calls are refused (a step there aborted the
# child), and its exit (which tore the optimizer down and waited for those
# threads) hung for good; "overlaps" forks while an overlap=True push runs,
# whose threads wait on a condition variable the child must not destroy. Run in a
# process of its own, so that no fork happens inside pytest's.
FORKED_AFTER_A_STEP = r"""
import os, sys, torch, shardopt
from shardopt.torch import RemoteAdamW
torch.manual_seed(0)
mode = sys.argv[3]
p, unused = torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(64))
opt = RemoteAdamW([p, unused], servers=sys.argv[1].split(","), job=sys.argv[2], lr=1e-2, overlap=mode == "overlaps")
def backward():
    opt.zero_grad()
    (p * torch.randn(64)).sum().backward()
backward()
opt.step()
backward()  # with overlap=True its push now runs, waiting for `unused`'s gradient until step()
pid = os.fork()
if pid == 0:
    import ctypes, signal
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: a hung child goes with the killed parent
    if mode == "new":  # gRPC cannot be used here at all, by a new optimizer either
        try:
            RemoteAdamW([torch.nn.Parameter(torch.randn(8))], servers=sys.argv[1].split(","), job=sys.argv[2] + "-child")
            print("child: made one")
        except shardopt.FailedPrecondition as e:
            print("child: refused:", e)
    elif mode != "exits":  # with an overlap push running, its finish is refused too
        try:
            opt.step()
            print("child: stepped")
        except shardopt.FailedPrecondition as e:
            print("child: refused:", e)
    sys.exit(0)  # the interpreter's teardown, which drops the optimizer
_, status = os.waitpid(pid, 0)
print("parent: child exit status", os.waitstatus_to_exitcode(status))
opt.step()
print("parent: stepped")
opt.drop()
"""


@pytest.mark.parametrize("child", ["steps", "exits", "overlaps", "new"])
def test_a_process_forked_after_a_step_is_refused_and_exits(servers, job, tmp_path, child):
    script = tmp_path / "forked.py"
    script.write_text(FORKED_AFTER_A_STEP)
    done = subprocess.run([sys.executable, str(script), ",".join(servers), job, child], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    if child != "exits":
        assert any(line.startswith("child: refused:") and "fork" in line for line in lines), done.stdout
    assert "parent: child exit status 0" in lines, done.stdout
    assert any(line.startswith("parent: stepped") for line in lines), done.stdout
