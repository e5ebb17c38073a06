"""state_dict round trips, moving between processes, and resuming from the
servers' state (attaching, and after the servers restart from a checkpoint)."""
import copy
import logging
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import shardopt
from shardopt.torch import RemoteAdamW
from models import bits, make_model, param_groups, same_bits, train, unnamed
from servers import checkpointing_servers
from workers import MIXED

torch.set_num_threads(1)
HERE = os.path.dirname(__file__)
STEPS = 20


def run_worker(*args):
    subprocess.run([sys.executable, os.path.join(HERE, "workers.py"), *map(str, args)], check=True, timeout=300)


def test_round_trip_in_a_new_process_is_bitwise(servers, job, tmp_path):
    """STEPS steps, save, load in a new process, STEPS more: bitwise equal to
    2*STEPS uninterrupted steps. The saved state is fp32 for the bf16 params
    too, and loading it does not round it to bf16 (the seed's resume trap)."""
    whole = make_model(**MIXED)
    opt = RemoteAdamW(param_groups(whole), servers=servers, job=f"{job}-whole", lr=1e-3)
    train(whole, opt, 2 * STEPS)
    opt.drop()

    model = make_model(**MIXED)
    opt = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-first", lr=1e-3)
    train(model, opt, STEPS)
    saved = opt.state_dict()
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}
    for k, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        state = saved["state"][k]
        assert int(state["step"]) == STEPS
        for key in ("exp_avg", "exp_avg_sq", "master"):
            assert state[key].dtype == torch.float32 and state[key].shape == p.shape, key
        if p.dtype == torch.bfloat16:
            # Not bf16 values in disguise: the moments have low bits set.
            assert (bits(state["exp_avg"]) & 0xFFFF).any()
            assert same_bits(state["master"].to(torch.bfloat16), p)
        else:
            assert same_bits(state["master"], p)
    checkpoint = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": saved}, checkpoint)
    opt.drop()

    out = tmp_path / "resumed.pt"
    run_worker("resume", "--servers", ",".join(servers), "--job", f"{job}-second", "--checkpoint", checkpoint,
               "--first", STEPS + 1, "--steps", STEPS, "--out", out)
    resumed = torch.load(out)
    for name, p in whole.state_dict().items():
        assert same_bits(resumed[name], p), name


def loaded_into_a_new_job(servers, job, before_load=lambda opt: None, **model_kw):
    """Three steps of job-a, its state_dict(), and job-b's optimizer with the
    model and that state loaded before any step (`before_load(opt)` called
    just before); job-a is dropped."""
    model = make_model(**model_kw)
    opt = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-a", lr=1e-3)
    train(model, opt, 3)
    saved = opt.state_dict()
    opt.drop()
    fresh = make_model(**model_kw)
    fresh.load_state_dict(model.state_dict())
    opt = RemoteAdamW(param_groups(fresh), servers=servers, job=f"{job}-b", lr=1e-3)
    before_load(opt)
    opt.load_state_dict(saved)
    return opt, saved


def assert_state_is(state_dict, saved):
    for k, state in saved["state"].items():
        for key, value in state.items():
            ours = state_dict["state"][k][key]
            # master_step is an int, as torch's load keeps it.
            assert same_bits(ours, value) if isinstance(value, torch.Tensor) else ours == value, (k, key)


def test_a_load_sent_many_tensors_a_call_in_several_calls_reads_back_bitwise(servers, job, monkeypatch):
    """Initial values and loaded state go many tensors a call, in calls of
    about 256 MiB of host copies; here 40 KB, so in several."""
    monkeypatch.setattr(shardopt._checks, "_HOST_BATCH_BYTES", 40000)
    calls = []

    class Counting:  # the client, its init_many calls counted
        def __init__(self, client):
            self._client = client

        def __getattr__(self, name):
            if name == "init_many":
                calls.append(name)
            return getattr(self._client, name)

    def count(opt):
        opt._client = Counting(opt._client)

    opt, saved = loaded_into_a_new_job(servers, job, before_load=count, **MIXED)
    assert len(calls) > 1, calls
    opt._client = opt._client._client
    assert_state_is(opt.state_dict(), saved)
    opt.drop()


