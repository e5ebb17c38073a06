"""RemoteAdamW against torch.optim.AdamW(foreach=False): an fp32 transformer
with RMSNorm, the seed's bf16 figure, lr schedulers, and moving a running
torch job onto shardopt."""
import logging
import math

import numpy as np
import pytest
import torch

import shardopt
from shardopt.torch import RemoteAdamW
from models import (BOUND_SQRT_STEPS, Peaks, batch, make_model, norm_gains, param_groups, same_bits, train,
                    ulps_of_peak, unnamed)

torch.set_num_threads(1)

STEPS = 200
LR = 1e-3
# Losses of the two runs: the params differ by a few ulps (see
# BOUND_SQRT_STEPS), so the losses may differ by what that moves, far below
# this.
LOSS_BOUND = 1e-4


def check_within_bound(ours, theirs, peaks, steps):
    ulps = ulps_of_peak(ours, theirs, peaks)
    worst = max(ulps, key=ulps.get)
    print(f"params after {steps} steps: max {ulps[worst]:.1f} ulps of the peak ({worst}); "
          f"bound {BOUND_SQRT_STEPS * math.sqrt(steps):.0f}")
    assert ulps[worst] <= BOUND_SQRT_STEPS * math.sqrt(steps)
    return ulps


@pytest.fixture(scope="module")
def fp32_runs(servers, request):
    """The same fp32 model trained STEPS steps by RemoteAdamW and by torch."""
    ours, theirs = make_model(), make_model()
    opt = RemoteAdamW(param_groups(ours), servers=servers, job=f"parity-{id(request)}", lr=LR)
    ref = torch.optim.AdamW(unnamed(param_groups(theirs)), lr=LR, foreach=False)
    peaks = Peaks(theirs)
    ours_losses = train(ours, opt, STEPS)
    theirs_losses = train(theirs, ref, STEPS, peaks=peaks)
    yield ours, theirs, opt, ours_losses, theirs_losses, peaks
    opt.drop()


def test_fp32_transformer_matches_torch(fp32_runs):
    ours, theirs, _, ours_losses, theirs_losses, peaks = fp32_runs
    loss_diff = np.abs(np.array(ours_losses) - np.array(theirs_losses))
    print(f"losses: first {ours_losses[0]:.4f}, last {ours_losses[-1]:.6f} (torch {theirs_losses[-1]:.6f}), "
          f"max |diff| {loss_diff.max():.3e}")
    assert ours_losses[-1] < 0.5 * ours_losses[0], "the model did not learn"
    assert loss_diff.max() <= LOSS_BOUND
    check_within_bound(ours, theirs, peaks, STEPS)


def test_fp32_params_are_the_master_bitwise(fp32_runs):
    ours, _, opt, _, _, _ = fp32_runs
    for name, p in ours.named_parameters():
        master = opt.master(p)
        assert p.dtype == torch.float32 and same_bits(p, master), name
    names, params = zip(*ours.named_parameters())
    masters = opt.masters(params)  # in one call
    assert len(masters) == len(params)
    for name, p, master in zip(names, params, masters):
        assert same_bits(p, master), name


@pytest.mark.parametrize("betas", [(0.0, 0.99), (0.0, 0.0), (0.3, 0.99), (0.5, 0.999)])
def test_small_beta1_matches_torch(servers, job, betas):
    """beta1 under 0.5 (lerp weights over 0.5): m follows torch's lerp from
    the gradient. Taken from m, it cancelled: with beta1 = 0 a gradient of
    1e-6 after one of 100 left m at 0, and the params went 537,109 ulps from
    torch's over 100 steps of gradients 1e-2 to 1e2 (a black-box probe)."""
    steps = 100
    gen = torch.Generator().manual_seed(7)
    ours = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.rand(20000, generator=gen) * 2 - 1)})
    theirs = torch.nn.ParameterDict({"w": torch.nn.Parameter(ours["w"].detach().clone())})
    opt = RemoteAdamW([("w", ours["w"])], servers=servers, job=job, lr=1e-3, betas=betas)
    ref = torch.optim.AdamW([theirs["w"]], lr=1e-3, betas=betas, foreach=False)
    peaks = Peaks(theirs)
    for _ in range(steps):
        scale = 10.0 ** (torch.rand(1, generator=gen).item() * 4 - 2)
        g = (torch.randn(20000, generator=gen) * scale).to(torch.bfloat16).float()
        for p, o in ((ours["w"], opt), (theirs["w"], ref)):
            p.grad = g.clone()
            o.step()
        peaks.update(theirs)
    check_within_bound(ours, theirs, peaks, steps)
    opt.drop()


