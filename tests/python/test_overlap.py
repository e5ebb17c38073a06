"""overlap=True pushes gradients while backward runs; the result is bitwise
that of overlap=False."""
import gc
import signal
import threading
import time
import weakref

import pytest
import torch

import shardopt
from shardopt.torch import RemoteAdamW
from models import batch, make_model, param_groups, same_bits, train
from servers import checkpointing_servers

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
    own; a gradient the trainer lets go of meanwhile (here p.grad = None,
    which step() then refuses; or the whole optimizer, dropped after
    backward raised) is held until the push ends, not freed under it; so
    is the memory that p.grad.data = ... takes from under a gradient (new
    tensors of its size get other memory)."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3, overlap=True)
    tokens, targets = batch(1)
    model(tokens, targets).backward()
    assert opt._client.pushing()
    p, q = list(model.parameters())[:2]
    grad = weakref.ref(p.grad)
    p.grad = None
    assert grad() is not None, "freed while the push may read it"
    swapped = q.grad.data_ptr()
    q.grad.data = torch.zeros_like(q.grad)
    assert swapped not in {torch.empty_like(q).data_ptr() for _ in range(8)}, "memory freed while the push may read it"
    with pytest.raises(shardopt.InvalidArgument, match="changed after backward"):
        opt.step()
    assert grad() is None, "still held after the push ended"
    opt.drop()


def _index(opt, param):
    return next(k for k, p in enumerate(p for g in opt.param_groups for p in g["params"]) if p is param)


def _step_alike(models, opts, step):
    """Every rank backward on batch `step`, then step(): the ranks' params
    come out the same bits."""
    for m in models:
        m.zero_grad()
        m(*batch(step)).backward()
    for o in opts:
        o.step()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert same_bits(p, q), name