def test_load_state_dict_does_not_cast_to_param_dtype(servers, job):
    """Loading writes the fp32 state exactly, for bf16 params too: reading it
    back gives the same bits."""
    opt, saved = loaded_into_a_new_job(servers, job, dtype=torch.bfloat16)
    assert_state_is(opt.state_dict(), saved)
    opt.drop()


def test_a_load_that_would_keep_an_earlier_loads_state_is_refused(servers, job):
    """torch's load_state_dict replaces the state: a param the dict has no
    state for has none after it. The servers cannot take a tensor's Adam
    step back to 0, so loading a stateless dict over an earlier load's state
    is refused, and the earlier state stays as it was."""
    opt, saved = loaded_into_a_new_job(servers, job)
    stateless = torch.optim.AdamW(unnamed(param_groups(make_model())), lr=1e-3).state_dict()
    with pytest.raises(shardopt.FailedPrecondition, match="earlier load_state_dict"):
        opt.load_state_dict(stateless)
    assert_state_is(opt.state_dict(), saved)
    opt.drop()


def test_a_shared_load_needs_torch_distributed_and_sends_nothing_without_it(servers, job):
    """load_state_dict(shared=True) in a process without torch.distributed
    raises ValueError before sending anything: the new job has still no Adam
    state, where the state dict would have given every param some."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-a", lr=1e-3)
    train(model, opt, 2)
    saved = opt.state_dict()
    opt.drop()
    assert len(saved["state"]) == len(list(model.parameters()))
    opt = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-b", lr=1e-3)
    with pytest.raises(ValueError, match="torch.distributed"):
        opt.load_state_dict(saved, shared=True)
    assert opt.state_dict()["state"] == {}
    opt.load_state_dict(saved)  # not shared: every caller sends all of it
    assert_state_is(opt.state_dict(), saved)
    opt.drop()


def test_attach_resumes_from_the_servers(servers, job):
    """A restarted trainer (new model, new optimizer, same job) attaches at
    the job's step, gets the servers' params, and continues bitwise as if
    never stopped."""
    whole = make_model()
    opt = RemoteAdamW(param_groups(whole), servers=servers, job=f"{job}-whole", lr=1e-3)
    train(whole, opt, 2 * STEPS)
    opt.drop()

    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3)
    assert opt.resumed_step == 0
    train(model, opt, STEPS)
    del opt, model  # the trainer dies; the job stays on the servers

    model = make_model(seed=7)
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3)
    assert opt.resumed_step == STEPS and opt.job_step == STEPS
    train(model, opt, STEPS, first=STEPS + 1)
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        assert same_bits(p, q), name
    opt.drop()


def test_a_restarted_trainer_loading_its_state_dict_resumes_its_schedulers_lr(servers, job):
    """The torch way to resume: load the model's, the optimizer's and the
    scheduler's state dicts. The servers hold the state; the optimizer's
    state dict of their step gives the groups the lr the scheduler had
    reached (a scheduler's own load_state_dict sets no group's lr). It used
    to be refused, and the loop then ran at the constructor's lr, unsaid."""
    def scheduled(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    whole = make_model()
    opt = RemoteAdamW(param_groups(whole), servers=servers, job=f"{job}-whole", lr=1e-3)
    train(whole, opt, 2 * STEPS, scheduler=scheduled(opt))
    opt.drop()

    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3)
    scheduler = scheduled(opt)
    train(model, opt, STEPS, scheduler=scheduler)
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "scheduler": scheduler.state_dict()}
    del opt, model, scheduler  # the trainer dies; the job stays on the servers

    model = make_model(seed=7)
    model.load_state_dict(saved["model"])
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3)
    assert opt.resumed_step == STEPS
    opt.load_state_dict(saved["opt"])
    scheduler = scheduled(opt)
    scheduler.load_state_dict(saved["scheduler"])
    assert [g["lr"] for g in opt.param_groups] == [1e-3 * 0.5 ** STEPS] * len(opt.param_groups)
    train(model, opt, STEPS, first=STEPS + 1, scheduler=scheduler)
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        assert same_bits(p, q), name
    opt.drop()