def test_seed_figure_bf16_model(servers, job):
    """On a bf16 model, fp32 state moves the RMSNorm gains; torch.optim.AdamW
    on the bf16 params leaves every one at 1.0, because each of its updates is
    below half of bf16's spacing just below 1.0 (2^-9)."""
    b1, b2 = 0.9, 0.999
    # A bound on Adam's |m_hat/sqrt(v_hat)| for any gradients (Cauchy-Schwarz,
    # as tests/torch/test_torch_reference.py derives it).
    t = np.arange(1, STEPS + 1, dtype=np.float64)
    ratio_bound = ((1 - b1) / np.sqrt(1 - b2) * np.sqrt(1 / (1 - b1 * b1 / b2))
                   * np.max(np.sqrt(1 - b2 ** t) / (1 - b1 ** t)))
    norm_lr = 2e-4
    assert norm_lr * ratio_bound < 2.0 ** -9
    ours, theirs = make_model(dtype=torch.bfloat16), make_model(dtype=torch.bfloat16)
    opt = RemoteAdamW(param_groups(ours, norm_lr=norm_lr), servers=servers, job=job, lr=LR, betas=(b1, b2))
    ref = torch.optim.AdamW(unnamed(param_groups(theirs, norm_lr=norm_lr)), lr=LR, betas=(b1, b2), foreach=False)
    ours_losses, theirs_losses = train(ours, opt, STEPS), train(theirs, ref, STEPS)
    moved_ours = int((norm_gains(ours) != 1.0).sum())
    moved_theirs = int((norm_gains(theirs) != 1.0).sum())
    total = norm_gains(ours).numel()
    print(f"seed's figure, bf16 model, {STEPS} steps: RemoteAdamW (fp32 state) moved {moved_ours} of {total} "
          f"RMSNorm gains, final loss {ours_losses[-1]:.4f}; torch.optim.AdamW on bf16 params moved {moved_theirs}, "
          f"final loss {theirs_losses[-1]:.4f}")
    assert moved_theirs == 0
    assert moved_ours >= total // 2
    opt.drop()


@pytest.mark.parametrize("schedule", ["lambda_per_group", "cosine"])
def test_lr_schedulers(servers, job, schedule):
    steps = 60
    ours, theirs = make_model(), make_model()
    opt = RemoteAdamW(param_groups(ours), servers=servers, job=job, lr=LR)
    ref = torch.optim.AdamW(unnamed(param_groups(theirs)), lr=LR, foreach=False)

    def scheduler(o):
        if schedule == "cosine":
            return torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=steps)
        return torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 0.97 ** s, lambda s: min(1.0, (s + 1) / 10)])

    peaks = Peaks(theirs)
    ours_sched, theirs_sched = scheduler(opt), scheduler(ref)
    train(ours, opt, steps, scheduler=ours_sched)
    train(theirs, ref, steps, scheduler=theirs_sched, peaks=peaks)
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs == [g["lr"] for g in ref.param_groups]
    if schedule == "lambda_per_group":
        assert lrs[0] != lrs[1]
    check_within_bound(ours, theirs, peaks, steps)
    opt.drop()