@pytest.mark.parametrize("then", ["zero_grad", "step"])
def test_a_second_backward_before_step_is_refused_and_its_step_skipped(servers, job, then):
    """The second backward raises from its first param's hook, p.grad then
    holding part of two backwards, which the push may have read: the pushed
    step is applied as a skip, by zero_grad() or by a step() called anyway,
    which raises saying so. Nothing moves, and training goes on."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3, overlap=True)
    initial = [p.detach().clone() for p in model.parameters()]
    tokens, targets = batch(1)
    model(tokens, targets).backward()
    with pytest.raises(shardopt.FailedPrecondition, match="second gradient before step"):
        model(tokens * 0 + 1, targets).backward()
    if then == "step":
        with pytest.raises(shardopt.FailedPrecondition, match="step 1 was applied as a skip"):
            opt.step()
    opt.zero_grad()
    assert opt.job_step == 1
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), initial))
    # A step of gradients set by hand (no backward) is a step, not a skip.
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.job_step == 2 and opt.last_decision is not None and not opt.last_decision.skip
    assert not same_bits(next(model.parameters()), initial[0])
    opt.zero_grad()
    train(model, opt, 2, first=3)
    assert opt.job_step == 4
    opt.drop()


def test_a_skip_of_the_pushed_step_is_not_refused_for_an_lr_the_loop_made_invalid(servers, job):
    """zero_grad() commits backward's push as a skip: it applies nothing,
    so a NaN lr set meanwhile does not refuse it (it used to, leaving the
    step pushed, and the next backward's step applied the old gradients).
    The next step is then that of its own gradients, as without overlap."""
    finals = []
    for overlap in (True, False):
        model = make_model()
        opt = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-{overlap}", lr=1e-3, overlap=overlap)
        tokens, targets = batch(1)
        model(tokens, targets).backward()
        for g in opt.param_groups:
            g["lr"] = float("nan")
        opt.zero_grad()
        for g in opt.param_groups:
            g["lr"] = 1e-3
        train(model, opt, 1, first=2)
        finals.append([p.detach().clone() for p in model.parameters()])
        opt.drop()
    assert all(same_bits(p, q) for p, q in zip(*finals))


class _SharedInTwoSegments(torch.nn.Module):
    """One layer used in two checkpointed segments, as a tied or shared
    block is."""

    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(3)
        self.shared = torch.nn.Linear(8, 8)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for _ in range(2):
            x = checkpoint(lambda y: torch.tanh(self.shared(y)), x, use_reentrant=self.reentrant)
        return x.square().sum()


def test_reentrant_activation_checkpointing_is_named_and_the_other_kind_works(servers, job):
    """A reentrant checkpoint gives a param used in two segments its
    gradient in two parts, which overlap cannot push whole: backward raises
    naming use_reentrant. With use_reentrant=False the gradient comes whole,
    and the steps are bitwise those of overlap=False."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    model = _SharedInTwoSegments(reentrant=True)
    opt = RemoteAdamW(model.parameters(), servers=servers, job=f"{job}-r", lr=1e-2, overlap=True)
    with pytest.raises(shardopt.FailedPrecondition, match="use_reentrant=False"):
        model(x.requires_grad_()).backward()
    opt.zero_grad()
    opt.drop()
    finals = []
    for overlap in (True, False):
        model = _SharedInTwoSegments(reentrant=False)
        opt = RemoteAdamW(model.parameters(), servers=servers, job=f"{job}-{overlap}", lr=1e-2, overlap=overlap)
        for _ in range(3):
            model(x).backward()
            opt.step()
            opt.zero_grad()
        finals.append([p.detach().clone() for p in model.parameters()])
        opt.drop()
    assert all(same_bits(p, q) for p, q in zip(*finals))
    assert not same_bits(finals[0][0], _SharedInTwoSegments(reentrant=False).shared.weight)


def test_checkpoint_every_checkpoints_with_overlap(server_binary, job, tmp_path):
    """checkpoint_every=2 with overlap=True: steps 2 and 4 are checkpointed
    (the overlap path commits without Client::Step, which checkpointed for
    overlap=False only)."""
    with checkpointing_servers(server_binary, tmp_path) as (procs, directory):
        model = make_model()
        opt = RemoteAdamW(param_groups(model), servers=[p.address for p in procs], job=job, lr=1e-3, overlap=True,
                          checkpoint_every=2)
        train(model, opt, 5)
        (job_dir,) = (d for d in directory.iterdir() if d.is_dir())  # beside it: the directory's id file
        complete = sorted(int(d.name[len("step-"):]) for d in job_dir.iterdir() if (d / "COMMIT").exists())
        assert complete == [2, 4]


def test_a_param_frozen_after_construction_is_left_alone_with_overlap(servers, job):
    """A param of the job frozen after construction (fine-tuning with a
    frozen embedding), the optimizer built under torch.no_grad(): it gets no
    gradient and is pushed as having none, overlap=True steps bitwise as
    overlap=False does, and the frozen param does not move. (One frozen
    before construction is not in the job: test_torch_parity.py.)"""
    models = [make_model(), make_model()]
    with torch.no_grad():
        overlapped = RemoteAdamW(param_groups(models[0]), servers=servers, job=f"{job}-overlap", lr=1e-3,
                                 overlap=True)
    plain = RemoteAdamW(param_groups(models[1]), servers=servers, job=f"{job}-plain", lr=1e-3)
    frozen = []
    for m in models:
        p = next(iter(m.parameters()))
        p.requires_grad_(False)
        frozen.append((p, p.detach().clone()))
    train(models[0], overlapped, 3)
    train(models[1], plain, 3)
    for p, before in frozen:
        assert same_bits(p, before)
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert same_bits(p, q), name


def test_a_gradient_step_cannot_take_leaves_the_optimizer_usable(servers, job):
    """A gradient that step() must refuse (a sparse one, set by hand on a
    param backward does not reach) while overlap's push runs: step() raises
    it, the push is committed as a skip, and training goes on."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3, overlap=True)
    frozen = next(iter(model.parameters()))
    frozen.requires_grad_(False)  # after construction: the job holds it (test_torch_parity.py has one frozen before)
    tokens, targets = batch(1)
    model(tokens, targets).backward()
    frozen.grad = torch.zeros_like(frozen).to_sparse()
    with pytest.raises(shardopt.InvalidArgument, match="sparse"):
        opt.step()
    assert opt.job_step == 1  # the step was taken, as a skip
    frozen.grad = None
    train(model, opt, 2, first=2)
    assert opt.job_step == 3
    opt.drop()


@pytest.mark.parametrize("change", ["clipped", "memory swapped through p.grad.data", "set to None"])
def test_gradients_changed_after_backward_are_refused_and_the_step_skipped(servers, job, change):
    """overlap=True pushes each gradient as backward produces it, so one
    clipped afterwards (clip_grad_norm_, GradScaler.unscale_) is not what the
    servers would apply: step() raises, the pushed step is committed as a
    skip (the params stay), and training goes on. So is one given other
    memory through p.grad.data = t, with no new tensor and no new version
    (the push, still reading the memory let go, used to have the servers
    apply what lay there: an outside probe saw -2.3e18 applied where
    backward gave 3 and the loop -5), and one set to None, which cannot
    leave the param alone as torch's step would: its gradient is on the
    servers."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3, overlap=True)
    tokens, targets = batch(1)
    model(tokens, targets).backward()
    name, p = next(iter(model.named_parameters()))
    before = [q.detach().clone() for q in model.parameters()]
    if change == "clipped":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    elif change == "set to None":
        p.grad = None
    else:
        p.grad.data = torch.full_like(p.grad, -5.0)
    with pytest.raises(shardopt.InvalidArgument, match="changed after backward") as refused:
        opt.step()
    if change == "clipped":
        # Clipping changed every gradient: the message names three and says
        # how many in all (it used to name three as if they were all).
        assert f", ... ({len(before)} in all) changed" in str(refused.value)
    else:
        assert f"the gradients of '{name}' changed" in str(refused.value)
    assert opt.job_step == 1
    assert all(same_bits(q, b) for q, b in zip(model.parameters(), before))
    train(model, opt, 2, first=2)
    assert opt.job_step == 3
    opt.drop()


def test_a_second_live_overlap_optimizer_of_the_same_params_is_refused_before_anything_is_sent(servers, job):
    """Two RemoteAdamW(overlap=True) on the same params would both push every
    gradient from the same backward: the second is refused at construction
    with InvalidArgument, before it connects (its server here does not
    exist: the refusal is not Unavailable); once the first is let go, the
    params are taken, also while a construction that failed is still alive
    in its traceback. overlap=False takes no hooks and is not refused."""
    model = make_model()
    first = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3, overlap=True)
    with pytest.raises(shardopt.InvalidArgument, match=f"pushed already by another .*job '{job}'"):
        RemoteAdamW(param_groups(model), servers=["127.0.0.1:1"], job=f"{job}-second", lr=1e-3, overlap=True)
    plain = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-plain", lr=1e-3)
    first.drop()
    del first
    try:  # a construction that fails, kept alive by its traceback, claims nothing
        RemoteAdamW(param_groups(model), servers=["127.0.0.1:1"], job=f"{job}-second", lr=1e-3, overlap=True,
                    rpc_timeout=0.5, max_attempts=1)
    except shardopt.Unavailable:
        second = RemoteAdamW(param_groups(model), servers=servers, job=f"{job}-second", lr=1e-3, overlap=True)
    train(model, second, 1)
    second.drop()
    plain.drop()