def test_a_state_dict_of_another_run_at_the_same_step_is_refused_not_dropped_unsaid(servers, job):
    """A trainer attached to a job that has stepped loads a state dict of
    the same Adam steps from another run (a stale job of the same name, a
    checkpoint of another experiment): the servers keep their state, so
    taking only the dict's lr would train on from the other run's weights
    with nothing said (an outside probe). It is refused, naming a param and
    an element where the masters differ, and changes nothing."""
    other = make_model(seed=3)
    opt = RemoteAdamW(param_groups(other), servers=servers, job=f"{job}-other", lr=2e-3)
    train(other, opt, 3)
    saved = opt.state_dict()
    opt.drop()

    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3)
    train(model, opt, 3)
    del opt
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3)
    assert opt.resumed_step == 3
    before = opt.masters(list(model.parameters()))
    with pytest.raises(shardopt.FailedPrecondition, match=r"master differs from the servers' \(element 0:.*another "
                                                          r"run's, saved at the same step"):
        opt.load_state_dict(saved)
    assert [g["lr"] for g in opt.param_groups] == [1e-3] * len(opt.param_groups)
    assert all(same_bits(a, b) for a, b in zip(opt.masters(list(model.parameters())), before))
    opt.load_state_dict(opt.state_dict())  # its own state: taken
    opt.drop()