def test_lr_reaches_servers(servers, job):
    """Each group's lr from param_groups is applied: group 1 at lr 0 stays
    where it was while group 0 moves."""
    model = make_model()
    groups = param_groups(model)
    initial = [[p.detach().clone() for _, p in g["params"]] for g in groups]
    opt = RemoteAdamW(groups, servers=servers, job=job, lr=LR)
    opt.param_groups[1]["lr"] = 0.0
    train(model, opt, 3)
    assert all(same_bits(p, q) for (_, p), q in zip(groups[1]["params"], initial[1]))
    assert not any(same_bits(p, q) for (_, p), q in zip(groups[0]["params"], initial[0]))
    opt.drop()


def test_load_torch_adamw_state_dict(servers, job):
    """A running torch job moves onto shardopt: 40 steps of torch, then 40
    more of RemoteAdamW from torch's model and optimizer state dicts, against
    80 steps of torch."""
    before, after = 40, 40
    theirs = make_model()
    ref = torch.optim.AdamW(unnamed(param_groups(theirs)), lr=LR, foreach=False)
    peaks = Peaks(theirs)
    train(theirs, ref, before, peaks=peaks)
    model_sd = {k: v.clone() for k, v in theirs.state_dict().items()}
    opt_sd = ref.state_dict()
    opt_sd = {"state": {k: {n: v.clone() for n, v in s.items()} for k, s in opt_sd["state"].items()},
              "param_groups": opt_sd["param_groups"]}

    ours = make_model(seed=123)  # other initial values: all must come from the state dicts
    ours.load_state_dict(model_sd)
    opt = RemoteAdamW(param_groups(ours), servers=servers, job=job, lr=0.5)
    opt.load_state_dict(opt_sd)
    assert [g["lr"] for g in opt.param_groups] == [LR, LR]
    loaded = opt.state_dict()
    for k, s in opt_sd["state"].items():
        assert int(loaded["state"][k]["step"]) == int(s["step"]) == before
        assert same_bits(loaded["state"][k]["exp_avg"], s["exp_avg"])
        assert same_bits(loaded["state"][k]["exp_avg_sq"], s["exp_avg_sq"])
    train(ours, opt, after, first=before + 1)
    train(theirs, ref, after, first=before + 1, peaks=peaks)
    check_within_bound(ours, theirs, peaks, before + after)
    opt.drop()


def test_contiguous_cpu_tensors_are_not_copied_and_others_are_staged(servers, job):
    """Contiguous CPU params and grads are read and written in place; a
    non-contiguous param goes through a staging buffer and gets the same
    bits."""
    g = torch.Generator().manual_seed(5)
    values = torch.randn(16, 8, generator=g)
    contiguous = torch.nn.Parameter(values.clone())
    transposed = torch.nn.Parameter(values.t().contiguous().t())  # same values, column-major
    assert not transposed.is_contiguous()
    opt = RemoteAdamW([("contiguous", contiguous), ("transposed", transposed)], servers=servers, job=job, lr=1e-2)
    address = contiguous.data_ptr()
    for step in range(3):
        grad = torch.randn(16, 8, generator=g)
        contiguous.grad = grad.clone()
        transposed.grad = grad.t().contiguous().t()
        opt.step()
    assert contiguous.data_ptr() == address
    by_name = {t.name: t for t in opt._tensors}
    assert by_name["contiguous"].host_param is None and by_name["contiguous"].host_grad is None
    assert by_name["transposed"].host_param is not None and not transposed.is_contiguous()
    assert same_bits(contiguous, transposed.contiguous())
    assert not same_bits(contiguous, values)
    opt.drop()