def test_two_live_overlap_optimizers_may_share_a_param_frozen_at_construction(servers, job):
    """A param neither job holds (frozen when each was made: a shared base
    model under two adapters) gets no hook from either, so the second is
    not refused for it, and each steps its own params."""
    model = make_model()
    params = list(model.named_parameters())
    params[0][1].requires_grad_(False)
    half = 1 + (len(params) - 1) // 2
    first = RemoteAdamW([params[0]] + params[1:half], servers=servers, job=f"{job}-first", lr=1e-3, overlap=True)
    second = RemoteAdamW([params[0]] + params[half:], servers=servers, job=f"{job}-second", lr=1e-3, overlap=True)
    before = {name: p.detach().clone() for name, p in params}
    tokens, targets = batch(1)
    model(tokens, targets).backward()
    first.step()
    second.step()
    assert first.job_step == second.job_step == 1
    assert same_bits(params[0][1], before[params[0][0]])
    for own in (params[1:half], params[half:]):  # each optimizer moved its own
        assert any(not same_bits(p, before[name]) for name, p in own)
    for o in (first, second):
        o.drop()


def test_a_push_abandoned_after_a_server_restarted_is_skipped_on_every_server(server_binary, job, tmp_path):
    """As below, with server 1 restarted after the push (it restored the
    step before, without the push): the skip is pushed there again, with no
    gradient, and committed, so that a trainer attaching later finds the
    servers at one step, not "servers disagree"."""
    with checkpointing_servers(server_binary, tmp_path, count=2) as (procs, _):
        model = make_model()
        addresses = [p.address for p in procs]
        opt = RemoteAdamW(param_groups(model), servers=addresses, job=job, lr=1e-3, overlap=True)
        train(model, opt, 2)
        opt.checkpoint()  # both servers' parts of step 2, for server 1 to restore
        tokens, targets = batch(3)
        model(tokens, targets).backward()
        time.sleep(1.0)  # the push of a model this small is long complete
        assert procs[1].stop(signal.SIGTERM) == 0
        procs[1].start()
        del opt
        gc.collect()
        again = RemoteAdamW(param_groups(make_model()), servers=addresses, job=job, lr=1e-3)
        assert again.resumed_step == 3  # the skip, on both
        again.drop()


