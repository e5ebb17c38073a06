"""A step() that failed, and what its retry was given.

After a failed step() the loop must call step() again with the same
gradients: servers that sealed the failed attempt's push keep its gradients
and answer a push of the step again from them (the step protocol's retry),
so a loop that went on to the next batch instead trains on silently, on
every rank but this one's view. An outside probe's rank 0 did so after a
refused commit: its step() returned OK, its new gradients were ignored, and
the other rank's next step timed out 26 s later. Said here, on the
"shardopt" logger, where it happens."""
import zlib

import torch

from ._errors import Error, InvalidArgument
from ._log import _logger


def _digest(sources):
    """A CRC-32 of every gradient's bytes, in tensor order (None: none), or
    None if it cannot be taken: a diagnostic never stands in the way of the
    step or of its own error."""
    try:
        crc = 0
        for _, tensor in sources:
            crc = zlib.crc32(b"\0" if tensor is None else b"\1", crc)
            if tensor is not None:
                host = tensor.detach().to("cpu").contiguous().reshape(-1)  # a 0-dim one has no bytes view
                crc = zlib.crc32(host.view(torch.uint8).numpy(), crc)
        return crc
    except Exception:
        return None


def step(opt, sources, run):
    """run([(name, address)]), the client's whole step of the gradients in
    `sources` ([(address, tensor)] in opt._remote's order): warns first when
    this is the retry of a step whose attempt failed with other gradients,
    and notes an attempt that fails."""
    t = opt._client.step_count + 1
    failed = getattr(opt, "_failed_attempt", None)
    now = _digest(sources) if failed is not None and failed[0] == t and failed[1] is not None else None
    if now is not None and now != failed[1]:
        _logger.warning("step %d is retried with other gradients than its attempt that failed: servers that took "
                        "that attempt's push keep its gradients, and ignore these. After a failed step(), call it "
                        "again with the same gradients, not the next batch's", t)
    grads = [(r.name, address) for r, (address, _) in zip(opt._remote, sources)]
    try:
        result = run(grads)
    except InvalidArgument:
        raise  # refused for its own arguments, before its push: nothing was sent
    except Error:
        opt._failed_attempt = (t, _digest(sources))
        raise
    opt._failed_attempt = None
    return result