@pytest.mark.parametrize("overlap", [False, True])
def test_autograd_sees_that_step_changed_the_params(servers, job, overlap):
    """step() changes the params in place, as torch.optim.AdamW's does, and
    autograd is told so: a backward through a graph that saved a param's old
    values raises, in place (contiguous) or staged, where it used to use
    the new values in the old graph without a word."""
    g = torch.Generator().manual_seed(11)
    contiguous = torch.nn.Parameter(torch.randn(6, 4, generator=g))
    transposed = torch.nn.Parameter(torch.randn(4, 6, generator=g).t())
    x = torch.randn(6, 4, generator=g)
    opt = RemoteAdamW([("contiguous", contiguous), ("transposed", transposed)], servers=servers, job=job, lr=1e-2,
                      overlap=overlap)
    for p in (contiguous, transposed):
        loss = (p * p * x).sum()  # saves p
        loss.backward(retain_graph=True)
        contiguous.grad = contiguous.grad if contiguous.grad is not None else torch.randn(6, 4, generator=g)
        transposed.grad = transposed.grad if transposed.grad is not None else torch.randn(6, 4, generator=g)
        before = p._version
        opt.step()
        assert p._version > before
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    opt.drop()


def test_a_step_bumps_only_the_versions_of_params_it_changed(servers, job, caplog):
    """As torch's: a param with no gradient this step, and every param of a
    skipped step (a nonfinite gradient), keep their version counters, so a
    graph that saved them still backprops."""
    g = torch.Generator().manual_seed(12)
    a = torch.nn.Parameter(torch.randn(8, generator=g))
    b = torch.nn.Parameter(torch.randn(8, generator=g))
    x = torch.randn(8, generator=g)
    opt = RemoteAdamW([("a", a), ("b", b)], servers=servers, job=job, lr=1e-2, max_grad_norm=1.0)
    through_b = (b * b * x).sum()  # saves b
    a.grad = torch.randn(8, generator=g)
    before = (a._version, b._version)
    opt.step()
    assert a._version > before[0] and b._version == before[1]
    through_b.backward(retain_graph=True)  # b was not changed: torch's own step would not raise either
    through_a = (a * a * x).sum()
    a.grad = torch.full((8,), float("nan"))
    versions = (a._version, b._version)
    with caplog.at_level(logging.WARNING, logger="shardopt"):
        opt.step()
    assert opt.last_decision.skip
    # Said, as torch's NaN params would show in the loss and these do not.
    assert [r.getMessage() for r in caplog.records if r.name == "shardopt"] == [
        "step 2 skipped: the gradients are not finite (grad_norm nan); params and Adam state stay as they were "
        "(opt.last_decision)"]
    assert (a._version, b._version) == versions
    through_a.backward()
    opt.drop()


def test_params_as_disjoint_views_of_one_buffer_train_as_separate_ones(servers, job):
    """Params carved out of one flat buffer with gaps, and the column blocks
    of one matrix (interleaved: their spans meet, their memory does not),
    are taken (only params whose memory overlaps are refused) and train
    bitwise as params of their own; the gaps keep their values."""
    g = torch.Generator().manual_seed(7)
    flat, matrix = torch.randn(40, generator=g), torch.randn(6, 8, generator=g)
    views = [flat[0:12].view(3, 4), flat[16:24], flat[30:40], matrix[:, :3], matrix[:, 3:]]
    gaps = torch.cat([flat[12:16], flat[24:30]]).clone()
    ours = [torch.nn.Parameter(v) for v in views]
    own = [torch.nn.Parameter(v.clone()) for v in views]
    before = [v.clone() for v in views]
    opt = RemoteAdamW(ours, servers=servers, job=f"{job}-views", lr=1e-2)
    ref = RemoteAdamW(own, servers=servers, job=f"{job}-own", lr=1e-2)
    for _ in range(3):
        for p, q in zip(ours, own):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    for p, q, v, b in zip(ours, own, views, before):
        assert same_bits(p, q) and same_bits(v, q) and not torch.equal(v, b)
    assert same_bits(torch.cat([flat[12:16], flat[24:30]]), gaps)
    opt.drop()
    ref.drop()