def test_a_push_abandoned_with_its_optimizer_is_committed_as_a_skip(servers, job):
    """An optimizer dropped after backward (backward or the loop raised, and
    the trainer went away) ends its push and commits that step as a skip.
    Left sealed, the step's partial push would answer the push of a trainer
    that attaches to the job later, and its commit would apply the old
    partial gradient instead of the new one: the new trainer's step is
    bitwise that of a job that never saw the abandoned push."""
    abandoned = make_model()
    opt = RemoteAdamW(param_groups(abandoned), servers=servers, job=job, lr=1e-3, overlap=True)
    tokens, targets = batch(7)
    abandoned(tokens, targets).backward()
    assert opt._client.pushing()
    del opt
    gc.collect()

    fresh, reference = make_model(), make_model()
    again = RemoteAdamW(param_groups(fresh), servers=servers, job=job, lr=1e-3)
    assert again.resumed_step == 1  # the skip
    ref = RemoteAdamW(param_groups(reference), servers=servers, job=f"{job}-ref", lr=1e-3)
    train(fresh, again, 1, first=2)
    train(reference, ref, 1, first=2)
    for (name, p), q in zip(fresh.named_parameters(), reference.parameters()):
        assert same_bits(p, q), name
    again.drop()
    ref.drop()


def test_a_rank_whose_optimizer_is_dropped_after_backward_leaves_the_step_to_the_others(servers, job):
    """With several ranks, an optimizer dropped after backward (the loop
    raised) commits nothing: the other ranks apply the step. It used to
    commit a skip, which the servers kept, and every commit of the other
    ranks was then refused ("ranks disagree") for good. Both ranks live in
    this process: with overlap, backward only starts a push, so neither
    waits for the other here."""
    models = [make_model(), make_model()]
    opts = [RemoteAdamW(param_groups(m), servers=servers, job=job, lr=1e-3, overlap=True, rank=r, world_size=2)
            for r, m in enumerate(models)]
    for m in models:
        m(*batch(1)).backward()
    assert all(o._client.pushing() for o in opts)
    dropped = weakref.ref(opts.pop())  # rank 1's loop raised: its optimizer goes, its push ends
    gc.collect()
    assert dropped() is None
    opts[0].step()  # refused with Aborted before
    assert not opts[0].last_decision.skip

    models[1] = make_model(seed=5)  # relaunched: it takes the job's values
    opts.append(RemoteAdamW(param_groups(models[1]), servers=servers, job=job, lr=1e-3, overlap=True, rank=1,
                            world_size=2))
    assert opts[1].resumed_step == 1
    _step_alike(models, opts, 2)
    opts[0].drop()


def test_hooks_on_two_autograd_threads_start_one_push(servers, job):
    """Backward runs a model's hooks on one autograd thread per device (a
    model over two GPUs): hooks that come at once from two threads start one
    push between them, and the step goes through. (Here two Python threads
    call the hook's entry at once, with gradients set by hand.)"""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3, overlap=True)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    indices = [_index(opt, params[0]), _index(opt, params[1])]
    gate, errors = threading.Barrier(2), []

    def hook(k):
        gate.wait()
        try:
            opt._on_grad_ready(k)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    for _ in range(5):
        threads = [threading.Thread(target=hook, args=(k,)) for k in indices]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        opt.step()
    assert opt.job_step == 5
    opt.drop()


