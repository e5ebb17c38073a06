"""Trainer processes the tests start: `resume` (a new process continuing
from a saved state dict) and `dp` (one rank of a data-parallel job).

    workers.py resume --servers A,B --job J --checkpoint F --first T --steps N --out OUT
    workers.py dp --servers A,B --job J --rank R --world_size W --steps N --out OUT
"""
import argparse
import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from shardopt.torch import RemoteAdamW  # noqa: E402
from models import BATCH, batch, bits, make_model, param_groups, train  # noqa: E402

torch.set_num_threads(1)

# The round trip's model: bf16 with fp32 RMSNorm gains, so both param dtypes
# go through one job.
MIXED = dict(dtype=torch.bfloat16, norm_dtype=torch.float32)


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(bits(p).numpy().tobytes())
    return h.hexdigest()


def resume(args):
    saved = torch.load(args.checkpoint)
    model = make_model(seed=99, **MIXED)  # other initial values: all come from the checkpoint
    model.load_state_dict(saved["model"])
    opt = RemoteAdamW(param_groups(model), servers=args.servers.split(","), job=args.job, lr=1e-3)
    opt.load_state_dict(saved["optimizer"])
    train(model, opt, args.steps, first=args.first)
    torch.save(model.state_dict(), args.out)
    opt.drop()


def dp(args):
    """Rank r of world_size trains on its share of each step's batch; no DDP,
    the servers average the gradients."""
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=args.servers.split(","), job=args.job, lr=1e-3, rank=args.rank,
                      world_size=args.world_size, barrier_timeout=10)
    share = BATCH // args.world_size
    digests = []
    for step in range(1, args.steps + 1):
        tokens, targets = batch(step)
        rows = slice(args.rank * share, (args.rank + 1) * share)
        opt.zero_grad()
        model(tokens[rows], targets[rows]).backward()
        opt.step()
        digests.append(digest(model))
    torch.save({"digests": digests, "model": model.state_dict()}, args.out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["resume", "dp"])
    parser.add_argument("--servers", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--checkpoint")
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world_size", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    {"resume": resume, "dp": dp}[args.mode](args)


if __name__ == "__main__":
    main()
