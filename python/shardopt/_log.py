"""What RemoteAdamW says on the "shardopt" logger (Python's logging: with no
handler configured, warnings reach stderr)."""
import logging

_logger = logging.getLogger("shardopt")


def _group_lrs(opt):
    return [float(g["lr"]) for g in opt.param_groups]


def _resume_lrs(opt):
    """At a resume (the job at step N > 0): the groups' lrs as constructed,
    and those step N was applied with, where the two differ; else None."""
    applied = list(opt._client.applied_group_lr)
    constructed = _group_lrs(opt)
    return (constructed, applied) if opt.resumed_step and applied and applied != constructed else None


def _log_step(opt, decision):
    """What a step() says once done.

    Each step its gradients' values skipped: torch.optim.AdamW would have
    applied them and made the params nonfinite, which a loss shows, where
    here the params stay as they were, so a loop whose every gradient is NaN
    would train on without moving (said at each, as DeepSpeed says an
    overflow).

    And the first step after a resume that is not skipped, if it ran at the
    lrs the optimizer was constructed with while the job's last step ran at
    others: the state came from the servers, but the lrs live in the
    trainer, and a scheduler's load_state_dict sets none, so a resumed
    schedule would silently restart. A schedule that is back at its first
    lrs then (a warmup's end, a warm restart's) is said too: nothing tells
    the two apart. A last step applied as a skip kept no lrs to compare."""
    step = opt._client.step_count
    if decision.skip:
        _logger.warning("step %d skipped: the gradients are not finite (grad_norm %s); params and Adam state stay "
                        "as they were (opt.last_decision)", step, decision.grad_norm)
        return  # its lrs moved nothing: the next step is the one to look at
    resume, opt._lrs_to_check = opt._lrs_to_check, None
    if resume is not None and _group_lrs(opt) == resume[0]:
        _logger.warning("step %d ran at the lrs RemoteAdamW was constructed with, %s, where step %d, which it "
                        "resumed from, ran at %s. If a scheduler drives them, a resume must set them from it (a "
                        "scheduler's load_state_dict sets no group's lr): for g, lr in zip(opt.param_groups, "
                        "sched.get_last_lr()): g['lr'] = lr. Ignore this if these are the lrs meant (the schedule "
                        "is back at its starting lr, or new lrs are wanted)", step, resume[0], opt.resumed_step,
                        resume[1])