@pytest.mark.parametrize("let_go", [False, True], ids=["unchanged", "a_gradient_let_go"])
def test_a_server_restarted_between_backward_and_step_costs_no_failed_call(servers, server_binary, job, tmp_path,
                                                                          let_go):
    """overlap=True: backward's push is complete, then the server is stopped
    (SIGTERM: its drain checkpoints the step before) and started again.
    step() gives it the job again, which restores that step with no push;
    the gradients are still in p.grad, so step() pushes them again and
    commits, on its first call, bitwise as an uninterrupted run. Not if a
    gradient was let go after backward: p.grad is then not what the other
    servers' rounds hold, and step() raises and commits the step as a skip
    (nothing moves)."""
    reference = make_model()
    plain = RemoteAdamW(param_groups(reference), servers=servers, job=f"{job}-ref", lr=1e-3)
    train(reference, plain, 4)
    plain.drop()
    with checkpointing_servers(server_binary, tmp_path, count=1) as (procs, _):
        model = make_model()
        opt = RemoteAdamW(param_groups(model), servers=[procs[0].address], job=job, lr=1e-3, overlap=True)
        train(model, opt, 3)
        after_three = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        tokens, targets = batch(4)
        model(tokens, targets).backward()
        time.sleep(1.0)  # the push of a model this small is long complete
        assert procs[0].stop(signal.SIGTERM) == 0
        procs[0].start()
        if let_go:
            next(iter(model.parameters())).grad = None
            with pytest.raises(shardopt.InvalidArgument, match="changed after backward"):
                opt.step()
            assert opt.job_step == 4  # as a skip, pushed again to the restarted server with no gradient
            for p, q in zip(model.parameters(), after_three):
                assert same_bits(p, q)
            return
        opt.step()
        assert opt.job_step == 4
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert same_bits(p, q), name


def test_a_skip_after_a_server_restarted_is_committed_on_its_first_call(server_binary, job, tmp_path):
    """overlap=True: backward's push is complete, the server restarts (its
    drain checkpoints the step before), and the loop skips the step
    (zero_grad): the skip is pushed again, with no gradient, and committed.
    Nothing moves, and the next step goes on."""
    with checkpointing_servers(server_binary, tmp_path, count=1) as (procs, _):
        model = make_model()
        opt = RemoteAdamW(param_groups(model), servers=[procs[0].address], job=job, lr=1e-3, overlap=True)
        train(model, opt, 2)
        before = [p.detach().clone() for p in model.parameters()]
        tokens, targets = batch(3)
        model(tokens, targets).backward()
        time.sleep(1.0)  # the push of a model this small is long complete
        assert procs[0].stop(signal.SIGTERM) == 0
        procs[0].start()
        opt.zero_grad()
        assert [s.step for s in opt.describe()] == [3]
        assert all(same_bits(p, q) for p, q in zip(model.parameters(), before))
        train(model, opt, 1, first=4)
        assert opt.job_step == 4
        opt.drop()


def test_a_skip_that_reached_some_servers_only_is_owed_by_the_next_step(server_binary, job, tmp_path):
    """overlap=True: zero_grad()'s skip reaches server 0 and not server 1,
    which is down (it raises Unavailable). Server 1 comes back (restoring
    the step before, without the push). The next backward and step()
    commit that step as a skip on both, as server 0 holds it, and step()
    says so: the servers agree, nothing moved, and the loop goes on."""
    with checkpointing_servers(server_binary, tmp_path, count=2) as (procs, _):
        model = make_model()
        opt = RemoteAdamW(param_groups(model), servers=[p.address for p in procs], job=job, lr=1e-3, overlap=True,
                          max_attempts=2)  # a server down is Unavailable after one retry
        train(model, opt, 2)
        opt.checkpoint()  # both servers' parts of step 2, for server 1 to restore
        before = [p.detach().clone() for p in model.parameters()]
        tokens, targets = batch(3)
        model(tokens, targets).backward()
        time.sleep(1.0)  # the push of a model this small is long complete
        assert procs[1].stop(signal.SIGTERM) == 0
        with pytest.raises(shardopt.Unavailable):
            opt.zero_grad()
        procs[1].start()
        model(tokens, targets).backward()
        with pytest.raises(shardopt.FailedPrecondition, match="step 3 was applied as a skip"):
            opt.step()
        assert [s.step for s in opt.describe()] == [3, 3]
        assert all(same_bits(p, q) for p, q in zip(model.parameters(), before))
        train(model, opt, 1, first=4)
        assert opt.job_step == 4
        opt.drop()