def test_a_resume_whose_first_step_keeps_the_constructors_lrs_while_the_job_ran_at_others_warns(servers, job,
                                                                                              caplog):
    """A trainer that resumes from the servers (a checkpoint, or the job
    still held) gets their state but keeps the lrs it was constructed with:
    a scheduler's load_state_dict sets no group's lr, so a resumed schedule
    restarted, unsaid. Its first step now says so on the "shardopt" logger,
    once; not when the lrs were set from the scheduler, nor for a constant
    lr."""
    def scheduled(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch)

    def said():
        return [r.getMessage() for r in caplog.records if r.name == "shardopt"]

    g = torch.Generator().manual_seed(3)
    for name, constant in ((f"{job}-forgot", False), (f"{job}-skipped-first", False), (f"{job}-set", False),
                           (f"{job}-constant", True)):
        p = torch.nn.Parameter(torch.randn(16, generator=g))
        opt = RemoteAdamW([p], servers=servers, job=name, lr=1.0)
        scheduler = None if constant else scheduled(opt)
        for _ in range(3):  # at lrs 1, 0.5 and 0.25
            p.grad = torch.randn(16, generator=g)
            opt.step()
            if scheduler is not None:
                scheduler.step()
        saved = None if constant else scheduler.state_dict()
        del opt, scheduler  # the trainer dies; the job stays on the servers

        q = torch.nn.Parameter(torch.randn(16, generator=g))
        opt = RemoteAdamW([q], servers=servers, job=name, lr=1.0)
        assert opt.resumed_step == 3
        if name.endswith("-set"):
            scheduler = scheduled(opt)
            scheduler.load_state_dict(saved)
            for group, lr in zip(opt.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardopt"):
            for k in range(2):
                q.grad = torch.randn(16, generator=g)
                if k == 0 and name.endswith("-skipped-first"):
                    q.grad[0] = float("nan")  # its lrs move nothing: the next step is looked at
                opt.step()
        if name.endswith("-skipped-first"):
            assert len(said()) == 2 and said()[0].startswith("step 4 skipped"), said()
            assert said()[1].startswith("step 5 ran at the lrs RemoteAdamW was constructed with, [1.0], where "
                                        "step 3, which it resumed from, ran at [0.25]")
        elif name.endswith("-forgot"):
            assert len(said()) == 1
            assert said()[0].startswith("step 4 ran at the lrs RemoteAdamW was constructed with, [1.0], where step "
                                        "3, which it resumed from, ran at [0.25]. If a scheduler drives them, a "
                                        "resume must set them from it")
        else:
            assert said() == [], name
        opt.drop()


def test_at_step_0_rank_0_sends_its_params_unless_the_job_holds_adam_state(servers, job):
    """Before the job's first step, a relaunched rank 0 sends its params (the
    weights it loaded since the last launch are the initial values); but
    once a state dict was loaded into the job, its masters go with those
    moments, and a rank 0 attaching then takes them, as at a later step."""
    first = make_model()
    opt = RemoteAdamW(param_groups(first), servers=servers, job=job, lr=1e-3)
    del opt  # the job stays at step 0 with first's values, and no Adam state

    relaunched = make_model(seed=7)
    kept = [p.detach().clone() for p in relaunched.parameters()]
    opt = RemoteAdamW(param_groups(relaunched), servers=servers, job=job, lr=1e-3)
    assert opt.resumed_step == 0
    for i, (p, q) in enumerate(zip(relaunched.parameters(), kept)):
        assert same_bits(p, q), i  # its own, sent; not first's, pulled

    # The state of another run's two steps, loaded: the job now holds Adam state.
    donor = make_model(seed=3)
    donor_opt = RemoteAdamW(param_groups(donor), servers=servers, job=f"{job}-donor", lr=1e-3)
    train(donor, donor_opt, 2)
    loaded = donor_opt.state_dict()
    donor_opt.drop()
    opt.load_state_dict(loaded)
    del opt

    other = make_model(seed=11)
    opt = RemoteAdamW(param_groups(other), servers=servers, job=job, lr=1e-3)
    assert opt.resumed_step == 0
    for k, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        assert same_bits(p, loaded["state"][k]["master"].to(p.dtype)), k
    assert_state_is(opt.state_dict(), loaded)
    opt.drop()


def test_a_relaunched_rank_0_that_sends_over_an_earlier_launchs_values_warns(servers, job):
    """With several ranks, a rank that attached before the relaunched rank 0
    sent its params took the earlier launch's: rank 0 says so."""
    first = RemoteAdamW(param_groups(make_model()), servers=servers, job=job, lr=1e-3, rank=0, world_size=2)
    del first
    with pytest.warns(UserWarning, match="held initial values from an earlier launch"):
        opt = RemoteAdamW(param_groups(make_model(seed=7)), servers=servers, job=job, lr=1e-3, rank=0,
                          world_size=2)
    opt.drop()


def test_attaching_warns_of_a_push_a_dead_trainer_left(servers, job):
    """A trainer killed between its push and its commit leaves the push on
    the servers, which count a rank's push of a step once: the next
    trainer's step is applied with the dead one's gradients. Attaching says
    so; and a restore_step that the servers holding the job ignore says so."""
    run_worker("push_and_die", "--servers", ",".join(servers), "--job", job, "--steps", 2)
    with pytest.warns(UserWarning, match="step 3 of job .* is pushed and not yet committed"):
        opt = RemoteAdamW(param_groups(make_model()), servers=servers, job=job, lr=1e-3)
    assert opt.resumed_step == 2
    with pytest.warns(UserWarning, match="restore_step=1 was not used"):
        RemoteAdamW(param_groups(make_model()), servers=servers, job=job, lr=1e-3, restore_step=1)
    opt.drop()


def test_checkpoint_survives_a_server_restart(server_binary, job, tmp_path):
    """checkpoint() writes the servers' state; after both servers are killed
    and restarted on the same directory, a new trainer resumes from it and
    continues bitwise equal to an uninterrupted run."""
    with checkpointing_servers(server_binary, tmp_path) as (procs, _):
        servers = [p.address for p in procs]
        whole = make_model()
        opt = RemoteAdamW(param_groups(whole), servers=servers, job=f"{job}-whole", lr=1e-3)
        train(whole, opt, 2 * STEPS)

        model = make_model()
        opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3)
        train(model, opt, STEPS)
        opt.checkpoint()
        train(model, opt, 2)  # lost with the servers: the resume goes back to the checkpoint
        del opt
        for p in procs:
            p.stop()
            p.start()
        model = make_model(seed=7)
        opt = RemoteAdamW(param_groups(model), servers=[p.address for p in procs], job=job, lr=1e-3)
        assert opt.resumed_step == STEPS
        train(model, opt, STEPS, first=STEPS + 1)
        for (name, p), q in zip(model.named_parameters(), whole.parameters()):
            assert same_bits(p, q), name


