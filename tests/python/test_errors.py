"""Errors a Python user understands: each is a shardopt.Error subclass with
the status code and the message naming the server."""
import socket
import time

import pytest
import torch

import shardopt
from shardopt.torch import RemoteAdamW
from models import batch, make_model, param_groups, train

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


def test_load_state_dict_after_steps_is_refused(servers, job):
    model = make_model()
    opt = RemoteAdamW(model.named_parameters(), servers=servers, job=job)
    train(model, opt, 1)
    with pytest.raises(shardopt.FailedPrecondition, match="step 1"):
        opt.load_state_dict(opt.state_dict())
    opt.drop()


def test_server_pattern_expands():
    assert shardopt.expand_server_pattern("shardopt-{i}.shardopt:50051", 2) == [
        "shardopt-0.shardopt:50051", "shardopt-1.shardopt:50051"]
    with pytest.raises(shardopt.InvalidArgument):
        shardopt.expand_server_pattern("no-pattern:50051", 2)


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
