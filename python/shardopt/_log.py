"""What RemoteAdamW says on the "shardopt" logger (Python's logging: with no
handler configured, warnings reach stderr)."""
import logging

_logger = logging.getLogger("shardopt")


def _log_skip(decision, step):
    """A step its gradients' values skipped. torch.optim.AdamW would have
    applied them and made the params nonfinite, which a loss shows; here the
    params stay as they were, so a loop whose every gradient is NaN would
    train on without moving. Said at each such step, as DeepSpeed says an
    overflow."""
    if decision is not None and decision.skip:
        _logger.warning("step %d skipped: the gradients are not finite (grad_norm %s); params and Adam state stay "
                        "as they were (opt.last_decision)", step, decision.grad_norm)