def test_params_without_grad_are_skipped(servers, job):
    """As in torch: a param whose grad is None keeps its value, its step count
    and (no) state; weight decay does not touch it either."""
    model = make_model()
    model.unused = torch.nn.Parameter(torch.full((8,), 2.0))
    opt = RemoteAdamW(model.named_parameters(), servers=servers, job=job, lr=LR, weight_decay=0.1)
    train(model, opt, 3)
    assert model.unused.grad is None and torch.equal(model.unused, torch.full((8,), 2.0))
    index = [name for name, _ in model.named_parameters()].index("unused")
    state = opt.state_dict()["state"]
    assert index not in state and len(state) == len(list(model.parameters())) - 1
    opt.drop()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_param_with_zero_elements_is_kept_and_left_alone(servers, job, overlap):
    """torch.optim.AdamW takes params with no elements (it has nothing to do
    for them); so does RemoteAdamW, which keeps them out of the job: the
    other params step bitwise as without them, the empty ones get no state,
    and a torch.optim.AdamW state dict that has state for them loads."""
    with_empty, without = make_model(), make_model()
    with_empty.empty = torch.nn.Parameter(torch.empty(0, 8))
    opt = RemoteAdamW(with_empty.named_parameters(), servers=servers, job=f"{job}-empty", lr=LR, overlap=overlap)
    plain = RemoteAdamW(without.named_parameters(), servers=servers, job=f"{job}-plain", lr=LR, overlap=overlap)
    for step in range(1, 4):
        tokens, targets = batch(step)
        for model, o in ((with_empty, opt), (without, plain)):
            o.zero_grad()
            loss = model(tokens, targets)
            if model is with_empty:
                loss = loss + model.empty.sum()  # an empty gradient, as torch gives a used empty param
            loss.backward()
            o.step()
    assert with_empty.empty.grad is not None and with_empty.empty.shape == (0, 8)
    theirs = dict(without.named_parameters())
    for name, p in with_empty.named_parameters():
        assert name == "empty" or same_bits(p, theirs[name]), name
    assert opt.master(with_empty.empty).shape == (0, 8)
    index = [name for name, _ in with_empty.named_parameters()].index("empty")
    state = opt.state_dict()["state"]
    assert index not in state and len(state) == len(list(without.parameters()))

    # torch's AdamW keeps a state for the empty param; loading it sends the rest.
    other = make_model()
    other.empty = torch.nn.Parameter(torch.empty(0, 8))
    ref = torch.optim.AdamW(other.parameters(), lr=LR, foreach=False)
    loss = other(*batch(1)) + other.empty.sum()
    loss.backward()
    ref.step()
    assert index in ref.state_dict()["state"]
    fresh = RemoteAdamW(other.named_parameters(), servers=servers, job=f"{job}-load", lr=LR)
    fresh.load_state_dict(ref.state_dict())
    loaded = fresh.state_dict()["state"]
    assert index not in loaded
    for k, entry in ref.state_dict()["state"].items():
        if k != index:
            assert same_bits(loaded[k]["exp_avg"], entry["exp_avg"]), k
    for o in (opt, plain, fresh):
        o.drop()