def test_torch_adamw_state_of_a_bf16_model_is_widened_exactly(servers, job):
    """torch.optim.AdamW on bf16 params keeps bf16 moments: loading them
    widens them exactly, and the step counts carry over."""
    theirs = make_model(dtype=torch.bfloat16)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3, foreach=False)
    train(theirs, ref, 3)
    ours = make_model(seed=5, dtype=torch.bfloat16)
    ours.load_state_dict(theirs.state_dict())
    opt = RemoteAdamW(ours.named_parameters(), servers=servers, job=job, lr=1e-3)
    opt.load_state_dict(ref.state_dict())
    loaded = opt.state_dict()["state"]
    for k, state in ref.state_dict()["state"].items():
        assert state["exp_avg"].dtype == torch.bfloat16
        assert int(loaded[k]["step"]) == int(state["step"]) == 3
        for key in ("exp_avg", "exp_avg_sq"):
            assert same_bits(loaded[k][key], state[key].float()), (k, key)
    assert all(same_bits(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))
    opt.drop()


def test_a_group_holds_the_state_precision_it_asks_for(servers, job):
    """{"state_precision": "bf16"} in one group: its moments are bf16 values
    (the low 16 bits of every fp32 are zero), the other group's are fp32."""
    model = make_model()
    groups = param_groups(model)
    groups[1]["state_precision"] = "bf16"
    opt = RemoteAdamW(groups, servers=servers, job=job, lr=1e-3)
    train(model, opt, 3)
    state = opt.state_dict()["state"]
    for gi, group in enumerate(opt.state_dict()["param_groups"]):
        low = [(state[i]["exp_avg"].view(torch.int32) & 0xFFFF).abs().sum().item() for i in group["params"]
               if i in state]
        assert low, gi
        assert (sum(low) == 0) == (gi == 1), (gi, low)


