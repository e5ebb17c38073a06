"""Trainer processes the tests start: `resume` (a new process continuing
from a saved state dict), `dp` (one rank of a data-parallel job) and
`resume_dp` (one rank of a data-parallel job joined by torch.distributed,
continuing from a saved state dict).

    workers.py resume --servers A,B --job J --checkpoint F --first T --steps N --out OUT
    workers.py dp --servers A,B --job J --rank R --world_size W --steps N --out OUT
    workers.py resume_dp --servers A,B --job J --rank R --world_size W --store S --checkpoint F[,F1...] --first T
        --steps N --out OUT [--fail_rank R]
    workers.py push_and_die --servers A,B --job J --steps N

`push_and_die` trains N steps with overlap=True, runs one more backward
(whose push completes) and exits at once, as a killed trainer would: no
step(), no clean-up.
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
    the servers average the gradients. Each rank builds its model from a
    seed of its own: rank 0's values are the job's, as with DDP."""
    model = make_model(seed=args.rank)
    opt = RemoteAdamW(param_groups(model), servers=args.servers.split(","), job=args.job, lr=1e-3, rank=args.rank,
                      world_size=args.world_size, barrier_timeout=10)
    train_share(model, opt, args)


def resume_dp(args):
    """As dp, from a saved state dict, with torch.distributed (gloo) joining
    the ranks: each rank sends its share of the optimizer's state
    (load_state_dict(shared=True))."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank,
                                         world_size=args.world_size)
    checkpoints = args.checkpoint.split(",")  # one for every rank, or one for each
    saved = torch.load(checkpoints[args.rank % len(checkpoints)])
    model = make_model(seed=99)  # other initial values: all come from the checkpoint
    model.load_state_dict(saved["model"])
    opt = RemoteAdamW(param_groups(model), servers=args.servers.split(","), job=args.job, lr=1e-3, rank=args.rank,
                      world_size=args.world_size, barrier_timeout=20)
    if args.rank == args.fail_rank:
        def fail(*_, **__):
            raise RuntimeError("injected: this rank's share cannot be sent")
        opt._init_values = fail
    try:
        opt.load_state_dict(saved["optimizer"], shared=True)
    except Exception as e:  # noqa: BLE001 (the test reads what each rank raised)
        torch.save({"error": f"{type(e).__name__}: {e}"}, args.out)
        # Torn down before exit: left to the interpreter's finalization, gloo's
        # threads at times aborted the process ("terminate called without an
        # active exception").
        torch.distributed.destroy_process_group()
        sys.exit(3)
    train_share(model, opt, args)
    torch.distributed.destroy_process_group()


def train_share(model, opt, args):
    share = BATCH // args.world_size
    digests = []
    for step in range(args.first, args.first + args.steps):
        tokens, targets = batch(step)
        rows = slice(args.rank * share, (args.rank + 1) * share)
        opt.zero_grad()
        model(tokens[rows], targets[rows]).backward()
        opt.step()
        digests.append(digest(model))
    torch.save({"digests": digests, "model": model.state_dict()}, args.out)


def push_and_die(args):
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=args.servers.split(","), job=args.job, lr=1e-3, overlap=True)
    train(model, opt, args.steps)
    opt.zero_grad()
    tokens, targets = batch(args.steps + 1)
    model(tokens, targets).backward()
    opt._finish_push()  # the push of step N+1 is complete on every server
    sys.stdout.flush()
    os._exit(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["resume", "dp", "resume_dp", "push_and_die"])
    parser.add_argument("--servers", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--checkpoint")
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world_size", type=int, default=1)
    parser.add_argument("--store", help="resume_dp: torch.distributed's file store")
    parser.add_argument("--fail_rank", type=int, default=-1,
                        help="resume_dp: this rank's load_state_dict fails to send its share")
    parser.add_argument("--out")
    args = parser.parse_args()
    {"resume": resume, "dp": dp, "resume_dp": resume_dp, "push_and_die": push_and_die}[args.mode](args)


if __name__ == "__main__":
    main()
