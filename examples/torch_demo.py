#!/usr/bin/python3
"""The PyTorch demo: a tiny RMSNorm transformer in bf16, trained twice on the
same data, once with shardopt.torch.RemoteAdamW (fp32 master and moments on a
shardopt server) and once with torch.optim.AdamW on the bf16 params.

The RMSNorm gains start at 1.0 and train at lr=2e-4, so every one of Adam's
updates to them stays below half of bf16's spacing just under 1.0 (2^-9):
torch's AdamW on bf16 params rounds each away, the fp32 master accumulates
them. Prints the gains moved and the final losses; writes the loss curves
and the gains' drift to a PNG.

    PYTHONPATH=build/python /usr/bin/python3 examples/torch_demo.py --server=127.0.0.1:50051 [--png=demo_torch.png]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shardopt.torch  # noqa: E402
from tiny_transformer import TinyTransformer, batch, norm_gains, param_groups, unnamed  # noqa: E402

LR, NORM_LR = 1e-3, 2e-4


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True, help="host:port of a shardopt-server")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--png", default="demo_torch.png")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    torch.set_num_threads(1)

    models = {name: TinyTransformer(seed=0).to(torch.bfloat16) for name in ("remote", "torch")}
    remote = models["remote"]
    optimizers = {
        # The two-line switch: torch.optim.AdamW(...) becomes RemoteAdamW(..., servers=..., job=...).
        "remote": shardopt.torch.RemoteAdamW(param_groups(remote, norm_lr=NORM_LR), servers=[args.server],
                                             job=f"torch-demo-{os.getpid()}", lr=LR),
        "torch": torch.optim.AdamW(unnamed(param_groups(models["torch"], norm_lr=NORM_LR)), lr=LR, foreach=False),
    }
    losses = {name: [] for name in models}
    drift = {name: [] for name in models}  # mean |gain - 1|
    started = time.monotonic()
    print(f"{'step':>6}  {'loss RemoteAdamW':>18}  {'loss torch AdamW':>18}")
    for step in range(1, args.steps + 1):
        tokens, targets = batch(step)
        for name, model in models.items():
            opt = optimizers[name]
            opt.zero_grad()
            loss = model(tokens, targets)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
            drift[name].append((norm_gains(model) - 1).abs().mean().item())
        if step % 50 == 0 or step == 1:
            print(f"{step:6d}  {losses['remote'][-1]:18.4f}  {losses['torch'][-1]:18.4f}")
    elapsed = time.monotonic() - started

    total = norm_gains(remote).numel()
    tail = min(20, args.steps)  # a run shorter than 20 steps: the mean of all of them
    print(f"after {args.steps} steps, bf16 model, RMSNorm gains at lr={NORM_LR:g} "
          "(updates below half of bf16's spacing at 1.0):")
    for name, label in (("remote", "RemoteAdamW (fp32 state)"), ("torch", "torch.optim.AdamW (bf16) ")):
        moved = int((norm_gains(models[name]) != 1.0).sum())
        final = sum(losses[name][-tail:]) / tail
        print(f"  {label}: {moved:3d} of {total} gains moved off 1.0, final loss {final:.4f} "
              f"(mean of the last {tail} steps)")
    print(f"  ({elapsed:.1f} s for both runs)")
    optimizers["remote"].drop()

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = range(1, args.steps + 1)
    for name, label in (("remote", "shardopt RemoteAdamW (fp32 state)"), ("torch", "torch.optim.AdamW on bf16")):
        left.plot(steps, losses[name], label=label, linewidth=1)
        right.plot(steps, drift[name], label=label)
    left.set(title="training loss (bf16 model)", xlabel="step", ylabel="cross-entropy")
    right.set(title="RMSNorm gains: mean |gain - 1|", xlabel="step")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=100)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