@pytest.mark.parametrize("saved_precision, job_precision", [("fp32", "bf16"), ("bf16", "fp32")])
def test_a_state_dict_of_another_state_precision_is_refused(servers, job, saved_precision, job_precision):
    """The constructor's state_precision, with no group setting its own: the
    state dict used not to record it, and loaded into a job of the other
    precision silently (fp32 moments and masters rounded to bf16, or bf16
    ones taken as fp32 state). Now each group records it, and the load is
    refused before anything is sent; a torch.optim.AdamW state dict, which
    has no such key, still loads."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-a", lr=1e-3, state_precision=saved_precision)
    train(model, opt, 2)
    saved = opt.state_dict()
    opt.drop()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-b", lr=1e-3, state_precision=job_precision)
    with pytest.raises(shardopt.InvalidArgument, match=f"state_precision {saved_precision!r} differs from the "
                                                       f"job's {job_precision!r}"):
        opt.load_state_dict(saved)
    assert opt.state_dict()["state"] == {}
    assert [g["state_precision"] for g in saved["param_groups"]] == [saved_precision] * len(saved["param_groups"])
    ref = torch.optim.AdamW(unnamed(param_groups(model)), lr=1e-3, foreach=False)
    train(model, ref, 1)
    opt.load_state_dict(ref.state_dict())
    assert sorted(opt.state_dict()["state"]) == sorted(ref.state_dict()["state"])
    opt.drop()


def test_a_second_thread_may_checkpoint_and_read_while_the_first_trains(server_binary, job, tmp_path):
    """The extension's calls release the GIL, so a checkpointing or
    monitoring thread can call in while the training loop steps. Each call
    runs alone in the client: a checkpoint taken between two steps is of the
    step the servers are at (before, it could name the step before a commit
    in flight, and be refused), and training is bitwise that of one thread.
    Every state dict is one step's: its masters are the params after the
    step its Adam steps name (before, steps were applied between its reads,
    and most dicts mixed several steps)."""
    with checkpointing_servers(server_binary, tmp_path) as (procs, _):
        servers = [p.address for p in procs]
        busy, alone = make_model(), make_model()
        opt = RemoteAdamW(busy.named_parameters(), servers=servers, job=f"{job}-busy", lr=1e-3)
        ref = RemoteAdamW(alone.named_parameters(), servers=servers, job=f"{job}-alone", lr=1e-3)
        done = threading.Event()
        errors, calls, dicts = [], [0], []

        def poke():
            while not done.is_set():
                try:
                    opt.checkpoint()
                    opt.describe()
                    dicts.append(opt.state_dict())
                    calls[0] += 1
                except Exception as e:  # noqa: BLE001 (reported below)
                    errors.append(e)
                    return

        poker = threading.Thread(target=poke)
        poker.start()
        after = {0: [p.detach().clone() for p in busy.parameters()]}  # the params after each step
        try:
            for step in range(1, 21):
                train(busy, opt, 1, first=step)
                after[step] = [p.detach().clone() for p in busy.parameters()]
        finally:
            done.set()
            poker.join()
        train(alone, ref, 20)
        assert not errors, errors[0]
        assert calls[0] > 0
        stepped = [sd for sd in dicts if sd["state"]]
        assert stepped, "no state dict was read after a step"
        for sd in stepped:
            steps = {int(entry["step"]) for entry in sd["state"].values()}
            assert len(steps) == 1, steps
            step = steps.pop()
            for k, p in enumerate(after[step]):
                assert same_bits(sd["state"][k]["master"], p), (step, k)
        for (name, p), q in zip(busy.named_parameters(), alone.parameters()):
            assert same_bits(p, q), name
        opt.drop()
        ref.drop()


@pytest.mark.parametrize("case", ["exp_avg_sq-negative", "exp_avg-nan", "master-inf", "master-bf16-overflow"])
def test_a_state_dict_the_servers_would_refuse_is_refused_before_anything_is_sent(servers, job, case):
    """One bad value in the last param's state: refused with the servers'
    code before the first param's state is sent, so the new job has no Adam
    state and its masters are still the params."""
    precision = "bf16" if case == "master-bf16-overflow" else "fp32"
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-a", lr=1e-3, state_precision=precision)
    train(model, opt, 2)
    saved = opt.state_dict()
    opt.drop()
    last = saved["state"][max(saved["state"])]
    key, value = {"exp_avg_sq-negative": ("exp_avg_sq", -1.0), "exp_avg-nan": ("exp_avg", float("nan")),
                  "master-inf": ("master", float("inf")), "master-bf16-overflow": ("master", 3.4e38)}[case]
    last[key].view(-1)[-1] = value
    fresh = make_model(seed=1)
    opt = RemoteAdamW(param_groups(fresh), servers=servers, job=f"{job}-b", lr=1e-3, state_precision=precision)
    with pytest.raises(shardopt.InvalidArgument, match=key):
        opt.load_state_dict(saved)
    assert opt.state_dict()["state"] == {}
    first = next(fresh.parameters()).detach()
    held = first if precision == "fp32" else first.to(torch.bfloat16).float()
    assert same_bits(opt.master(next(fresh.parameters())), held)
    opt.drop()


def test_a_state_whose_second_moment_overflowed_loads_and_steps_on_bitwise(servers, job):
    """A gradient whose square passes fp32's range leaves v at +Inf, on the
    servers as in torch. A state dict saved after it was refused on load
    ("exp_avg_sq ... is not finite", a probe), where torch loads it; now it
    loads, and the run goes on bitwise as the uninterrupted one."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-a", lr=1e-3)
    train(model, opt, 1)
    gen = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype) * 1e-2
    first = opt.param_groups[0]["params"][0]  # state index 0
    first.grad.view(-1)[3] = 1e22
    opt.step()
    saved = opt.state_dict()
    assert saved["state"][0]["exp_avg_sq"].view(-1)[3].item() == float("inf")
    assert torch.isfinite(saved["state"][0]["master"]).all()
    fresh = make_model(seed=1)
    fresh.load_state_dict(model.state_dict())
    resumed = RemoteAdamW(param_groups(fresh), servers=servers, job=f"{job}-b", lr=1e-3)
    resumed.load_state_dict(saved)
    train(model, opt, 2, first=3)
    train(fresh, resumed, 2, first=3)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert same_bits(p, q), name
    opt.drop()
    resumed.drop()


