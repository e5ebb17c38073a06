"""Data parallelism without DDP: two trainer processes, each on half of every
batch, against one process with the summed gradient."""
import os
import subprocess
import sys

import torch

from shardopt.torch import RemoteAdamW
from models import BATCH, batch, make_model, param_groups, same_bits
from workers import digest

torch.set_num_threads(1)
HERE = os.path.dirname(__file__)
STEPS = 30


def test_two_ranks_equal_one_process_with_the_summed_gradient(servers, job, tmp_path):
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    ranks = [subprocess.Popen([sys.executable, os.path.join(HERE, "workers.py"), "dp", "--servers", ",".join(servers),
                               "--job", f"{job}-dp", "--rank", str(r), "--world_size", "2", "--steps", str(STEPS),
                               "--out", str(outs[r])]) for r in range(2)]
    try:
        assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            p.kill()

    # One process, world_size 1: the two halves' gradients summed in fp32 by
    # accumulating backward passes (as the servers sum the ranks' in rank
    # order), then halved (exact), as the servers average over 2 ranks.
    model = make_model()
    opt = RemoteAdamW(param_groups(model), servers=servers, job=job, lr=1e-3)
    digests = []
    half = BATCH // 2
    for step in range(1, STEPS + 1):
        tokens, targets = batch(step)
        opt.zero_grad()
        for r in range(2):
            model(tokens[r * half:(r + 1) * half], targets[r * half:(r + 1) * half]).backward()
        for p in model.parameters():
            p.grad.mul_(0.5)
        opt.step()
        digests.append(digest(model))
    opt.drop()

    results = [torch.load(out) for out in outs]
    assert results[0]["digests"] == results[1]["digests"], "the ranks' params differ after some step"
    assert results[0]["digests"] == digests
    for name, p in model.state_dict().items():
        assert same_bits(results[0]["model"][name], p), name
