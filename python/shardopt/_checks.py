"""Checks RemoteAdamW makes before anything reaches a server, with torch's
messages where torch makes the same check."""
import numbers

import torch

from . import _C
from ._errors import AlreadyExists, InvalidArgument, UnsupportedDtype


# The bytes of host copies a call of many tensors makes at once: calls of
# many tensors, not one each (a round trip each), but not a large model's
# worth of copies.
_HOST_BATCH_BYTES = 256 << 20


def _in_batches(items, nbytes):
    """`items` in consecutive lists, each closed once its items'
    `nbytes(item)` reach _HOST_BATCH_BYTES."""
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += nbytes(item)
        if size >= _HOST_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _host_fp32(x, what):
    """x as contiguous fp32 host memory: fp32 kept as it is, bf16 widened
    (exactly). Never narrows."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise UnsupportedDtype(f"{what} is {x.dtype}; fp32 or bf16 needed")
    return x.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _some_names(names, shown=3):
    """The first `shown` names, quoted, and how many there are in all where
    there are more: for messages that name what a check found."""
    names = list(names)
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return ", ".join(map(repr, names[:shown])) + more


def _raise_naming_frozen(error, frozen):
    """Raises `error`, an AlreadyExists from attaching, naming the params
    left out of the job for requires_grad=False (`frozen`): a job made with
    them trainable (by another rank, or before 2026-12-05) differs so."""
    if not frozen:
        raise error
    raise AlreadyExists(f"{error.message}; params with requires_grad=False here ({_some_names(frozen)}) are not in "
                        "this job, so a job made with them trainable (by another rank, or before 2026-12-05) "
                        "differs: make the optimizer while they are trainable, then freeze them") from error


def _check_ints(**named):
    """TypeError naming an argument that is not an int (bool is one, and 2.0
    is not): pybind's own TypeError only lists the extension's signatures."""
    for what, number in named.items():
        if isinstance(number, bool) or not isinstance(number, numbers.Integral):
            raise TypeError(f"{what} must be an int, not {type(number).__name__} {number!r}")


def _check_seconds(**named):
    """A duration in seconds: a finite real number of at least a millisecond
    (they go to the extension in whole milliseconds, where 0 would mean the
    servers' default and infinity does not convert)."""
    for what, seconds in named.items():
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
            raise TypeError(f"{what} must be a number of seconds, not {type(seconds).__name__} {seconds!r}")
        if not 0.001 <= seconds < float("inf"):
            raise ValueError(f"{what} must be a finite number of seconds, at least 0.001, not {seconds!r}")


def _check_gradient(name, g, shape):
    """A gradient the push can read: dense, and of its param's shape, which
    `p.grad.data = other` skips torch's own check of (the push would read
    numel elements from `other`'s memory, past its end)."""
    if g.is_sparse:
        raise InvalidArgument(f"param {name!r} has a sparse gradient; RemoteAdamW needs dense ones")
    if g.shape != shape:
        raise InvalidArgument(f"param {name!r} has a gradient of shape {tuple(g.shape)}, not the param's "
                              f"{tuple(shape)}; RemoteAdamW takes gradients of their params' shapes")


def _check_betas(betas, where):
    """torch indexes betas[0] and betas[1], so it takes three, and its step
    fails on them. A 1-D tensor or numpy array of two is a pair, as torch
    takes it."""
    pair = (isinstance(betas, (tuple, list)) or getattr(betas, "ndim", None) == 1) and len(betas) == 2
    if not pair:
        raise ValueError(f"{where}betas must be a pair (beta1, beta2), not {betas!r}")


def _as_float32(x):
    """A number as the float32 the servers hold it (eps, say), as a Python
    float: rounded to nearest, inf past float32's range."""
    return float(torch.tensor(x, dtype=torch.float32))


def _check_hyper(g, where):
    """torch.optim.AdamW's checks of a group's hyperparameters, with its
    messages (NaN fails them too), made before anything reaches a server."""
    _check_betas(g["betas"], where)
    lr, (beta1, beta2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
    # One-element tensors, as torch takes them (betas as a tensor of two).
    for what, x in (("lr", lr), ("betas[0]", beta1), ("betas[1]", beta2)):
        if isinstance(x, torch.Tensor) and x.numel() != 1:
            raise ValueError(f"{where}{what} must be a number or a one-element tensor, not a tensor of "
                             f"{x.numel()} elements")
    lr, beta1, beta2 = (x.item() if isinstance(x, torch.Tensor) else x for x in (lr, beta1, beta2))
    for what, x in (("lr", lr), ("eps", eps), ("weight_decay", wd), ("betas[0]", beta1), ("betas[1]", beta2)):
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise TypeError(f"{where}{what} must be a number, not {type(x).__name__} {x!r}")
    if not 0.0 <= lr < float("inf"):
        raise ValueError(f"{where}Invalid learning rate: {lr}")
    # torch takes eps = 0; the servers do not (a zero gradient's update
    # would be 0/0). They hold eps as a float32, so one that rounds to 0
    # or to inf there is refused here too.
    if not 0.0 < eps:
        raise ValueError(f"{where}Invalid epsilon value: {eps} (must be > 0)")
    if not _as_float32(eps) < float("inf"):
        raise ValueError(f"{where}Invalid epsilon value: {eps} (must be finite as the float32 the servers hold)")
    if not 0.0 < _as_float32(eps):
        raise ValueError(f"{where}Invalid epsilon value: {eps} (rounds to 0 as the float32 the servers hold)")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"{where}Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"{where}Invalid beta parameter at index 1: {beta2}")
    if not 0.0 <= wd < float("inf"):
        raise ValueError(f"{where}Invalid weight_decay value: {wd}")
    # The servers' own check (rpc/learning_rates.h): an lr whose update
    # constants overflow their float32 is refused at the commit, after
    # backward; here, before.
    try:
        _C.check_learning_rate(float(lr), float(beta1), float(wd))
    except InvalidArgument as e:
        raise ValueError(f"{where}Invalid learning rate: {lr} ({e.message})") from None
    if g.get("amsgrad") or g.get("maximize"):
        raise InvalidArgument(f"{where}RemoteAdamW does not implement amsgrad or maximize")
    if g.get("capturable") or g.get("differentiable"):
        raise InvalidArgument(f"{where}RemoteAdamW updates on the servers: capturable and differentiable are not "
                              "supported")


def _check_disjoint(params):
    """Refuses params (name, tensor) whose memory overlaps another's (two
    Parameters made from one tensor, or overlapping views of it): torch
    would apply both updates to that memory, where the servers hold a master
    for each and would leave it with one of them. Views at disjoint places
    of one buffer (params carved out of a flat buffer, the column blocks of
    a fused matrix) are taken."""
    by_device = {}
    for name, p in params:
        if any(n > 1 and stride == 0 for n, stride in zip(p.shape, p.stride())):
            raise ValueError(f"param {name!r} overlaps itself (an expanded tensor, with a stride of 0): each of its "
                             "elements needs memory of its own; clone() it")
        by_device.setdefault(p.device, []).append((*_span(p), name, p))
    for spans in by_device.values():
        # Sorted by where they begin, a span meets only the ones after it
        # that begin before it ends.
        spans.sort(key=lambda span: span[0])
        for i, (first, end, name, p) in enumerate(spans):
            j = i + 1
            while j < len(spans) and spans[j][0] < end:
                other_first, other_end, other_name, other = spans[j]
                if _share_bytes(p, other, min(first, other_first), max(end, other_end)):
                    raise ValueError(f"params {name!r} and {other_name!r} share memory (one tensor's data, or "
                                     "overlapping views of it): torch would apply both updates to it, while the "
                                     "servers hold a master for each; give each param memory of its own")
                j += 1


def _span(p):
    """The bytes [first, end) that p's elements lie within (from data_ptr,
    sizes and strides: the same on torch 1.13 and 2.x; strides are never
    negative)."""
    first = p.data_ptr()
    return first, first + (sum((n - 1) * s for n, s in zip(p.shape, p.stride())) + 1) * p.element_size()


def _share_bytes(p, q, first, end):
    """Whether p and q, non-empty on one device and within the bytes
    [first, end), have a byte in common: each marks its bytes in a host mask
    of those, so that interleaved views whose spans meet (column blocks) are
    told apart from overlapping ones."""
    mask = torch.zeros(end - first, dtype=torch.bool)

    def marks(x):
        size = x.element_size()
        return mask.as_strided((*x.shape, size), (*(s * size for s in x.stride()), 1), x.data_ptr() - first)

    marks(p).fill_(True)
    return bool(marks(q).any())
