"""Checks RemoteAdamW makes before anything reaches a server, with torch's
messages where torch makes the same check."""
import torch

from ._errors import InvalidArgument, UnsupportedDtype


def _host_fp32(x, what):
    """x as contiguous fp32 host memory: fp32 kept as it is, bf16 widened
    (exactly). Never narrows."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise UnsupportedDtype(f"{what} is {x.dtype}; fp32 or bf16 needed")
    return x.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _check_hyper(g, where):
    """torch.optim.AdamW's checks of a group's hyperparameters, with its
    messages (NaN fails them too), made before anything reaches a server."""
    lr, (beta1, beta2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
    if isinstance(lr, torch.Tensor):
        lr = lr.item()
    if not 0.0 <= lr < float("inf"):
        raise ValueError(f"{where}Invalid learning rate: {lr}")
    # torch takes eps = 0; the servers do not (a zero gradient's update
    # would be 0/0). They hold eps as a float32, so one that rounds to 0
    # or to inf there is refused here too.
    if not 0.0 < eps < float("inf"):
        raise ValueError(f"{where}Invalid epsilon value: {eps} (must be > 0)")
    if not 0.0 < float(torch.tensor(eps, dtype=torch.float32)) < float("inf"):
        raise ValueError(f"{where}Invalid epsilon value: {eps} (rounds to 0 or inf as the float32 the servers hold)")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"{where}Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"{where}Invalid beta parameter at index 1: {beta2}")
    if not 0.0 <= wd < float("inf"):
        raise ValueError(f"{where}Invalid weight_decay value: {wd}")
    if g.get("amsgrad") or g.get("maximize"):
        raise InvalidArgument(f"{where}RemoteAdamW does not implement amsgrad or maximize")
    if g.get("capturable") or g.get("differentiable"):
        raise InvalidArgument(f"{where}RemoteAdamW updates on the servers: capturable and differentiable are not "
                              "supported")