@pytest.mark.parametrize("before", ["nothing", "a_step"])
def test_a_step_with_no_backward_is_a_step_of_the_job(servers, job, before):
    """A step() no backward preceded (every param frozen for now, a rank
    with nothing to do) is a step in which no param has a gradient, as with
    overlap=False: the job moves on, and no param or state does."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3, overlap=True)
    if before == "a_step":
        train(model, opt, 1)
        opt.zero_grad()
    start = opt._client.step_count
    params = [p.detach().clone() for p in model.parameters()]
    steps = opt._client.adam_steps()
    opt.step()
    assert opt._client.step_count == start + 1
    assert opt._client.adam_steps() == steps
    assert all(same_bits(p, q) for p, q in zip(model.parameters(), params))
    opt.drop()


def test_a_rank_whose_skip_lost_to_the_others_apply_takes_the_step_and_goes_on(servers, job):
    """A rank that caught an exception after backward and called
    zero_grad() commits the pushed step as a skip; where the other ranks'
    commits applied it first, that skip is refused (Aborted). The rank used
    to owe the skip for good: every later step() committed it again and was
    refused, and the other ranks waited out the barrier of the next step.
    Now it takes the applied step's params from the servers, raises once
    saying so, and steps on with the others."""
    models = [make_model(), make_model(seed=5)]
    opts = [RemoteAdamW(param_groups(m), servers=servers, job=job, lr=1e-3, overlap=True, rank=r, world_size=2)
            for r, m in enumerate(models)]
    for m in models:
        m(*batch(1)).backward()
    opts[0].step()  # applies step 1 with both pushes
    with pytest.raises(shardopt.Aborted, match="took step 1 as the servers applied it"):
        opts[1].zero_grad()  # rank 1's loop raised after backward: it skips
    assert opts[1]._client.step_count == 1
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert same_bits(p, q), name
    for step in (2, 3):
        _step_alike(models, opts, step)
        assert [o._client.step_count for o in opts] == [step, step]
    opts[0].drop()


def test_a_rank_whose_apply_lost_to_the_others_skip_takes_the_step_and_goes_on(servers, job):
    """The other way round: the other rank's loop raised after backward and
    its zero_grad() skipped the step before this rank's step() applied it.
    The apply is refused (Aborted, "skipped -> applied"), and the rank used
    to owe it for good: every later step() was refused about that step
    while the other rank waited out the next barrier, until the process was
    started again (an outside probe). Now it takes the step as the servers
    skipped it, raises once saying so, and steps on with the others."""
    models = [make_model(), make_model(seed=5)]
    opts = [RemoteAdamW(param_groups(m), servers=servers, job=job, lr=1e-3, overlap=True, rank=r, world_size=2)
            for r, m in enumerate(models)]
    initial = [p.detach().clone() for p in models[0].parameters()]
    for m in models:
        m(*batch(1)).backward()
    opts[1].zero_grad()  # rank 1's loop raised after backward: it skips step 1
    with pytest.raises(shardopt.Aborted, match="took step 1 as the servers did"):
        opts[0].step()
    assert [o._client.step_count for o in opts] == [1, 1]
    for (name, p), q, r in zip(models[0].named_parameters(), models[1].parameters(), initial):
        assert same_bits(p, q) and same_bits(p, r), name
    for step in (2, 3):
        _step_alike(models, opts, step)
        assert [o._client.step_count for o in opts] == [step, step]
    opts[0].drop()


def test_a_rank_whose_own_error_ends_in_a_lost_skip_keeps_its_error_and_goes_on(servers, job):
    """The same where the skip comes from step() refusing this rank's own
    gradients (clipped after backward): that error is what the caller gets,
    not the skip's Aborted, and the rank has taken the applied step."""
    models = [make_model(), make_model(seed=5)]
    opts = [RemoteAdamW(param_groups(m), servers=servers, job=job, lr=1e-3, overlap=True, rank=r, world_size=2)
            for r, m in enumerate(models)]
    for m in models:
        m(*batch(1)).backward()
    opts[0].step()
    torch.nn.utils.clip_grad_norm_(models[1].parameters(), 1e-3)
    with pytest.raises(shardopt.InvalidArgument, match="changed after backward"):
        opts[1].step()
    assert opts[1]._client.step_count == 1
    _step_alike(models, opts, 2)
    opts[0].drop()