@pytest.mark.parametrize("overlap", [False, True])
def test_params_frozen_at_construction_are_left_out_of_the_job(servers, job, overlap):
    """A fine-tuning model given whole to the optimizer (model.parameters()),
    with its embedding frozen and a -inf mask and an EMA copy kept as frozen
    params: the servers hold state of the trainable params only, which step
    bitwise as with an optimizer of those alone; the mask is taken, the EMA
    copy may change in place. A frozen param
    unfrozen later has its gradient refused, naming it, and training goes
    on once its grad is None."""
    def build():
        model = make_model()
        next(iter(model.parameters())).requires_grad_(False)
        model.mask = torch.nn.Parameter(torch.full((4, 4), float("-inf")).triu(1), requires_grad=False)
        model.ema = torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(1)),
                                       requires_grad=False)
        return model

    whole, alone = build(), build()
    frozen = [(name, p.detach().clone()) for name, p in whole.named_parameters() if not p.requires_grad]
    opt = RemoteAdamW(whole.named_parameters(), servers=servers, job=f"{job}-whole", lr=LR, overlap=overlap)
    plain = RemoteAdamW([(n, p) for n, p in alone.named_parameters() if p.requires_grad], servers=servers,
                        job=f"{job}-alone", lr=LR, overlap=overlap)
    assert sum(s.state_bytes for s in opt.describe()) == sum(s.state_bytes for s in plain.describe())
    for step in range(1, 4):
        for model, o in ((whole, opt), (alone, plain)):
            train(model, o, 1, first=step)
            with torch.no_grad():
                model.ema.mul_(0.9).add_(0.1)  # as an EMA teacher's update, outside step()
    theirs = dict(alone.named_parameters())
    for name, p in whole.named_parameters():
        assert same_bits(p, theirs[name]), name
    now = dict(whole.named_parameters())
    assert same_bits(now[frozen[0][0]], frozen[0][1]) and same_bits(whole.mask, frozen[1][1])
    with pytest.raises(KeyError, match="requires_grad=False when this optimizer was made"):
        opt.master(whole.ema)
    with pytest.raises(KeyError, match="requires_grad=False when this optimizer was made"):
        opt.masters([now[n] for n, p in whole.named_parameters() if p.requires_grad][:2] + [whole.ema])
    with pytest.raises(KeyError, match="not a param of this optimizer"):
        opt.masters([torch.nn.Parameter(torch.ones(2))])

    embedding = now[frozen[0][0]]
    embedding.requires_grad_(True)
    opt.zero_grad()
    whole(*batch(4)).backward()
    with pytest.raises(shardopt.InvalidArgument, match=f"param '{frozen[0][0]}' has a gradient, but it had "
                                                       "requires_grad=False"):
        opt.step()
    # overlap=True's push ran in backward: it was committed as a skip.
    assert opt.job_step == (4 if overlap else 3)
    assert same_bits(embedding, frozen[0][1])
    embedding.requires_grad_(False)
    embedding.grad = None
    train(whole, opt, 1, first=5)
    assert opt.job_step == (5 if overlap else 4)
    for o in (opt, plain):
        o.drop()


def test_params_loaded_after_the_optimizer_was_built(servers, job):
    """model.load_state_dict after the optimizer was built, a common order
    with torch.optim.AdamW: before step 1 the loaded values become the
    master, so training is bitwise that of an optimizer built after the load;
    a param rewritten with its own values (DDP's broadcast does that) is
    kept; changed after a step, params are refused rather than overwritten
    with the servers' master, and written back as they were, kept."""
    pretrained = make_model(seed=1).state_dict()
    late, early, same = make_model(), make_model(), make_model()
    opt_late = RemoteAdamW(late.named_parameters(), servers=servers, job=f"{job}-late", lr=LR)
    late.load_state_dict(pretrained)
    early.load_state_dict(pretrained)
    opt_early = RemoteAdamW(early.named_parameters(), servers=servers, job=f"{job}-early", lr=LR)
    same.load_state_dict(pretrained)
    opt_same = RemoteAdamW(same.named_parameters(), servers=servers, job=f"{job}-same", lr=LR)
    with torch.no_grad():
        for p in same.parameters():
            p.copy_(p.clone())
    for model, opt in ((late, opt_late), (early, opt_early), (same, opt_same)):
        train(model, opt, 3)
    for (name, p), q, r in zip(late.named_parameters(), early.parameters(), same.parameters()):
        assert same_bits(p, q) and same_bits(r, q), name

    first = next(iter(late.parameters()))
    held = first.detach().clone()
    with torch.no_grad():
        first.add_(1.0)
    with pytest.raises(shardopt.ParamsChanged, match="changed outside step"):
        train(late, opt_late, 1, first=4)
    # Written back as they were (an EMA swapped out and in, say), the values
    # are no change: training goes on, bitwise with the one never changed.
    with torch.no_grad():
        first.copy_(held)
    train(late, opt_late, 1, first=4)
    train(early, opt_early, 1, first=4)
    for (name, p), q in zip(late.named_parameters(), early.parameters()):
        assert same_bits(p, q), name
    for opt in (opt_late, opt_early, opt_same):
        opt.drop()