# Each case's state dict, and what its refusal says.
UNSTEPPABLE = {"exp_avg-transposed": "shape", "exp_avg_sq-flat": "shape", "step-fractional": "whole number",
               "step-negative": "whole number", "step-inf": "whole number", "step-missing": "has no step",
               "exp_avg-missing": "has no exp_avg:", "exp_avg_sq-missing": "has no exp_avg_sq",
               "exp_avg-fp64": "fp32 or bf16 needed", "step-past-2^53": "to 2\\^53"}


@pytest.mark.parametrize("case", list(UNSTEPPABLE))
def test_a_state_dict_torch_could_not_step_with_is_refused_before_anything_is_sent(servers, job, case, monkeypatch):
    """Moments of another shape than the param's (a transposed kernel from
    another framework; torch's step would fail on it) were read in flat
    order, a fractional step taken as its integer part, an entry without
    exp_avg or exp_avg_sq raised a bare KeyError, and one without step
    dropped its moments silently; now each is a ValueError and nothing is
    sent. (fp64 moments were refused before, with UnsupportedDtype, a
    ValueError too: the case keeps the README's word for it.)"""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-a", lr=1e-3)
    train(model, opt, 2)
    saved = opt.state_dict()
    opt.drop()
    index, entry = next((k, e) for k, e in saved["state"].items() if e["exp_avg"].dim() == 2
                        and e["exp_avg"].shape[0] != e["exp_avg"].shape[1])
    if case == "exp_avg-transposed":
        entry["exp_avg"] = entry["exp_avg"].t().contiguous()
    elif case == "exp_avg_sq-flat":
        entry["exp_avg_sq"] = entry["exp_avg_sq"].reshape(-1)
    elif case.endswith("-missing"):
        del entry[case[:-len("-missing")]]
    elif case == "exp_avg-fp64":
        entry["exp_avg"] = entry["exp_avg"].double()
    else:
        entry["step"] = torch.tensor({"step-fractional": 2.5, "step-negative": -1.0, "step-inf": float("inf"),
                                      "step-past-2^53": 2.0**54}[case])
    # The state goes many tensors a call, in calls of about 256 MiB of host
    # copies: here 40 KB, so that a refusal by the servers in a later call
    # would come after the first calls were sent.
    monkeypatch.setattr(shardopt._checks, "_HOST_BATCH_BYTES", 40000)
    fresh = make_model(seed=1)
    opt = RemoteAdamW(param_groups(fresh), servers=servers, job=f"{job}-b", lr=1e-3)
    with pytest.raises(shardopt.UnsupportedDtype if case == "exp_avg-fp64" else ValueError, match=UNSTEPPABLE[case]):
        opt.load_state_dict(saved)
    assert opt.state_dict()["state"] == {}
    opt.drop()


def test_a_torch_state_dict_saved_with_capturable_or_fused_loads(servers, job):
    """capturable, differentiable, foreach and fused say how torch ran its
    step, not what the state is: a torch.optim.AdamW state dict that has
    them loads, and they do not come into the groups (where the next step
    would refuse capturable)."""
    model = make_model()
    ref = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    train(model, ref, 2)
    saved = ref.state_dict()
    for g in saved["param_groups"]:
        g.update(capturable=True, differentiable=False, foreach=True, fused=None)
    opt = RemoteAdamW(model.parameters(), servers=servers, job=job, lr=1e-3)
    opt.load_state_dict(saved)
    assert all(not g["capturable"] for g in opt.param_groups)
    train(model, opt, 1, first=3)
    assert opt.job_step == 1
    opt.drop()


