"""The tests' model (examples/tiny_transformer.py) in the dtypes they need,
the training loop, and comparisons: the ulp bound against torch, and bits."""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

from tiny_transformer import (BATCH, TinyTransformer, batch, is_norm, norm_gains, param_groups,  # noqa: E402,F401
                              unnamed)

# tests/torch/test_torch_reference.py's bound: torch is the outside reference,
# not bitwise (torch 1.13 computes m as mul_+add_ where the servers compute a
# lerp, and addcdiv as (-step_size*m)/d where the servers compute
# step_size*(m/d)); each param may differ by BOUND_SQRT_STEPS*sqrt(steps) ulps
# of the largest |value| it reached.
BOUND_SQRT_STEPS = 8


def make_model(seed=0, dtype=torch.float32, norm_dtype=None):
    """The model in `dtype`, its RMSNorm gains in `norm_dtype` (default: the
    same)."""
    model = TinyTransformer(seed).to(dtype)
    for name, p in model.named_parameters():
        if norm_dtype is not None and is_norm(name):
            p.data = p.data.to(norm_dtype)
    return model


def train(model, opt, steps, first=1, scheduler=None, peaks=None):
    """Steps first ... first+steps-1 of the usual loop; returns the losses."""
    losses = []
    for step in range(first, first + steps):
        tokens, targets = batch(step)
        opt.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if peaks is not None:
            peaks.update(model)
        losses.append(loss.item())
    return losses


class Peaks:
    """The largest |value| each param element reached, for the ulp bound."""

    def __init__(self, model):
        self.peak = {n: p.detach().abs().double().clone() for n, p in model.named_parameters()}

    def update(self, model):
        for n, p in model.named_parameters():
            torch.maximum(self.peak[n], p.detach().abs().double(), out=self.peak[n])


def ulps_of_peak(ours, theirs, peaks):
    """Per param name: the largest |ours - theirs| in ulps (fp32 spacing) of
    the peak |value| the element reached."""
    out = {}
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        diff = (a.detach().double() - b.detach().double()).abs().numpy()
        spacing = np.spacing(peaks.peak[name].numpy().astype(np.float32)).astype(np.float64)
        out[name] = float((diff / spacing).max())
    return out


def bits(t):
    """A tensor's raw bits, for bitwise comparisons."""
    t = t.detach().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