def test_a_state_dict_trained_on_by_torch_keeps_torchs_params_not_the_stale_master(servers, job):
    """RemoteAdamW to torch.optim.AdamW, two steps there, and back: torch
    keeps the dict's master as it was and trains the params. The load used
    to set the params it was given back to that older master, silently (an
    outside probe: 0.05 off after five torch steps); now it warns and takes
    the params, as for a torch dict. A dict of ours that torch did not step
    still gives its master."""
    model = make_model()
    opt = RemoteAdamW(model.parameters(), servers=servers, job=job, lr=1e-3)
    train(model, opt, 3)
    saved = opt.state_dict()
    opt.drop()
    theirs = make_model(seed=5)
    theirs.load_state_dict(model.state_dict())
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3, foreach=False)
    ref.load_state_dict(saved)
    unstepped = copy.deepcopy(ref.state_dict())  # torch's holds its live state
    train(theirs, ref, 2, first=4)
    moved = make_model(seed=6)
    moved.load_state_dict(theirs.state_dict())
    back = RemoteAdamW(moved.parameters(), servers=servers, job=job + "-back", lr=1e-3)
    with pytest.warns(UserWarning, match=r"older than its moments .*master of Adam step 3, moments of step 5"):
        back.load_state_dict(ref.state_dict())
    assert all(same_bits(p, q) for p, q in zip(moved.parameters(), theirs.parameters()))
    loaded = back.state_dict()["state"]
    for k, p in enumerate(moved.parameters()):
        assert same_bits(loaded[k]["master"], p) and int(loaded[k]["step"]) == loaded[k]["master_step"] == 5, k
    back.drop()

    fresh = make_model(seed=7)
    again = RemoteAdamW(fresh.parameters(), servers=servers, job=job + "-again", lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its master is of its moments' step: not stale
        again.load_state_dict(unstepped)
    assert all(same_bits(p, q) for p, q in zip(fresh.parameters(), model.parameters()))
    again.drop()


def test_moments_loaded_at_adam_step_zero_are_state_until_a_load_clears_them(servers, job):
    """A state dict whose entries have step 0 and moments (a warm start):
    the servers hold the moments though their Adam step says 0, so
    state_dict() shows them, where it used to leave them out (a save right
    after the load lost them). A later load without state for those params
    clears them, as torch's load would, where they used to stay: the next
    step is then a fresh job's."""
    model = make_model()
    opt = RemoteAdamW(model.named_parameters(), servers=servers, job=job, lr=1e-3)
    generator = torch.Generator().manual_seed(11)
    warm = opt.state_dict()
    warm["state"] = {i: {"step": torch.tensor(0.0),
                         "exp_avg": torch.randn(p.shape, generator=generator) * 1e-3,
                         "exp_avg_sq": torch.rand(p.shape, generator=generator) * 1e-6}
                     for i, p in enumerate(model.parameters())}
    opt.load_state_dict(warm)
    shown = opt.state_dict()["state"]
    assert sorted(shown) == sorted(warm["state"])
    for i, entry in warm["state"].items():
        assert shown[i]["step"].item() == 0
        assert torch.equal(shown[i]["exp_avg"], entry["exp_avg"]) and torch.equal(shown[i]["exp_avg_sq"],
                                                                                   entry["exp_avg_sq"])
    cold = dict(warm, state={})
    opt.load_state_dict(cold)
    assert opt.state_dict()["state"] == {}
    fresh_model = make_model()
    fresh = RemoteAdamW(fresh_model.named_parameters(), servers=servers, job=f"{job}-fresh", lr=1e-3)
    train(model, opt, 1)
    train(fresh_model, fresh, 1)
    for (name, p), q in zip(model.named_parameters(), fresh_model.parameters()):
        assert same_bits(p, q), name
    opt.drop()
    fresh.drop()
